"""Export a trained Keras model for serving: SavedModel, TFLite and `.keras`, in any precision.

    from tfmp.serving import export
    report = export.export(model, "runs/x/export", formats=("saved_model", "tflite", "keras"),
                           precision="bfloat16", metadata={"image_shape": [32, 32, 3]},
                           reference_images=eval_images)
    # -> runs/x/export/bfloat16/{saved_model/, model.tflite, model.keras, export.json}

or from the command line: `python -m apps.export --model_dir=RUN --precision=bfloat16`.

What each artifact is:

* `saved_model/` - `serving_default` takes float32 images (`images`, NHWC in [0, 1]) and returns
  float32 `probabilities`. It computes in the requested precision with a *true* copy of the
  model: for float16/bfloat16 every variable is stored in that dtype, so no weight is cast on a
  call (what `model.export` of a mixed model does instead). `mixed` keeps float32 variables and
  half compute, like the training policy.
* `model.tflite` - always converted from a float32 copy (converting half-precision compute
  fails with "'tf.Conv2D' op is neither a custom op nor a flex op"); float32 precision keeps
  float32 weights, every other precision stores float16 weights. Built-in ops only (no Flex),
  float32 input and output.
* `model.keras` - the inference copy in the requested precision.

Every inference copy folds each BatchNormalization that directly follows a bias-free linear
convolution or dense layer into that layer's kernel and bias (exact algebra, done in float64),
so a served ResNet runs one fused conv+bias+relu instead of five element-wise ops per layer.
The softmax stays in float32 in every precision: it has no weights, and float32 keeps the small
probabilities that top-k reports.

Detectors (dict outputs, `tfmp.detection.retinanet`) export through `tfmp.serving.detector`: their
`serving_default` returns float32 boxes and scores (int32 classes, counts) after NMS, their
`.tflite` the raw outputs (NMS is no TFLite builtin), and their table compares per output.

Extension points: `SERVING_BUILDERS` maps a model kind to the function that builds its serving
endpoints; `strip_for_inference` removes training-only state first: pruning masks and their
kernel constraints (`tfmp.pruning.strip`, pruned weights baked in as zeros). A run trained
with a pipeline split (`--pipeline_stages`) saves one Keras model (placement is not saved), so
it exports like any other.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile

import keras
import numpy as np
import tensorflow as tf

from tfmp.errors import UsageError, unknown
from tfmp.serving import detector as export_detector

FORMATS = ("saved_model", "tflite", "keras")
PRECISIONS = ("float32", "float16", "bfloat16", "mixed")
SAVED_MODEL_DIR, TFLITE_FILE, KERAS_FILE = "saved_model", "model.tflite", "model.keras"
METADATA_FILE = "export.json"  # preprocessing, class names and the difference table
INPUT_NAME, OUTPUT_NAME = "images", "probabilities"
_FOLDABLE = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D, keras.layers.Dense)


def check_request(formats, precision: str) -> tuple[str, ...]:
    """Validates the formats and precision; returns the formats without duplicates."""
    if precision not in PRECISIONS:
        raise unknown("precision", precision, PRECISIONS)
    formats = tuple(dict.fromkeys(formats))
    if not formats:
        raise UsageError(f"no export format given; choose from: {', '.join(FORMATS)}")
    for name in formats:
        if name not in FORMATS:
            raise unknown("format", name, FORMATS)
    return formats


def layer_policy(precision: str) -> str:
    """The Keras dtype policy of an inference copy's layers for an export precision."""
    if precision == "mixed":
        from tfmp import precision as precisions

        return precisions.resolve("mixed").policy  # mixed_bfloat16 on CPU, mixed_float16 on GPU
    return precision


def model_kind(model: keras.Model) -> str:
    """ "classifier" (one probabilities tensor) or "detector" (a dict of outputs)."""
    return "detector" if isinstance(model.output, dict) else "classifier"


def strip_for_inference(model: keras.Model) -> keras.Model:
    """Removes training-only state: pruning masks via `tfmp.pruning.strip` (a no-op copy for an
    unpruned model). New training-only wrappers get their strip call here."""
    if importlib.util.find_spec("tfmp.pruning") is None:  # a checkout without pruning
        return model
    from tfmp import pruning

    return pruning.strip(model)


