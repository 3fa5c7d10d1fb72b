"""Detection input pipelines: built-in drawn scenes, COCO-format folders and TFDS, with anchors
matched in the pipeline so the train step is static-shaped.

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

    info = data.describe("shapes", image_size=128)        # cheap: validates, no loading
    anchors = boxes.generate_anchors(128, retinanet.anchor_config("retinanet_tiny"))
    train, policy = data.load("shapes", "train", 32, anchors=anchors, augment=True)
    evaluation, _ = data.load("shapes", "eval", 32, anchors=anchors)
    image, scale, original = data.read_image("photo.jpg", 128)   # for predictions

Every image is made square (``image_size``): resized so its longer side fits, then padded with
zeros at the bottom/right. Training elements are ``(image, labels)``, eval elements
``(image, labels, truth)``:

* ``image`` float32 [S, S, 3] in [0, 1];
* ``labels`` {"classes": int32 [A], "boxes": float32 [A, 5]}: the anchor targets of
  `tfmp.detection.boxes.match` (the encoding `tfmp.detection.losses` documents);
* ``truth`` (eval only) {"image_id": int64 (the image's index in the eval split, -1 for
  padding), "boxes": float32 [M, 4] xyxy pixels of the square image, "classes": int32 [M] (-1 =
  no box), "scale": float32 (original-image pixels per input pixel, to report boxes in the
  original image), "valid": bool (False for padding rows)}; M = ``max_boxes`` (default 100;
  4 for ``shapes``). `truth` is a third element, not part of ``labels``, because Keras requires
  the labels' structure to match the model's outputs: for `model.evaluate`, map it away
  (``dataset.map(lambda image, labels, truth: (image, labels))``).

Augmentation (``augment=True``, training): scale jitter (the longer side becomes 0.75-1.25 x S),
a random S x S crop of an enlarged image (padding of a shrunk one) and a horizontal flip, keyed
by the stream position, boxes moved with the pixels; a box cut to less than 40% of its area (or
under 2 pixels) is dropped. Crowd annotations are skipped (no crowd regions in eval).

Sharding, repetition, skipping and eval padding follow `tfmp.classification.data.load`: eval batches are padded
to full batches with rows whose anchors are all ignored and whose ``valid`` is False, so every
replica and worker runs the same number of steps and padding counts nowhere.
"""

from __future__ import annotations

import dataclasses
import math

import tensorflow as tf
from absl import logging

from tfmp.detection import boxes as box_ops
from tfmp.detection import shapes
from tfmp.errors import UsageError, unknown

SPLITS = ("train", "eval")
SHAPES_TRAIN_EXAMPLES, SHAPES_EVAL_EXAMPLES = 50_000, 500
SHAPES_MAX_SHAPES = 4
DEFAULT_IMAGE_SIZE = {"shapes": 128, "coco": 512, "tfds": 512}
DEFAULT_MAX_BOXES = 100
MIN_IMAGE_SIZE, MAX_IMAGE_SIZE = 32, 2048
SCALE_JITTER = (0.75, 1.25)
MIN_KEPT_AREA, MIN_BOX_SIDE = 0.4, 2.0
_CONTENT_SEED = 7_654_321  # fixes the shapes scenes; `seed` only orders and augments them
_CHOICES = ["shapes", "coco:<path>", "tfds:voc/2007", "tfds:coco/2017"]
_AUTOTUNE = tf.data.AUTOTUNE


@dataclasses.dataclass(frozen=True)
class DetectionInfo:
    name: str  # the spec as given
    image_size: int  # square model input side
    num_classes: int
    class_names: tuple[str, ...]
    train_examples: int  # 0 when unknown (a TFDS dataset whose split sizes TFDS doesn't know)
    eval_examples: int
    max_boxes: int  # ground-truth rows per eval image (more are truncated)


@dataclasses.dataclass
class Source:
    """One split: a cheap stream of dict items and `decode(item) -> (image float32 [h, w, 3],
    boxes float32 [n, 4] xyxy pixels of that image, classes int32 [n], -1 rows allowed)`."""

    info: DetectionInfo
    num_examples: int  # in this split (0 = unknown)
    num_files: int  # files behind the split (FILE sharding needs one per pipeline)
    examples: object  # (file_shard_context | None, shuffle_seed | None) -> Dataset of dicts
    decode: object
    shuffle_buffer: int


