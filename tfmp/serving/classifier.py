"""The "classifier" model kind: one float32 probabilities output.

This module registers it in `tfmp.serving.export.KINDS` (the SavedModel's `serving_default`:
float32 `images` in, float32 `probabilities` out; a difference table of max |difference| of
the probabilities and top-1 agreement against the trained weights computed in float32, on eval
batches of the run's classification dataset) and in `tfmp.serving.artifacts.KINDS` (runs of
any `tfmp.models` name; `apps.predict` prints the top-k classes of each image).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmp import models
from tfmp.classification import data as classification_data
from tfmp.errors import UsageError
from tfmp.input import image_files
from tfmp.serving import artifacts, copies, export, predictors


# ----------------------------------------------------------------------------- exporting
def serving(model: keras.Model, options: dict):
    """`serving_default`: float32 images [B, H, W, C] in [0, 1] -> float32 probabilities."""
    height, width, channels = predictors.image_input_shape(model)
    spec = tf.TensorSpec([None, height, width, channels], tf.float32, name=export.INPUT_NAME)

    @tf.function(input_signature=[spec])
    def serve(images):
        # The first layer casts the float32 images to its compute dtype; the softmax is float32.
        return {export.OUTPUT_NAME: tf.cast(model(images, training=False), tf.float32)}

    return serve


def compare(model, precision, formats, directory, reference_images, options) -> list[dict]:
    """Writes each format, reloads it and compares its probabilities with the model's."""
    copy = copies.inference_copy(model, precision)
    # The reference is the trained weights computed in float32: the exact function the
    # training policy approximated, so each row shows what its precision costs.
    reference = copies.inference_copy(model, "float32", fold_batch_norms=False)
    expected = export.reference_outputs(reference, reference_images)
    rows = []
    for name, path in export.written_artifacts(model, copy, precision, formats, directory, options):
        outputs = predictors.LOADERS[name](path, {}).predict(reference_images)
        rows.append(
            {
                "format": name,
                "file": export.FILE_NAMES[name],
                "precision": export.artifact_precision(name, precision),
                "size_bytes": export.disk_size(path),
                "max_abs_difference": float(np.max(np.abs(outputs - expected))),
                "top1_agreement": float(np.mean(outputs.argmax(-1) == expected.argmax(-1))),
            }
        )
    return rows


def table(rows: list[dict]) -> tuple[tuple, list[tuple]]:
    """Header and cells of a classifier's difference table (`export.format_table`)."""
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
    ]
    return header, lines


def eval_images(metadata: dict, model, options, batches: int, batch_size: int):
    """(images, description): eval batches of the run's classification dataset, or None."""
    dataset = metadata["dataset"]
    if dataset == "synthetic":
        return None
    try:
        stream, _ = classification_data.load(
            dataset,
            "eval",
            batch_size,
            image_size=metadata.get("image_size"),
            data_dir=metadata.get("data_dir"),
            training=False,
        )
        images = np.concatenate([batch.numpy() for batch, _ in stream.take(batches)])
    except Exception as error:  # data not readable here: the comparison still means something
        logging.warning(
            "tfmp.serving.export: eval data of %s unavailable (%s); comparing on random images",
            dataset,
            str(error).splitlines()[0] if str(error) else error,
        )
        return None
    if images.shape[1:] != tuple(predictors.image_input_shape(model)):
        return None
    return images, f"{len(images)} eval images of {dataset}"


# ----------------------------------------------------------------------------- predicting
def classify_files(model: str, paths: list[str], settings: dict) -> list[dict]:
    """{"image": path, "top_k": [{"class", "name", "probability"}, ...]} per image file; every
    file is decoded before anything is predicted. `settings`: top_k, batch_size,
    trust_saved_model, max_image_pixels."""
    predictor = predictors.load(model, settings.get("trust_saved_model", False))
    if isinstance(getattr(getattr(predictor, "model", None), "output", None), dict):
        raise UsageError(
            f"--model={model} is a detector without a run's flags.txt or an export.json; "
            "give its run dir or export it with apps.export"
        )
    max_pixels = settings.get("max_image_pixels", image_files.MAX_IMAGE_PIXELS)
    pixels = predictors.read_images(paths, predictor.preprocessing, max_pixels)
    probabilities = predictor.predict(pixels, batch_size=settings.get("batch_size", 64))
    return [
        {"image": path, "top_k": predictors.top_k(row, settings.get("top_k", 5), predictor.class_names)}
        for path, row in zip(paths, probabilities)
    ]


def class_names(dataset: str, image_size: int | None, data_dir: str | None):
    """A classification dataset's class names (detection's "shapes" has other classes)."""
    # Names only: the files' checks are training's (and the data need not be here).
    info = classification_data.describe(dataset, image_size=image_size, data_dir=data_dir, verify=False)
    return info.class_names


export.KINDS["classifier"] = export.ExportKind(
    accepts=lambda model: not isinstance(model.output, dict),
    serving=serving,
    compare=compare,
    table=table,
    eval_images=eval_images,
)
artifacts.KINDS["classifier"] = artifacts.PredictionKind(
    trains=lambda name: name in models.MODELS,
    class_names=class_names,
    predict_files=classify_files,
)