# ----------------------------------------------------------------------------- inference copies
@keras.saving.register_keras_serializable(package="tfmp")
class FoldedBatchNorm(keras.layers.Layer):
    """Stands where a folded BatchNormalization stood: passes its input through. (Keras'
    Identity layer does not accept the `mask` argument the functional graph replays.)"""

    def call(self, inputs, mask=None, training=None):
        return inputs

    def compute_output_shape(self, input_shape):
        return input_shape


def _batch_norm_folds(model: keras.Model) -> dict[str, str]:
    """{batch-norm layer name: name of the conv/dense layer whose output only it reads}."""
    folds = {}
    for layer in model.layers:
        if not isinstance(layer, keras.layers.BatchNormalization) or len(layer._inbound_nodes) != 1:
            continue
        parents = layer._inbound_nodes[0].parent_nodes
        if len(parents) != 1:
            continue
        producer = parents[0].operation
        axis = layer.axis if isinstance(layer.axis, int) else None
        if (
            isinstance(producer, _FOLDABLE)
            and not producer.use_bias
            and producer.get_config().get("activation") == "linear"
            and len(producer._inbound_nodes) == 1
            and len(producer._outbound_nodes) == 1
            and axis in (-1, len(layer.input.shape) - 1)
        ):
            folds[layer.name] = producer.name
    return folds


def _folded_weights(producer, batch_norm) -> list[np.ndarray]:
    """Kernel and bias of `producer` followed by `batch_norm` in inference mode, in float64."""
    value = lambda variable: np.asarray(variable.numpy(), np.float64)
    scale = 1.0 / np.sqrt(value(batch_norm.moving_variance) + batch_norm.epsilon)
    if batch_norm.scale:
        scale = scale * value(batch_norm.gamma)
    shift = -value(batch_norm.moving_mean) * scale
    if batch_norm.center:
        shift = shift + value(batch_norm.beta)
    kernel = value(producer.kernel) * scale  # output channels are the last axis
    return [kernel.astype(np.float32), shift.astype(np.float32)]


def inference_copy(
    model: keras.Model, precision: str, fold_batch_norms: bool = True, keep_float32_layers: bool = False
) -> keras.Model:
    """A functional copy for serving: BatchNorm folded, every layer in `precision`'s policy
    (float16/bfloat16: half variables, half compute), the softmax output in float32.
    `keep_float32_layers`: layers a half/mixed model runs in float32 on purpose (a detector's
    output convs) stay float32."""
    policy = layer_policy(precision)
    source_policies = [layer.dtype_policy.name for layer in model.layers if layer.weights]
    mostly_float32 = source_policies.count("float32") * 2 > len(source_policies)
    keep = {
        layer.name
        for layer in model.layers
        if keep_float32_layers and not mostly_float32 and layer.dtype_policy.name == "float32"
    }
    folds = _batch_norm_folds(model) if fold_batch_norms else {}
    folded_producers = set(folds.values())
    output_layers = {tensor._keras_history.operation.name for tensor in tf.nest.flatten(model.output)}

    def clone_layer(layer):
        config = layer.get_config()
        if layer.name in folds:  # the producer's new bias does the batch norm's work
            return FoldedBatchNorm(name=layer.name, dtype=policy)
        if layer.name in folded_producers:
            config["use_bias"] = True
        softmax_out = layer.name in output_layers and not layer.weights
        config["dtype"] = "float32" if softmax_out or layer.name in keep else policy
        return layer.__class__.from_config(config)

    try:
        copy = keras.models.clone_model(model, clone_function=clone_layer)
    except (TypeError, ValueError) as error:
        raise UsageError(
            f"model {model.name!r} cannot be copied for export (only functional and "
            f"sequential models can): {str(error).splitlines()[0]}"
        ) from None
    source_layers = {layer.name: layer for layer in model.layers}
    for layer in copy.layers:
        source = source_layers.get(layer.name)
        if source is None or layer.name in folds or not source.weights:
            continue
        if layer.name in folded_producers:
            batch_norm = next(source_layers[bn] for bn, producer in folds.items() if producer == layer.name)
            layer.set_weights(_folded_weights(source, batch_norm))
        else:
            layer.set_weights(source.get_weights())  # set_weights casts to the copy's dtype
    return copy


