"""Classify images with a trained run or an exported model; one JSON line per image.

    python -m apps.predict --model=runs/seed_cnn-shapes-... cat.png dog.jpg
    python -m apps.predict --model=RUN/export/bfloat16 --top_k=3 a.png         # export dir: SavedModel
    python -m apps.predict --model=RUN/export/float16/model.tflite a.png        # LiteRT if installed

--model is a training run dir, an export dir, a SavedModel dir, a .tflite or a .keras file.
Images are preprocessed as in training (decoded, float32 in [0, 1], resized to the model's input
size). Each line: {"image": path, "top_k": [{"class": i, "name": ..., "probability": p}, ...]}.
An unreadable image or model exits 2 with one line, before any prediction is printed.
"""

import json
import sys

from absl import app, flags

from apps import cli
from tfmp import inference
from tfmp.errors import EXIT_USAGE, UsageError

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Run dir, export dir, SavedModel dir, .tflite or .keras file.")
flags.DEFINE_integer("top_k", 5, "Classes to print per image.")
flags.DEFINE_integer("batch_size", 32, "Images per model call.")


def main(argv):
    images = argv[1:]
    if not FLAGS.model:
        raise UsageError("--model is required: a run dir, an export dir, a SavedModel, .tflite or .keras")
    if not images:
        raise UsageError("no images given; usage: python -m apps.predict --model=RUN img1.png img2.jpg")
    if FLAGS.top_k < 1:
        raise UsageError(f"--top_k={FLAGS.top_k} must be >= 1")
    predictor = inference.load(FLAGS.model)
    if isinstance(getattr(getattr(predictor, "model", None), "output", None), dict):
        raise UsageError(f"--model={FLAGS.model} is a detector; draw its boxes with: python -m apps.detect "
                         f"--model_dir=RUN --predict={','.join(images)}")
    pixels = inference.read_images(images, predictor.preprocessing)
    probabilities = predictor.predict(pixels, batch_size=FLAGS.batch_size)
    for path, row in zip(images, probabilities):
        print(json.dumps({"image": path, "top_k": inference.top_k(row, FLAGS.top_k, predictor.class_names)}),
              flush=True)


def _main_with_image_arguments(argv):
    # apps.cli.run refuses positional arguments (training apps take none); predict's are images.
    cli._quiet_tensorflow()
    try:
        main(argv)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


if __name__ == "__main__":
    app.run(_main_with_image_arguments, flags_parser=cli._parse_flags)
