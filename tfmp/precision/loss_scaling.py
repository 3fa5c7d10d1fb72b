"""Loss scaling for float16: tfmp's replica-safe LossScaleOptimizer and the loss-scale flags.

    from tfmp.precision import loss_scaling
    optimizer = loss_scaling.wrap_optimizer(keras.optimizers.Adam(1e-3), "mixed_float16", "auto")

Loss scaling exists only for float16, whose 5-bit exponent underflows small gradients; bfloat16
and float32 have float32's exponent range and are refused a loss scale. Dynamic scaling uses
`LossScaleOptimizer` below, which fixes a Keras 3.15 bug: under MirroredStrategy Keras decides
"all gradients finite" from replica 0 only, so an overflow on replica 1 writes inf into the
weights. Here the verdict is all-reduced across every replica and worker first.

A fixed scale is Keras 3's `optimizer.loss_scale_factor`: the loss is multiplied by it and the
gradients divided by it in `optimizer.apply`; an overflowing step is applied, not skipped (tfmp's
loop then stops the run with TrainingDiverged naming the scale). Keras' `model.compile` wraps a
mixed_float16 model's plain optimizer in its own LossScaleOptimizer, which sets the optimizer's
`loss_scale_factor` to None: compile with `auto_scale_loss=False` to keep a fixed scale
(tfmp's tasks do; `check_compiled_with` refuses an engine whose optimizer lost it that way).
"""

from __future__ import annotations

import math

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmp.errors import UsageError
from tfmp.precision.policy import model_compute_dtypes

DEFAULT_INITIAL_SCALE = 2.0**15
DEFAULT_GROWTH_STEPS = 2000
# Skips in a row past the halvings from the initial scale to 1 before a run stops (skip_limit).
SKIP_MARGIN = 16
# The loss is scaled in float32: a larger scale is inf there, so every step would be inf.
FLOAT32_MAX = float(np.finfo(np.float32).max)


@keras.saving.register_keras_serializable(package="tfmp")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Keras 3 dynamic loss scaling whose skip decision is shared by all replicas and workers.

    Keras takes the "finite" verdict from replica 0 (MirroredStrategy) or from each replica on its
    own (MultiWorkerMirroredStrategy, which would diverge or hang). Summing the count of replicas
    that saw a non-finite gradient makes every replica take the same branch: on overflow anywhere,
    the step is skipped everywhere and the scale halves. Works in `model.fit` and custom loops.
    """

    def build(self, var_list):
        if self.built:  # Keras' would make a new scale at its initial value (a second tfmp.fit)
            return
        super().build(var_list)
        # Steps skipped in a row, kept by every replica alike (the verdict is all-reduced) and
        # saved with the optimizer's checkpoint, so a resumed run counts on where it stopped.
        # A tf.Variable, not an optimizer variable: `.keras` files keep Keras' own list.
        self.skipped_in_a_row = tf.Variable(
            0,
            dtype=tf.int64,
            trainable=False,
            name="skipped_in_a_row",
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )

    def check_finite(self, grads):
        finite = super().check_finite(grads)
        replica_context = tf.distribute.get_replica_context()
        if replica_context is not None and replica_context.num_replicas_in_sync > 1:
            overflowed = tf.cast(tf.logical_not(finite), tf.float32)
            overflowed_replicas = replica_context.all_reduce(tf.distribute.ReduceOp.SUM, overflowed)
            finite = tf.equal(overflowed_replicas, 0.0)
        # Keras calls this once per apply, and skips the step exactly when it returns False.
        self.skipped_in_a_row.assign(tf.where(finite, tf.constant(0, tf.int64), self.skipped_in_a_row + 1))
        return finite


def skip_limit(optimizer: keras.optimizers.LossScaleOptimizer) -> int:
    """Steps a dynamic loss scale may skip in a row before a run stops (2^15 initial scale: 32).

    Each skip halves the scale, so halvings(initial scale -> below 1) skips in a row from the
    initial scale reach 1/2, where the run stops anyway (a step overflowed at scale 1: float16
    overflows unscaled). The margin, SKIP_MARGIN more, covers a scale that has grown since the
    start (x2 every `dynamic_growth_steps` finite steps) and then falls fast when the gradients
    jump: a streak this long means the gradients grew 2^limit-fold in as many steps.
    """
    halvings = max(0, math.ceil(math.log2(max(float(optimizer.initial_scale), 1.0)))) + 1
    return halvings + SKIP_MARGIN


def parse_loss_scale(loss_scale: str) -> str | float | None:
    """`auto`/`dynamic`/`none` or a positive number, as given on the command line."""
    if loss_scale in ("auto", "dynamic", "none"):
        return None if loss_scale == "none" else loss_scale
    try:
        value = float(loss_scale)
    except ValueError:
        raise UsageError(
            f"--loss_scale={loss_scale!r} is neither auto, dynamic, none nor a number; "
            "use e.g. --loss_scale=dynamic or --loss_scale=1024"
        ) from None
    return _checked_fixed_scale(value, loss_scale)


def _checked_fixed_scale(value: float, shown) -> float:
    """A fixed loss scale float32 can hold: positive, at most float32's largest value 3.4e38.

    Scales above float16's 65504 are allowed: the scaled loss is float32, and a float16 gradient
    overflows only when scale x gradient exceeds 65504 (dynamic scaling often runs at 2^16 and up).
    """
    if not value > 0 or value == float("inf"):
        raise UsageError(f"--loss_scale={shown} must be a positive finite number, e.g. 1024")
    if value > FLOAT32_MAX:
        raise UsageError(
            f"--loss_scale={shown} is more than float32's largest value {FLOAT32_MAX:.3g}: the loss is "
            "scaled in float32, so every scaled loss would be inf; use e.g. --loss_scale=1024 or dynamic"
        )
    return float(value)


def wrap_optimizer(
    optimizer: keras.optimizers.Optimizer,
    policy: str,
    loss_scale: str | float | None = "auto",
    *,
    initial_scale: float = DEFAULT_INITIAL_SCALE,
    growth_steps: int = DEFAULT_GROWTH_STEPS,
) -> keras.optimizers.Optimizer:
    """Adds the loss scaling `policy` needs; `loss_scale` as from `parse_loss_scale`.

    "auto" means dynamic for mixed_float16 and nothing otherwise. A fixed number uses Keras 3's
    `loss_scale_factor` (Keras 3 removed `LossScaleOptimizer(dynamic=False)`); either way the
    caller does `optimizer.scale_loss(loss)` then `optimizer.apply(grads)`, which unscales.
    Compile the model with `auto_scale_loss=False`: Keras' compile would otherwise replace a
    fixed scale (or none) by its own dynamic LossScaleOptimizer.
    """
    if policy != "mixed_float16":
        if loss_scale not in ("auto", None):
            raise UsageError(
                f"--loss_scale={loss_scale} needs --precision=mixed_float16; {policy} has "
                "float32's exponent range and needs no loss scaling (drop --loss_scale)"
            )
        return optimizer
    if loss_scale is None:
        logging.warning("mixed_float16 without loss scaling: small gradients may underflow")
        return optimizer
    if loss_scale in ("auto", "dynamic"):
        return LossScaleOptimizer(optimizer, initial_scale=initial_scale, dynamic_growth_steps=growth_steps)
    optimizer.loss_scale_factor = _checked_fixed_scale(float(loss_scale), loss_scale)
    return optimizer


def check_compiled_with(model: keras.Model, optimizer: keras.optimizers.Optimizer) -> None:
    """Refuses training `model` with `optimizer` when `model.compile` wrapped that optimizer in
    Keras' LossScaleOptimizer: the wrapper set its `loss_scale_factor` (a fixed scale) to None."""
    wrapper = model.optimizer
    if wrapper is not optimizer and getattr(wrapper, "inner_optimizer", None) is optimizer:
        raise UsageError(
            f"model.compile wrapped the {type(optimizer).__name__} optimizer in Keras' dynamic "
            f"LossScaleOptimizer (the model's policy is {model.dtype_policy.name}), which clears a fixed "
            "loss_scale_factor; compile with auto_scale_loss=False to train with the loss scaling the "
            "optimizer was given"
        )


