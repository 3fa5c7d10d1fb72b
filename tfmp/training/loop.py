"""The one training loop: epochs, host calls, evaluation, checkpoints, preemption, reporting.

`tfmp.fit` (a user's compiled model) and `train.train_and_evaluate` (the apps) both end here:

    result = Loop(engine, data_for_epoch, settings, checkpoints=..., reporter=...).run(start_step)

Each host call runs up to `steps_per_execution` steps (`Engine.train`), cut short at epoch ends,
checkpoint steps and the steps where a hook (pruning) must act. Per epoch: the model's metrics
are averaged from the epoch's start (as Keras reports them), `evaluate()` runs if given, a
checkpoint is saved, and Keras callbacks see the same `logs` that `model.fit` would give them.

Stopping: SIGTERM (and ^C, SIGINT, with `stop_on_interrupt=True`, as the apps do) makes every
worker save a checkpoint at the next step boundary and raise `Preempted`, whose message says
which step was saved and the `resume_command`. A second signal stops at once, and so does a
first one on a single worker before its first step finished (nothing trained yet to save),
each with one line naming the checkpoint a resume starts from (see `_StopSignals`).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import keras
from absl import logging

from tfmp import compat, precision
from tfmp.distribute import strategies as distribute
from tfmp.errors import EXIT_PREEMPTED, NonFiniteInput, PeerLost, Preempted, TrainingDiverged
from tfmp.precision import loss_scaling
from tfmp.training.checkpoint import Checkpoints
from tfmp.training.engine import Engine
from tfmp.training.reporting import Reporter, format_logs


class StepHook(Protocol):
    """Something that acts between host calls at chosen steps (e.g. pruning's mask updates)."""

    def next_update_step(self, step: int) -> int | None: ...

    def update(self, step: int) -> None: ...


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    total_steps: int
    steps_per_epoch: int
    global_batch_size: int
    steps_per_execution: int = 1
    checkpoint_every: int = 0  # steps; 0: at every epoch end only
    log_every: int = 50
    learning_rate: Callable[[int], float] | None = None  # for the logs
    validation_freq: int | list = 1  # as Keras: every Nth epoch, or the 1-based epochs listed
    verbose: int | str = 0  # Keras' progress bar (ProgbarLogger) for 1, 2 and "auto"; 0: none


@dataclasses.dataclass
class LoopResult:
    step: int
    last_eval: dict | None
    history: keras.callbacks.History
    examples_per_sec: float | None


class Loop:
    """Runs `settings.total_steps` steps of `engine` on the batches `data_for_epoch` yields.

    `data_for_epoch(epoch, steps_done_in_epoch)` returns an iterator of distributed batches
    positioned at that step; it is called at each epoch start (it may return one long-lived
    iterator for an endless stream). `evaluate()` returns a metrics dict (or None to skip).
    """

    def __init__(
        self,
        engine: Engine,
        data_for_epoch: Callable[[int, int], Iterator],
        settings: LoopSettings,
        *,
        reporter: Reporter,
        checkpoints: Checkpoints | None = None,
        evaluate: Callable[[], dict | None] | None = None,
        hooks: tuple = (),
        callbacks: list | None = None,
        scalars: Callable[[], dict] | None = None,
        resume_command: str | None = None,
        stop_on_interrupt: bool = False,
    ):
        self.engine = engine
        self.data_for_epoch = data_for_epoch
        self.settings = settings
        self.reporter = reporter
        self.checkpoints = checkpoints
        self.evaluate = evaluate
        self.hooks = tuple(hooks)
        self.extra_scalars = scalars or (lambda: {})
        self.resume_command = resume_command
        self.stop_signals = (signal.SIGTERM, signal.SIGINT) if stop_on_interrupt else (signal.SIGTERM,)
        self.epochs = -(-settings.total_steps // settings.steps_per_epoch)
        self.callbacks = keras.callbacks.CallbackList(
            callbacks,
            add_history=True,
            add_progbar=settings.verbose != 0,
            model=engine.model,
            verbose=settings.verbose,
            epochs=self.epochs,
            steps=settings.steps_per_epoch,
        )
        # With Keras' TerminateOnNaN a non-finite loss ends the run as model.fit's would (it sees
        # the NaN in the batch logs and stops training); otherwise tfmp raises TrainingDiverged.
        self.terminate_on_nan = any(
            isinstance(item, keras.callbacks.TerminateOnNaN) for item in callbacks or ()
        )
        self.optimizer = engine.optimizer
        self.dynamic_scaling = isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
        self._steady_examples, self._steady_seconds, self._first_call = 0, 0.0, True

    def run(self, start_step: int) -> LoopResult:
        step, last_eval = start_step, None
        single_worker = distribute.describe(self.engine.strategy).workers == 1
        preemption = _StopSignals(self.stop_signals, self._resume_clause, single_worker)
        try:
            self.engine.model.stop_training = False
            self.callbacks.on_train_begin()
            step = self._restored_by_callback(step)
            for hook in self.hooks:
                if hook.next_update_step(step) == step:
                    hook.update(step)
            ran = False
            while step < self.settings.total_steps and not self.engine.model.stop_training:
                step, last_eval = self._epoch(step, preemption)
                ran = True
            if self.evaluate is not None and not ran:  # resumed a finished run
                last_eval = self._evaluate(step)
        except distribute.PEER_FAILURES as error:
            peer = distribute.lost_peer(error, self.engine.strategy)
            if peer is None:
                raise
            raise PeerLost(f"{peer}; training stopped, {self._resume_clause()}") from None
        finally:
            preemption.restore()
        self.callbacks.on_train_end()
        throughput = self._steady_examples / self._steady_seconds if self._steady_seconds else None
        return LoopResult(step, last_eval, self.engine.model.history, throughput)

    def _restored_by_callback(self, step: int) -> int:
        """Where a `keras.callbacks.BackupAndRestore` that restored the weights in on_train_begin
        says the run stopped (an epoch start); a later checkpoint of tfmp's own wins."""
        restored = compat.restored_epoch(self.engine.model)
        compat.clear_restored_epoch(self.engine.model)
        return max(step, (restored or 0) * self.settings.steps_per_epoch)

    def _epoch(self, step: int, preemption) -> tuple[int, dict | None]:
        settings = self.settings
        epoch = step // settings.steps_per_epoch
        epoch_start = epoch * settings.steps_per_epoch
        epoch_end = min(epoch_start + settings.steps_per_epoch, settings.total_steps)
        self.reporter.start_epoch(epoch + 1, self.epochs, epoch_end - epoch_start)
        self.callbacks.on_epoch_begin(epoch)
        self.engine.reset_metrics()
        iterator = self.data_for_epoch(epoch, step - epoch_start)
        logs, log_step, log_started = {}, step, time.perf_counter()
        while step < epoch_end:
            num_steps = self._steps_in_call(step, epoch_end)
            self.callbacks.on_train_batch_begin(step - epoch_start)
            logs, seconds, num_steps = self._call(iterator, step, num_steps, preemption)
            step += num_steps
            for hook in self.hooks:
                if hook.next_update_step(step) == step:
                    hook.update(step)
            self.reporter.progress(
                step - epoch_start, {**logs, "examples/s": num_steps * settings.global_batch_size / seconds}
            )
            self.callbacks.on_train_batch_end(step - epoch_start - 1, logs)
            if step - log_step >= settings.log_every or step == epoch_end:
                elapsed = time.perf_counter() - log_started
                self._log_scalars(step, logs, (step - log_step) * settings.global_batch_size / elapsed)
                log_step, log_started = step, time.perf_counter()
            if settings.checkpoint_every and step % settings.checkpoint_every == 0 and step < epoch_end:
                self._save(step)
            if self.engine.model.stop_training:  # a callback asked (EarlyStopping, TerminateOnNaN, ...)
                break
        validate = self.evaluate is not None and _validates(epoch, settings.validation_freq)
        last_eval = self._evaluate(step) if validate else None
        self._save(step)
        epoch_logs = dict(logs)
        epoch_logs.update({f"val_{name}": value for name, value in (last_eval or {}).items()})
        self.callbacks.on_epoch_end(epoch, epoch_logs)
        return step, last_eval

    def _steps_in_call(self, step: int, epoch_end: int) -> int:
        """Up to steps_per_execution, ending at the epoch end, a checkpoint or a hook's step."""
        stops = [epoch_end, step + self.settings.steps_per_execution]
        if self.settings.checkpoint_every:
            stops.append(step + self.settings.checkpoint_every - step % self.settings.checkpoint_every)
        for hook in self.hooks:
            next_step = hook.next_update_step(step + 1)
            if next_step is not None:
                stops.append(next_step)
        return max(1, min(stops) - step)

    def _call(self, iterator, step: int, num_steps: int, preemption) -> tuple[dict, float, int]:
        """(logs, seconds, steps run) of one host call of up to `num_steps` steps."""
        started = time.perf_counter()
        result = self.engine.train(iterator, num_steps, stop_requested=preemption.received)
        preemption.trained = True
        seconds = time.perf_counter() - started
        step += num_steps
        if result.stop_requests:
            # Every worker sees the same reduced value, so all save at this step.
            self._save(step)
            # A peer only learns that some worker asked (one summed number): SIGTERM, the
            # preemption notice, is what reaches one worker alone (^C reaches a terminal's all).
            who = f"{preemption.name or 'SIGTERM'} on a worker"
            if self.checkpoints is None:
                raise Preempted(f"{who}: stopped at step {step}; nothing saved (no model_dir)")
            raise Preempted(
                f"{who}: checkpoint saved at step {step} in {self.checkpoints.location}; {self._resume_how()}"
            )
        if not self._first_call:  # the first call traces and compiles: not throughput
            self._steady_examples += num_steps * self.settings.global_batch_size
            self._steady_seconds += seconds
        self._first_call = False
        if result.halted_at and self.terminate_on_nan:
            # The step was not applied (tfmp never applies one); Keras' callback sees its loss.
            return {**result.metrics, "loss": float("nan")}, seconds, result.halted_at
        if result.halted_at:
            self._stop_on_nonfinite(step - num_steps + result.halted_at, result.nonfinite_inputs)
        if self.dynamic_scaling:
            self._check_loss_scale(step, result.skipped_in_a_row)
        return result.metrics, seconds, num_steps

    def _stop_on_nonfinite(self, bad_step: int, nonfinite_inputs: tuple) -> None:
        """Raises for the step whose numbers were not finite; the engine applied neither it nor
        any later step, so the model holds the weights of the step before."""
        if nonfinite_inputs:
            raise NonFiniteInput(
                f"the training data's {' and '.join(nonfinite_inputs)} hold NaN or inf at step {bad_step}: "
                f"training stopped, the model keeps its weights of step {bad_step - 1}; {self._kept()}"
                "fix or drop the non-finite values (e.g. dataset.filter with tf.math.is_finite) and run again"
            )
        compute = ", ".join(sorted(precision.model_compute_dtypes(self.engine.model)))
        mode = precision.loss_scale_mode(self.optimizer)
        # A fixed scale too large for float16's gradients overflows however small the rate.
        fix = (
            "lower the loss scale or use --loss_scale=dynamic"
            if mode.startswith("fixed")
            else "lower the learning rate"
        )
        raise TrainingDiverged(
            f"loss became non-finite at step {bad_step} computing in {compute} (loss scale: {mode}; the "
            f"inputs were finite); training stopped, the model keeps its weights of step {bad_step - 1}; "
            f"{self._kept()}{fix}"
        )

    def _check_loss_scale(self, step: int, skipped_in_a_row: int | None) -> None:
        """Stops a run whose dynamic loss scale fell below 1 (its floor: the gradients overflow
        float16 even unscaled) or that skipped `skip_limit` steps in a row. Non-finite inputs
        stopped the run at their step already, so these steps had finite inputs."""
        scale = precision.current_loss_scale(self.optimizer)
        limit = loss_scaling.skip_limit(self.optimizer)
        if scale >= 1.0 and (skipped_in_a_row is None or skipped_in_a_row < limit):
            return
        streak = "" if skipped_in_a_row is None else f"{skipped_in_a_row} step(s) in a row "
        if scale < 1.0:
            why = f"loss scale fell below 1, its floor: now {scale:g}): the model overflows float16 even at scale 1"
        else:  # a scale that had grown far: every one tried since overflowed
            why = (
                f"{limit} in a row is the limit; loss scale now {scale:g}): it overflows at every scale tried"
            )
        raise TrainingDiverged(
            f"float16 loss scaling skipped {streak}up to step {step} for non-finite gradients from finite inputs "
            f"({why}; training stopped, {self._kept()}keep the overflowing layers in float32 "
            "(tfmp.precision.diagnose names them), train in mixed_bfloat16, or lower the learning rate"
        )

    def _kept(self) -> str:
        """Which checkpoint a diverged run keeps (none may exist yet)."""
        if self.checkpoints is None:
            return ""
        if self.checkpoints.saved_step is None:
            return f"no checkpoint was saved yet in {self.checkpoints.location}; "
        return (
            f"the checkpoint of step {self.checkpoints.saved_step} in {self.checkpoints.location} is kept; "
        )

    def _resume_how(self) -> str:
        if self.resume_command:
            return f"resume with: {self.resume_command}"
        return "run the same command again to resume"

    def _resume_clause(self) -> str:
        """What a resume starts from now (said by `_StopSignals` when it stops at once)."""
        if self.checkpoints is None:
            return "nothing is saved (no model_dir)"
        if self.checkpoints.saved_step is None:
            rerun = f": {self.resume_command}" if self.resume_command else ""
            return f"no checkpoint is saved in {self.checkpoints.location} yet, so a rerun starts from step 0{rerun}"
        return (
            f"a resume starts from the checkpoint of step {self.checkpoints.saved_step} in "
            f"{self.checkpoints.location}; {self._resume_how()}"
        )

    def _log_scalars(self, step: int, logs: dict, examples_per_sec: float) -> None:
        values = dict(logs)
        if self.settings.learning_rate is not None:
            values["learning_rate"] = float(self.settings.learning_rate(step - 1))
        values["loss_scale"] = precision.current_loss_scale(self.optimizer)
        values["examples_per_sec"] = examples_per_sec
        values.update(self.extra_scalars())
        self.reporter.scalars(step, "train", values)

    def _evaluate(self, step: int) -> dict | None:
        results = self.evaluate()
        if results is None:
            return None
        self.reporter.scalars(step, "eval", results)
        self.reporter.message("  eval: " + format_logs(results, separator=" ", joined_by=", "))
        return results

    def _save(self, step: int) -> None:
        if self.checkpoints is not None:
            self.checkpoints.save(step)


def _validates(epoch: int, validation_freq) -> bool:
    """Keras' `_should_eval`: every `validation_freq`-th epoch, or the (1-based) epochs listed."""
    if isinstance(validation_freq, int):
        return (epoch + 1) % validation_freq == 0
    return epoch + 1 in validation_freq


class _StopSignals:
    """Notes SIGTERM (a scheduler's preemption notice), and SIGINT if asked, instead of dying mid-step.

    The first signal asks every worker to checkpoint after the step it is in (Engine.train
    reduces the request over the workers). A second one stops the process at once (exit
    128 + the signal's number), and so does a first one on a single worker that has not
    finished a step yet (exit 42: nothing trained to save, the checkpoint it restored is still
    the newest), each with one line saying what a resume starts from. Another kind of signal
    within a second of the first is the same request by another route, not a second one: ^C
    in a terminal reaches a launched worker directly (SIGINT) and as the launcher's SIGTERM.
    Python runs handlers only between the main thread's bytecodes, and that thread sits
    inside TensorFlow for a whole step (forever, if the step hangs), so a thread woken through
    `signal.set_wakeup_fd` acts instead; the Python handlers do nothing.
    """

    SAME_REQUEST_SECONDS = 1.0

    def __init__(
        self,
        signums,
        resume_clause: Callable[[], str],
        single_worker: bool,
        exit=os._exit,
        clock=time.monotonic,
    ):
        self.received = False
        self.name = None  # the signal this worker got
        self.trained = False  # set by the loop once a step finished
        self.seen = 0  # signals acted on, for tests
        self._resume_clause, self._single_worker = resume_clause, single_worker
        self._exit, self._clock, self._first_at = exit, clock, 0.0
        self._previous, self._thread = {}, None
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous = {signum: signal.signal(signum, _noted_by_thread) for signum in signums}
        self._previous_wakeup = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="tfmp-stop-signals", daemon=True)
        self._thread.start()

    def _watch(self):
        while True:
            byte = os.read(self._read_fd, 1)
            if not byte or byte[0] == 0:  # restore()'s sentinel: no signal has number 0
                return
            if byte[0] in self._previous:
                self._note(signal.Signals(byte[0]))

    def _note(self, signum: signal.Signals) -> None:
        again = "press ^C again" if signum == signal.SIGINT else f"send {signum.name} again"
        self.seen += 1
        if (
            self.received
            and signum.name != self.name
            and self._clock() - self._first_at < self.SAME_REQUEST_SECONDS
        ):
            return
        if self.received:
            self._stop_now(
                f"interrupted: a second {signum.name}, stopped at once without saving; {self._resume_clause()}",
                128 + signum,
            )
        elif self._single_worker and not self.trained:
            self._stop_now(
                f"preempted: {signum.name} before the first step finished, nothing trained to save; "
                f"{self._resume_clause()}",
                EXIT_PREEMPTED,
            )
        else:
            self.name, self.received, self._first_at = signum.name, True, self._clock()
            logging.warning(
                "%s received: saving a checkpoint with every worker after this step, then stopping "
                "(exit 42); %s to stop at once",
                signum.name,
                again,
            )

    def _stop_now(self, message: str, code: int) -> None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        self._exit(code)

    def restore(self):
        if self._thread is None:
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(self._previous_wakeup)
        os.write(self._write_fd, b"\0")
        self._thread.join()
        os.close(self._read_fd)
        os.close(self._write_fd)
        self._thread = None


def _noted_by_thread(signum, frame):
    """The Python-level handler; `_StopSignals._watch` acts on the signal."""
