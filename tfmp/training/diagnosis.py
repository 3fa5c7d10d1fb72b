"""`diagnose_precision(config, task)`: the precision doctor on a run's model and data, no training.

    from tfmp.classification.task import TASK
    from tfmp.training.config import TrainConfig
    from tfmp.training.diagnosis import diagnose_precision
    report = diagnose_precision(TrainConfig.from_flat(precision="mixed_float16"), TASK, steps=3)

What `python -m apps.classify --diagnose_precision` (and apps.detect, apps.mnist) runs: the
same plan, model (with `--float32_layers` applied), optimizer and compiled loss as training,
and the first `steps` batches of the training pipeline, through `tfmp.precision.diagnose`.
The chief writes `precision_report.json` into the run directory and prints the table; the
model's weights are never changed and nothing else is written. The doctor runs on one device:
it measures values, not speed, so the run's strategy only places the model's own variables.
"""

from __future__ import annotations

import os

import keras

from tfmp import precision
from tfmp.training.config import TrainConfig
from tfmp.training.plan import default_model_dir, make_plan
from tfmp.training.run import build_model, build_optimizer
from tfmp.training.task import Task

DEFAULT_STEPS = 3


def diagnose_precision(config: TrainConfig, task: Task, steps: int = DEFAULT_STEPS) -> precision.Report:
    """Diagnoses the run `config` describes; returns the report (chief: also saved and printed)."""
    plan = make_plan(config, task)
    keras.utils.set_random_seed(config.seed)
    model = build_model(config, plan, task)
    task.compile(model, build_optimizer(config, plan, model), plan)
    dataset, _ = task.train_dataset(config, plan)
    report = precision.diagnose(model, dataset, steps=steps)
    if plan.topology.is_chief:
        # Validation is over (plan, model, data, diagnosis): only now is anything written.
        path = precision.save_report(report, config.checkpointing.model_dir or default_model_dir(config))
        if config.verbose:
            print(precision.format_report(report), flush=True)
            print(f"wrote {os.path.abspath(path)}", flush=True)
    return report
