"""The part of every input pipeline that is not about the examples themselves: who reads what
(sharding), in which order (shuffle, repeat, resume), how eval ends (padding to full batches).

    batch_size, pipelines = per_replica_batch(global_batch_size, input_context)
    policy, why = shard_policy(pipelines, training=True, num_files=source.num_files)
    dataset = example_stream(source, policy, input_context, training=True, seed=1, skip_examples=0)
    ...  # the task decodes, augments and batches (position, item) pairs
    dataset = finish(dataset)

Order: cheap example stream (indices, file paths, still-encoded records) -> [shard early] ->
[decode + cache] -> shuffle -> repeat -> enumerate -> [shard late] -> skip (training), or
enumerate -> [shard early] (eval). Two ways to split a training stream between input pipelines:

- late (DATA, or one file per example, no cache): every pipeline shuffles the same cheap stream
  with the same seed, then takes every n-th example, so each global batch is exactly the one a
  single process would see, on any number of workers;
- early (TFDS file sharding, eval, cache): each pipeline reads only its own part, shuffled on
  its own; cheaper I/O and memory, a different batch composition.

Shuffling and skipping the cheap stream means resuming after N examples decodes none of them.
The stream position numbers each training example (it keys the augmentation, so a resumed run
augments identically); an eval example's position is its index in the split (its id).
"""

from __future__ import annotations

import math

import tensorflow as tf

from tfmp.errors import UsageError
from tfmp.input.source import Source

AUTOTUNE = tf.data.AUTOTUNE


def per_replica_batch(global_batch_size: int, input_context) -> tuple[int, int]:
    """(batch size of one replica, input pipelines) for a distributed input function."""
    if input_context is None:
        return global_batch_size, 1
    try:
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    except ValueError as error:
        raise UsageError(f"{str(error).strip()}; pick a multiple of the replica count") from None
    return batch_size, input_context.num_input_pipelines


def pipelines_and_replicas(input_context) -> tuple[int, int]:
    """(input pipelines, replicas each pipeline feeds) of a distributed input function."""
    if input_context is None:
        return 1, 1
    pipelines = input_context.num_input_pipelines
    return pipelines, max(input_context.num_replicas_in_sync // pipelines, 1)


def shard_policy(pipelines: int, *, training: bool, num_files: int, per_pipeline: bool = False):
    """("OFF" | "FILE" | "DATA", why). `per_pipeline`: each pipeline makes its own data."""
    if pipelines == 1:
        return "OFF", "one input pipeline reads everything"
    if not training:
        return "DATA", "eval: every pipeline must run the same number of batches"
    if per_pipeline:
        return "DATA", "each pipeline generates its own random batch"
    if num_files >= pipelines:
        return "FILE", f"{num_files} files are split between pipelines"
    files = f"only {num_files} files" if num_files else "no files (generated)"
    return "DATA", f"{files} for {pipelines} pipelines: each takes every n-th example"


def _shard(dataset, input_context):
    return dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)


def example_stream(
    source: Source,
    policy: str,
    input_context,
    *,
    training: bool,
    seed: int = 0,
    skip_examples: int = 0,
    file_level: bool = False,
    cache=None,
) -> tf.data.Dataset:
    """(position int64, item) pairs of this pipeline's part of `source` (module docstring).

    `file_level`: the source reads only this pipeline's files itself (TFDS `ReadConfig`).
    `cache(item) -> decoded item`: decode in source order and cache before the shuffle; the
    shuffle buffer is the same, so the order is the same as without cache. An item that is a
    tuple reaches `cache` as one tuple.
    """
    late = training and cache is None and not file_level and policy != "OFF"
    dataset = source.examples(
        input_context if file_level else None, seed if training and file_level else None
    )
    if not training:
        dataset = dataset.enumerate()
    if policy != "OFF" and not late and not file_level:
        dataset = _shard(dataset, input_context)
    if cache is not None:
        if training:
            decode = lambda *item: cache(item if len(item) > 1 else item[0])  # noqa: E731
        else:
            decode = lambda position, item: (position, cache(item))  # noqa: E731
        dataset = dataset.map(decode, num_parallel_calls=AUTOTUNE).cache()
    if not training:
        return dataset
    dataset = dataset.shuffle(source.shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
    dataset = dataset.repeat().enumerate()
    if late:
        dataset = _shard(dataset, input_context)
    return dataset.skip(skip_examples)


def pad_to_full_batches(dataset, total: int, padding, input_context, batch_size: int):
    """Appends `padding` elements to an eval shard: ceil(total / pipelines) examples rounded up
    to whole steps of its replicas, so every replica of every pipeline runs the same number of
    full batches (the padding rows must count nowhere)."""
    pipelines, replicas_per_pipeline = pipelines_and_replicas(input_context)
    examples_per_step = batch_size * replicas_per_pipeline
    steps = math.ceil(math.ceil(total / pipelines) / examples_per_step)
    padding = tf.data.Dataset.from_tensors(padding).repeat()
    return dataset.concatenate(padding).take(steps * examples_per_step)


def finish(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """Deterministic order (parallel maps keep it: reproducible runs) and no second sharding:
    tfmp shards itself, tf.distribute must not shard again."""
    options = tf.data.Options()
    options.deterministic = True
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return dataset.with_options(options)


def with_threads(dataset: tf.data.Dataset, threads: int) -> tf.data.Dataset:
    """The dataset on a private tf.data thread pool of `threads` threads (0: the shared default)."""
    if not threads:
        return dataset
    options = tf.data.Options()
    options.threading.private_threadpool_size = threads
    return dataset.with_options(options)
