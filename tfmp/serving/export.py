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
  model (`tfmp.serving.copies`): for float16/bfloat16 every variable is stored in that dtype, so
  no weight is cast on a call (what `model.export` of a mixed model does instead). `mixed` keeps
  float32 variables and half compute, like the training policy.
* `model.tflite` - always converted from a float32 copy (converting half-precision compute
  fails with "'tf.Conv2D' op is neither a custom op nor a flex op"); float32 precision keeps
  float32 weights, every other precision stores float16 weights. Built-in ops only (no Flex),
  float32 input and output.
* `model.keras` - the inference copy in the requested precision (BatchNorm folded).
* `export.json` - the report: kind, precisions, preprocessing, class names, the difference
  table, and `saved_model_sha256`, the SHA-256 of `saved_model/saved_model.pb`: a SavedModel is
  a program, and `apps.predict` runs one only when this record matches (`tfmp.serving.trust`).

Model kinds: `KINDS` maps a kind ("classifier", "detector", "two_stage_detector", registered by
`tfmp.serving.classifier`, `.detector` and `.two_stage`) to what is specific to it:
which models it accepts, its serving endpoints, its options section of export.json, its eval
images, its difference table and the formats it cannot write (a Faster R-CNN has no TFLite:
left out of the default formats with a note in the report, refused when asked for). The code
below only looks the kind up; a new kind registers an `ExportKind` from its own module.
`copies.strip_for_inference` removes training-only state first (pruning masks). A run trained
with a pipeline split (`--pipeline_stages`) saves one Keras model, so it exports like any other.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from tfmp import run_dir as run_files
from tfmp.errors import UsageError, unknown
from tfmp.serving import artifacts, copies, predictors, trust

FORMATS = ("saved_model", "tflite", "keras")
PRECISIONS = copies.PRECISIONS
SAVED_MODEL_DIR, TFLITE_FILE, KERAS_FILE = "saved_model", "model.tflite", "model.keras"
FILE_NAMES = {"saved_model": SAVED_MODEL_DIR, "tflite": TFLITE_FILE, "keras": KERAS_FILE}
INPUT_NAME, OUTPUT_NAME = "images", "probabilities"


@dataclasses.dataclass(frozen=True)
class ExportKind:
    """What exporting one kind of model needs beyond the generic writers.

    `serving(copy, options)` returns the serving tf.function (one float32 input signature, a dict
    of outputs) or {endpoint name: tf.function} with "serving_default"; with `options["raw_only"]`
    only what TFLite can convert. `compare(model, precision, formats, directory, images, options)`
    writes every format (see `written_artifacts`) and returns the difference-table rows, which
    `table(rows)` turns into (header, cells). `options(model, requested, name)` is the kind's
    section of export.json (empty: none); `eval_images(metadata, model, options, batches,
    batch_size)` the run's eval images as (images, description), or None. `unsupported`: {format:
    why this kind cannot write it}, completing "--formats=NAME: MODEL ..." (one line)."""

    accepts: Callable[[keras.Model], bool]
    serving: Callable[[keras.Model, dict], object]
    compare: Callable[..., list[dict]]
    table: Callable[[list[dict]], tuple[tuple, list[tuple]]]
    options: Callable[[keras.Model, dict | None, str | None], dict] = lambda model, requested, name: {}
    eval_images: Callable[..., tuple[np.ndarray, str] | None] = lambda *args: None
    resize: str | None = None  # export.json's preprocessing "resize", when the kind's differs
    unsupported: dict[str, str] = dataclasses.field(default_factory=dict)


KINDS: dict[str, ExportKind] = {}  # filled by the modules that know a kind (tfmp.serving.__init__)


def check_request(formats, precision: str) -> tuple[str, ...] | None:
    """Validates the formats and precision; returns the formats without duplicates (None, the
    default: every format the model's kind writes, see `kind_formats`)."""
    if precision not in PRECISIONS:
        raise unknown("precision", precision, PRECISIONS)
    if formats is None:
        return None
    formats = tuple(dict.fromkeys(formats))
    if not formats:
        raise UsageError(f"no export format given; choose from: {', '.join(FORMATS)}")
    for name in formats:
        if name not in FORMATS:
            raise unknown("format", name, FORMATS)
    return formats


