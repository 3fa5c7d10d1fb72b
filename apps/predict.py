"""Classify images (or detect objects) with a trained run or an exported model; one JSON line per image.

    python -m apps.predict --model=runs/seed_cnn-shapes-... cat.png dog.jpg
    python -m apps.predict --model=RUN/export/bfloat16 --top_k=3 a.png         # export dir: SavedModel
    python -m apps.predict --model=RUN/export/float16/model.tflite a.png        # LiteRT if installed

--model is a training run dir, an export dir, a SavedModel dir, a .tflite or a .keras file.
Images are preprocessed as in training (decoded, float32 in [0, 1], resized to the model's input
size). Each line: {"image": path, "top_k": [{"class": i, "name": ..., "probability": p}, ...]}.
An unreadable image or model exits 2 with one line, before any prediction is printed.

A detector (a run of apps.detect, or its export) prints detections instead and writes
IMAGE.detections.png with the boxes drawn (next to each image, or in --output_dir):

    python -m apps.predict --model=runs/retinanet_tiny-shapes-... --score_threshold=0.5 a.png
    python -m apps.predict --model=RUN/export/bfloat16 a.png     # the SavedModel's NMS output

Each line: {"image": path, "png": path, "detections": [{"box": [x0, y0, x1, y1] (pixels of the
original image), "class": i, "name": ..., "score": s}, ...]}.
"""

import json
import os

from absl import flags

from apps import cli
from tfmp.errors import UsageError
from tfmp.serving import predictors as inference

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Run dir, export dir, SavedModel dir, .tflite or .keras file.")
flags.DEFINE_integer("top_k", 5, "Classes to print per image.")
flags.DEFINE_integer("batch_size", 32, "Images per model call.")
flags.DEFINE_float("score_threshold", 0.3, "Detectors: lowest score printed and drawn.")
flags.DEFINE_integer("max_detections", 100, "Detectors (run dirs): detections kept per image after NMS.")
flags.DEFINE_string(
    "output_dir", None, "Detectors: where the .detections.png files go (default: next to each image)."
)


def main(argv):
    images = argv[1:]
    if not FLAGS.model:
        raise UsageError("--model is required: a run dir, an export dir, a SavedModel, .tflite or .keras")
    if not images:
        raise UsageError("no images given; usage: python -m apps.predict --model=RUN img1.png img2.jpg")
    if FLAGS.top_k < 1:
        raise UsageError(f"--top_k={FLAGS.top_k} must be >= 1")
    if inference.is_detector(FLAGS.model):
        for record in _detect(FLAGS.model, images):
            print(json.dumps(record), flush=True)
        return
    predictor = inference.load(FLAGS.model)
    if isinstance(getattr(getattr(predictor, "model", None), "output", None), dict):
        raise UsageError(
            f"--model={FLAGS.model} is a detector without a run's flags.txt or an export.json; "
            "give its run dir or export it with apps.export"
        )
    pixels = inference.read_images(images, predictor.preprocessing)
    probabilities = predictor.predict(pixels, batch_size=FLAGS.batch_size)
    for path, row in zip(images, probabilities):
        print(
            json.dumps({"image": path, "top_k": inference.top_k(row, FLAGS.top_k, predictor.class_names)}),
            flush=True,
        )


def _detect(model, images):
    """Detection records: a run dir through the detection predict mode (its model.keras, in its
    training precision), an export through its own artifact (the SavedModel's NMS output)."""
    if os.path.isdir(model) and inference.is_detector_run(model):
        from tfmp.detection import predict as detection_predict

        return detection_predict.predict_files(
            model, images, FLAGS.score_threshold, FLAGS.max_detections, FLAGS.output_dir
        )
    from tfmp.serving import detector as export_detector

    return export_detector.predict_files(
        inference.load(model), images, FLAGS.score_threshold, FLAGS.output_dir
    )


if __name__ == "__main__":
    cli.run(main, positional_arguments=True)  # the positional arguments are the image paths
