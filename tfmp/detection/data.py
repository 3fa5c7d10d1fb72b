"""Detection input pipelines: built-in drawn scenes, COCO-format folders and TFDS. They decode,
resize, augment and pad the ground truth; anchors are matched on the device, in the step
(`tfmp.detection.targets`).

A dataset is named by a spec string (as in `tfmp.classification.data`):

* ``shapes``      offline, deterministic scenes of 1-4 coloured shapes (`tfmp.detection.shapes`,
  6 classes), any ``image_size`` (default 128); 50,000 train and 500 eval images.
* ``coco:PATH``   COCO-format annotations: a directory in COCO's layout
  (``PATH/annotations/instances_<split>.json``, images in ``PATH/<split>/``, splits
  ``train``/``val`` or ``train2017``/``val2017``), or one annotation JSON whose ``file_name``s
  are relative to its folder (every 10th image, in file order, is held out for eval).
* ``tfds:voc/2007``, ``tfds:coco/2017`` (or another TFDS dataset with ``objects/bbox`` and
  ``objects/label``), prepared in ``data_dir``; never downloads.

Usage::

    info = data.describe("shapes", image_size=128)        # validates, loads nothing
    train, policy = data.load("shapes", "train", 32, augment=True)    # (image, truth)
    evaluation, _ = data.load("shapes", "eval", 32)                    # (image, truth)
    image, scale, original = data.read_image("photo.jpg", 128)   # for predictions

Every image is made square (``image_size``): resized so its longer side fits, then padded with
zeros at the bottom/right. Elements are ``(image, truth)``:

* ``image`` float32 [S, S, 3] in [0, 1];
* ``truth`` {"boxes": float32 [M, 4] xyxy pixels of the square image, "classes": int32 [M]
  (-1 on padding rows), "box_valid": bool [M] (the validity mask: False on padding rows)},
  M = ``max_boxes`` (default 100; 4 for ``shapes``); eval elements also carry "image_id":
  int64 (the image's index in the eval split, -1 for padding), "scale": float32 (original-image
  pixels per input pixel, to report boxes in the original image) and "valid": bool (False for
  padding rows).

With ``anchors`` [A, 4] (`boxes.generate_anchors` for the same size) the pipeline matches them
itself, batched (`targets.match_anchors`), for a model compiled with per-anchor labels: training
elements are ``(image, labels)``, eval ``(image, labels, truth)``, ``labels`` {"classes": int32
[A], "boxes": float32 [A, 5]} as `tfmp.detection.losses` documents; a padding row's anchors are
all ignored. Without it the labels are made on the device (`losses.ground_truth_labels`).

Augmentation (``augment=True``, training): scale jitter (the longer side becomes 0.75-1.25 x S),
a random S x S crop of an enlarged image (padding of a shrunk one) and a horizontal flip, keyed
by the stream position, boxes moved with the pixels; a box cut to less than 40% of its area (or
under 2 pixels) is dropped. It runs on whole batches of squared images (`augment_batch`).
Crowd annotations are skipped (no crowd regions in eval). ``cache=True`` keeps the decoded,
un-augmented images (8-bit drawn scenes, so cached and drawn are equal) in memory: the whole
split, filled before the first shuffle buffer is full, so it is for eval splits and small sets
(50,000 ``shapes`` train scenes of 128 px are ~10 GB; they are drawn per batch, cheaply, instead).

Sharding, repetition, skipping and eval padding are `tfmp.input.stream`'s: eval batches are
padded to full batches with rows whose ``valid`` is False, so every replica and worker runs the
same number of steps and padding counts nowhere.
"""

from __future__ import annotations

import os

import tensorflow as tf
from absl import logging

from tfmp.detection import sources, targets
from tfmp.detection.boxes import IGNORE
from tfmp.detection.sources import (  # noqa: F401  (re-exported: data.DetectionInfo, data.SHAPES_*)
    SHAPES_EVAL_EXAMPLES,
    SHAPES_MAX_SHAPES,
    SHAPES_TRAIN_EXAMPLES,
    DetectionInfo,
)
from tfmp.errors import UsageError
from tfmp.input import decoding, image_files, stream
from tfmp.input import spec as specs
from tfmp.input.source import Source

