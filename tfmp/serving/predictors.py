"""Load any tfmp model artifact, preprocess images as training did, and predict.

    from tfmp.serving import predictors
    predictor = predictors.load("runs/x")         # a run dir, an export dir, a SavedModel dir,
                                                  # a .tflite or a .keras file
    images = predictors.read_images(["cat.png"], predictor.preprocessing)
    probabilities = predictor.predict(images)     # float32 (N, classes)
    print(predictors.top_k(probabilities[0], 5, predictor.class_names))

Preprocessing is the one of `tfmp.classification.data`'s image folders: decode, float32 in [0, 1], bilinear
resize with antialiasing to the model's input size, clip to [0, 1]. The size and channels come
from the model's input; class names from the export's `export.json`, or, for a run dir, from the
dataset named in its `flags.txt` (resolved flags written by training).

Model kinds: `KINDS` maps a kind ("classifier", "detector", "two_stage_detector", registered by
`tfmp.serving.classifier`, `.detector` and `.two_stage`) to what predicting with it needs:
which `--model` names a run of that kind trained, its dataset's class names, and how
`apps.predict` turns image files into records. A model whose inputs are a dict (Faster R-CNN:
images and the padded ground truth its training step samples from) gets the images in its
"images" input and one padding row in every other (`model_inputs`).
"""

from __future__ import annotations

import abc
import dataclasses
import json
import os
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from tfmp import precision as _precision  # noqa: F401  registers the loss-scale optimizer a run saves
from tfmp import run_dir
from tfmp.errors import UsageError
from tfmp.input import decoding, image_files
from tfmp.serving import copies, trust
from tfmp.serving import layers as _layers  # noqa: F401  registers FoldedBatchNorm for exported .keras

IMAGES_INPUT = "images"  # the images' key when a model's inputs are a dict


@dataclasses.dataclass(frozen=True)
class PredictionKind:
    """What predicting with one kind of model needs beyond the generic loaders.

    `trains(name)`: whether a run that trained `--model=name` is of this kind.
    `class_names(dataset, image_size, data_dir)`: the dataset's class names (None if unknown).
    `predict_files(model, image_paths, settings)`: one JSON-able record per image, for
    `apps.predict` (`settings`: its flags top_k, batch_size, score_threshold, max_detections,
    output_dir, trust_saved_model, max_image_pixels; each kind reads the ones it uses).
    `section`: what export.json's section named after the kind must hold, {key: "number" |
    "count" | "counts"} (a number; a positive integer; a list of them), checked on reading."""

    trains: Callable[[str | None], bool]
    class_names: Callable[[str, int | None, str | None], list[str] | None]
    predict_files: Callable[[str, list[str], dict], list[dict]]
    section: dict[str, str] = dataclasses.field(default_factory=dict)


KINDS: dict[str, PredictionKind] = {}  # filled by the modules that know a kind (tfmp.serving.__init__)


@dataclasses.dataclass(frozen=True)
class Preprocessing:
    """How an image file becomes a model input."""

    height: int
    width: int
    channels: int

    def to_json(self) -> dict:
        return {
            "image_shape": [self.height, self.width, self.channels],
            "dtype": "float32",
            "value_range": [0.0, 1.0],
            "resize": "bilinear, antialias, clipped to [0, 1]",
        }

    @classmethod
    def from_shape(cls, shape) -> Preprocessing:
        height, width, channels = (int(size) for size in shape)
        return cls(height, width, channels)


