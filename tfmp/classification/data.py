"""Every input pipeline of tfmp: built-in offline datasets, TFDS and image folders.

A dataset is named by a spec string:

* ``shapes``     10 classes of procedurally drawn coloured shapes, any ``image_size`` (default 32).
* ``digits``     MNIST-shaped (28x28x1) jittered stroke digits, 10 classes.
* ``synthetic``  one fixed random batch repeated: pure input-free throughput.
* ``tfds:NAME``  a prepared TFDS image classification dataset (``data_dir``; never downloads);
  eval is its ``test`` split, else ``validation``, else the last 10% of ``train``. NAME may
  carry a config and version (``tfds:mnist:3.*.*``). Split sizes are 0 when TFDS doesn't know
  them (not prepared, or under ``tfds.testing.mock_data``).
* ``folder:PATH`` one sub-folder per class of jpg/png/bmp/gif/webp files (``image_size`` default 64).
  ``PATH/train`` + ``PATH/val`` (or ``validation``/``test``) are used as splits when present,
  otherwise every 10th file of each class (sorted order) is held out for eval. `describe`
  refuses a folder with a file that is not a whole image (`tfmp.input.image_files`), naming it.
  Every image decodes to RGB (`tfmp.input.decoding`: a WebP's or PNG's alpha dropped), and file
  and class folder names need not be UTF-8 (class names then show the bytes escaped, ``\xff``).

Usage::

    info = data.describe("shapes", image_size=64)           # validates, loads nothing
    ds, policy = data.load("shapes", "train", 256, input_context=ctx, seed=1)

Images are float32 in [0, 1] (HxWxC), labels int32. ``shapes`` and ``digits`` are generated
per example index from stateless random numbers keyed by (fixed content seed, split, index), so
they cost no memory at any resolution, are identical everywhere and parallelise freely.

Pipeline order: cheap example stream (indices, file paths or still-encoded TFDS records) ->
[shard] -> [decode + cache, if cache=True] -> shuffle (training) -> repeat (training only) ->
[shard] -> skip(skip_examples) -> decode -> augment -> batch -> [mix] -> prefetch. Training streams
without TFDS file sharding or cache shard late: every worker shuffles identically and takes
every n-th example, so each global batch is exactly a single process's. Shuffling and skipping the
cheap stream means resuming after N examples decodes none of them. ``cache=True`` decodes
in source order and caches *before* the shuffle; the shuffle buffer is the same, so the
example order is the same as without cache (skipped examples are then decoded, as they fill
the cache anyway). The order depends only on ``seed`` (and TensorFlow's global seed, which
tf.data folds into every op seed), never on the number of replicas sharing one pipeline.

Training augmentation (`tfmp.classification.augmentation`): ``augment=True`` flips and crops,
``randaugment=(num_ops, magnitude)`` applies RandAugment per example after that, and
``mixing=`` (a `tfmp.input.mixing.Mixing` or a dict of its fields, e.g. ``{"mixup_alpha": 0.8,
"cutmix_alpha": 1.0, "label_smoothing": 0.1}``) mixes each batch with Mixup/CutMix; the labels
are then float32 [batch, num_classes]. All are keyed by the seed and the stream position, so a
resumed run (``skip_examples``, a whole number of batches for mixing) augments identically.
"""

import dataclasses
import math
import os

import tensorflow as tf
from absl import logging

from tfmp.classification import augmentation, drawing
from tfmp.errors import UsageError
from tfmp.input import decoding, image_files, stream, tfds_reader
from tfmp.input import spec as specs
from tfmp.input.mixing import Mixing
from tfmp.input.source import Source
from tfmp.input.stream import with_threads  # noqa: F401  (re-exported: callers use data.with_threads)

