"""Checkpoints that resume a run exactly where it stopped, written by the chief only.

    checkpoints = Checkpoints(model_dir, is_chief, task_id, global_batch_size=64,
                              model=model, optimizer=optimizer)
    step = checkpoints.restore()      # 0 on a fresh run
    checkpoints.save(step)
    checkpoints.saved_step            # the newest complete checkpoint's step (None: none yet)

A checkpoint holds the model (with every optimizer it holds, e.g. a GAN's two, and its seed
generators' states), the optimizer (slots, iteration count and the loss-scale state), the global
step and the global batch size, which together fix the data position: the input
pipeline skips `step * global_batch_size` examples on resume, so a run resumed with another
global batch would continue at a different place in the data; that is refused with both sizes.
A checkpoint that cannot be read (a truncated or overwritten data or index file) is skipped
with a warning for the next older kept one; only when none restores is it a user error. A
damaged or missing state file (`checkpoints/checkpoint`, which lists the kept checkpoints) is
named in a warning and the `ckpt-N` files on disk are tried instead, newest first; the damaged
file is kept as `checkpoint.damaged` when the next save writes a new one.
Every worker must take part in a save under MultiWorkerMirroredStrategy, so non-chief workers
save into a private temporary directory that `close()` removes.
A save that fails for a full disk, a read-only file system, a denied permission or a file-size
limit raises `tfmp.errors.WriteFailed` naming the step and the file; TensorFlow writes a save's
files into `ckpt-N_temp/` and renames them only once all are written, so the older checkpoints
and the state file are whole, and the temporary folder is removed at once (and by the next
start, `run_dir.remove_leftovers`, after a kill).
"""

from __future__ import annotations

import contextlib
import glob
import logging as python_logging
import os
import shutil
import signal
import tempfile
import threading

import tensorflow as tf
from absl import logging

from tfmp import run_dir, write_faults
from tfmp.errors import Preempted, UsageError

SUBDIR = run_dir.CHECKPOINT_DIR
STATE_FILE = "checkpoint"  # tf.train.CheckpointManager's list of kept checkpoints
RANDOM_STATE = "random_state"  # the seed generators' states (`_untracked_variables`)
# What a damaged or mismatched checkpoint raises while being read (a truncated data file gives
# IndexError "Read less bytes than requested" from the reader, not an OpError).
_READ_ERRORS = (tf.errors.OpError, AssertionError, ValueError, IndexError, KeyError, EOFError)


