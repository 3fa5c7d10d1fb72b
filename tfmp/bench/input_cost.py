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
  cheapest decode a real dataset would plausibly need), then decoded, fitted to the square
  input and padded per example as `tfmp.detection.data` reads COCO or TFDS images, and batched.
  No file reads: a real pipeline only adds to it;
- "drawn_augmented", "jpeg_augmented": the same plus `apps.detect`'s default augmentation
  (scale jitter, crop/pad, flip: `tfmp.detection.data.augment_batch`).
Each round builds every pipeline afresh, skips its first batches (tracing, filling buffers),
times `batches` more and deletes it, so no pipeline's prefetching runs while another is timed;
images/s is the median of `repeats` rounds.
"""

from __future__ import annotations

import statistics
import time

import tensorflow as tf

from tfmp.detection import data as detection_data
from tfmp.input import stream

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


def _jpeg(scenes, size: int, batch: int, augment: bool, seed: int = 0) -> tf.data.Dataset:
    """Decode -> fit to the square input -> pad the boxes, per example; batch; augment; the
    training elements `(images, truth)` of `tfmp.detection.data.load`."""
    jpegs, boxes, classes = scenes
    max_boxes = int(boxes.shape[1])

    def decode(jpeg, image_boxes, image_classes):
        image = tf.cast(tf.io.decode_jpeg(jpeg, channels=3), tf.float32) / 255.0
        keep = image_classes >= 0
        image, kept_boxes, kept_classes, _ = detection_data.fit_to_square(
            image, image_boxes[keep], image_classes[keep], size
        )
        kept_boxes, kept_classes = detection_data.pad_boxes(kept_boxes, kept_classes, max_boxes)
        return tf.ensure_shape(image, [size, size, 3]), kept_boxes, kept_classes

    seed_tensor = tf.constant(seed, tf.int64)

    def example(position, item):  # the augmentation's draws are keyed by the stream position
        return detection_data.augmentation_draws(tf.stack([seed_tensor, position])), decode(*item)

    def finish(draws, batched):
        images, image_boxes, image_classes = batched
        if augment:
            images, image_boxes, image_classes = detection_data.augment_batch(
                images, image_boxes, image_classes, draws
            )
        truth = {"boxes": image_boxes, "classes": image_classes, "box_valid": image_classes >= 0}
        return images, truth

    dataset = tf.data.Dataset.from_tensor_slices((jpegs, boxes, classes)).repeat().enumerate()
    dataset = dataset.map(example, num_parallel_calls=tf.data.AUTOTUNE).batch(batch, drop_remainder=True)
    dataset = dataset.map(finish, num_parallel_calls=tf.data.AUTOTUNE)
    return stream.finish(dataset.prefetch(tf.data.AUTOTUNE))


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
