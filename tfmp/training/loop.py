"""The one training loop: epochs, host calls, evaluation, checkpoints, preemption, reporting.

`tfmp.fit` (a user's compiled model) and `train.train_and_evaluate` (the apps) both end here:

    result = Loop(engine, data_for_epoch, settings, checkpoints=..., reporter=...).run(start_step)

Each host call runs up to `steps_per_execution` steps (`Engine.train`), cut short at epoch ends,
checkpoint steps and the steps where a hook (pruning) must act. Per epoch: the model's metrics
are averaged from the epoch's start (as Keras reports them), `evaluate()` runs if given, a
checkpoint is saved, and Keras callbacks see the same `logs` that `model.fit` would give them.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import keras
from absl import logging

from tfmp import precision
from tfmp.errors import Preempted, TrainingDiverged
from tfmp.training.checkpoint import Checkpoints
from tfmp.training.engine import Engine
from tfmp.training.reporting import Reporter


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
    ):
        self.engine = engine
        self.data_for_epoch = data_for_epoch
        self.settings = settings
        self.reporter = reporter
        self.checkpoints = checkpoints
        self.evaluate = evaluate
        self.hooks = tuple(hooks)
        self.extra_scalars = scalars or (lambda: {})
        self.epochs = -(-settings.total_steps // settings.steps_per_epoch)
        self.callbacks = keras.callbacks.CallbackList(
            callbacks,
            add_history=True,
            add_progbar=False,
            model=engine.model,
            verbose=0,
            epochs=self.epochs,
            steps=settings.steps_per_epoch,
        )
        self.optimizer = engine.optimizer
        self.dynamic_scaling = isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
        self._steady_examples, self._steady_seconds, self._first_call = 0, 0.0, True

    def run(self, start_step: int) -> LoopResult:
        step, last_eval = start_step, None
        preemption = _PreemptionNotice()
        self.engine.model.stop_training = False
        self.callbacks.on_train_begin()
        for hook in self.hooks:
            if hook.next_update_step(step) == step:
                hook.update(step)
        try:
            while step < self.settings.total_steps and not self.engine.model.stop_training:
                step, last_eval = self._epoch(step, preemption)
            if self.evaluate is not None and last_eval is None:  # resumed a finished run
                last_eval = self._evaluate(step)
        finally:
            preemption.restore()
        self.callbacks.on_train_end()
        throughput = self._steady_examples / self._steady_seconds if self._steady_seconds else None
        return LoopResult(step, last_eval, self.engine.model.history, throughput)

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
            logs, seconds = self._call(iterator, step, num_steps, preemption)
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
        last_eval = self._evaluate(step) if self.evaluate is not None else None
        self._save(step)
        epoch_logs = dict(logs)
        if self.dynamic_scaling:
            epoch_logs["loss_scale"] = precision.current_loss_scale(self.optimizer)
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

    def _call(self, iterator, step: int, num_steps: int, preemption) -> tuple[dict, float]:
        started = time.perf_counter()
        result = self.engine.train(iterator, num_steps, stop_requested=preemption.received)
        seconds = time.perf_counter() - started
        step += num_steps
        if result.stop_requests:
            # Every worker sees the same reduced value, so all save at this step.
            self._save(step)
            where = self.checkpoints.directory if self.checkpoints else "nowhere (no model_dir)"
            raise Preempted(
                f"SIGTERM on a worker: checkpoint saved at step {step} in {where}; "
                "run the same command again to resume"
            )
        if not self._first_call:  # the first call traces and compiles: not throughput
            self._steady_examples += num_steps * self.settings.global_batch_size
            self._steady_seconds += seconds
        self._first_call = False
        if result.nonfinite_steps and not self.dynamic_scaling:
            where = (
                f"the last good checkpoint in {self.checkpoints.directory} is kept; "
                if self.checkpoints
                else ""
            )
            compute = ", ".join(sorted(precision.model_compute_dtypes(self.engine.model)))
            raise TrainingDiverged(
                f"loss became non-finite at step {step} computing in {compute} (loss scale: "
                f"{precision.loss_scale_mode(self.optimizer)}); training stopped, {where}lower the learning rate"
            )
        if self.dynamic_scaling and precision.current_loss_scale(self.optimizer) < 1.0:
            raise TrainingDiverged(
                f"loss scale fell below 1 at step {step}: gradients are non-finite "
                "even unscaled; lower the learning rate"
            )
        return result.metrics, seconds

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
        self.reporter.message(
            "  eval: " + ", ".join(f"{name} {value:.4f}" for name, value in results.items())
        )
        return results

    def _save(self, step: int) -> None:
        if self.checkpoints is not None:
            self.checkpoints.save(step)


class _PreemptionNotice:
    """Notes SIGTERM (a scheduler's preemption notice) instead of dying mid-step."""

    def __init__(self):
        self.received = False
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum, frame):
        logging.warning("SIGTERM received: checkpointing with every worker after this execution")
        self.received = True

    def restore(self):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
