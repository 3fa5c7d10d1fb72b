"""Classify images (or detect objects) with a trained run or an exported model; one JSON line per image.

    python -m apps.predict --model=runs/seed_cnn-shapes-... cat.png dog.jpg
    python -m apps.predict --model=RUN/export/bfloat16 --top_k=3 a.png         # export dir: SavedModel
    python -m apps.predict --model=RUN/export/float16/model.tflite a.png        # LiteRT if installed

--model is a training run dir, an export dir, a SavedModel dir, a .tflite or a .keras file.
Images are preprocessed as in training (decoded, float32 in [0, 1], resized to the model's input
size). Each line: {"image": path, "top_k": [{"class": i, "name": ..., "probability": p}, ...]}.
An unreadable image or model exits 2 with one line, before any prediction is printed.

Untrusted files: a SavedModel is a program that runs with your permissions. It runs only from a
directory apps.export wrote (its export.json records the SHA-256 of saved_model.pb and it
matches), with one `note:` line on stderr; any other SavedModel is refused with one `error:`
line unless --trust_saved_model is given. `.keras` files load in Keras' safe mode. An image
whose header declares more than --max_image_pixels pixels is refused before it is decoded.

A detector (a run of apps.detect, or its export) prints detections instead and writes
IMAGE.detections.png with the boxes drawn (next to each image, or in --output_dir):

    python -m apps.predict --model=runs/retinanet_tiny-shapes-... --score_threshold=0.5 a.png
    python -m apps.predict --model=RUN/export/bfloat16 a.png     # the SavedModel's NMS output

Each line: {"image": path, "png": path, "detections": [{"box": [x0, y0, x1, y1] (pixels of the
original image), "class": i, "name": ..., "score": s}, ...]}.
"""

import json
import sys

from absl import flags

from apps import cli
from tfmp import run_dir
from tfmp.errors import UsageError
from tfmp.input import decoding, image_files
from tfmp.serving import artifacts, trust

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Run dir, export dir, SavedModel dir, .tflite or .keras file.")
flags.DEFINE_integer("top_k", 5, "Classes to print per image.")
flags.DEFINE_integer("batch_size", 32, "Images per model call.")
flags.DEFINE_float("score_threshold", 0.3, "Detectors: lowest score printed and drawn.")
flags.DEFINE_integer("max_detections", 100, "Detectors (run dirs): detections kept per image after NMS.")
flags.DEFINE_string(
    "output_dir", None, "Detectors: where the .detections.png files go (default: next to each image)."
)
flags.DEFINE_bool(
    "trust_saved_model",
    False,
    "Run a SavedModel that apps.export did not write (or whose graph changed since): it is a program.",
)
flags.DEFINE_integer(
    "max_image_pixels",
    image_files.MAX_IMAGE_PIXELS,
    "Refuse images whose header declares more pixels (decompression bombs); 0: no limit.",
)


def main(argv):
    images = argv[1:]
    if not FLAGS.model:
        raise UsageError("--model is required: a run dir, an export dir, a SavedModel, .tflite or .keras")
    if not images:
        raise UsageError("no images given; usage: python -m apps.predict --model=RUN img1.png img2.jpg")
    if FLAGS.top_k < 1:
        raise UsageError(f"--top_k={FLAGS.top_k} must be >= 1")
    if FLAGS.batch_size < 1:
        raise UsageError(f"--batch_size={FLAGS.batch_size} must be a positive number of images, e.g. 32")
    if FLAGS.max_detections < 1:
        raise UsageError(
            f"--max_detections={FLAGS.max_detections} must be a positive number of boxes, e.g. 100"
        )
    if not 0 <= FLAGS.score_threshold < 1:
        raise UsageError(f"--score_threshold={FLAGS.score_threshold} must be a score in [0, 1), e.g. 0.3")
    image_files.pixel_limit(FLAGS.max_image_pixels)  # a negative limit: one line
    if FLAGS.output_dir:
        run_dir.writable_dir(FLAGS.output_dir, "--output_dir")
    for image in images:  # every header before the model loads: a bomb costs no model load
        too_large = image_files.oversized(image, FLAGS.max_image_pixels)
        if too_large:
            raise UsageError(
                f"image '{decoding.shown(image)}' is {too_large}; shrink it, or raise --max_image_pixels (0: no limit)"
            )
    settings = {
        name: FLAGS[name].value
        for name in (
            "top_k",
            "batch_size",
            "score_threshold",
            "max_detections",
            "output_dir",
            "trust_saved_model",
            "max_image_pixels",
        )
    }
    kind = artifacts.KINDS[artifacts.kind_of(FLAGS.model)]  # a malformed export.json: one line
    saved_model = artifacts.saved_model_dir(FLAGS.model)
    if saved_model:  # said once, before the graph runs; refused here when untrusted
        metadata = artifacts.saved_model_metadata(saved_model)
        print(trust.check(saved_model, metadata, FLAGS.trust_saved_model), file=sys.stderr, flush=True)
    for record in kind.predict_files(FLAGS.model, images, settings):
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    cli.run(main, positional_arguments=True)  # the positional arguments are the image paths