SPLITS = specs.SPLITS
DEFAULT_IMAGE_SIZE = {"shapes": 128, "coco": 512, "tfds": 512}
DEFAULT_MAX_BOXES = 100
MIN_IMAGE_SIZE, MAX_IMAGE_SIZE = 32, 2048
SCALE_JITTER = (0.75, 1.25)
MIN_KEPT_AREA, MIN_BOX_SIDE = 0.4, 2.0
CHOICES = ["shapes", "coco:<path>", "tfds:voc/2007", "tfds:coco/2017"]
_AUTOTUNE = stream.AUTOTUNE


# ----------------------------------------------------------------------------- spec handling
def source(
    spec: str,
    split: str,
    image_size: int | None = None,
    data_dir: str | None = None,
    max_boxes: int | None = None,
    verify: bool = False,
    max_image_pixels: int | None = image_files.MAX_IMAGE_PIXELS,
) -> Source:
    """The `Source` of one split of `spec` (validates everything `load` would; `verify`: what
    `describe` checks besides, `max_image_pixels` its limit)."""
    kind, argument = specs.parse(
        spec, builtins=("shapes",), with_argument=("coco", "tfds"), what="detection dataset", choices=CHOICES
    )
    specs.check_split(split)
    if max_boxes is not None and (not isinstance(max_boxes, int) or max_boxes < 1):
        raise UsageError(f"bad max_boxes {max_boxes!r}; use a positive integer")
    size = specs.image_size(
        image_size,
        default=DEFAULT_IMAGE_SIZE[kind],
        low=MIN_IMAGE_SIZE,
        high=MAX_IMAGE_SIZE,
        what="detection image_size",
        hint=" (a multiple of 32 for RetinaNet)",
    )
    if kind == "shapes":
        return sources.shapes_source(spec, split, size)
    if kind == "coco":
        return sources.coco_source(
            spec, argument, split, size, max_boxes or DEFAULT_MAX_BOXES, verify, max_image_pixels
        )
    return sources.tfds_source(spec, argument, split, size, max_boxes or DEFAULT_MAX_BOXES, data_dir, verify)


def describe(
    spec: str,
    image_size: int | None = None,
    data_dir: str | None = None,
    max_boxes: int | None = None,
    *,
    verify: bool = True,
    max_image_pixels: int | None = image_files.MAX_IMAGE_PIXELS,
) -> DetectionInfo:
    """Validates `spec` and returns its image size, classes and split sizes without loading.

    `verify` (what a training run needs before it writes anything): both splits have images,
    every COCO image file starts and ends as an image does and declares at most
    `max_image_pixels` pixels (0: no limit; `tfmp.input.image_files`), a TFDS
    dataset's records are in `data_dir`; boxes clipped to their image are counted in one
    warning. `verify=False` checks only what naming the classes needs.
    """
    return source(spec, "train", image_size, data_dir, max_boxes, verify, max_image_pixels).info


# ----------------------------------------------------------------------------- geometry
def fit_to_square(image, boxes, classes, size: int, key=None, jitter=SCALE_JITTER):
    """Resizes (keeping the aspect ratio), crops/pads to `size` x `size` and flips, moving the
    boxes along; boxes left too small get class -1. With `key` None: longer side = `size`, no
    crop or flip. `image`: float32 in [0, 1], or the decoded integers (resized before they become
    float32, see `image_files.unit_float`). Returns (float32 image, boxes, classes, scale =
    original pixels per output pixel)."""
    shape = tf.cast(tf.shape(image)[:2], tf.float32)
    if key is None:
        zoom, offset_key, flip = tf.constant(1.0), None, tf.constant(False)
    else:
        zoom_key, offset_key, flip_key = tf.unstack(tf.random.experimental.stateless_split(key, 3))
        zoom = tf.random.stateless_uniform([], zoom_key, jitter[0], jitter[1])
        flip = tf.random.stateless_uniform([], flip_key) < 0.5
    ratio = size * zoom / tf.reduce_max(shape)
    resized = tf.maximum(tf.cast(tf.round(shape * ratio), tf.int32), 1)
    image = (
        image_files.unit_float(image, resized)
        if image.dtype.is_integer
        else tf.image.resize(image, resized, antialias=True)
    )
    if offset_key is None:
        offset = tf.zeros([2], tf.int32)
    else:  # a random window of an enlarged image; 0 where the image is smaller than `size`
        room = tf.maximum(resized - size, 0)
        offset = tf.cast(
            tf.floor(tf.random.stateless_uniform([2], offset_key) * tf.cast(room + 1, tf.float32)), tf.int32
        )
        offset = tf.minimum(offset, room)
    image = image[offset[0] : offset[0] + size, offset[1] : offset[1] + size]
    image = tf.image.pad_to_bounding_box(image, 0, 0, size, size)
    shift = tf.cast(tf.stack([offset[1], offset[0], offset[1], offset[0]]), tf.float32)
    boxes, classes = _move_boxes(tf.cast(boxes, tf.float32) * ratio - shift, classes, flip, size)
    image = tf.where(flip, tf.reverse(image, [1]), image)
    return tf.clip_by_value(image, 0.0, 1.0), boxes, classes, 1.0 / ratio


