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

Which artifact a path holds, its kind and its checked export.json: `tfmp.serving.artifacts`.
A model whose inputs are a dict (Faster R-CNN: images and the padded ground truth its training
step samples from) gets the images in its "images" input and one padding row in every other
(`model_inputs`).
"""

from __future__ import annotations

import abc
import os

import keras
import numpy as np
import tensorflow as tf

from tfmp import precision as _precision  # noqa: F401  registers the loss-scale optimizer a run saves
from tfmp import run_dir
from tfmp.errors import UsageError
from tfmp.input import decoding, image_files
from tfmp.serving import layers as _layers  # noqa: F401  registers FoldedBatchNorm for exported .keras
from tfmp.serving import trust
from tfmp.serving.artifacts import Preprocessing, export_metadata, run_metadata, saved_model_metadata

IMAGES_INPUT = "images"  # the images' key when a model's inputs are a dict


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
