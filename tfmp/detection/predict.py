"""Detections for image files from a trained run: JSON records and PNGs with the boxes drawn.

    records = predict.predict_files("runs/retinanet_tiny-shapes-...", ["a.jpg", "b.png"],
                                    score_threshold=0.3, output_dir=None)

The run's `flags.txt` names the detector, dataset and image size; the images go through the
training preprocessing (`data.read_image`: fit into the square input, pad), the model's raw
outputs are decoded in float32 (whatever precision it trained in), and boxes are reported in
the original image's pixels. Every input is checked before anything is written.
"""

from __future__ import annotations

import os

import keras
import tensorflow as tf

from tfmp import run_dir
from tfmp.detection import boxes, data, faster_rcnn, retinanet, visualize
from tfmp.errors import UsageError
from tfmp.input import image_files


def load_detector(model_dir: str) -> tuple[keras.Model, dict, data.DetectionInfo]:
    flags = run_dir.read_flags(model_dir, required=True)
    if flags.get("model") not in {**retinanet.DETECTORS, **faster_rcnn.DETECTORS}:
        raise UsageError(
            f"run {model_dir!r} trained {flags.get('model')!r}, not a detector; "
            f"use apps.predict for classifiers"
        )
    path = run_dir.model_path(model_dir)
    image_size = int(flags["image_size"]) if flags.get("image_size") not in (None, "None") else None
    info = data.describe(  # names and image size only: no file checks at predict time
        flags.get("dataset", "shapes"), image_size=image_size, data_dir=flags.get("data_dir"), verify=False
    )
    model = keras.models.load_model(path, compile=False)
    return model, flags, info


def predict_files(
    model_dir: str,
    paths: list[str],
    score_threshold: float = 0.3,
    max_detections: int = 100,
    output_dir: str | None = None,
    max_pixels: int | None = image_files.MAX_IMAGE_PIXELS,
) -> list[dict]:
    """One record per image ({"image", "png", "detections": [{"box", "class", "name", "score"}]});
    an image whose header declares more than `max_pixels` pixels (0: no limit) is refused."""
    if not 0.0 <= score_threshold < 1.0:
        raise UsageError(f"--score_threshold={score_threshold} must be in [0, 1)")
    model, flags, info = load_detector(model_dir)
    # Every image decodes, or nothing is written.
    images = [data.read_image(path, info.image_size, max_pixels) for path in paths]
    batch = tf.stack([image for image, _, _ in images])
    if flags["model"] in faster_rcnn.DETECTORS:  # NMS inside the model
        found = faster_rcnn.detect(model, batch, score_threshold, max_detections)
    else:
        found = boxes.decode_detections(
            model.predict_on_batch(batch),
            boxes.generate_anchors(info.image_size, retinanet.anchor_config(flags["model"])),
            score_threshold=score_threshold,
            max_detections=max_detections,
            image_size=info.image_size,
        )
    found = {key: value.numpy() for key, value in found.items()}
    records = []
    for row, (path, (_, scale, original)) in enumerate(zip(paths, images)):
        count = int(found["valid_detections"][row])
        picked = {key: found[key][row][:count] for key in ("boxes", "scores", "classes")}
        picked["boxes"] = picked["boxes"] * scale  # back to the original image's pixels
        folder = output_dir or os.path.dirname(os.path.abspath(path))
        png = os.path.join(folder, os.path.splitext(os.path.basename(path))[0] + ".detections.png")
        visualize.draw_detections(
            original.numpy(), picked["boxes"], picked["classes"], picked["scores"], info.class_names, png
        )
        records.append(
            {
                "image": path,
                "png": png,
                "boxes_dtype": str(picked["boxes"].dtype),
                "scores_dtype": str(picked["scores"].dtype),
                "detections": [
                    {
                        "box": [round(float(v), 1) for v in box],
                        "class": int(label),
                        "name": info.class_names[int(label)],
                        "score": round(float(score), 4),
                    }
                    for box, label, score in zip(picked["boxes"], picked["classes"], picked["scores"])
                ],
            }
        )
    return records