def _move_boxes(moved, classes, flip, size: int):
    """Boxes [..., M, 4] already scaled and shifted: clipped to the image, flipped with it, and
    dropped (class -1, zeros) when less than MIN_KEPT_AREA of them or under MIN_BOX_SIDE is left."""
    clipped = tf.clip_by_value(moved, 0.0, float(size))
    area = lambda b: (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])  # noqa: E731
    sides = tf.minimum(clipped[..., 2] - clipped[..., 0], clipped[..., 3] - clipped[..., 1])
    keep = (
        (classes >= 0)
        & (sides >= MIN_BOX_SIDE)
        & (area(clipped) >= MIN_KEPT_AREA * tf.maximum(area(moved), 1e-6))
    )
    x_min, y_min, x_max, y_max = tf.unstack(clipped, axis=-1)
    flipped = tf.stack([size - x_max, y_min, size - x_min, y_max], axis=-1)
    clipped = tf.where(flip[..., None, None] if flip.shape.rank else flip, flipped, clipped)
    return tf.where(keep[..., None], clipped, 0.0), tf.where(keep, tf.cast(classes, tf.int32), -1)


def augmentation_draws(key):
    """The random numbers [4] of one example's augmentation (zoom, crop y, crop x, flip)."""
    return tf.random.stateless_uniform([4], key)


def augment_batch(images, boxes, classes, draws, jitter=SCALE_JITTER):
    """Scale jitter, a random crop (of an enlarged image) or zero padding (bottom/right, of a
    shrunk one) and a horizontal flip of a batch of square images [N, S, S, C], boxes moved
    along: what `fit_to_square` does with a key, for the whole batch in one
    `tf.image.crop_and_resize` (bilinear). `draws` [N, 4] from `augmentation_draws`."""
    size = images.shape[1]
    zoom = jitter[0] + (jitter[1] - jitter[0]) * draws[:, 0]
    room = tf.maximum(tf.round(size * zoom) - size, 0.0)
    offset = tf.minimum(tf.floor(draws[:, 1:3] * (room[:, None] + 1.0)), room[:, None])  # (y, x)
    flip = draws[:, 3] < 0.5
    # Output pixel i samples input pixel (i + offset + .5) / zoom - .5; crop_and_resize's
    # window [start, end] in units of (size - 1) gives exactly that, flipped when end < start.
    start = ((offset + 0.5) / zoom[:, None] - 0.5) / (size - 1)
    end = start + 1.0 / zoom[:, None]
    x_start, x_end = tf.where(flip, end[:, 1], start[:, 1]), tf.where(flip, start[:, 1], end[:, 1])
    windows = tf.stack([start[:, 0], x_start, end[:, 0], x_end], axis=1)
    images = tf.image.crop_and_resize(
        images, windows, tf.range(tf.shape(images)[0]), [size, size], extrapolation_value=0.0
    )
    shift = tf.concat([offset[:, ::-1], offset[:, ::-1]], axis=1)[:, None, :]
    boxes, classes = _move_boxes(boxes * zoom[:, None, None] - shift, classes, flip, size)
    return images, boxes, classes


def read_image(path: str, image_size: int, max_pixels: int | None = image_files.MAX_IMAGE_PIXELS):
    """One image file for prediction: (model input float32 [S, S, 3], scale = original pixels
    per input pixel, original image uint8 [h, w, 3]). Multiply predicted boxes by `scale` to
    draw them on the original image. A file whose header declares more than `max_pixels`
    pixels (0: no limit) is refused before it is decoded (`image_files.oversized`)."""
    exists = tf.io.gfile.exists(path) if decoding.is_remote(path) else os.path.exists(path)
    if not exists or decoding.isdir(path):
        raise UsageError(f"image file '{decoding.shown(path)}' does not exist; pass existing image files")
    too_large = image_files.oversized(path, max_pixels)
    if too_large:
        raise UsageError(
            f"image file '{decoding.shown(path)}' is {too_large}; shrink it or raise --max_image_pixels"
        )
    try:
        raw = decoding.decode(tf.io.read_file(decoding.tf_path(path)), channels=3)
    except tf.errors.InvalidArgumentError:
        raise UsageError(
            f"cannot decode image file '{decoding.shown(path)}'; use a jpg, png, bmp, gif or webp"
        ) from None
    image, _, _, scale = fit_to_square(raw, tf.zeros([0, 4]), tf.zeros([0], tf.int32), image_size)
    return image, float(scale), raw


