"""What a run tells its user: the run card, a progress bar, TensorBoard and a JSON-lines file.

Only the chief writes files; the other workers get a `Reporter` with `model_dir=None`, which
keeps quiet. Files in the model dir:

    run_card.json      every setting that decides speed and numerics (printed at start too)
    metrics.jsonl      one JSON object per log point: step, split, loss, accuracy, lr, ...
    tensorboard/{train,eval}/   the same scalars for `tensorboard --logdir`
"""

from __future__ import annotations

import json
import os
import sys
import time

import keras
import tensorflow as tf
from tensorflow.core.framework import summary_pb2

from tfmp import run_dir

_SCALAR_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
).SerializeToString()


def format_run_card(card: dict) -> str:
    width = max(len(key) for key in card)
    lines = ["tfmp run card"] + [f"  {key:<{width}}  {value}" for key, value in card.items()]
    return "\n".join(lines)


class Reporter:
    """Writes run card, scalars and progress; a no-op writer where `model_dir` is None."""

    def __init__(self, model_dir: str | None, verbose: bool = True):
        self.model_dir = model_dir
        self.verbose = verbose
        self._writers = {}
        self._metrics_file = None
        self._progress = None
        if model_dir:
            self._metrics_file = open(os.path.join(model_dir, run_dir.METRICS_FILE), "a", encoding="utf-8")

    def run_card(self, card: dict) -> None:
        if self.verbose:
            print(format_run_card(card), flush=True)
        if self.model_dir:
            with open(os.path.join(self.model_dir, run_dir.RUN_CARD_FILE), "w", encoding="utf-8") as file:
                json.dump(card, file, indent=2, default=str)

    def _writer(self, split: str):
        if split not in self._writers:
            self._writers[split] = tf.summary.create_file_writer(
                os.path.join(self.model_dir, "tensorboard", split)
            )
        return self._writers[split]

    def scalars(self, step: int, split: str, values: dict) -> None:
        """Logs `values` (name -> number) at `step` to metrics.jsonl and TensorBoard."""
        if not self.model_dir:
            return
        record = {"step": step, "split": split, "time": round(time.time(), 3)}
        record.update({k: float(v) for k, v in values.items()})
        self._metrics_file.write(json.dumps(record) + "\n")
        self._metrics_file.flush()
        with self._writer(split).as_default(step=step):
            for name, value in values.items():
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

    def close(self) -> None:
        for writer in self._writers.values():
            writer.flush()
            writer.close()
        if self._metrics_file:
            self._metrics_file.close()