SHAPES_TRAIN_EXAMPLES, SHAPES_EVAL_EXAMPLES = 12_000, 2_000
DIGITS_TRAIN_EXAMPLES, DIGITS_EVAL_EXAMPLES = 20_000, 2_000
SYNTHETIC_TRAIN_EXAMPLES, SYNTHETIC_EVAL_EXAMPLES = 12_000, 2_000
SPLITS = specs.SPLITS
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp")
DEFAULT_IMAGE_SIZE = {"shapes": 32, "synthetic": 32, "folder": 64}
MIN_IMAGE_SIZE, MAX_IMAGE_SIZE = 8, 1024
TFDS_SHUFFLE_BUFFER = 10_000  # encoded records: bounded; index/path streams shuffle fully
_CONTENT_SEED = 1_234_567  # fixes the built-in datasets' content; `seed` only orders it
_CHOICES = ["shapes", "digits", "synthetic", "tfds:<name>", "folder:<path>"]
_AUTOTUNE = stream.AUTOTUNE


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    name: str  # the spec as given
    image_shape: tuple[int, int, int]
    num_classes: int
    train_examples: int  # 0 when unknown (a TFDS dataset whose split sizes TFDS doesn't know)
    eval_examples: int
    class_names: tuple[str, ...] | None = None  # label index -> name, where the dataset has names
    # The image files a folder: dataset decodes (train and eval): a run that fails to decode one
    # mid-run names it (`tfmp.input.decoding.failing_file`). Empty for the other datasets.
    files: tuple[str, ...] = dataclasses.field(default=(), repr=False, compare=False)


SHAPES_CLASS_NAMES = (
    "circle",
    "square",
    "triangle",
    "diamond",
    "plus",
    "ring",
    "horizontal_bar",
    "vertical_bar",
    "ellipse",
    "x",
)  # the order of drawing.draw_shape's classes
DIGITS_CLASS_NAMES = tuple(str(digit) for digit in range(10))


# ----------------------------------------------------------------------------- spec handling
def describe(
    spec: str,
    image_size: int | None = None,
    data_dir: str | None = None,
    *,
    verify: bool = True,
    max_image_pixels: int | None = image_files.MAX_IMAGE_PIXELS,
) -> DatasetInfo:
    """Validates `spec` and returns its shape, classes and split sizes without loading data.

    `verify` (what a training run needs before it writes anything): both splits have examples,
    every image file of a folder starts and ends as an image does (`tfmp.input.image_files`:
    two small reads a file, ~0.2 s per 10,000 cached files) and declares at most
    `max_image_pixels` pixels (0: no limit), a TFDS dataset's records are in `data_dir`.
    `verify=False` checks only what naming the classes and the image shape needs.
    """
    return _source(spec, "train", image_size, data_dir, verify=verify, max_pixels=max_image_pixels).info


def _source(
    spec, split, image_size, data_dir, verify=False, max_pixels=image_files.MAX_IMAGE_PIXELS
) -> Source:
    kind, arg = specs.parse(
        spec,
        builtins=("shapes", "digits", "synthetic"),
        with_argument=("tfds", "folder"),
        what="dataset",
        choices=_CHOICES,
    )
    specs.check_split(split)
    size = specs.image_size(
        image_size, default=DEFAULT_IMAGE_SIZE.get(kind), low=MIN_IMAGE_SIZE, high=MAX_IMAGE_SIZE
    )
    if kind == "tfds":
        return _tfds_source(spec, arg, split, size, data_dir, verify)
    if kind == "folder":
        return _folder_source(spec, arg, split, size, verify, max_pixels)
    return _builtin_source(spec, kind, split, size)


# ----------------------------------------------------------------------------- built-ins
def _builtin_source(spec, kind, split, size):
    counts = {
        "shapes": (SHAPES_TRAIN_EXAMPLES, SHAPES_EVAL_EXAMPLES),
        "digits": (DIGITS_TRAIN_EXAMPLES, DIGITS_EVAL_EXAMPLES),
        "synthetic": (SYNTHETIC_TRAIN_EXAMPLES, SYNTHETIC_EVAL_EXAMPLES),
    }[kind]
    if kind == "digits":
        shape, draw = (size or 28, size or 28, 1), drawing.draw_digit
    else:
        shape, draw = (size, size, 3), drawing.draw_shape
    names = {"shapes": SHAPES_CLASS_NAMES, "digits": DIGITS_CLASS_NAMES}.get(kind)
    info = DatasetInfo(spec, shape, 10, *counts, class_names=names)
    split_id = SPLITS.index(split)
    num_examples = counts[split_id]

    def decode(index):
        key = tf.stack([tf.constant(_CONTENT_SEED + split_id, tf.int64), index])
        image = draw(key, tf.cast(index % 10, tf.int32), shape[0])
        if image.shape[:2] != shape[:2]:  # digits are drawn at 28x28
            image = tf.clip_by_value(tf.image.resize(image, shape[:2], antialias=True), 0.0, 1.0)
        return image, tf.cast(index % 10, tf.int32)  # index % 10: exactly balanced classes

    return Source(
        info,
        num_examples,
        0,
        lambda *_: tf.data.Dataset.range(num_examples),
        decode,
        num_examples,
        flip_ok=kind != "digits",
    )


