"""Optimizers and learning-rate schedules by name.

    from tfmp import optim
    schedule = optim.schedule(0.1, total_steps=1000, warmup_steps=50, decay="cosine")
    optimizer = optim.build("sgd", schedule)

Learning rates here are already scaled for the global batch (`distribute.scale_learning_rate`);
warmup ramps linearly from 0 so a large global batch does not blow up in the first steps
(Goyal et al. 2017).
"""

from __future__ import annotations

import math

import keras
from keras import ops

from tfmp.errors import UsageError, unknown

DECAYS = ("constant", "cosine")


@keras.saving.register_keras_serializable(package="tfmp")
class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup to `peak` over `warmup_steps`, then constant or cosine decay to 0."""

    def __init__(self, peak: float, total_steps: int, warmup_steps: int = 0, decay: str = "constant"):
        self.peak = float(peak)
        self.total_steps = int(total_steps)
        self.warmup_steps = int(warmup_steps)
        self.decay = decay

    def __call__(self, step):
        step = ops.cast(step, "float32")
        warmup = ops.minimum(1.0, (step + 1.0) / max(self.warmup_steps, 1))
        if self.decay == "constant":
            return self.peak * warmup
        decay_steps = max(self.total_steps - self.warmup_steps, 1)
        progress = ops.clip((step - self.warmup_steps) / decay_steps, 0.0, 1.0)
        return self.peak * warmup * 0.5 * (1.0 + ops.cos(math.pi * progress))

    def get_config(self):
        return {
            "peak": self.peak,
            "total_steps": self.total_steps,
            "warmup_steps": self.warmup_steps,
            "decay": self.decay,
        }


def schedule(
    learning_rate: float, total_steps: int, warmup_steps: int = 0, decay: str = "constant"
) -> WarmupSchedule:
    if decay not in DECAYS:
        raise unknown("learning-rate decay", decay, DECAYS)
    if not 0 < learning_rate < math.inf:  # also refuses NaN
        raise UsageError(f"learning rate {learning_rate} must be a positive finite number, e.g. 0.001")
    if warmup_steps < 0 or warmup_steps > total_steps:
        raise UsageError(
            f"warmup of {warmup_steps} steps does not fit the {total_steps} training steps; "
            f"use warmup_steps from 0 to {total_steps}"
        )
    return WarmupSchedule(learning_rate, total_steps, warmup_steps, decay)


def _sgd(learning_rate, weight_decay):
    return keras.optimizers.SGD(learning_rate, momentum=0.9, nesterov=True, weight_decay=weight_decay)


OPTIMIZERS = {
    "sgd": _sgd,
    "adam": lambda learning_rate, weight_decay: keras.optimizers.Adam(
        learning_rate, weight_decay=weight_decay
    ),
    "adamw": lambda learning_rate, weight_decay: keras.optimizers.AdamW(
        learning_rate, weight_decay=weight_decay or 1e-4
    ),
    "rmsprop": lambda learning_rate, weight_decay: keras.optimizers.RMSprop(
        learning_rate, weight_decay=weight_decay
    ),
}


def build(name: str, learning_rate, weight_decay: float | None = None) -> keras.optimizers.Optimizer:
    """`sgd` (momentum 0.9, Nesterov), `adam`, `adamw` or `rmsprop`."""
    if name not in OPTIMIZERS:
        raise unknown("optimizer", name, OPTIMIZERS)
    if weight_decay is not None and not 0 <= weight_decay < math.inf:  # also refuses NaN
        raise UsageError(
            f"weight decay {weight_decay} must be 0 (none) or a positive finite number, e.g. 1e-4"
        )
    return OPTIMIZERS[name](learning_rate, weight_decay or None)