def loss_scale_mode(optimizer: keras.optimizers.Optimizer) -> str:
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return (
            f"dynamic (initial {optimizer.initial_scale:g}, x2 every "
            f"{optimizer.dynamic_growth_steps} finite steps, /2 on overflow)"
        )
    if optimizer.loss_scale_factor:
        return f"fixed {optimizer.loss_scale_factor:g}"
    return "none"


def current_loss_scale(optimizer: keras.optimizers.Optimizer) -> float:
    """The loss scale in force now (1.0 without loss scaling)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        if not optimizer.built:
            return float(optimizer.initial_scale)
        return float(optimizer.dynamic_scale.numpy())
    return float(optimizer.loss_scale_factor or 1.0)


def ensure_loss_scaling(
    model: keras.Model, strategy: tf.distribute.Strategy
) -> tuple[keras.optimizers.Optimizer, str | None]:
    """The optimizer a user's compiled model should train with under tfmp, and what changed.

    A model that computes in float16 needs loss scaling: a plain optimizer gets tfmp's
    replica-safe `LossScaleOptimizer`, and Keras' own `LossScaleOptimizer` (which `compile`
    adds under a global mixed_float16 policy) is replaced by tfmp's with the same settings,
    because Keras' skips an overflow only when replica 0 sees it. A fixed
    `loss_scale_factor` the user chose is kept; it survives `compile` only with
    `auto_scale_loss=False` (or a model whose own policy is not mixed_float16), since Keras'
    wrapper clears it. Returns (optimizer, note or None).
    """
    optimizer = model.optimizer
    if isinstance(optimizer, LossScaleOptimizer):
        return optimizer, None
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        with strategy.scope():
            replaced = LossScaleOptimizer(
                optimizer.inner_optimizer,
                initial_scale=optimizer.initial_scale,
                dynamic_growth_steps=optimizer.dynamic_growth_steps,
            )
        return replaced, (
            "replaced Keras' LossScaleOptimizer by tfmp.precision.LossScaleOptimizer "
            f"(same initial scale {optimizer.initial_scale:g}, growth every "
            f"{optimizer.dynamic_growth_steps} steps): Keras skips an overflow only when "
            "replica 0 sees it"
        )
    if "float16" in model_compute_dtypes(model) and not optimizer.loss_scale_factor:
        with strategy.scope():
            wrapped = LossScaleOptimizer(
                optimizer, initial_scale=DEFAULT_INITIAL_SCALE, dynamic_growth_steps=DEFAULT_GROWTH_STEPS
            )
        return wrapped, (
            "the model computes in float16 and its optimizer had no loss scaling: "
            "wrapped it in tfmp.precision.LossScaleOptimizer (dynamic)"
        )
    return optimizer, None