# ----------------------------------------------------------------------------- TFDS
def _tfds_source(spec, name, split, size, data_dir, verify):
    tfds = tfds_reader.module()
    info = tfds_reader.builder(name, data_dir).info
    image_key, label_key = info.supervised_keys if info.supervised_keys else ("image", "label")
    features = info.features
    if not (
        image_key in features.keys()
        and isinstance(features[image_key], tfds.features.Image)
        and label_key in features.keys()
        and isinstance(features[label_key], tfds.features.ClassLabel)
    ):
        raise UsageError(f"tfds dataset {name!r} is not image classification (no image/label)")
    native_shape = features[image_key].shape
    if size is None and None in native_shape[:2]:
        raise UsageError(f"tfds dataset {name!r} has images of varying size; pass image_size")
    height, width = (size, size) if size else native_shape[:2]
    splits = info.splits  # empty when the dataset isn't prepared in data_dir (or TFDS is mocked)
    names = ("train", next((s for s in ("test", "validation") if s in splits), "test"))
    if splits and names[1] not in splits:  # train only (e.g. tf_flowers): hold out its last 10%
        names = ("train[:90%]", "train[90%:]")
    if splits and "train" not in splits:
        raise UsageError(f"tfds dataset {name!r} has no train split (it has {', '.join(splits)})")
    if verify:  # the reader's own open: an unprepared dataset fails here, not after the run starts
        tfds_reader.check_readable(name, names, data_dir)
    split_infos = [splits[s] if splits else None for s in names]
    counts = [s.num_examples if s else 0 for s in split_infos]
    tfds_split = names[SPLITS.index(split)]
    image_feature = features[image_key]

    def examples(file_shard_context, shuffle_seed):
        # Images stay encoded (SkipDecoding) until after shuffle/skip; see module docstring.
        decoders = {image_key: tfds.decode.SkipDecoding()}
        return tfds_reader.read(
            name, tfds_split, data_dir, file_shard_context, shuffle_seed, decoders, as_supervised=True
        )

    def decode(encoded, label):
        image = image_files.unit_float(image_feature.decode_example(encoded), (size, size) if size else None)
        return image, tf.cast(label, tf.int32)

    channels = native_shape[2] or 3
    info = DatasetInfo(
        spec,
        (height, width, channels),
        features[label_key].num_classes,
        *counts,
        class_names=tuple(features[label_key].names),
    )
    num_examples = counts[SPLITS.index(split)]
    num_files = split_infos[SPLITS.index(split)].num_shards if splits else 0
    buffer = min(num_examples or TFDS_SHUFFLE_BUFFER, TFDS_SHUFFLE_BUFFER)
    return Source(info, num_examples, num_files, examples, decode, buffer)


