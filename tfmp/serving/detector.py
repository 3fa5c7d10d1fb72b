"""Detector exports and their predictions: NMS inside the SavedModel, raw outputs in TFLite.

This module registers the "detector" kind (models whose outputs are RetinaNet's dict
`{"classes": logits, "boxes": deltas}`) in `tfmp.serving.export.KINDS` and
`tfmp.serving.artifacts.KINDS`; importing `tfmp.serving` imports it, so use
`tfmp.serving.export.export`/`export_run` and `apps.predict` as for a classifier. What a
detector export holds:

* `saved_model/` - `serving_default`: float32 `images` [B, S, S, 3] in [0, 1] in; out float32
  `boxes` [B, D, 4] (xyxy pixels of the S x S input, clipped to it), float32 `scores` [B, D],
  int32 `classes` [B, D] and int32 `valid_detections` [B] (rows past the count are 0). The
  detector runs in the export precision; decoding and combined NMS always run in float32. A
  second signature `raw_outputs` returns the float32 `classes` logits [B, A, K] and `boxes`
  deltas [B, A, 4] for callers with their own decoder.
* `model.tflite` - the raw outputs only (same names and shapes): `combined_non_max_suppression`
  is no TFLite builtin (conversion fails without Flex ops), so decoding + NMS is the caller's:
  `export.json["detector"]` holds the anchor config and thresholds, and
  `detections(tfmp.serving.predictors.load(path), images)` decodes exactly as the SavedModel does.
* `model.keras` - the inference copy (raw outputs).

The difference table compares the raw outputs per key (max |difference| of logits and of box
deltas against the trained weights computed in float32): they are what the precision changes,
and unlike NMS results they do not jump when two scores swap order. Its last column is the
detection agreement: the F1 of matching each export's detections to the float32 reference's
(same class, IoU >= 0.5).
"""

from __future__ import annotations

import os

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmp.detection import boxes, data, retinanet, visualize
from tfmp.detection import predict as run_predict
from tfmp.errors import UsageError
from tfmp.input import image_files
from tfmp.serving import artifacts, copies, export, predictors

RAW_SIGNATURE = "raw_outputs"
DEFAULT_OPTIONS = {"score_threshold": 0.05, "iou_threshold": 0.5, "max_detections": 100}
MATCH_IOU = 0.5
PREPROCESSING = (
    "longer side resized to S keeping the aspect ratio (bilinear, antialias), padded "
    "bottom/right with 0 to S x S (tfmp.detection.data.read_image); multiply boxes by "
    "original pixels per input pixel to draw them on the original image"
)


def anchor_levels(model, name: str | None = None) -> tuple[int, ...]:
    """The FPN levels the detector's outputs follow: its registry entry's (by `name` or the
    model's name), checked against the number of anchors it predicts."""
    size, count = int(model.input.shape[1]), int(model.output["boxes"].shape[1])
    candidates = [retinanet.anchor_config(n).levels for n in (name, model.name) if n in retinanet.DETECTORS]
    candidates += [tuple(range(3, top + 1)) for top in range(3, 8)]  # an unregistered RetinaNet
    for levels in candidates:
        config = boxes.AnchorConfig(levels=levels)
        if (
            sum(boxes.feature_size(size, level) ** 2 for level in levels) * config.anchors_per_location
            == count
        ):
            return tuple(levels)
    raise UsageError(
        f"detector {model.name!r} predicts {count} anchors, which no FPN levels 3..7 "
        f"of a {size}px input give; export it with the --model its run trained"
    )


def options_for(model, options: dict | None, name: str | None = None) -> dict:
    """The detector section of export.json: image size, anchors, NMS thresholds."""
    options = dict(DEFAULT_OPTIONS, **{k: v for k, v in (options or {}).items() if v is not None})
    if not 0.0 <= options["score_threshold"] < 1.0 or options["max_detections"] < 1:
        raise UsageError(
            f"score_threshold={options['score_threshold']} must be in [0, 1) and "
            f"max_detections={options['max_detections']} >= 1"
        )
    levels = anchor_levels(model, name)
    config = boxes.AnchorConfig(levels=levels)
    return dict(
        options,
        image_size=int(model.input.shape[1]),
        anchor_levels=list(levels),
        anchor_scales=list(config.scales),
        anchor_ratios=list(config.ratios),
        anchor_size=config.size,
        box_variance=list(boxes.BOX_VARIANCE),
        num_classes=int(model.output["classes"].shape[-1]),
        tflite_outputs="raw: classes logits [B, A, K], boxes deltas [B, A, 4]; decode + NMS "
        "with tfmp.detection.boxes.decode_detections and these anchors",
    )