def read_images(
    paths, preprocessing: Preprocessing, max_pixels: int | None = image_files.MAX_IMAGE_PIXELS
) -> np.ndarray:
    """Decodes and resizes every file; a file that is missing or not an image, or whose header
    declares more than `max_pixels` pixels (0: no limit; refused before it is decoded), is a
    UsageError (checked for all files before anything is predicted)."""
    images = []
    for path in paths:
        if os.path.isdir(path):
            raise UsageError(
                f"image '{decoding.shown(path)}' is a directory; give image files, e.g. {path}/*.png"
            )
        too_large = image_files.oversized(path, max_pixels)
        if too_large:
            raise UsageError(
                f"image '{decoding.shown(path)}' is {too_large}; shrink it, or raise --max_image_pixels (0: no limit)"
            )
        try:  # as training decodes: a WebP's alpha dropped, the model's channels whatever the file's
            raw = decoding.decode(tf.io.read_file(decoding.tf_path(path)), preprocessing.channels)
        except (tf.errors.InvalidArgumentError, tf.errors.NotFoundError, ValueError) as error:
            reason = "no such file" if isinstance(error, tf.errors.NotFoundError) else "not a decodable image"
            raise UsageError(
                f"image '{decoding.shown(path)}': {reason}; give jpg, png, bmp, gif or webp files"
            ) from None
        # Resized from the decoded integers: a large photo is never held as full-size float32.
        images.append(image_files.unit_float(raw, (preprocessing.height, preprocessing.width)).numpy())
    return (
        np.stack(images)
        if images
        else np.zeros((0, preprocessing.height, preprocessing.width, preprocessing.channels), np.float32)
    )


def top_k(probabilities: np.ndarray, k: int, class_names=None) -> list[dict]:
    """[{"class": index, "name": name (if known), "probability": p}, ...], most probable first."""
    order = np.argsort(-probabilities, kind="stable")[:k]
    result = []
    for index in order:
        entry = {"class": int(index)}
        if class_names and int(index) < len(class_names):
            entry["name"] = class_names[int(index)]
        entry["probability"] = round(float(probabilities[index]), 6)
        result.append(entry)
    return result


def image_input_shape(model: keras.Model) -> tuple[int, int, int]:
    """(height, width, channels) of the images `model` takes: its one input's, or the shape of
    its "images" input when its inputs are a dict."""
    spec = model.input[IMAGES_INPUT] if isinstance(model.input, dict) else model.input
    return tuple(int(size) for size in spec.shape[1:])


def model_inputs(model: keras.Model, images):
    """What `model` is called with for a batch of float32 `images`: the images, or, when its
    inputs are a dict, the images in "images" and one padding row in every other input (0 in
    a float input, -1 in an integer one: tfmp's padded ground truth, which inference ignores)."""
    if not isinstance(model.input, dict):
        return images
    images = tf.convert_to_tensor(images, tf.float32)  # Keras refuses numpy next to tensors
    batch = tf.shape(images)[0]
    inputs = {IMAGES_INPUT: images}
    for key, spec in model.input.items():
        if key != IMAGES_INPUT:
            dtype = tf.as_dtype(spec.dtype)
            shape = [batch, 1, *(int(size) for size in spec.shape[2:])]
            inputs[key] = tf.fill(shape, tf.constant(-1 if dtype.is_integer else 0, dtype))
    return inputs