# ----------------------------------------------------------------------------- spec handling
def _size(kind, image_size):
    if image_size is None:
        return DEFAULT_IMAGE_SIZE[kind]
    if (
        isinstance(image_size, bool)
        or not isinstance(image_size, int)
        or not (MIN_IMAGE_SIZE <= image_size <= MAX_IMAGE_SIZE)
    ):
        raise UsageError(
            f"bad detection image_size {image_size!r}; use an integer from "
            f"{MIN_IMAGE_SIZE} to {MAX_IMAGE_SIZE} (a multiple of 32 for RetinaNet)"
        )
    return image_size


def source(
    spec: str,
    split: str,
    image_size: int | None = None,
    data_dir: str | None = None,
    max_boxes: int | None = None,
) -> Source:
    """The `Source` of one split of `spec` (validates everything `load` would)."""
    from tfmp.detection import sources  # COCO JSON and TFDS readers

    kind, _, argument = spec.partition(":") if isinstance(spec, str) else (repr(spec), "", "")
    if not ((kind == "shapes" and not argument) or (kind in ("coco", "tfds") and argument)):
        raise unknown("detection dataset", spec, _CHOICES)
    if split not in SPLITS:
        raise unknown("split", split, SPLITS)
    if max_boxes is not None and (not isinstance(max_boxes, int) or max_boxes < 1):
        raise UsageError(f"bad max_boxes {max_boxes!r}; use a positive integer")
    size = _size(kind, image_size)
    if kind == "shapes":
        return _shapes_source(spec, split, size)
    if kind == "coco":
        return sources.coco_source(spec, argument, split, size, max_boxes or DEFAULT_MAX_BOXES)
    return sources.tfds_source(spec, argument, split, size, max_boxes or DEFAULT_MAX_BOXES, data_dir)


def describe(
    spec: str, image_size: int | None = None, data_dir: str | None = None, max_boxes: int | None = None
) -> DetectionInfo:
    """Validates `spec` and returns its image size, classes and split sizes without loading."""
    return source(spec, "train", image_size, data_dir, max_boxes).info


def _shapes_source(spec, split, size):
    info = DetectionInfo(
        spec,
        size,
        len(shapes.CLASS_NAMES),
        shapes.CLASS_NAMES,
        SHAPES_TRAIN_EXAMPLES,
        SHAPES_EVAL_EXAMPLES,
        SHAPES_MAX_SHAPES,
    )
    split_id = SPLITS.index(split)
    count = (SHAPES_TRAIN_EXAMPLES, SHAPES_EVAL_EXAMPLES)[split_id]

    def decode(item):
        key = tf.stack([tf.constant(_CONTENT_SEED + split_id, tf.int64), item["index"]])
        return shapes.draw_scene(key, size, SHAPES_MAX_SHAPES)

    def examples(*_):
        return tf.data.Dataset.range(count).map(lambda index: {"index": index})

    return Source(info, count, 0, examples, decode, count)