def pad_boxes(boxes, classes, max_boxes: int):
    """The valid rows first, padded (or truncated) to `max_boxes` rows of class -1."""
    valid = classes >= 0
    boxes, classes = tf.boolean_mask(boxes, valid), tf.boolean_mask(classes, valid)
    missing = tf.maximum(max_boxes - tf.shape(classes)[0], 0)
    boxes = tf.pad(boxes, [[0, missing], [0, 0]])[:max_boxes]
    classes = tf.pad(classes, [[0, missing]], constant_values=-1)[:max_boxes]
    return tf.ensure_shape(boxes, [max_boxes, 4]), tf.ensure_shape(classes, [max_boxes])


# ----------------------------------------------------------------------------- the pipeline
def load(
    spec: str,
    split: str,
    global_batch_size: int,
    *,
    anchors=None,
    image_size: int | None = None,
    data_dir: str | None = None,
    input_context: tf.distribute.InputContext | None = None,
    training: bool | None = None,
    augment: bool = False,
    cache: bool = False,
    seed: int = 0,
    skip_examples: int = 0,
    max_boxes: int | None = None,
) -> tuple[tf.data.Dataset, str]:
    """Returns (batched dataset, shard policy "OFF" | "FILE" | "DATA"); see the module docstring.

    `training` defaults to `split == "train"`: a training stream is shuffled, repeats forever
    and starts after `skip_examples` examples of this pipeline; an eval stream is finite and
    padded to the same number of full batches for every replica. With `input_context`,
    batches are per replica and each input pipeline reads its own shard.
    """
    return load_source(
        source(spec, split, image_size, data_dir, max_boxes),
        split,
        global_batch_size,
        anchors=anchors,
        input_context=input_context,
        training=training,
        augment=augment,
        cache=cache,
        seed=seed,
        skip_examples=skip_examples,
    )


def load_source(
    source_: Source,
    split: str,
    global_batch_size: int,
    *,
    anchors=None,
    input_context: tf.distribute.InputContext | None = None,
    training: bool | None = None,
    augment: bool = False,
    cache: bool = False,
    seed: int = 0,
    skip_examples: int = 0,
) -> tuple[tf.data.Dataset, str]:
    """`load` of a `Source` already made (by `source`, or by hand: `tfmp.bench.input_cost`
    reads in-memory JPEGs through it); the same pipeline, batches and shard policy."""
    spec = source_.info.name
    training = split == "train" if training is None else training
    specs.check_counts(global_batch_size, skip_examples)
    if anchors is not None:
        anchors = tf.convert_to_tensor(anchors, tf.float32)
        if anchors.shape.rank != 2 or anchors.shape[-1] != 4:
            size = source_.info.image_size
            raise UsageError(
                f"bad anchors of shape {anchors.shape}; pass boxes.generate_anchors({size}, config) "
                f"for image_size {size}"
            )
    batch_size, pipelines = stream.per_replica_batch(global_batch_size, input_context)
    policy, why = stream.shard_policy(pipelines, training=training, num_files=source_.num_files)
    logging.info(
        "tfmp.detection.data: %s %s split: shard policy %s for %d input pipeline(s) (%s)",
        spec,
        split,
        policy,
        pipelines,
        why,
    )
    dataset = stream.example_stream(
        source_,
        policy,
        input_context,
        training=training,
        seed=seed,
        skip_examples=skip_examples,
        file_level=policy == "FILE" and spec.startswith("tfds:"),
        cache=_decoder(source_) if cache else None,
    )
    if training:
        dataset = _training_batches(dataset, source_, batch_size, seed, augment, cached=cache)
    else:
        dataset = _eval_batches(dataset, source_, batch_size, input_context, cached=cache)
    if anchors is not None:
        dataset = dataset.map(lambda image, truth: _with_anchor_labels(image, truth, anchors, training))
    return stream.finish(dataset.prefetch(_AUTOTUNE)), policy