# ----------------------------------------------------------------------------- predictors
class Predictor(abc.ABC):
    """A loaded artifact: `predict(float32 NHWC images) -> float32 probabilities`.

    Subclasses (Keras, SavedModel, TFLite) say how to read the input shape and run one batch."""

    format = "?"

    def __init__(self, path: str, metadata: dict):
        self.path = path
        self.metadata = metadata
        self.class_names = tuple(metadata["class_names"]) if metadata.get("class_names") else None
        self.preprocessing = Preprocessing.from_shape(self.input_shape())
        recorded = (metadata.get("preprocessing") or {}).get("image_shape")
        if recorded is not None and list(recorded) != list(self.input_shape()):  # an edited export.json
            raise UsageError(
                f"--model={path}: its export.json says images of {recorded}, but the model takes "
                f"{list(self.input_shape())}; export the run again with apps.export"
            )

    @abc.abstractmethod
    def input_shape(self) -> tuple[int, int, int]:
        """(height, width, channels) the artifact takes."""

    def predict(self, images: np.ndarray, batch_size: int = 64) -> np.ndarray:
        outputs = [
            self.predict_batch(np.asarray(images[start : start + batch_size], np.float32))
            for start in range(0, len(images), batch_size)
        ]
        return np.concatenate(outputs) if outputs else np.zeros((0, 0), np.float32)

    @abc.abstractmethod
    def predict_batch(self, images: np.ndarray) -> np.ndarray:
        """Float32 probabilities of one batch of float32 images."""

    def predict_outputs(self, images: np.ndarray, batch_size: int = 64, **kwargs) -> dict:
        """Every named output ({"probabilities"} for a classifier, {"classes", "boxes"} raw
        outputs of a detector), float32 numpy, batch by batch."""
        batches = [
            self.outputs_batch(np.asarray(images[start : start + batch_size], np.float32), **kwargs)
            for start in range(0, len(images), batch_size)
        ]
        return {key: np.concatenate([batch[key] for batch in batches]) for key in batches[0]}

    def outputs_batch(self, images: np.ndarray) -> dict:
        return {"probabilities": self.predict_batch(images)}


class KerasPredictor(Predictor):
    format = "keras"

    def __init__(self, path, metadata, model=None):
        if model is None:
            run_dir.check_keras_file(path)
            try:
                # Safe mode (Keras' default, spelt out): a Lambda layer's bytecode is refused.
                model = keras.saving.load_model(path, compile=False, safe_mode=True)
            except Exception as error:  # a corrupt or foreign file: say which, not a traceback
                raise UsageError(f"cannot load Keras model {path!r}: {str(error).splitlines()[0]}") from None
        self.model = model
        # One trace for every batch size (the benchmark alternates 1 and 64).
        spec = tf.TensorSpec([None, *image_input_shape(model)], tf.float32)
        self._call = tf.function(
            lambda images: model(model_inputs(model, images), training=False), input_signature=[spec]
        )
        super().__init__(path, metadata)

    def input_shape(self):
        return image_input_shape(self.model)

    def predict_batch(self, images):
        return np.asarray(tf.cast(self._call(tf.constant(images)), tf.float32))

    def outputs_batch(self, images):
        outputs = self._call(tf.constant(images))
        if not isinstance(outputs, dict):
            outputs = {"probabilities": outputs}
        return {key: np.asarray(tf.cast(value, tf.float32)) for key, value in outputs.items()}


class SavedModelPredictor(Predictor):
    format = "saved_model"

    def __init__(self, path, metadata):
        try:
            self.loaded = tf.saved_model.load(path)
        except (OSError, ValueError, tf.errors.OpError) as error:
            raise UsageError(f"cannot load SavedModel {path!r}: {str(error).splitlines()[0]}") from None
        if "serving_default" not in self.loaded.signatures:
            raise UsageError(f"SavedModel {path!r} has no serving_default signature")
        self.serve = self.loaded.signatures["serving_default"]
        self.input_name = next(iter(self.serve.structured_input_signature[1]))
        super().__init__(path, metadata)

    def input_shape(self):
        return tuple(self.serve.structured_input_signature[1][self.input_name].shape[1:])

    def predict_batch(self, images):
        outputs = self.serve(**{self.input_name: tf.constant(images)})
        return np.asarray(
            outputs["probabilities"] if "probabilities" in outputs else next(iter(outputs.values()))
        )

    def outputs_batch(self, images, signature: str = "serving_default"):
        outputs = self.loaded.signatures[signature](**{self.input_name: tf.constant(images)})
        return {key: value.numpy() for key, value in outputs.items()}


def tflite_interpreter_class():
    """LiteRT's interpreter (the `litert` extra) if installed, else the deprecated tf.lite one."""
    try:  # optional: ai-edge-litert is an extra (`pip install tfmp[litert]`), imported only if present
        from ai_edge_litert.interpreter import Interpreter
    except ImportError:
        Interpreter = tf.lite.Interpreter
    return Interpreter


