"""Checkpoints that resume a run exactly where it stopped, written by the chief only.

    checkpoints = Checkpoints(model_dir, is_chief, task_id, global_batch_size=64,
                              model=model, optimizer=optimizer)
    step = checkpoints.restore()      # 0 on a fresh run
    checkpoints.save(step)

A checkpoint holds the model, the optimizer (slots, iteration count and the loss-scale state),
the global step and the global batch size, which together fix the data position: the input
pipeline skips `step * global_batch_size` examples on resume, so a run resumed with another
global batch would continue at a different place in the data; that is refused with both sizes.
A checkpoint that cannot be read (a truncated or overwritten data or index file) is skipped
with a warning for the next older kept one; only when none restores is it a user error.
Every worker must take part in a save under MultiWorkerMirroredStrategy, so non-chief workers
save into a private temporary directory that `close()` removes.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import tensorflow as tf
from absl import logging

from tfmp import run_dir
from tfmp.errors import UsageError

SUBDIR = run_dir.CHECKPOINT_DIR
# What a damaged or mismatched checkpoint raises while being read (a truncated data file gives
# IndexError "Read less bytes than requested" from the reader, not an OpError).
_READ_ERRORS = (tf.errors.OpError, AssertionError, ValueError, IndexError, KeyError, EOFError)


class Checkpoints:
    def __init__(
        self,
        model_dir: str,
        is_chief: bool,
        task_id: int,
        keep: int = 3,
        global_batch_size: int = 0,
        say=logging.warning,
        **objects,
    ):
        self.is_chief = is_chief
        self.model_dir = model_dir
        self.say = say
        if is_chief:
            self.directory = os.path.join(model_dir, SUBDIR)
        else:
            self.directory = tempfile.mkdtemp(prefix=f"tfmp-worker{task_id}-")
        self.global_batch_size = global_batch_size
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        self.batch = tf.Variable(global_batch_size, dtype=tf.int64, trainable=False, name="global_batch_size")
        self.checkpoint = tf.train.Checkpoint(step=self.step, global_batch_size=self.batch, **objects)
        self.manager = tf.train.CheckpointManager(self.checkpoint, self.directory, max_to_keep=keep)

    def _candidates(self) -> list[str]:
        """The chief's kept checkpoints, newest first (non-chief workers read the chief's)."""
        directory = os.path.join(self.model_dir, SUBDIR)
        state = tf.train.get_checkpoint_state(directory)
        if state is None:
            return []
        paths = list(state.all_model_checkpoint_paths) or [state.model_checkpoint_path]
        paths = [path if os.path.isabs(path) else os.path.join(directory, path) for path in paths]
        return sorted(set(paths), key=_number, reverse=True)

    def restore(self) -> int:
        """Restores the newest readable checkpoint; returns the step it holds (0 if none)."""
        candidates = self._candidates()
        skipped = []
        for path in candidates:
            try:
                self.checkpoint.restore(path).assert_existing_objects_matched()
            except _READ_ERRORS as error:
                reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
                skipped.append(f"{os.path.basename(path)} ({reason})")
                self.say(f"skipped checkpoint {path}: cannot be read ({reason}); trying the next older one")
                continue
            self._check_batch(path)
            step = int(self.step.numpy())
            logging.info("restored %s at step %d", path, step)
            return step
        if candidates:
            raise UsageError(
                f"no checkpoint in {os.path.join(self.model_dir, SUBDIR)} can be restored into "
                f"this model/optimizer: {'; '.join(skipped)}; use a fresh --model_dir or the "
                "run's original flags"
            )
        return 0

    def _check_batch(self, path: str) -> None:
        saved = int(self.batch.numpy())
        if saved and self.global_batch_size and saved != self.global_batch_size:
            raise UsageError(
                f"checkpoint {path} (step {int(self.step.numpy())}) was trained with global batch {saved}, "
                f"this run uses {self.global_batch_size}: its step count would point elsewhere in the "
                f"data; resume with --global_batch_size={saved} or start a fresh --model_dir"
            )

    def save(self, step: int) -> str:
        self.step.assign(step)
        self.batch.assign(self.global_batch_size)
        return self.manager.save(checkpoint_number=step)

    def close(self) -> None:
        if not self.is_chief:
            shutil.rmtree(self.directory, ignore_errors=True)


def _number(path: str) -> int:
    try:
        return int(path.rsplit("-", 1)[-1])
    except ValueError:
        return -1