def anchors(options: dict) -> tf.Tensor:
    return boxes.generate_anchors(
        options["image_size"], boxes.AnchorConfig(levels=tuple(options["anchor_levels"]))
    )


def decode(raw: dict, options: dict, score_threshold: float | None = None) -> dict:
    """Detections (numpy, float32 boxes/scores, int32 classes/valid_detections) from raw outputs."""
    found = boxes.decode_detections(
        {key: tf.constant(raw[key]) for key in ("classes", "boxes")},
        anchors(options),
        score_threshold=options["score_threshold"] if score_threshold is None else score_threshold,
        iou_threshold=options["iou_threshold"],
        max_detections=options["max_detections"],
        image_size=options["image_size"],
    )
    return {key: value.numpy() for key, value in found.items()}


# ----------------------------------------------------------------------------- serving functions
def serving_endpoints(model, options: dict) -> dict:
    """{"serving_default": images -> detections after NMS, "raw_outputs": images -> logits and
    deltas}; with `options["raw_only"]` the raw function is `serving_default` (what TFLite
    converts)."""
    size = options["image_size"]
    spec = tf.TensorSpec([None, size, size, 3], tf.float32, name=export.INPUT_NAME)
    anchor_boxes = anchors(options)

    @tf.function(input_signature=[spec])
    def raw(images):
        outputs = model(images, training=False)
        return {key: tf.cast(outputs[key], tf.float32) for key in ("classes", "boxes")}

    if options.get("raw_only"):
        return {"serving_default": raw}

    @tf.function(input_signature=[spec])
    def detect(images):
        # The detector computes in the export precision; decoding and NMS in float32. Calling
        # `raw` (not the model) traces the model once for both signatures.
        return boxes.decode_detections(
            raw(images),
            anchor_boxes,
            score_threshold=options["score_threshold"],
            iou_threshold=options["iou_threshold"],
            max_detections=options["max_detections"],
            image_size=size,
        )

    return {"serving_default": detect, RAW_SIGNATURE: raw}


# ----------------------------------------------------------------------------- the difference table
def matches(reference: dict, found: dict) -> list[tuple[int, int, int]]:
    """(image, reference index, found index) of each greedy match of `found` detections to
    `reference`'s: same class, IoU >= 0.5, each reference detection (best score first) takes
    the unmatched found detection it overlaps most."""
    pairs = []
    for row in range(len(reference["valid_detections"])):
        n, m = int(reference["valid_detections"][row]), int(found["valid_detections"][row])
        if not n or not m:
            continue
        iou = boxes.compute_iou(reference["boxes"][row][:n], found["boxes"][row][:m]).numpy()
        iou[reference["classes"][row][:n, None] != found["classes"][row][None, :m]] = 0.0
        used = set()
        for i in range(n):  # reference rows come sorted by score
            candidates = [j for j in np.argsort(-iou[i]) if j not in used and iou[i, j] >= MATCH_IOU]
            if candidates:
                used.add(candidates[0])
                pairs.append((row, i, int(candidates[0])))
    return pairs


def agreement(reference: dict, found: dict) -> float:
    """F1 of greedy matching (same class, IoU >= 0.5) of `found` detections to `reference`'s."""
    total = int(np.sum(reference["valid_detections"])) + int(np.sum(found["valid_detections"]))
    return 1.0 if total == 0 else 2.0 * len(matches(reference, found)) / total


def write_and_compare(model, precision, formats, directory, reference_images, options) -> list[dict]:
    """Writes each format, reloads it, and compares raw outputs and detections with the trained
    weights computed in float32 (see the module docstring)."""
    copy = copies.inference_copy(model, precision, keep_float32_layers=True)
    reference = copies.inference_copy(model, "float32", fold_batch_norms=False)
    expected = predictors.KerasPredictor("", {}, model=reference).predict_outputs(reference_images)
    expected_detections = decode(expected, options)
    rows = []
    for name, path in export.written_artifacts(model, copy, precision, formats, directory, options):
        predictor = predictors.LOADERS[name](path, {"detector": options})
        raw, found = detections(predictor, reference_images)
        differences = {key: float(np.max(np.abs(raw[key] - expected[key]))) for key in ("classes", "boxes")}
        rows.append(
            artifact_row(
                name, path, precision, "raw logits and box deltas", differences, expected_detections, found
            )
        )
    return rows