class TFLitePredictor(Predictor):
    format = "tflite"

    def __init__(self, path, metadata, num_threads: int | None = None):
        try:
            self.interpreter = tflite_interpreter_class()(
                model_path=path, num_threads=num_threads or os.cpu_count()
            )
            self.interpreter.allocate_tensors()
        except (ValueError, RuntimeError) as error:
            raise UsageError(f"cannot load TFLite model {path!r}: {str(error).splitlines()[0]}") from None
        self.input_detail = self.interpreter.get_input_details()[0]
        self.output_index = self.interpreter.get_output_details()[0]["index"]
        self.batch = int(self.input_detail["shape"][0])
        super().__init__(path, metadata)

    def input_shape(self):
        return tuple(int(size) for size in self.input_detail["shape_signature"][1:])

    def predict_batch(self, images):
        if len(images) != self.batch:  # resizing re-plans the tensors: only when the batch changes
            self.interpreter.resize_tensor_input(self.input_detail["index"], list(images.shape))
            self.interpreter.allocate_tensors()
            self.batch = len(images)
        self.interpreter.set_tensor(self.input_detail["index"], images)
        self.interpreter.invoke()
        return self.interpreter.get_tensor(self.output_index).copy()

    def outputs_batch(self, images):
        # The signature runner names the outputs (a detector's "classes" and "boxes") and
        # resizes its input tensor to each batch.
        if not hasattr(self, "_runner"):
            self._runner = self.interpreter.get_signature_runner("serving_default")
        return {
            key: np.asarray(value).copy()
            for key, value in self._runner(**{next(iter(self._runner.get_input_details())): images}).items()
        }


LOADERS = {"saved_model": SavedModelPredictor, "tflite": TFLitePredictor, "keras": KerasPredictor}


# ----------------------------------------------------------------------------- finding artifacts
def run_kind(path: str) -> str:
    """The kind of model a training run dir trained: the first kind whose registry entry trains
    its `--model` (a name no kind lists is served as a classifier: one probabilities output)."""
    name = run_dir.read_flags(path).get("model")
    return next((kind for kind, spec in KINDS.items() if spec.trains(name)), "classifier")


def run_metadata(path: str) -> dict:
    """Dataset, model and class names of a training run dir (what export.json carries)."""
    flags = run_dir.read_flags(path)
    dataset = flags.get("dataset")
    if dataset is None:
        dataset = str(run_dir.read_run_card(path).get("dataset", "")).split(" ")[0] or None
    image_size = flags.get("image_size")
    metadata = {
        "model": flags.get("model"),
        "dataset": dataset,
        "data_dir": flags.get("data_dir"),
        "image_size": int(image_size) if image_size and image_size.isdigit() else None,
        "class_names": None,
    }
    if dataset:
        try:  # names need the dataset's description only (a folder listing, TFDS metadata)
            names = KINDS[run_kind(path)].class_names(dataset, metadata["image_size"], metadata["data_dir"])
            metadata["class_names"] = list(names) if names else None
        except Exception:  # the data moved or TFDS is missing: predict without names
            pass
    return metadata


def kind_of(path: str) -> str:
    """The kind of model --model `path` (run dir, export dir, SavedModel dir, file) holds."""
    path = os.path.normpath(os.path.expanduser(path))
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    for folder in (directory, os.path.dirname(directory)):  # an export's SavedModel: its parent
        metadata = export_metadata(folder)
        if metadata is not None:
            return metadata.get("kind", "classifier")
    return run_kind(directory)