def model_kind(model: keras.Model) -> str:
    """The first registered kind that accepts `model` ("classifier": one probabilities tensor)."""
    for kind, spec in KINDS.items():
        if spec.accepts(model):
            return kind
    outputs = sorted(model.output) if isinstance(model.output, dict) else type(model.output).__name__
    raise UsageError(
        f"model {model.name!r} (outputs {outputs}) is no kind this export knows "
        f"({', '.join(KINDS)}); register an ExportKind in tfmp.serving.export.KINDS"
    )


def kind_formats(kind: str, formats, model_name: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """(formats to write, {format left out of the default: why}) for a model of `kind`: None
    means every format the kind writes; a format asked for by name that it cannot write is a
    UsageError naming the formats it can."""
    unsupported = KINDS[kind].unsupported
    supported = tuple(name for name in FORMATS if name not in unsupported)
    if formats is None:
        return supported, dict(unsupported)
    for name in formats:
        if name in unsupported:
            raise UsageError(
                f"--formats={name}: {model_name} {unsupported[name]}; export {','.join(supported)}"
            )
    return tuple(formats), {}


# ----------------------------------------------------------------------------- writing artifacts
def write_saved_model(model: keras.Model, path: str, options: dict | None = None) -> None:
    """SavedModel with `serving_default` (float32 `images` in) and any other endpoint the model
    kind's serving builder returns; `options` go to the builder (a detector's thresholds)."""
    endpoints = KINDS[model_kind(model)].serving(model, options or {})
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


def written_artifacts(model, copy, precision: str, formats, directory: str, options: dict | None = None):
    """Writes each format of the inference `copy` of `model` into `directory`, yielding
    (format, path) after each one so the caller compares it before the next is written."""
    float32_copy = copy if precision == "float32" else None
    for name in formats:
        path = os.path.join(directory, FILE_NAMES[name])
        if name == "saved_model":
            write_saved_model(copy, path, options)
        elif name == "tflite":
            float32_copy = float32_copy or copies.inference_copy(model, "float32")
            write_tflite(float32_copy, path, precision != "float32", dict(options or {}, raw_only=True))
        else:
            copy.save(path)
        yield name, path


def artifact_precision(name: str, precision: str) -> str:
    """What a row of the difference table computes in (a half .tflite: float16 weights only)."""
    return "float16 weights, float32 compute" if name == "tflite" and precision != "float32" else precision


# ----------------------------------------------------------------------------- one export
def export(
    model: keras.Model,
    output_dir: str,
    formats=None,
    precision: str = "float32",
    *,
    metadata: dict | None = None,
    reference_images: np.ndarray | None = None,
    options: dict | None = None,
) -> dict:
    """Writes `output_dir/<precision>/` (artifacts + export.json) and returns the report.

    Everything is written to a temporary sibling first and renamed into place at the end, so
    an error leaves no half-written export (and an earlier export of the same precision stays
    until the new one is complete). `reference_images` (float32 NHWC in [0, 1]) are what the
    difference table compares on; random images are used when there are none. `options` go to
    the model kind (a detector's score_threshold, iou_threshold, max_detections). `formats`
    None: every format the model's kind writes (the report's "skipped_formats" says which not).
    """
    formats = check_request(formats, precision)
    kind = model_kind(model)
    formats, skipped = kind_formats(kind, formats, (metadata or {}).get("model") or model.name)
    model = copies.strip_for_inference(model)
    options = KINDS[kind].options(model, options, (metadata or {}).get("model"))
    image_shape = predictors.image_input_shape(model)
    if reference_images is None:
        reference_images = np.random.default_rng(0).uniform(size=(64, *image_shape))
    reference_images = np.asarray(reference_images, np.float32)
    output_dir = run_files.writable_dir(output_dir, "output_dir")
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
        rows = KINDS[kind].compare(model, precision, formats, temporary, reference_images, options)
        report = dict(
            metadata or {},
            kind=kind,
            precision=precision,
            layer_policy=copies.layer_policy(precision),
            source_layer_policy=next(
                (layer.dtype_policy.name for layer in model.layers if layer.weights), None
            ),
            batch_norms_folded=len(copies.batch_norm_folds(model)),
            preprocessing=artifacts.Preprocessing.from_shape(image_shape).to_json(),
            artifacts=rows,
        )
        if skipped:
            report["skipped_formats"] = skipped
        report.setdefault("compared_with", f"{len(reference_images)} images")
        if options:
            report[kind] = options
        if KINDS[kind].resize:
            report["preprocessing"]["resize"] = KINDS[kind].resize
        if "saved_model" in formats:  # what apps.predict checks before it runs the graph
            report[trust.RECORD_KEY] = trust.graph_digest(os.path.join(temporary, SAVED_MODEL_DIR))
        metadata_path = os.path.join(temporary, run_files.EXPORT_METADATA_FILE)
        run_files.write_text_atomic(metadata_path, json.dumps(report, indent=2))
        _replace_directory(temporary, final_dir)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        if created_output_dir:
            shutil.rmtree(output_dir, ignore_errors=True)
        raise
    report["directory"] = os.path.abspath(final_dir)
    return report


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


def format_table(rows: list[dict], kind: str = "classifier") -> str:
    """The difference table of an export of `kind` (export.json's "kind") as aligned text."""
    header, lines = KINDS[kind].table(rows)
    widths = [max(len(str(cells[i])) for cells in [header, *lines]) for i in range(len(header))]
    return "\n".join(
        "  ".join(str(cell).ljust(width) for cell, width in zip(cells, widths)).rstrip()
        for cells in [header, *lines]
    )


# ----------------------------------------------------------------------------- a training run
def export_run(
    run_dir: str,
    formats=None,
    precision: str = "float32",
    output_dir: str | None = None,
    eval_batches: int = 2,
    batch_size: int = 32,
    options: dict | None = None,
) -> dict:
    """Exports `run_dir/model.keras` to `output_dir` (default `run_dir/export`)/<precision>/,
    compared on `eval_batches` eval batches of the run's dataset (random images if the data
    cannot be read here). Everything a user can get wrong is checked before writing; `formats`
    None: every format the run's model kind writes."""
    formats = check_request(formats, precision)
    if eval_batches < 1 or batch_size < 1:
        raise UsageError(f"eval_batches={eval_batches} and batch_size={batch_size} must be >= 1")
    run_dir = os.path.expanduser(run_dir)
    model_path = os.path.join(run_dir, run_files.MODEL_FILE)
    if not os.path.isdir(run_dir):
        raise UsageError(
            f"--model_dir={run_dir} does not exist or is not a directory; give a training run dir"
        )
    if not os.path.isfile(model_path):
        raise UsageError(
            f"--model_dir={run_dir} holds no {run_files.MODEL_FILE}; "
            "train to the end first (the model is saved when a run finishes)"
        )
    output_dir = run_files.writable_dir(
        output_dir or os.path.join(run_dir, run_files.EXPORT_DIR), "--output_dir"
    )
    trained = run_files.read_flags(run_dir).get("model")
    if trained and not any(spec.trains(trained) for spec in artifacts.KINDS.values()):
        raise UsageError(
            f"--model_dir={run_dir} trained {trained!r}, which apps.export cannot export yet "
            f"(it exports {', '.join(artifacts.KINDS)} runs; a new kind registers in tfmp.serving)"
        )
    model = predictors.KerasPredictor(model_path, {}).model
    metadata = artifacts.run_metadata(run_dir)
    kind_formats(model_kind(model), formats, trained or model.name)  # refused before reading data
    kind = KINDS[model_kind(model)]
    found = None
    if metadata.get("dataset"):
        kind_options = kind.options(model, options, metadata.get("model"))
        found = kind.eval_images(metadata, model, kind_options, eval_batches, batch_size)
    if found is None:
        rng = np.random.default_rng(0)
        shape = (eval_batches * batch_size, *predictors.image_input_shape(model))
        found = rng.uniform(size=shape).astype(np.float32), f"{shape[0]} random images"
    images, source = found
    metadata.update(source_model=os.path.abspath(model_path), compared_with=source)
    return export(
        model,
        output_dir,
        formats,
        precision,
        metadata=metadata,
        reference_images=images,
        options=options,
    )
