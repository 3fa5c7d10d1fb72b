"""`Task`: what a training run needs from a task (classification, detection, ...).

A task is a model + a loss + data. `tfmp.training.run.train_and_evaluate(config, task)` plans
the run, asks the task for its pieces in this order and runs them in the one engine and loop:

    info = task.describe(config)                      # dataset sizes, classes, image size
    model = task.build_model(config, plan)            # inside plan.model_strategy.scope()
    task.compile(model, optimizer, plan)              # the compiled loss and metrics the engine runs
    dataset, shard_policy = task.train_dataset(config, plan)   # global batches (the precision doctor)
    data_for_epoch, evaluate, shard_policies = task.inputs(config, plan, engine, start_step)
    rows = task.card(config, plan, model)             # task rows of the run card (incl. "dataset")
    fields, headline = task.headline(last_eval)       # summary fields and the one-line result

Implementations: `tfmp.classification.task.TASK`, `tfmp.detection.task.TASK`. A new task needs
no base class: any object with these members is a `Task` (checked with `isinstance` at run time).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import keras

from tfmp.training.config import TrainConfig
from tfmp.training.engine import Engine
from tfmp.training.plan import Plan, Plannable

# The loop's training data: (epoch, steps done) -> an iterator of distributed batches.
DataForEpoch = Callable[[int, int], Any]
# Evaluation: () -> metric name -> value; None when the run does not evaluate.
Evaluate = Callable[[], dict] | None


@runtime_checkable
class Task(Plannable, Protocol):
    models: Mapping[str, Callable[..., keras.Model]]  # registry name -> builder
    model_kind: str  # what an unknown --model is called in the error ("model", "detector")
    unit: str  # what the speed counts ("examples", "images")

    def describe(self, config: TrainConfig) -> Any:
        """The dataset description; needs `train_examples` and `eval_examples`."""

    def build_model(self, config: TrainConfig, plan: Plan) -> keras.Model:
        """The model, built in `plan.model_strategy.scope()` (the run's strategy but for a pipeline
        on every worker) with `plan.policy`."""

    def compile(self, model: keras.Model, optimizer: keras.optimizers.Optimizer, plan: Plan) -> keras.Model:
        """Compiles the loss and metrics the engine computes per replica."""

    def train_dataset(
        self, config: TrainConfig, plan: Plan, input_context: Any = None, skip_examples: int = 0
    ) -> tuple[Any, str]:
        """(endless training tf.data.Dataset, shard policy): global batches of `(x, y)` without
        `input_context`, per-replica batches of that pipeline's shard with one."""

    def inputs(
        self, config: TrainConfig, plan: Plan, engine: Engine, start_step: int
    ) -> tuple[DataForEpoch, Evaluate, list[str]]:
        """Training data positioned at `start_step`, the evaluation, and the shard policies used."""

    def card(self, config: TrainConfig, plan: Plan, model: keras.Model) -> dict:
        """Task rows of the run card; must include "dataset"."""

    def headline(self, last_eval: dict) -> tuple[dict, str]:
        """Summary fields from the last evaluation, and its one-line headline."""
