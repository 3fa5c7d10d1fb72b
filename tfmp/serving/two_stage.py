"""Two-stage detector exports (Faster R-CNN): the model's own NMS in the SavedModel, no TFLite.

This module registers the "two_stage_detector" kind (models whose outputs hold the second
stage's "rois" and the detections' "valid_detections": `tfmp.detection.faster_rcnn`) in
`tfmp.serving.export.KINDS` and `tfmp.serving.artifacts.KINDS`, so `apps.export` and
`apps.predict` take a Faster R-CNN run or export like a RetinaNet one. What an export holds:

* `saved_model/` - `serving_default`: float32 `images` [B, S, S, 3] in [0, 1] in (the function
  supplies the empty ground truth the model's inputs hold); out float32 `boxes` [B, D, 4] (xyxy
  pixels of the S x S input), float32 `scores` [B, D], int32 `classes` [B, D] and int32
  `valid_detections` [B] after the model's own per-class NMS, cut to `score_threshold` and
  `max_detections` (`faster_rcnn.select_detections`). The model runs in the export precision;
  anchors, proposals, ROIAlign, decoding and NMS are float32 layers in every precision. The
  model's NMS is built with its IoU and score thresholds and detection count, so an export
  can only raise the threshold and lower the count (refused otherwise, in one line). A second
  signature `raw_outputs` returns the float32 RPN outputs, the proposals (`rois`,
  `roi_weights`) and the second stage's `roi_classes` logits and `roi_deltas`.
* `model.keras` - the inference copy (`copies.inference_copy`, the float32 layers kept).
* no `model.tflite`: ROIAlign's CropAndResize and the NMS ops are no TFLite builtins, and tfmp
  converts built-in ops only; the default formats leave it out with a note, `--formats=tflite`
  is refused.

The difference table, against the trained weights computed in float32: max |difference| of
the RPN's objectness logits and box deltas (dense outputs, one per anchor: what the precision
changes, and they do not jump when two scores swap order; the second stage's raw outputs
would, since they belong to whichever proposals won the top-k); the detection agreement, an F1
of greedy matches (same class, IoU >= 0.5, `tfmp.serving.detector.matches`); and max
|difference| of the scores of matched detections. Two detections swap only when their scores
are within the precision's error of each other, so matching the other one moves that number by
about as much; it grows past the error only when a proposal swapped in the first stage hands
the second stage another box of the same object.
"""

from __future__ import annotations

import functools

import keras
import numpy as np
import tensorflow as tf

from tfmp.detection import faster_rcnn
from tfmp.errors import UsageError
from tfmp.serving import artifacts, copies, detector, export, predictors

KIND = "two_stage_detector"
DETECTION_KEYS = ("boxes", "scores", "classes", "valid_detections")
RPN_KEYS = ("rpn_scores", "rpn_deltas")
NO_TFLITE = "needs CropAndResize and NMS, which are no TFLite builtins"


def _detections_layer(model) -> faster_rcnn.Detections:
    """The model's final NMS layer, which holds its built-in thresholds and detection count."""
    found = [layer for layer in model.layers if isinstance(layer, faster_rcnn.Detections)]
    if len(found) != 1:
        raise UsageError(
            f"model {model.name!r} has {len(found)} Detections layers, not 1; export a model "
            "built by tfmp.detection.faster_rcnn"
        )
    return found[0]


def options_for(model, requested: dict | None, name: str | None = None) -> dict:
    """The two_stage_detector section of export.json: image size, classes, the thresholds the
    SavedModel applies (the model's own unless raised) and the model's built-in ones."""
    layer = _detections_layer(model)
    requested = {key: value for key, value in (requested or {}).items() if value is not None}
    label = name or model.name
    score_threshold = requested.get("score_threshold", layer.score_threshold)
    max_detections = requested.get("max_detections", layer.max_detections)
    if not layer.score_threshold <= score_threshold < 1.0:
        raise UsageError(
            f"--score_threshold={score_threshold} must be in [{layer.score_threshold}, 1): {label}'s "
            "NMS keeps no lower scores; train it with a lower apps.detect --score_threshold"
        )
    if not 1 <= max_detections <= layer.max_detections:
        raise UsageError(
            f"--max_detections={max_detections} must be in [1, {layer.max_detections}]: {label}'s "
            "NMS keeps no more; train it with a higher apps.detect --max_detections"
        )
    if requested.get("iou_threshold", layer.iou_threshold) != layer.iou_threshold:
        raise UsageError(
            f"--iou_threshold={requested['iou_threshold']}: {label}'s NMS IoU threshold is "
            f"built into the model ({layer.iou_threshold}); leave --iou_threshold out"
        )
    return {
        "score_threshold": float(score_threshold),
        "max_detections": int(max_detections),
        "iou_threshold": float(layer.iou_threshold),
        "model_score_threshold": float(layer.score_threshold),
        "model_max_detections": int(layer.max_detections),
        "image_size": int(layer.image_size),
        "num_classes": int(layer.num_classes),
        "tflite": NO_TFLITE,
    }


