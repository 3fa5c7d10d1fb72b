"""Checkpoints that resume a run exactly where it stopped, written by the chief only.

    checkpoints = Checkpoints(model_dir, is_chief, task_id, model=model, optimizer=optimizer)
    step = checkpoints.restore()      # 0 on a fresh run
    checkpoints.save(step)

A checkpoint holds the model, the optimizer (slots, iteration count and the loss-scale state)
and the global step, which also fixes the data position: the input pipeline skips
`step * global_batch_size` examples on resume. Every worker must take part in a save under
MultiWorkerMirroredStrategy, so non-chief workers save into a private temporary directory that
`close()` removes.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import tensorflow as tf
from absl import logging

from tfmp.errors import UsageError

SUBDIR = "checkpoints"


class Checkpoints:
    def __init__(self, model_dir: str, is_chief: bool, task_id: int, keep: int = 3, **objects):
        self.is_chief = is_chief
        if is_chief:
            self.directory = os.path.join(model_dir, SUBDIR)
        else:
            self.directory = tempfile.mkdtemp(prefix=f"tfmp-worker{task_id}-")
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        self.checkpoint = tf.train.Checkpoint(step=self.step, **objects)
        self.manager = tf.train.CheckpointManager(self.checkpoint, self.directory, max_to_keep=keep)

    def restore(self, model_dir: str | None = None) -> int:
        """Restores the newest checkpoint of the chief's directory; returns the step it holds."""
        # Non-chief workers read the chief's checkpoint (a shared file system, or the same host).
        directory = os.path.join(model_dir, SUBDIR) if model_dir else self.directory
        latest = tf.train.latest_checkpoint(directory)
        if latest is None:
            return 0
        try:
            self.checkpoint.restore(latest).assert_existing_objects_matched()
        except (tf.errors.OpError, AssertionError, ValueError) as error:
            first_line = str(error).strip().splitlines()[0][:300]
            raise UsageError(f"checkpoint {latest} cannot be restored into this model/optimizer "
                             f"({first_line}); use a fresh --model_dir or the run's original "
                             "flags") from None
        step = int(self.step.numpy())
        logging.info("restored %s at step %d", latest, step)
        return step

    def save(self, step: int) -> str:
        self.step.assign(step)
        return self.manager.save(checkpoint_number=step)

    def close(self) -> None:
        if not self.is_chief:
            shutil.rmtree(self.directory, ignore_errors=True)