# ----------------------------------------------------------------------------- geometry
def fit_to_square(image, boxes, classes, size: int, key=None, jitter=SCALE_JITTER):
    """Resizes (keeping the aspect ratio), crops/pads to `size` x `size` and flips, moving the
    boxes along; boxes left too small get class -1. With `key` None: longer side = `size`, no
    crop or flip. Returns (image, boxes, classes, scale = original pixels per output pixel)."""
    shape = tf.cast(tf.shape(image)[:2], tf.float32)
    if key is None:
        zoom, offset_key, flip = tf.constant(1.0), None, tf.constant(False)
    else:
        zoom_key, offset_key, flip_key = tf.unstack(tf.random.experimental.stateless_split(key, 3))
        zoom = tf.random.stateless_uniform([], zoom_key, jitter[0], jitter[1])
        flip = tf.random.stateless_uniform([], flip_key) < 0.5
    ratio = size * zoom / tf.reduce_max(shape)
    resized = tf.maximum(tf.cast(tf.round(shape * ratio), tf.int32), 1)
    image = tf.image.resize(image, resized, antialias=True)
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
    moved = tf.cast(boxes, tf.float32) * ratio - shift
    clipped = tf.clip_by_value(moved, 0.0, float(size))
    area = lambda b: (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    sides = tf.minimum(clipped[:, 2] - clipped[:, 0], clipped[:, 3] - clipped[:, 1])
    keep = (
        (classes >= 0)
        & (sides >= MIN_BOX_SIDE)
        & (area(clipped) >= MIN_KEPT_AREA * tf.maximum(area(moved), 1e-6))
    )
    flipped = tf.stack([size - clipped[:, 2], clipped[:, 1], size - clipped[:, 0], clipped[:, 3]], 1)
    image = tf.where(flip, tf.reverse(image, [1]), image)
    clipped = tf.where(flip, flipped, clipped)
    classes = tf.where(keep, tf.cast(classes, tf.int32), -1)
    return (tf.clip_by_value(image, 0.0, 1.0), tf.where(keep[:, None], clipped, 0.0), classes, 1.0 / ratio)


def read_image(path: str, image_size: int):
    """One image file for prediction: (model input float32 [S, S, 3], scale = original pixels
    per input pixel, original image float32 [h, w, 3]). Multiply predicted boxes by `scale` to
    draw them on the original image."""
    if not tf.io.gfile.exists(path) or tf.io.gfile.isdir(path):
        raise UsageError(f"image file {path!r} does not exist; pass existing image files")
    try:
        raw = tf.io.decode_image(tf.io.read_file(path), channels=3, expand_animations=False)
    except tf.errors.InvalidArgumentError:
        raise UsageError(f"cannot decode image file {path!r}; use a jpg, png, bmp or gif") from None
    original = tf.image.convert_image_dtype(raw, tf.float32)
    image, _, _, scale = fit_to_square(original, tf.zeros([0, 4]), tf.zeros([0], tf.int32), image_size)
    return image, float(scale), original


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
    anchors,
    image_size: int | None = None,
    data_dir: str | None = None,
    input_context: tf.distribute.InputContext | None = None,
    training: bool | None = None,
    augment: bool = False,
    seed: int = 0,
    skip_examples: int = 0,
    max_boxes: int | None = None,
) -> tuple[tf.data.Dataset, str]:
    """Returns (batched dataset, shard policy "OFF" | "FILE" | "DATA"); see the module docstring.

    `anchors` [A, 4] (from `boxes.generate_anchors` for the same `image_size`) are matched to
    the boxes of every image. `training` defaults to `split == "train"`: a training stream is
    shuffled, repeats forever and starts after `skip_examples` examples of this pipeline; an
    eval stream is finite and padded to the same number of full batches for every replica.
    With `input_context`, batches are per replica and each input pipeline reads its own shard.
    """
    source_ = source(spec, split, image_size, data_dir, max_boxes)
    training = split == "train" if training is None else training
    if (
        isinstance(global_batch_size, bool)
        or not isinstance(global_batch_size, int)
        or (global_batch_size < 1)
    ):
        raise UsageError(f"bad global_batch_size {global_batch_size!r}; use a positive integer")
    if not isinstance(skip_examples, int) or skip_examples < 0:
        raise UsageError(f"bad skip_examples {skip_examples!r}; use an integer >= 0")
    anchors = tf.convert_to_tensor(anchors, tf.float32)
    if anchors.shape.rank != 2 or anchors.shape[-1] != 4:
        raise UsageError(
            f"bad anchors of shape {anchors.shape}; pass boxes.generate_anchors("
            f"{source_.info.image_size}, config) for image_size "
            f"{source_.info.image_size}"
        )
    batch_size, pipelines = global_batch_size, 1
    if input_context is not None:
        try:
            batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        except ValueError as error:
            raise UsageError(f"{str(error).strip()}; pick a multiple of the replica count") from None
        pipelines = input_context.num_input_pipelines
    if pipelines == 1:
        policy = "OFF"
    elif not training or source_.num_files < pipelines or not spec.startswith("tfds:"):
        policy = "DATA"  # eval, generated data, or files read one per example: split examples
    else:
        policy = "FILE"
    logging.info(
        "tfmp.detection.data: %s %s split: shard policy %s for %d input pipeline(s)",
        spec,
        split,
        policy,
        pipelines,
    )
    dataset = _pipeline(
        source_,
        policy,
        input_context,
        batch_size,
        anchors,
        training=training,
        augment=augment,
        seed=seed,
        skip_examples=skip_examples,
    )
    options = tf.data.Options()
    options.deterministic = True  # parallel maps keep order: runs are reproducible
    # Sharded here (above); tf.distribute must not shard a second time.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return dataset.with_options(options), policy