def _decoder(source_):
    """item -> one square example (image, boxes [M, 4], classes [M], scale), un-augmented."""
    size, max_boxes = source_.info.image_size, source_.info.max_boxes
    if source_.decode_batch is not None:  # a drawn source: draw a batch of one

        def draw_one(item):
            drawn = tf.nest.map_structure(lambda value: value[None], source_.decode_item(item))
            images, boxes, classes = source_.decode_batch(drawn)
            return images[0], boxes[0], classes[0], tf.constant(1.0)

        return draw_one

    def decode(item):
        image, boxes, classes = source_.decode_item(item)
        image, boxes, classes, scale = fit_to_square(image, boxes, classes, size)
        boxes, classes = pad_boxes(boxes, classes, max_boxes)
        return tf.ensure_shape(image, [size, size, 3]), boxes, classes, tf.cast(scale, tf.float32)

    return decode


def _square_batches(dataset, source_, batch_size, cached, drop_remainder):
    """Batches of (carried, (images, boxes, classes, scales)) from (carried, item) pairs: drawn
    sources decode per example only their random numbers and draw per batch."""
    if cached:
        return dataset.batch(batch_size, drop_remainder=drop_remainder)
    if source_.decode_batch is None:
        decode = _decoder(source_)
        dataset = dataset.map(lambda carried, item: (carried, decode(item)), num_parallel_calls=_AUTOTUNE)
        return dataset.batch(batch_size, drop_remainder=drop_remainder)

    def draw(carried, drawn):
        images, boxes, classes = source_.decode_batch(drawn)
        return carried, (images, boxes, classes, tf.ones_like(boxes[:, 0, 0]))

    dataset = dataset.map(
        lambda carried, item: (carried, source_.decode_item(item)), num_parallel_calls=_AUTOTUNE
    )
    dataset = dataset.batch(batch_size, drop_remainder=drop_remainder)
    return dataset.map(draw, num_parallel_calls=_AUTOTUNE)


def _training_batches(dataset, source_, batch_size, seed, augment, cached):
    seed_tensor = tf.constant(seed, tf.int64)
    # The stream position keys the augmentation: a resumed run augments identically.
    dataset = dataset.map(
        lambda position, item: (augmentation_draws(tf.stack([seed_tensor, position])), item)
    )
    dataset = _square_batches(dataset, source_, batch_size, cached, drop_remainder=True)

    def finish(draws, example):
        images, boxes, classes, _ = example
        if augment:
            images, boxes, classes = augment_batch(images, boxes, classes, draws)
        return images, {"boxes": boxes, "classes": classes, "box_valid": classes >= 0}

    return dataset.map(finish, num_parallel_calls=_AUTOTUNE)


def _eval_batches(dataset, source_, batch_size, input_context, cached):
    dataset = _square_batches(dataset, source_, batch_size, cached, drop_remainder=False).unbatch()

    def element(position, example):
        image, boxes, classes, scale = example
        truth = {"boxes": boxes, "classes": classes, "box_valid": classes >= 0}
        return image, {**truth, "image_id": position, "scale": scale, "valid": tf.constant(True)}

    dataset = dataset.map(element)
    size, max_boxes = source_.info.image_size, source_.info.max_boxes
    padding = (
        tf.zeros([size, size, 3]),
        {
            "boxes": tf.zeros([max_boxes, 4]),
            "classes": tf.fill([max_boxes], -1),
            "box_valid": tf.zeros([max_boxes], tf.bool),
            "image_id": tf.constant(-1, tf.int64),
            "scale": tf.constant(1.0),
            "valid": tf.constant(False),
        },
    )
    dataset = stream.pad_to_full_batches(dataset, source_.count(), padding, input_context, batch_size)
    return dataset.batch(batch_size, drop_remainder=True)


def _with_anchor_labels(image, truth, anchors, training):
    """Per-anchor labels matched in the pipeline (a batch at a time); padding rows ignore all."""
    labels = targets.loss_labels(
        targets.match_anchors(anchors, truth["boxes"], truth["classes"], truth["box_valid"])
    )
    if training:
        return image, labels
    real = truth["valid"][:, None]
    labels = {
        "classes": tf.where(real, labels["classes"], IGNORE),
        "boxes": tf.where(real[..., None], labels["boxes"], 0.0),
    }
    return image, labels, truth