# ----------------------------------------------------------------------------- folders
def _folder_files(path):
    """(class folder names, train [(file, label)], eval [(file, label)]) of a `folder:` dataset;
    local names as `os.listdir` gives them (surrogate-escaped where not UTF-8)."""
    root = os.path.expanduser(path)
    if not decoding.isdir(root):
        raise UsageError(f"dataset folder {path!r} does not exist (or is not a folder)")
    eval_dir = next((d for d in ("val", "validation", "test") if decoding.isdir(os.path.join(root, d))), None)
    split_dirs = decoding.isdir(os.path.join(root, "train")) and eval_dir
    class_root = os.path.join(root, "train") if split_dirs else root
    classes = sorted(d for d in decoding.listdir(class_root) if decoding.isdir(os.path.join(class_root, d)))

    def files(directory, holdout):  # holdout: None = all files, True/False = eval/train part
        found = []
        for label, name in enumerate(classes):
            folder = os.path.join(directory, name)
            names = sorted(decoding.listdir(folder)) if decoding.isdir(folder) else []
            names = [n for n in names if n.lower().endswith(IMAGE_EXTENSIONS)]
            found += [
                (os.path.join(folder, n), label)
                for i, n in enumerate(names)
                if holdout is None or (i % 10 == 9) == holdout
            ]
        return found

    if split_dirs:
        return classes, files(class_root, None), files(os.path.join(root, eval_dir), None)
    return classes, files(root, False), files(root, True)


def _folder_source(spec, path, split, size, verify, max_pixels):
    classes, train, evaluation = _folder_files(path)
    if not train:
        raise UsageError(
            f"dataset folder {path!r} has no images in class sub-folders "
            f"(expected {path}/<class>/*.png|jpg|bmp|gif|webp)"
        )
    info = DatasetInfo(
        spec,
        (size, size, 3),
        len(classes),
        len(train),
        len(evaluation),
        class_names=tuple(decoding.shown(name) for name in classes),
        files=tuple(file for file, _ in train + evaluation),
    )
    if not evaluation and (verify or split == "eval"):
        raise UsageError(
            f"dataset folder {path!r} has no eval images; give each class 10 or more images "
            f"(every 10th is held out) or put the eval images in {path}/val/<class>/ beside train/"
        )
    if verify:  # a bad file found now, before the run writes anything, not as a traceback mid-run
        image_files.check([file for file, _ in train + evaluation], spec, max_pixels=max_pixels)
    chosen = train if split == "train" else evaluation
    paths, labels = [decoding.tf_path(p) for p, _ in chosen], [label for _, label in chosen]

    def decode(file_path, label):
        raw = decoding.decode(tf.io.read_file(file_path), channels=3)
        return image_files.unit_float(raw, (size, size)), tf.cast(label, tf.int32)  # uint8 resized

    def examples(file_shard_context, _):  # one file per example: sharding files = sharding data
        dataset = tf.data.Dataset.from_tensor_slices((paths, labels))
        if file_shard_context is None:
            return dataset
        return dataset.shard(file_shard_context.num_input_pipelines, file_shard_context.input_pipeline_id)

    return Source(info, len(chosen), len(chosen), examples, decode, max(len(chosen), 1))


# ----------------------------------------------------------------------------- the pipeline
def load(
    spec: str,
    split: str,
    global_batch_size: int,
    *,
    image_size: int | None = None,
    data_dir: str | None = None,
    input_context: tf.distribute.InputContext | None = None,
    training: bool = True,
    augment: bool = False,
    cache: bool = False,
    seed: int = 0,
    skip_examples: int = 0,
    randaugment: tuple[int, float] | None = None,
    mixing: Mixing | dict | None = None,
) -> tuple[tf.data.Dataset, str]:
    """Returns (batched dataset of (image, label), shard policy "OFF" | "FILE" | "DATA").

    With `input_context` (from `strategy.distribute_datasets_from_function`) batches are
    per-replica and each input pipeline reads its own shard. Training streams repeat forever
    and start after `skip_examples` examples (of this pipeline's stream); eval streams ignore
    it, are finite and padded with label -1 rows to the same number of full batches for every
    replica, so no replica or worker runs short (`Engine.evaluate` ignores the padding).

    Training only (eval ignores them; see the module docstring): `randaugment` (num_ops,
    magnitude) per example, `mixing` per batch (a `tfmp.input.mixing.Mixing` or a dict of its
    fields: mixup_alpha, cutmix_alpha, switch_prob, label_smoothing, num_classes; labels become
    float32 [batch, num_classes]). The ``synthetic`` dataset's training stream refuses both.
    """
    source = _source(spec, split, image_size, data_dir)
    specs.check_counts(global_batch_size, skip_examples)
    augmenting = augmentation.settings(
        spec,
        augment=augment,
        randaugment=randaugment,
        mixing=mixing,
        num_classes=source.info.num_classes,
        training=training,
    )
    batch_size, pipelines = stream.per_replica_batch(global_batch_size, input_context)
    pipeline_id = input_context.input_pipeline_id if input_context else 0
    policy, why = stream.shard_policy(
        pipelines, training=training, num_files=source.num_files, per_pipeline=spec == "synthetic"
    )
    logging.info(
        "tfmp.classification.data: %s %s split: shard policy %s for %d input pipeline(s) (%s)",
        spec,
        split,
        policy,
        pipelines,
        why,
    )

    if spec == "synthetic":
        dataset = _synthetic(source, batch_size, training, seed + 7919 * pipeline_id, input_context)
    else:
        dataset = _pipeline(
            source,
            policy,
            input_context,
            batch_size,
            training=training,
            augmenting=augmenting,
            cache=cache,
            seed=seed,
            skip_examples=skip_examples,
            file_level=policy == "FILE" and spec.startswith("tfds:"),
        )
    return stream.finish(dataset), policy


