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

import math

import tensorflow as tf
from absl import logging

from tfmp.classification import augmentation, sources
from tfmp.classification.sources import (  # noqa: F401  (re-exported: callers use data.<name>)
    DIGITS_CLASS_NAMES,
    DIGITS_EVAL_EXAMPLES,
    DIGITS_TRAIN_EXAMPLES,
    IMAGE_EXTENSIONS,
    SHAPES_CLASS_NAMES,
    SHAPES_EVAL_EXAMPLES,
    SHAPES_TRAIN_EXAMPLES,
    SPLITS,
    SYNTHETIC_EVAL_EXAMPLES,
    SYNTHETIC_TRAIN_EXAMPLES,
    TFDS_SHUFFLE_BUFFER,
    DatasetInfo,
)
from tfmp.input import image_files, stream
from tfmp.input import spec as specs
from tfmp.input.mixing import Mixing
from tfmp.input.source import Source
from tfmp.input.stream import with_threads  # noqa: F401  (re-exported: callers use data.with_threads)

DEFAULT_IMAGE_SIZE = {"shapes": 32, "synthetic": 32, "folder": 64}
MIN_IMAGE_SIZE, MAX_IMAGE_SIZE = 8, 1024
_CHOICES = ["shapes", "digits", "synthetic", "tfds:<name>", "folder:<path>"]
_AUTOTUNE = stream.AUTOTUNE


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
        return sources.tfds(spec, arg, split, size, data_dir, verify)
    if kind == "folder":
        return sources.folder(spec, arg, split, size, verify, max_pixels)
    return sources.builtin(spec, kind, split, size)


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
        key = tf.constant([seed, sources.CONTENT_SEED], tf.int64)
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