MAX_METADATA_BYTES = 64 << 20  # export.json holds names and numbers: ImageNet-21k's names are ~0.5 MB
_SECTION_CHECKS = {
    "number": (lambda value: isinstance(value, (int, float)) and not isinstance(value, bool), "a number"),
    "count": (lambda value: isinstance(value, int) and not isinstance(value, bool) and value > 0, "a count"),
    "counts": (
        lambda value: isinstance(value, list) and all(_SECTION_CHECKS["count"][0](item) for item in value),
        "a list of counts",
    ),
}


def export_metadata(directory: str) -> dict | None:
    """`directory`'s export.json (None if it has none), checked to be what apps.export writes: a
    JSON object, a known "kind" (none: a classifier, as exports before kinds), class names as a
    list of strings, and the kind's section; anything else is one UsageError naming the file."""
    path = os.path.join(directory, run_dir.EXPORT_METADATA_FILE)
    if not os.path.isfile(path):
        return None
    fix = "export the run again with apps.export"
    try:
        too_large = os.path.getsize(path) > MAX_METADATA_BYTES
        if not too_large:
            with open(path, encoding="utf-8") as file:
                metadata = json.load(file)
    except (OSError, ValueError, RecursionError) as error:  # ValueError: bad JSON or UTF-8
        reason = getattr(error, "strerror", None) or str(error).splitlines()[0] or type(error).__name__
        raise UsageError(f"{path} is not readable JSON ({reason}); {fix}") from None
    if too_large:
        raise UsageError(
            f"{path} is larger than {MAX_METADATA_BYTES >> 20} MiB, more than any export writes; {fix}"
        )
    if not isinstance(metadata, dict):
        raise UsageError(
            f"{path} holds a JSON {type(metadata).__name__}, not the object apps.export writes; {fix}"
        )
    kind = metadata.get("kind", "classifier")
    if kind not in KINDS:
        raise UsageError(
            f"{path} names kind {kind!r}, which apps.predict does not know ({', '.join(KINDS)}); {fix}"
        )
    names = metadata.get("class_names")
    if names is not None and not (isinstance(names, list) and all(isinstance(name, str) for name in names)):
        raise UsageError(
            f"{path}: class_names must be a list of strings, not {json.dumps(names)[:60]}; {fix}"
        )
    _check_common(path, metadata, fix)
    _check_section(path, metadata, kind, fix)
    return metadata


def _check_common(path: str, metadata: dict, fix: str) -> None:
    """The fields every export writes, where present: its precision, and the preprocessing a
    server applies (its image shape is checked against the model's own when the model loads)."""
    precision = metadata.get("precision")
    if precision is not None and precision not in copies.PRECISIONS:
        raise UsageError(
            f"{path}: precision must be one of {', '.join(copies.PRECISIONS)}, not {json.dumps(precision)[:60]}; {fix}"
        )
    if "preprocessing" not in metadata:
        return
    preprocessing = metadata["preprocessing"]
    shape = preprocessing.get("image_shape") if isinstance(preprocessing, dict) else None
    if not (isinstance(shape, list) and len(shape) == 3 and _SECTION_CHECKS["counts"][0](shape)):
        raise UsageError(
            f"{path}: preprocessing.image_shape must be [height, width, channels], not "
            f"{json.dumps(shape)[:60] if shape is not None else 'missing'}; {fix}"
        )
    wanted = Preprocessing.from_shape(shape).to_json()
    for key in ("dtype", "value_range"):  # what every tfmp model takes, and apps.predict gives
        if preprocessing.get(key, wanted[key]) != wanted[key]:
            raise UsageError(
                f"{path}: preprocessing.{key} must be {json.dumps(wanted[key])} (what the model was trained "
                f"on), not {json.dumps(preprocessing[key])[:60]}; {fix}"
            )