def _pipeline(
    source, policy, input_context, batch_size, *, training, augmenting, cache, seed, skip_examples, file_level
):
    # The order, sharding and resumption of `tfmp.input.stream.example_stream`; see its docstring.
    dataset = stream.example_stream(
        source,
        policy,
        input_context,
        training=training,
        seed=seed,
        skip_examples=skip_examples,
        file_level=file_level,
        cache=source.decode_item if cache else None,
    )
    per_example, per_batch = augmenting.per_example, augmenting.mixing is not None
    seed_tensor = tf.constant(seed, tf.int64)

    def prepare(position, item):
        image, label = item if cache else source.decode_item(item)
        if per_example:  # the stream position keys the augmentation: a resumed run augments identically
            key, image_shape = tf.stack([seed_tensor, position]), source.info.image_shape
            image = augmenting.example(image, key, flip_ok=source.flip_ok, image_shape=image_shape)
        # Mixing keys a batch by its first example's position: the position travels with the batch.
        return (position, image, label) if per_batch else (image, label)

    # A cached, un-augmented, unmixed stream is ready as it is: no per-example op left to run.
    if cache and not per_example and not per_batch:
        dataset = dataset.map(lambda position, item: item)
    else:
        dataset = dataset.map(prepare, num_parallel_calls=_AUTOTUNE)
    if not training:
        image_shape = source.info.image_shape
        dataset = dataset.map(lambda image, label: (tf.ensure_shape(image, image_shape), label))
        padding = (tf.zeros(image_shape, tf.float32), tf.constant(-1, tf.int32))  # label -1: counts nowhere
        dataset = stream.pad_to_full_batches(dataset, source.count(), padding, input_context, batch_size)
    dataset = dataset.batch(batch_size, drop_remainder=True)
    if per_batch:
        dataset = augmenting.mix(dataset, seed=seed, num_classes=source.info.num_classes)
    return dataset.prefetch(_AUTOTUNE)


def _synthetic(source, batch_size, training, seed, input_context):
    """One random batch, generated lazily once and cached: no per-step cost, no big constant."""
    height, width, channels = source.info.image_shape

    def make_batch(_):
        key = tf.constant([seed, _CONTENT_SEED], tf.int64)
        images = tf.random.stateless_uniform([batch_size, height, width, channels], key)
        labels = tf.random.stateless_uniform([batch_size], key + 1, maxval=10, dtype=tf.int32)
        return images, labels

    dataset = tf.data.Dataset.range(1).map(make_batch).cache()
    if training:
        return dataset.repeat().prefetch(_AUTOTUNE)
    # About one eval split, in whole steps of this pipeline's replicas (no padding needed).
    pipelines, replicas_per_pipeline = stream.pipelines_and_replicas(input_context)
    examples_per_step = batch_size * replicas_per_pipeline
    steps = math.ceil(math.ceil(source.num_examples / pipelines) / examples_per_step)
    return dataset.repeat(steps * replicas_per_pipeline).prefetch(_AUTOTUNE)