# ----------------------------------------------------------------------------- serving functions
def _classifier_serving(model: keras.Model, options: dict):
    height, width, channels = model.input.shape[1:]
    spec = tf.TensorSpec([None, height, width, channels], tf.float32, name=INPUT_NAME)

    @tf.function(input_signature=[spec])
    def serve(images):
        # The first layer casts the float32 images to its compute dtype; the softmax is float32.
        return {OUTPUT_NAME: tf.cast(model(images, training=False), tf.float32)}

    return serve


# model kind -> builder(inference copy, options) -> the serving tf.function (one float32 input
# signature, a dict of outputs) or a dict {endpoint name: tf.function} with "serving_default".
SERVING_BUILDERS = {
    "classifier": _classifier_serving,
    "detector": lambda model, options: export_detector.serving_endpoints(
        model, options=options, input_name=INPUT_NAME, raw_only=options.get("raw_only", False)
    ),
}


def _check_kind(model: keras.Model) -> str:
    kind = model_kind(model)
    if kind not in SERVING_BUILDERS:
        raise UsageError(
            f"model {model.name!r} is a {kind} (dict outputs); its export is not "
            f"available yet: register tfmp.serving.export.SERVING_BUILDERS[{kind!r}]"
        )
    return kind


def write_saved_model(model: keras.Model, path: str, options: dict | None = None) -> None:
    """SavedModel with `serving_default` (float32 `images` in) and any other endpoint the model
    kind's builder returns; `options` go to the builder (a detector's thresholds and anchors)."""
    endpoints = SERVING_BUILDERS[model_kind(model)](model, options or {})
    archive = keras.export.ExportArchive()
    archive.track(model)
    for name, function in (
        endpoints if isinstance(endpoints, dict) else {"serving_default": endpoints}
    ).items():
        archive.add_endpoint(name, function)
    archive.write_out(path, verbose=False)


def write_tflite(
    float32_model: keras.Model, path: str, float16_weights: bool, options: dict | None = None
) -> None:
    """TFLite flatbuffer of a float32 inference copy, built-in ops only, float32 I/O."""
    # Through a SavedModel: converting a concrete function of a Keras 3 model directly loses
    # its variables (the converter does not freeze them; the file holds no weights).
    with tempfile.TemporaryDirectory(prefix="tfmp-tflite-") as saved_model:
        write_saved_model(float32_model, saved_model, options)
        converter = tf.lite.TFLiteConverter.from_saved_model(saved_model)
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]  # no Flex ops
        if float16_weights:
            converter.optimizations = [tf.lite.Optimize.DEFAULT]
            converter.target_spec.supported_types = [tf.float16]
        flatbuffer = converter.convert()
    with open(path, "wb") as file:
        file.write(flatbuffer)