def has_checkpoint(model_dir: str) -> bool:
    """Whether `model_dir` holds anything a run would resume from (a state file or ckpt-N files)."""
    directory = os.path.join(os.path.expanduser(model_dir), SUBDIR)
    return os.path.isfile(os.path.join(directory, STATE_FILE)) or bool(_files_on_disk(directory))


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
        # Absolute once: paths read back from the state file are joined onto it, and a later
        # chdir must not move the run.
        self.model_dir = os.path.abspath(os.path.expanduser(model_dir))
        self.location = os.path.join(self.model_dir, SUBDIR)  # the chief's, on every worker
        self.say = say
        if is_chief:
            self.directory = self.location
        else:
            self.directory = tempfile.mkdtemp(prefix=f"tfmp-worker{task_id}-")
        self.global_batch_size = global_batch_size
        self.keep = keep
        self.saved_step: int | None = None
        self._damaged_state = False
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        self.batch = tf.Variable(global_batch_size, dtype=tf.int64, trainable=False, name="global_batch_size")
        self._objects = dict(objects, step=self.step, global_batch_size=self.batch)
        self._random_state = _untracked_variables(objects["model"]) if "model" in objects else []
        random_state = {RANDOM_STATE: self._random_state} if self._random_state else {}
        self.checkpoint = tf.train.Checkpoint(**self._objects, **random_state)
        self._manager = None  # made at the first save: it reads (and then rewrites) the state file

    def _candidates(self) -> list[str]:
        """The chief's kept checkpoints, newest first (non-chief workers read the chief's).

        The state file's paths come back already joined onto the directory. Without a readable
        state file, the ckpt-N files on disk, newest first.
        """
        state_file = os.path.join(self.location, STATE_FILE)
        if not os.path.isfile(state_file):
            paths = _files_on_disk(self.location)
            if paths:
                self.say(f"{state_file} is missing; trying the checkpoint files on disk, newest first")
            return paths
        try:
            with _quiet_tensorflow():  # it logs a parse error in two lines; one is said below
                state = tf.train.get_checkpoint_state(self.location)
        except ValueError:  # parsed, but names no checkpoint
            state = None
        if state is not None:
            paths = list(state.all_model_checkpoint_paths) or [state.model_checkpoint_path]
            return sorted(set(paths), key=_number, reverse=True)
        self._damaged_state = True
        paths = _files_on_disk(self.location)
        self.say(
            f"checkpoint state file {state_file} is damaged (unreadable); trying the "
            f"{len(paths)} checkpoint file(s) on disk, newest first"
        )
        return paths

    def restore(self) -> int:
        """Restores the newest readable checkpoint; returns the step it holds (0 if none)."""
        candidates = self._candidates()
        skipped = []
        for path in candidates:
            reason = self._restore_from(path)
            if reason is not None:
                skipped.append(f"{os.path.basename(path)} ({reason})")
                self.say(f"skipped checkpoint {path}: cannot be read ({reason}); trying the next older one")
                continue
            self._check_batch(path)
            step = int(self.step.numpy())
            self.saved_step = step
            logging.info("restored %s at step %d", path, step)
            return step
        if candidates:
            raise UsageError(
                f"no checkpoint in {self.location} can be restored into "
                f"this model/optimizer: {'; '.join(skipped)}; use a fresh --model_dir or the "
                "run's original flags"
            )
        return 0

    def _restore_from(self, path: str) -> str | None:
        """Restores `path`; None, or why it cannot be (its first line)."""
        checkpoint = self.checkpoint
        try:
            if self._random_state and not _holds(path, RANDOM_STATE):
                # Written before checkpoints held the seed generators' states: all else is restored.
                self.say(f"checkpoint {path} holds no random state: the seed generators start afresh")
                checkpoint = tf.train.Checkpoint(**self._objects)
            status = checkpoint.restore(path)
            status.expect_partial()  # mismatches raise below; no warnings when it is collected
            status.assert_existing_objects_matched()
            return None
        except _READ_ERRORS as error:
            return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]

    def _check_batch(self, path: str) -> None:
        saved = int(self.batch.numpy())
        if saved and self.global_batch_size and saved != self.global_batch_size:
            raise UsageError(
                f"checkpoint {path} (step {int(self.step.numpy())}) was trained with global batch {saved}, "
                f"this run uses {self.global_batch_size}: its step count would point elsewhere in the "
                f"data; resume with --global_batch_size={saved} or start a fresh --model_dir"
            )

    @property
    def manager(self) -> tf.train.CheckpointManager:
        if self._manager is None:
            state_file = os.path.join(self.directory, STATE_FILE)
            if self.is_chief and self._damaged_state and os.path.isfile(state_file):
                # The manager would fail on it or overwrite it; kept for whoever looks into it.
                os.replace(state_file, state_file + ".damaged")
            self._manager = tf.train.CheckpointManager(self.checkpoint, self.directory, max_to_keep=self.keep)
        return self._manager

    def save(self, step: int) -> str:
        self.step.assign(step)
        self.batch.assign(self.global_batch_size)
        try:
            with write_faults.guarded(f"saving the checkpoint of step {step}", self.directory):
                path = self.manager.save(checkpoint_number=step)
        except BaseException:
            shutil.rmtree(os.path.join(self.directory, f"ckpt-{step}_temp"), ignore_errors=True)
            raise
        self.saved_step = step  # only now: the state file names it once its files are written
        return path

    def save_model(self, model, resume_command: str | None = None) -> None:
        """The chief's model.keras at the end of a run, written whole or not at all; a SIGTERM while
        it is written (a scheduler's preemption notice) stops it as a preemption does, with the
        temporary file removed and one line: the checkpoint of the last step is saved, and
        `resume_command` (which finds training done and saves the model) writes it."""
        path = os.path.join(self.model_dir, run_dir.MODEL_FILE)
        rerun = f"resume with: {resume_command}" if resume_command else "run the same command again"
        preempted = Preempted(
            f"SIGTERM while {path} was written: it was not (no half-written file is left); the checkpoint "
            f"of step {self.saved_step} in {self.location} holds the trained model; {rerun} to write it"
        )
        with _raising_on_sigterm(preempted), write_faults.guarded("saving the model", path):
            with run_dir.atomic_path(path) as temporary:
                model.save(temporary)

    def close(self) -> None:
        if not self.is_chief:
            shutil.rmtree(self.directory, ignore_errors=True)


def _holds(path: str, name: str) -> bool:
    """Whether the checkpoint at `path` has an object `name` at its top."""
    return any(key.split("/", 1)[0] == name for key, _ in tf.train.list_variables(path))


def _untracked_variables(model) -> list:
    """The model's variables its object graph does not reach, which a checkpoint of the model
    alone would leave out: Keras' seed generators' states (a Dropout's, a GAN's noise), so a
    resumed run draws the random numbers the uninterrupted one would have."""
    reached = {id(item) for item in tf.train.TrackableView(model).descendants()}
    return [variable for variable in model.variables if id(variable) not in reached]


@contextlib.contextmanager
def _raising_on_sigterm(error: Exception):
    """SIGTERM raises `error` in the main thread meanwhile (instead of ending the process at once,
    which would leave no line and a temporary file); elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise error

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _files_on_disk(directory: str) -> list[str]:
    """The ckpt-N prefixes in `directory` that have an index file, newest first."""
    paths = [
        path[: -len(".index")] for path in glob.glob(os.path.join(glob.escape(directory), "ckpt-*.index"))
    ]
    return sorted((path for path in paths if _number(path) >= 0), key=_number, reverse=True)


@contextlib.contextmanager
def _quiet_tensorflow():
    logger = python_logging.getLogger("tensorflow")
    level = logger.level
    logger.setLevel(python_logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _number(path: str) -> int:
    try:
        return int(path.rsplit("-", 1)[-1])
    except ValueError:
        return -1
