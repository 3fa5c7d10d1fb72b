"""`Source`: how a data module reads one split, whatever the dataset.

A source is a cheap per-example stream (indices, file paths, still-encoded TFDS records), so
shuffling, sharding and skipping it costs nothing, plus the decoder that turns one item into
tensors. `tfmp.input.stream.example_stream` orders and splits the stream; the task's data
module decodes, augments and batches it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import tensorflow as tf


@dataclasses.dataclass
class Source:
    """One split of one dataset."""

    info: object  # the task's dataset description (DatasetInfo, DetectionInfo)
    num_examples: int  # in this split (0 = unknown, e.g. a TFDS dataset TFDS has no sizes for)
    num_files: int  # files behind the split; FILE sharding needs at least one per pipeline
    examples: Callable  # (file_shard_context | None, shuffle_seed | None) -> cheap-item Dataset
    decode: Callable  # item -> the task's decoded tensors
    shuffle_buffer: int
    flip_ok: bool = True  # a mirrored example is still an example of its class (digits: no)
    # For sources that draw rather than read: decode() makes an example's random numbers, and
    # decode_batch(batch of them) draws a whole batch at once (vectorised: cheap per example).
    decode_batch: Callable | None = None

    def decode_item(self, item):
        """`decode` of one stream item (a tuple item is passed as positional arguments)."""
        return self.decode(*item) if isinstance(item, tuple) else self.decode(item)

    def count(self) -> int:
        """`num_examples`, or when unknown the length of the cheap stream, counted once."""
        if self.num_examples:
            return self.num_examples
        stream = self.examples(None, None)
        return int(stream.reduce(tf.constant(0, tf.int64), lambda count, *_: count + 1))
