"""What one image costs the detection input pipeline: the built-in `shapes` scenes against
decoding a JPEG of the same scene. `{"kind": "input_cost"}` cells, planned by `apps.bench`
next to the detector cells when they train on the built-in data (`--data=builtin`).

    from tfmp.bench import input_cost
    result = input_cost.measure({"image_size": 128, "global_batch_size": 16, "batches": 20, "repeats": 3})
    result["ratios"]["drawn / jpeg"]     # >= 1: drawing a scene is no dearer than decoding a JPEG

Four pipelines, each on ONE thread (a private tf.data pool of 1, intra-op parallelism 1), so
images/s is what one core delivers and the ratios are per-image costs:
- "drawn": `tfmp.detection.data.load("shapes", "train", ...)` as `apps.detect` trains on it
  (random numbers per example, the scenes drawn per batch, the ground truth padded);
- "jpeg": the same scenes encoded once as in-memory JPEGs (quality 75, libjpeg's default: the
  cheapest decode a real dataset would plausibly need), read as a detection `Source` through
  the same training pipeline (`tfmp.detection.data.load_source`): decoded, fitted to the square
  input and padded per example as COCO or TFDS images are, then batched. No file reads: a real
  pipeline only adds to it;
- "drawn_augmented", "jpeg_augmented": the same plus `apps.detect`'s default augmentation
  (scale jitter, crop/pad, flip: `tfmp.detection.data.augment_batch`).
Each round builds every pipeline afresh, skips its first batches (tracing, filling buffers),
times `batches` more and deletes it, so no pipeline's prefetching runs while another is timed;
images/s is the median of `repeats` rounds.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import tensorflow as tf

from tfmp.detection import data as detection_data
from tfmp.input.source import Source

JPEG_QUALITY = 75
WARMUP_BATCHES = 2
PIPELINES = ("drawn", "jpeg", "drawn_augmented", "jpeg_augmented")


def _one_thread(dataset: tf.data.Dataset) -> tf.data.Dataset:
    options = tf.data.Options()
    options.threading.private_threadpool_size = 1
    options.threading.max_intra_op_parallelism = 1
    return dataset.with_options(options)


def _drawn(size: int, batch: int, augment: bool) -> tf.data.Dataset:
    return detection_data.load("shapes", "train", batch, image_size=size, augment=augment)[0]


def _encoded_scenes(size: int, count: int):
    """(JPEG bytes [count], boxes [count, M, 4], classes [count, M]) of drawn training scenes."""
    images, boxes, classes = [], [], []
    for batch_images, truth in _drawn(size, count, augment=False).take(1):
        pixels = tf.cast(tf.round(tf.clip_by_value(batch_images, 0.0, 1.0) * 255.0), tf.uint8)
        images = [tf.io.encode_jpeg(image, quality=JPEG_QUALITY) for image in pixels]
        boxes, classes = truth["boxes"], truth["classes"]
    return tf.stack(images), boxes, classes


def _jpeg_source(scenes, size: int) -> Source:
    """The encoded scenes as a detection `Source` whose items decode like a COCO image file's
    (`tfmp.detection.sources.coco_source`), from memory instead of disk."""
    jpegs, boxes, classes = scenes
    count = int(jpegs.shape[0])
    info = dataclasses.replace(
        detection_data.describe("shapes", image_size=size), name="jpeg (in memory)", train_examples=count
    )

    def examples(*_):
        return tf.data.Dataset.from_tensor_slices({"jpeg": jpegs, "boxes": boxes, "classes": classes})

    def decode(item):
        keep = item["classes"] >= 0  # the drawn scenes' padding rows
        image = tf.image.convert_image_dtype(tf.io.decode_jpeg(item["jpeg"], channels=3), tf.float32)
        return image, item["boxes"][keep], item["classes"][keep]

    # A shuffle buffer of 1 keeps the drawn order (already shuffled when drawn): the JPEG
    # pipeline's first batch is the drawn pipeline's first batch, decoded.
    return Source(info, count, 1, examples, decode, shuffle_buffer=1)


def _jpeg(scenes, size: int, batch: int, augment: bool) -> tf.data.Dataset:
    """tfmp's training pipeline of a decoded source (`tfmp.detection.data.load_source`: decode,
    fit to the square input and pad per example, batch, augment) over the JPEG scenes."""
    return detection_data.load_source(_jpeg_source(scenes, size), "train", batch, augment=augment)[0]


def _images_per_second(make, batch: int, batches: int) -> float:
    iterator = iter(_one_thread(make()))
    for _ in range(WARMUP_BATCHES):
        next(iterator)
    started = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    seconds = time.perf_counter() - started
    del iterator  # stops its prefetching before the next pipeline is timed
    return batch * batches / seconds


def measure(cell: dict) -> dict:
    """Images/s of each pipeline on one thread, microseconds per image, and drawn / JPEG."""
    size, batch = cell["image_size"], cell["global_batch_size"]
    scenes = _encoded_scenes(size, cell.get("scenes", 64))
    makers = {
        "drawn": lambda: _drawn(size, batch, augment=False),
        "jpeg": lambda: _jpeg(scenes, size, batch, augment=False),
        "drawn_augmented": lambda: _drawn(size, batch, augment=True),
        "jpeg_augmented": lambda: _jpeg(scenes, size, batch, augment=True),
    }
    rounds = {name: [] for name in PIPELINES}
    for _ in range(cell["repeats"]):  # in turns: drifting load hits every pipeline alike
        for name in PIPELINES:
            rounds[name].append(_images_per_second(makers[name], batch, cell["batches"]))
    speed = {name: statistics.median(values) for name, values in rounds.items()}
    return {
        "image_size": size,
        "batch": batch,
        "jpeg_quality": JPEG_QUALITY,
        "jpeg_bytes_per_image": float(tf.reduce_mean(tf.cast(tf.strings.length(scenes[0]), tf.float32))),
        "images_per_second": speed,
        "microseconds_per_image": {name: 1e6 / value for name, value in speed.items()},
        "ratios": {
            "drawn / jpeg": speed["drawn"] / speed["jpeg"],
            "drawn_augmented / jpeg_augmented": speed["drawn_augmented"] / speed["jpeg_augmented"],
        },
    }