def _check_section(path: str, metadata: dict, kind: str, fix: str) -> None:
    """export.json's section of `kind` holds every key its predictor reads, of the right type."""
    wanted = KINDS[kind].section
    if not wanted:
        return
    section = metadata.get(kind)
    if not isinstance(section, dict):
        raise UsageError(f"{path} has no {kind!r} section (an object), which a {kind} export holds; {fix}")
    for key, expected in wanted.items():
        accepts, noun = _SECTION_CHECKS[expected]
        if not accepts(section.get(key)):
            found = json.dumps(section[key])[:60] if key in section else "missing"
            raise UsageError(f"{path}: {kind}.{key} must be {noun}, not {found}; {fix}")


def saved_model_dir(path: str) -> str | None:
    """The SavedModel directory `load(path)` would run (a SavedModel dir, or an export dir's
    saved_model/), or None when it loads a .keras or .tflite."""
    path = os.path.normpath(os.path.expanduser(path))
    if not os.path.isdir(path):
        return None
    if os.path.isfile(os.path.join(path, trust.GRAPH_FILE)):
        return path
    saved = os.path.join(path, "saved_model")
    if os.path.exists(saved) and export_metadata(path) is not None:
        return saved
    return None


def saved_model_metadata(path: str) -> dict | None:
    """The export.json of the SavedModel dir `path`: its own, or its export dir's (the parent)."""
    return export_metadata(path) or export_metadata(os.path.dirname(path))


def _saved_model(path: str, metadata: dict | None, trust_saved_model: bool) -> SavedModelPredictor:
    trust.check(path, metadata, trust_saved_model)  # refused before TensorFlow reads the graph
    return SavedModelPredictor(path, metadata or {})


def load(path: str, trust_saved_model: bool = False) -> Predictor:
    """Loads a run dir, an export dir (`export.json`), a SavedModel dir, a .tflite or a .keras.

    A SavedModel is a program: it is run only when apps.export wrote it (its export.json records
    its graph's digest, `tfmp.serving.trust`) or `trust_saved_model` is True; else a UsageError."""
    path = os.path.normpath(os.path.expanduser(path))
    if os.path.isfile(path):
        directory = os.path.dirname(path)
        metadata = export_metadata(directory)
        if metadata is None and run_dir.is_run_dir(directory):
            metadata = run_metadata(directory)
        if path.endswith(".tflite"):
            return TFLitePredictor(path, metadata or {})
        if path.endswith(".keras"):
            return KerasPredictor(path, metadata or {})
        raise UsageError(f"--model={path} is a file but neither .tflite nor .keras")
    if not os.path.isdir(path):
        raise UsageError(
            f"--model={path} does not exist; give a run dir, an export dir, a "
            "SavedModel dir, a .tflite or a .keras file"
        )
    if os.path.isfile(os.path.join(path, trust.GRAPH_FILE)):
        return _saved_model(path, saved_model_metadata(path), trust_saved_model)
    metadata = export_metadata(path)
    if metadata is not None:  # an export dir: the SavedModel serves best, then .keras, .tflite
        if os.path.exists(os.path.join(path, "saved_model")):
            return _saved_model(os.path.join(path, "saved_model"), metadata, trust_saved_model)
        for name, predictor in (("model.keras", KerasPredictor), ("model.tflite", TFLitePredictor)):
            if os.path.exists(os.path.join(path, name)):
                return predictor(os.path.join(path, name), metadata)
    if os.path.isfile(os.path.join(path, run_dir.MODEL_FILE)):
        return KerasPredictor(os.path.join(path, run_dir.MODEL_FILE), run_metadata(path))
    exports = sorted(
        name
        for name in os.listdir(path)
        if os.path.isfile(os.path.join(path, name, run_dir.EXPORT_METADATA_FILE))
    )
    if exports:  # RUN/export: one dir per precision
        raise UsageError(
            f"--model={path} holds exports in several precisions; pick one: "
            + ", ".join(os.path.join(path, name) for name in exports)
        )
    raise UsageError(
        f"--model={path} holds no model (no {run_dir.MODEL_FILE}, saved_model.pb or "
        f"{run_dir.EXPORT_METADATA_FILE}); train first or point at an export"
    )