# ----------------------------------------------------------------------------- one export
def export(
    model: keras.Model,
    output_dir: str,
    formats=FORMATS,
    precision: str = "float32",
    *,
    metadata: dict | None = None,
    reference_images: np.ndarray | None = None,
    detector_options: dict | None = None,
) -> dict:
    """Writes `output_dir/<precision>/` (artifacts + export.json) and returns the report.

    Everything is written to a temporary sibling first and renamed into place at the end, so
    an error leaves no half-written export (and an earlier export of the same precision stays
    until the new one is complete). `reference_images` (float32 NHWC in [0, 1]) are what the
    difference table compares on; random images are used when there are none.
    `detector_options` (score_threshold, iou_threshold, max_detections) set a detector's NMS.
    """
    from tfmp.serving import predictors as inference

    formats = check_request(formats, precision)
    kind = _check_kind(model)
    model = strip_for_inference(model)
    detector = kind == "detector" and export_detector.options_for(
        model, detector_options, (metadata or {}).get("model")
    )
    if reference_images is None:
        reference_images = np.random.default_rng(0).uniform(size=(64, *model.input.shape[1:]))
    reference_images = np.asarray(reference_images, np.float32)
    final_dir = os.path.join(output_dir, precision)
    if os.path.exists(final_dir) and not os.path.isdir(final_dir):
        raise UsageError(f"export path {final_dir!r} exists and is not a directory; remove it")
    created_output_dir = not os.path.exists(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    temporary = tempfile.mkdtemp(prefix=f".{precision}.partial-", dir=output_dir)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(temporary, 0o777 & ~umask)  # mkdtemp's 0700 would hide the export from a server
    try:
        if detector:
            rows = export_detector.write_and_compare(
                model, precision, formats, temporary, reference_images, detector
            )
        else:
            rows = _write_and_compare(model, precision, formats, temporary, reference_images)
        report = dict(
            metadata or {},
            kind=kind,
            precision=precision,
            layer_policy=layer_policy(precision),
            source_layer_policy=next(
                (layer.dtype_policy.name for layer in model.layers if layer.weights), None
            ),
            batch_norms_folded=len(_batch_norm_folds(model)),
            preprocessing=inference.Preprocessing.from_shape(model.input.shape[1:]).to_json(),
            artifacts=rows,
        )
        report.setdefault("compared_with", f"{len(reference_images)} images")
        if detector:
            report.update(detector=detector)
            report["preprocessing"]["resize"] = export_detector.PREPROCESSING
        with open(os.path.join(temporary, METADATA_FILE), "w", encoding="utf-8") as file:
            json.dump(report, file, indent=2)
        _replace_directory(temporary, final_dir)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        if created_output_dir:
            shutil.rmtree(output_dir, ignore_errors=True)
        raise
    report["directory"] = os.path.abspath(final_dir)
    return report


def _write_and_compare(model, precision, formats, directory, reference_images) -> list[dict]:
    """Writes each format into `directory`, reloads it and compares it with the model."""
    from tfmp.serving import predictors as inference

    copy = inference_copy(model, precision)
    writers = {
        "saved_model": lambda path: write_saved_model(copy, path),
        "tflite": lambda path: write_tflite(
            copy if precision == "float32" else inference_copy(model, "float32"),
            path,
            float16_weights=precision != "float32",
        ),
        "keras": lambda path: copy.save(path),
    }
    loaders = {
        "saved_model": inference.SavedModelPredictor,
        "tflite": inference.TFLitePredictor,
        "keras": inference.KerasPredictor,
    }
    file_names = {"saved_model": SAVED_MODEL_DIR, "tflite": TFLITE_FILE, "keras": KERAS_FILE}
    # The reference is the trained weights computed in float32: the exact function the
    # training policy approximated, so each row shows what its precision costs.
    expected = reference_outputs(inference_copy(model, "float32", fold_batch_norms=False), reference_images)
    rows = []
    for name in formats:
        path = os.path.join(directory, file_names[name])
        writers[name](path)
        outputs = loaders[name](path, {}).predict(reference_images)
        rows.append(
            {
                "format": name,
                "file": file_names[name],
                "precision": "float16 weights, float32 compute"
                if name == "tflite" and precision != "float32"
                else precision,
                "size_bytes": disk_size(path),
                "max_abs_difference": float(np.max(np.abs(outputs - expected))),
                "top1_agreement": float(np.mean(outputs.argmax(-1) == expected.argmax(-1))),
            }
        )
    return rows


def reference_outputs(model, images, batch_size=64):
    """The trained model's float32 outputs, the reference every artifact is compared with."""
    call = lambda batch: tf.cast(model(batch, training=False), tf.float32)  # eager: called once
    return np.concatenate(
        [
            call(tf.constant(images[start : start + batch_size])).numpy()
            for start in range(0, len(images), batch_size)
        ]
    )


def _replace_directory(new: str, final: str) -> None:
    """Renames `new` to `final`; an existing `final` is moved aside first and removed after."""
    old = None
    if os.path.exists(final):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.old-", dir=os.path.dirname(final))
        os.rename(final, os.path.join(old, "previous"))
    os.rename(new, final)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def disk_size(path: str) -> int:
    """Bytes of a file, or of every file under a directory."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(
        os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names
    )


def format_table(rows: list[dict]) -> str:
    """The difference table as aligned text (a detector's: per output, see tfmp.serving.detector)."""
    header = ("format", "precision", "size", "max |diff| vs Keras float32", "top-1 agreement")
    lines = [
        (
            row["format"],
            row["precision"],
            f"{row['size_bytes'] / 2**20:.2f} MiB",
            f"{row['max_abs_difference']:.2e}",
            f"{100 * row['top1_agreement']:.1f}%",
        )
        for row in rows
        if "top1_agreement" in row
    ]
    if rows and "detection_agreement" in rows[0]:
        header, lines = export_detector.table_lines(rows)
    widths = [max(len(str(cells[i])) for cells in [header, *lines]) for i in range(len(header))]
    return "\n".join(
        "  ".join(str(cell).ljust(width) for cell, width in zip(cells, widths)).rstrip()
        for cells in [header, *lines]
    )


# ----------------------------------------------------------------------------- a training run
def export_run(
    run_dir: str,
    formats=FORMATS,
    precision: str = "float32",
    output_dir: str | None = None,
    eval_batches: int = 2,
    batch_size: int = 32,
    detector_options: dict | None = None,
) -> dict:
    """Exports `run_dir/model.keras` to `output_dir` (default `run_dir/export`)/<precision>/,
    compared on `eval_batches` eval batches of the run's dataset (random images if the data
    cannot be read here). Everything a user can get wrong is checked before writing."""
    from tfmp.serving import predictors as inference

    formats = check_request(formats, precision)
    if eval_batches < 1 or batch_size < 1:
        raise UsageError(f"eval_batches={eval_batches} and batch_size={batch_size} must be >= 1")
    model_path = os.path.join(run_dir, inference.RUN_MODEL_FILE)
    if not os.path.isdir(run_dir):
        raise UsageError(f"--model_dir={run_dir} does not exist; give a training run dir")
    if not os.path.isfile(model_path):
        raise UsageError(
            f"--model_dir={run_dir} holds no {inference.RUN_MODEL_FILE}; "
            "train to the end first (the model is saved when a run finishes)"
        )
    model = inference.KerasPredictor(model_path, {}).model
    metadata = inference.run_metadata(run_dir)
    found = None
    if model_kind(model) == "detector" and metadata.get("dataset"):
        options = export_detector.options_for(model, detector_options, metadata.get("model"))
        found = export_detector.eval_images(
            metadata, options["image_size"], options, eval_batches, batch_size
        )
    images, source = found or _eval_images(metadata, tuple(model.input.shape[1:]), eval_batches, batch_size)
    metadata.update(source_model=os.path.abspath(model_path), compared_with=source)
    return export(
        model,
        output_dir or os.path.join(run_dir, "export"),
        formats,
        precision,
        metadata=metadata,
        reference_images=images,
        detector_options=detector_options,
    )


def _eval_images(metadata: dict, image_shape, batches: int, batch_size: int):
    """(images, description): eval batches of the run's dataset, or random images."""
    from tfmp.classification import data

    dataset = metadata.get("dataset")
    if dataset and dataset != "synthetic":
        try:
            stream, _ = data.load(
                dataset,
                "eval",
                batch_size,
                image_size=metadata.get("image_size"),
                data_dir=metadata.get("data_dir"),
                training=False,
            )
            images = np.concatenate([batch.numpy() for batch, _ in stream.take(batches)])
            if images.shape[1:] == image_shape:
                return images, f"{len(images)} eval images of {dataset}"
        except Exception as error:  # data not readable here: the comparison still means something
            from absl import logging

            logging.warning(
                "tfmp.serving.export: eval data of %s unavailable (%s); comparing on random images",
                dataset,
                str(error).splitlines()[0] if str(error) else error,
            )
    rng = np.random.default_rng(0)
    images = rng.uniform(size=(batches * batch_size, *image_shape)).astype(np.float32)
    return images, f"{len(images)} random images"