def _pipeline(source_, policy, input_context, batch_size, anchors, *, training, augment, seed, skip_examples):
    # As tfmp.classification.data: a training stream without file sharding shards late (every pipeline shuffles
    # the same cheap stream, then takes every n-th item), so a global batch is the same on any
    # number of workers; eval shards early, after numbering the images (their ids).
    file_level = policy == "FILE"
    late = training and policy == "DATA"
    dataset = source_.examples(
        input_context if file_level else None, seed if training and file_level else None
    )
    if not training:
        dataset = dataset.enumerate()
        if policy != "OFF":
            dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    else:
        dataset = dataset.shuffle(source_.shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
        dataset = dataset.repeat().enumerate()  # the stream position keys the augmentation
        if late:
            dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        dataset = dataset.skip(skip_examples)
    size, max_boxes = source_.info.image_size, source_.info.max_boxes
    seed_tensor = tf.constant(seed, tf.int64)

    def prepare(position, item):
        image, boxes, classes = source_.decode(item)
        key = tf.stack([seed_tensor, position]) if training and augment else None
        image, boxes, classes, scale = fit_to_square(image, boxes, classes, size, key)
        boxes, classes = pad_boxes(boxes, classes, max_boxes)
        class_targets, box_targets = box_ops.match(anchors, boxes, classes)
        image = tf.ensure_shape(image, [size, size, 3])
        labels = {"classes": class_targets, "boxes": box_targets}
        if training:
            return image, labels
        truth = {
            "image_id": position,
            "boxes": boxes,
            "classes": classes,
            "scale": tf.cast(scale, tf.float32),
            "valid": tf.constant(True),
        }
        return image, labels, truth

    dataset = dataset.map(prepare, num_parallel_calls=_AUTOTUNE)
    if not training:
        dataset = _pad_to_full_batches(dataset, source_, input_context, batch_size, anchors)
    return dataset.batch(batch_size, drop_remainder=True).prefetch(_AUTOTUNE)


def _pad_to_full_batches(dataset, source_, input_context, batch_size, anchors):
    """Pads an eval shard with rows that count nowhere (all anchors ignored, no boxes, valid
    False) to ceil(total / pipelines) examples rounded up to whole steps of its replicas."""
    pipelines = input_context.num_input_pipelines if input_context else 1
    replicas = max(input_context.num_replicas_in_sync // pipelines, 1) if input_context else 1
    total = source_.num_examples
    if not total:  # unknown to TFDS (e.g. mocked): count the cheap stream once
        total = int(source_.examples(None, None).reduce(tf.constant(0, tf.int64), lambda count, _: count + 1))
    examples_per_step = batch_size * replicas
    steps = math.ceil(math.ceil(total / pipelines) / examples_per_step)
    size, max_boxes, num_anchors = (source_.info.image_size, source_.info.max_boxes, anchors.shape[0])
    padding = (
        tf.zeros([size, size, 3]),
        {"classes": tf.fill([num_anchors], box_ops.IGNORE), "boxes": tf.zeros([num_anchors, 5])},
        {
            "image_id": tf.constant(-1, tf.int64),
            "boxes": tf.zeros([max_boxes, 4]),
            "classes": tf.fill([max_boxes], -1),
            "scale": tf.constant(1.0),
            "valid": tf.constant(False),
        },
    )
    padding = tf.data.Dataset.from_tensors(padding).repeat()
    return dataset.concatenate(padding).take(steps * examples_per_step)