def serving_endpoints(model, options: dict) -> dict:
    """{"serving_default": images -> detections, "raw_outputs": images -> RPN, proposals and
    second-stage outputs} (module docstring)."""
    size = options["image_size"]
    spec = tf.TensorSpec([None, size, size, 3], tf.float32, name=export.INPUT_NAME)

    @tf.function(input_signature=[spec])
    def outputs(images):
        # Both signatures call this one function: the model is traced once.
        return model(predictors.model_inputs(model, images), training=False)

    @tf.function(input_signature=[spec])
    def raw(images):
        found = outputs(images)
        return {key: tf.cast(value, tf.float32) for key, value in found.items() if key not in DETECTION_KEYS}

    @tf.function(input_signature=[spec])
    def detect(images):
        return faster_rcnn.select_detections(
            outputs(images), options["score_threshold"], options["max_detections"]
        )

    return {"serving_default": detect, detector.RAW_SIGNATURE: raw}


def detections(
    predictor: predictors.Predictor, images: np.ndarray, batch_size: int = 64
) -> tuple[dict, dict]:
    """(raw outputs, detections) of an exported two-stage detector: a SavedModel answers both
    itself; a .keras (or a run's model.keras) gives every output, cut here to the export's
    thresholds exactly as the SavedModel cuts them."""
    if isinstance(predictor, predictors.SavedModelPredictor):
        if detector.RAW_SIGNATURE not in predictor.loaded.signatures:
            raise UsageError(
                f"SavedModel {predictor.path!r} is not an exported detector (no {detector.RAW_SIGNATURE} signature)"
            )
        raw = predictor.predict_outputs(images, batch_size, signature=detector.RAW_SIGNATURE)
        return raw, predictor.predict_outputs(images, batch_size)
    options = predictor.metadata.get(KIND)
    if not options:
        raise UsageError(
            f"{predictor.path!r} is not an exported two-stage detector (its export.json has no "
            f"{KIND} section); export the run with apps.export first"
        )
    return _split(predictor.predict_outputs(images, batch_size), options)


def _split(outputs: dict, options: dict) -> tuple[dict, dict]:
    """(raw outputs, detections cut to the export's thresholds) of every output of the model."""
    found = faster_rcnn.select_detections(outputs, options["score_threshold"], options["max_detections"])
    raw = {key: value for key, value in outputs.items() if key not in DETECTION_KEYS}
    return raw, {key: np.asarray(value) for key, value in found.items()}


def _reference(model, images: np.ndarray, options: dict, batch_size: int = 64) -> tuple[dict, dict]:
    """(raw outputs, detections) of `model` called eagerly: the reference is computed once, and
    tracing it would cost more than the call."""
    batches = [
        model(predictors.model_inputs(model, images[start : start + batch_size]), training=False)
        for start in range(0, len(images), batch_size)
    ]
    outputs = {key: np.concatenate([np.asarray(batch[key]) for batch in batches]) for key in batches[0]}
    return _split(outputs, options)


def write_and_compare(model, precision, formats, directory, reference_images, options) -> list[dict]:
    """Writes each format, reloads it, and compares it with the trained weights computed in
    float32 (module docstring)."""
    copy = copies.inference_copy(model, precision, keep_float32_layers=True)
    reference = copies.inference_copy(model, "float32", fold_batch_norms=False)
    expected_raw, expected = _reference(reference, reference_images, options)
    rows = []
    for name, path in export.written_artifacts(model, copy, precision, formats, directory, options):
        raw, found = detections(predictors.LOADERS[name](path, {KIND: options}), reference_images)
        differences = {key: float(np.max(np.abs(raw[key] - expected_raw[key]))) for key in RPN_KEYS}
        pairs = detector.matches(expected, found)
        score_differences = [abs(expected["scores"][r, i] - found["scores"][r, j]) for r, i, j in pairs]
        row = detector.artifact_row(
            name, path, precision, "every model output (detections after NMS)", differences, expected, found
        )
        rows.append({**row, "max_matched_score_difference": float(max(score_differences, default=0.0))})
    return rows


def table_lines(rows: list[dict]) -> tuple[tuple, list[tuple]]:
    """Header and cells of a two-stage detector's difference table (`export.format_table`)."""
    header = (
        "format",
        "precision",
        "size",
        "max |diff RPN logits|",
        "max |diff RPN deltas|",
        "max |diff matched scores|",
        "detection agreement (F1)",
    )
    lines = [
        (
            row["format"],
            row["precision"],
            f"{row['size_bytes'] / 2**20:.2f} MiB",
            f"{row['max_abs_difference_per_output']['rpn_scores']:.2e}",
            f"{row['max_abs_difference_per_output']['rpn_deltas']:.2e}",
            f"{row['max_matched_score_difference']:.2e}",
            f"{100 * row['detection_agreement']:.1f}% of {row['reference_detections']}",
        )
        for row in rows
    ]
    return header, lines


def _accepts(model: keras.Model) -> bool:
    """A Faster R-CNN: second-stage `rois` and NMS `valid_detections` among dict outputs."""
    return isinstance(model.output, dict) and {"rois", "valid_detections"} <= set(model.output)


export.KINDS[KIND] = export.ExportKind(
    accepts=_accepts,
    serving=serving_endpoints,
    compare=write_and_compare,
    table=table_lines,
    options=options_for,
    eval_images=detector.eval_images,
    resize=detector.PREPROCESSING,
    unsupported={"tflite": NO_TFLITE},
)
artifacts.KINDS[KIND] = artifacts.PredictionKind(
    trains=lambda name: name in faster_rcnn.DETECTORS,
    class_names=detector.detection_class_names,
    predict_files=functools.partial(detector.predict, kind=KIND, find=detections),
    section={
        key: detector.SECTION[key]
        for key in ("score_threshold", "max_detections", "image_size", "num_classes")
    },
)