def artifact_row(name, path, precision, outputs, differences, reference, found) -> dict:
    """One row of a detector kind's difference table: the artifact `name` at `path`, what a
    non-SavedModel artifact `outputs`, the max |difference| per raw output, and the agreement
    of its detections `found` with the `reference` detections."""
    return {
        "format": name,
        "file": export.FILE_NAMES[name],
        "precision": export.artifact_precision(name, precision),
        "outputs": "detections after NMS (+ raw_outputs signature)" if name == "saved_model" else outputs,
        "size_bytes": export.disk_size(path),
        "max_abs_difference": max(differences.values()),
        "max_abs_difference_per_output": differences,
        "detection_agreement": agreement(reference, found),
        "reference_detections": int(reference["valid_detections"].sum()),
    }


def table_lines(rows: list[dict]) -> tuple[tuple, list[tuple]]:
    """Header and cells of a detector's difference table (`tfmp.serving.export.format_table`)."""
    header = (
        "format",
        "precision",
        "size",
        "max |diff logits|",
        "max |diff box deltas|",
        "detection agreement (F1)",
    )
    lines = [
        (
            row["format"],
            row["precision"],
            f"{row['size_bytes'] / 2**20:.2f} MiB",
            f"{row['max_abs_difference_per_output']['classes']:.2e}",
            f"{row['max_abs_difference_per_output']['boxes']:.2e}",
            f"{100 * row['detection_agreement']:.1f}% of {row['reference_detections']}",
        )
        for row in rows
    ]
    return header, lines


# ----------------------------------------------------------------------------- predictions
def eval_images(metadata: dict, model, options: dict, batches: int, batch_size: int):
    """(images, description): eval batches of the run's detection dataset, or None (any
    detector kind: `options` needs its "image_size" only)."""
    try:
        stream, _ = data.load(
            metadata["dataset"],
            "eval",
            batch_size,
            image_size=options["image_size"],
            data_dir=metadata.get("data_dir"),
            training=False,
        )
        images = np.concatenate([batch[0].numpy() for batch in stream.take(batches)])
        return images, f"{len(images)} eval images of {metadata['dataset']}"
    except Exception as error:  # data not readable here: the caller compares on random images
        logging.warning(
            "tfmp.serving.export: detection eval data unavailable (%s)", str(error).splitlines()[0]
        )
        return None


def predict_files(
    predictor,
    paths,
    score_threshold: float = 0.3,
    output_dir: str | None = None,
    kind: str = "detector",
    find=None,
    max_pixels: int | None = image_files.MAX_IMAGE_PIXELS,
) -> list[dict]:
    """Detections for image files from an exported detector (any format), as
    `tfmp.detection.predict.predict_files` makes them for a run: one record per image, a PNG
    with the boxes drawn next to each image (or in `output_dir`). `kind`: the export.json
    section with the image size, classes and thresholds; `find(predictor, images)` -> (raw
    outputs, detections), this module's `detections` by default; `max_pixels`: the largest
    image decoded (0: no limit)."""
    options = predictor.metadata[kind]
    if not options["score_threshold"] <= score_threshold < 1.0:
        fix = "re-export with a lower --score_threshold"
        if options.get("model_score_threshold", -1.0) >= options["score_threshold"]:
            fix = "train with a lower apps.detect --score_threshold"  # a two-stage model's own NMS
        raise UsageError(
            f"--score_threshold={score_threshold} must be in [{options['score_threshold']}, 1): "
            f"the export kept no lower scores; {fix}"
        )
    class_names = predictor.class_names or [str(i) for i in range(options["num_classes"])]
    images = [data.read_image(path, options["image_size"], max_pixels) for path in paths]  # all decode first
    _, found = (find or detections)(predictor, np.stack([image.numpy() for image, _, _ in images]))
    records = []
    for row, (path, (_, scale, original)) in enumerate(zip(paths, images)):
        keep = np.arange(len(found["scores"][row])) < found["valid_detections"][row]
        keep &= found["scores"][row] >= score_threshold
        picked = {key: found[key][row][keep] for key in ("boxes", "scores", "classes")}
        picked["boxes"] = picked["boxes"] * scale  # back to the original image's pixels
        folder = output_dir or os.path.dirname(os.path.abspath(path))
        png = os.path.join(folder, os.path.splitext(os.path.basename(path))[0] + ".detections.png")
        visualize.draw_detections(
            original.numpy(), picked["boxes"], picked["classes"], picked["scores"], class_names, png
        )
        records.append(
            {
                "image": path,
                "png": png,
                "model_format": predictor.format,
                "detections": [
                    {
                        "box": [round(float(v), 1) for v in box],
                        "class": int(label),
                        "name": class_names[int(label)],
                        "score": round(float(score), 4),
                    }
                    for box, label, score in zip(picked["boxes"], picked["classes"], picked["scores"])
                ],
            }
        )
    return records


