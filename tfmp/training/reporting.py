"""What a run tells its user: the run card, a progress bar, TensorBoard and a JSON-lines file.

Only the chief writes files; the other workers get a `Reporter` with `model_dir=None`, which
keeps quiet. Files in the model dir:

    run_card.json      every setting that decides speed and numerics (printed at start too)
    metrics.jsonl      one JSON object per log point: step, split, loss, accuracy, lr, ... and
                       the run's tags (the all-reduce dtype)
    tensorboard/{train,eval}/   the same scalars for `tensorboard --logdir`

The run card is written whole (renamed into place); metrics.jsonl is opened at the first record
(a run that fails at its start leaves none), and before appending, a last line cut short by a
fault is dropped, and so are the records of a killed run past the checkpoint this run resumes
from (`start_step`), which it logs again: the steps never go backwards. A write that fails for a
full disk, a read-only file system, a denied permission or a file-size limit raises
`tfmp.errors.WriteFailed` naming the file (see `tfmp.write_faults`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time

import keras
import numpy as np
import tensorflow as tf
from tensorflow.core.framework import summary_pb2

from tfmp import run_dir, write_faults
from tfmp.errors import WriteFailed

_STEP = re.compile(rb'"step": *(-?[0-9.]+)')  # json.dumps writes it first: no full parse needed
_SCALAR_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
).SerializeToString()


def format_logs(values: dict, separator: str = ": ", joined_by: str = " - ") -> str:
    """`name: 0.1234 - other: [0.5 0.25]`: numbers to 4 decimals, vector or matrix metrics as arrays."""

    def shown(value) -> str:
        if np.ndim(value) == 0:
            return f"{value:.4f}"
        return np.array2string(np.asarray(value), precision=4, separator=", ")

    return joined_by.join(f"{name}{separator}{shown(value)}" for name, value in values.items())


def format_run_card(card: dict) -> str:
    width = max(len(key) for key in card)
    lines = ["tfmp run card"] + [f"  {key:<{width}}  {value}" for key, value in card.items()]
    return "\n".join(lines)


class Reporter:
    """Writes run card, scalars and progress; a no-op writer where `model_dir` is None."""

    def __init__(
        self,
        model_dir: str | None,
        verbose: bool = True,
        tags: dict | None = None,
        start_step: int | None = None,
    ):
        """`start_step`: the step the run resumes from (records past it are dropped); None: the
        first record's step less one (records from that step on are dropped)."""
        self.model_dir = model_dir
        self.start_step = start_step
        self.verbose = verbose
        self.tags = dict(tags or {})  # written as they are into every metrics.jsonl record
        self._writers = {}
        self._metrics_file = None
        self._progress = None

    def run_card(self, card: dict) -> None:
        if self.verbose:
            print(format_run_card(card), flush=True)
        if self.model_dir:
            path = os.path.join(self.model_dir, run_dir.RUN_CARD_FILE)
            with write_faults.guarded("writing the run card", path):
                run_dir.write_text_atomic(path, json.dumps(card, indent=2, default=str))

    def _metrics(self, step: int):
        if self._metrics_file is None:
            path = os.path.join(self.model_dir, run_dir.METRICS_FILE)
            _keep_records_up_to(path, step - 1 if self.start_step is None else self.start_step)
            self._metrics_file = open(path, "a", encoding="utf-8")
        return self._metrics_file

    def _writer(self, split: str):
        if split not in self._writers:
            self._writers[split] = tf.summary.create_file_writer(
                os.path.join(self.model_dir, "tensorboard", split)
            )
        return self._writers[split]

    def scalars(self, step: int, split: str, values: dict) -> None:
        """Logs `values` (name -> number, or a NumPy array: a vector or matrix metric) at `step`
        to metrics.jsonl (arrays as lists) and TensorBoard (numbers only)."""
        if not self.model_dir:
            return
        record = {"step": step, "split": split, "time": round(time.time(), 3), **self.tags}
        record.update({k: np.asarray(v, np.float64).tolist() for k, v in values.items()})
        with write_faults.guarded(f"logging step {step}", os.path.join(self.model_dir, run_dir.METRICS_FILE)):
            self._metrics(step).write(json.dumps(record) + "\n")
            self._metrics(step).flush()
        with write_faults.guarded(f"logging step {step}", os.path.join(self.model_dir, "tensorboard", split)):
            with self._writer(split).as_default(step=step):
                for name, value in values.items():
                    if np.ndim(value):
                        continue  # a vector or matrix: metrics.jsonl has it
                    # tf.summary.scalar lives in the tensorboard package, which TF 2.21 no longer
                    # installs; the raw write op plus the scalars-plugin tag is all it does.
                    tf.summary.write(name, tf.constant(float(value), tf.float32), metadata=_SCALAR_METADATA)

    def start_epoch(self, epoch: int, epochs: int, steps: int) -> None:
        if self.verbose:
            print(f"Epoch {epoch}/{epochs}", flush=True)
            # Non-interactive output (CI, log files) gets one line per update instead of \r.
            self._progress = keras.utils.Progbar(
                steps,
                stateful_metrics=["loss", "accuracy", "examples/s"],
                interval=0.5,
                verbose=1 if sys.stdout.isatty() else 2,
            )

    def progress(self, steps_done: int, values: dict) -> None:
        if self._progress is not None:
            self._progress.update(steps_done, list(values.items()))

    def message(self, text: str) -> None:
        if self.verbose:
            print(text, flush=True)

    def close(self, failing: bool = False) -> None:
        """Flushes and closes the files; `failing=True` (the run is ending on an error already)
        drops a second write fault instead of raising it over the first."""
        try:
            with write_faults.guarded("closing the run's logs", self.model_dir or "."):
                for writer in self._writers.values():
                    writer.flush()
                    writer.close()
                if self._metrics_file:
                    self._metrics_file.close()
        except WriteFailed:
            if not failing:
                raise
        finally:
            self._writers, self._metrics_file = {}, None


def _keep_records_up_to(path: str, last_step: int) -> None:
    """Truncates `path` before its records past `last_step` (records are appended in step order:
    a killed run's last ones, which the resumed run logs again) and a last line a fault cut short
    (it would run into the next record). Read from the end: a long run's file is not read whole."""
    with contextlib.suppress(FileNotFoundError), open(path, "rb+") as file:
        size = keep = file.seek(0, os.SEEK_END)
        for offset, line in _lines_from_end(file, size):
            if line.endswith(b"\n") and _step(line) <= last_step:
                break
            keep = offset
        if keep < size:
            file.truncate(keep)


def _lines_from_end(file, size: int):
    """(offset, line) of the file's lines, the last first, read in blocks from its end."""
    position, rest = size, b""
    while position > 0:
        start = max(0, position - 65536)
        file.seek(start)
        *ended, last = (file.read(position - start) + rest).split(b"\n")
        lines = [line + b"\n" for line in ended] + ([last] if last else [])
        rest = lines.pop(0) if start > 0 else b""  # may begin mid-line: completed by the next block
        offset = start + len(rest) + sum(len(line) for line in lines)
        for line in reversed(lines):
            offset -= len(line)
            yield offset, line
        position = start
    if rest:
        yield 0, rest


def _step(line: bytes) -> float:
    """A metrics.jsonl record's step (a line that is no record counts as step 0: kept)."""
    found = _STEP.search(line)
    return float(found.group(1)) if found else 0