def detections(
    predictor: predictors.Predictor, images: np.ndarray, batch_size: int = 64
) -> tuple[dict, dict]:
    """(raw outputs, detections) of an exported detector in any format. A SavedModel answers
    both itself (its `raw_outputs` signature and its NMS serving_default); a .keras or .tflite
    gives the raw outputs, decoded here exactly as the SavedModel decodes them (export.json's
    "detector" section: anchors, thresholds)."""
    if isinstance(predictor, predictors.SavedModelPredictor):
        if RAW_SIGNATURE not in predictor.loaded.signatures:
            raise UsageError(
                f"SavedModel {predictor.path!r} is not an exported detector (no {RAW_SIGNATURE} signature)"
            )
        raw = predictor.predict_outputs(images, batch_size, signature=RAW_SIGNATURE)
        return raw, predictor.predict_outputs(images, batch_size)
    if not predictor.metadata.get("detector"):
        raise UsageError(
            f"{predictor.path!r} is not an exported detector (its export.json has no "
            "detector section); export the run with apps.export first"
        )
    raw = predictor.predict_outputs(images, batch_size)
    return raw, decode(raw, predictor.metadata["detector"])


def predict(model: str, paths: list[str], settings: dict, kind: str = "detector", find=None) -> list[dict]:
    """Detection records for `apps.predict`: a run dir through the detection predict mode (its
    model.keras, in its training precision), an export through its own artifact (the
    SavedModel's NMS output). `settings`: score_threshold, max_detections, output_dir,
    trust_saved_model, max_image_pixels; `kind` and `find` as for `predict_files` (another
    detector kind passes its own)."""
    score_threshold = settings.get("score_threshold", 0.3)
    if os.path.isdir(model) and artifacts.run_kind(model) == kind:
        return run_predict.predict_files(
            model,
            paths,
            score_threshold,
            settings.get("max_detections", 100),
            settings.get("output_dir"),
            settings.get("max_image_pixels", image_files.MAX_IMAGE_PIXELS),
        )
    return predict_files(
        predictors.load(model, settings.get("trust_saved_model", False)),
        paths,
        score_threshold,
        settings.get("output_dir"),
        kind,
        find,
        settings.get("max_image_pixels", image_files.MAX_IMAGE_PIXELS),
    )


def detection_class_names(dataset: str, image_size: int | None, data_dir: str | None) -> list[str]:
    """A detection dataset's names (classification's "shapes" has other classes)."""
    # Names only: the files' checks are training's (and the data need not be here).
    return list(data.describe(dataset, image_size=image_size, data_dir=data_dir, verify=False).class_names)


def _accepts(model: keras.Model) -> bool:
    """RetinaNet's outputs are exactly the raw {"classes", "boxes"} (a two-stage detector's
    "boxes" are detections among more outputs: tfmp.serving.two_stage's kind)."""
    return isinstance(model.output, dict) and set(model.output) == {"classes", "boxes"}


# ----------------------------------------------------------------------------- the detector kind
export.KINDS["detector"] = export.ExportKind(
    accepts=_accepts,
    serving=serving_endpoints,
    compare=write_and_compare,
    table=table_lines,
    options=options_for,
    eval_images=eval_images,
    resize=PREPROCESSING,
)
# What predicting reads from export.json's "detector" section (`predict_files`, `decode`).
SECTION = {
    "score_threshold": "number",
    "iou_threshold": "number",
    "max_detections": "count",
    "image_size": "count",
    "num_classes": "count",
    "anchor_levels": "counts",
}
artifacts.KINDS["detector"] = artifacts.PredictionKind(
    trains=lambda name: name in retinanet.DETECTORS,
    class_names=detection_class_names,
    predict_files=predict,
    section=SECTION,
)
