"""Precision policies and loss scaling for Keras 3 on TensorFlow.

    from tfmp import precision
    choice = precision.resolve("auto")            # or "mixed", "float32", "mixed_float16", ...
    optimizer = precision.wrap_optimizer(keras.optimizers.Adam(1e-3), choice.policy, "auto")

A policy keeps variables in float32 ("master weights") and computes in float16 or bfloat16.
`auto` picks the fastest policy the hardware runs well; `mixed` (what `--mixed` asks for) picks
the best *mixed* policy and, where that policy is slow on this hardware, says so once.

Loss scaling exists only for float16, whose 5-bit exponent underflows small gradients; bfloat16
and float32 have float32's exponent range and are refused a loss scale. Dynamic scaling uses
`LossScaleOptimizer` below, which fixes a Keras 3.15 bug: under MirroredStrategy Keras decides
"all gradients finite" from replica 0 only, so an overflow on replica 1 writes inf into the
weights. Here the verdict is all-reduced across every replica and worker first.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import keras
import tensorflow as tf
from absl import logging

from tfmp import models
from tfmp.errors import UsageError, unknown

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
CHOICES = POLICIES + ("auto", "mixed")
DEFAULT_INITIAL_SCALE = 2.0**15
DEFAULT_GROWTH_STEPS = 2000


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What the policy choice depends on."""

    gpu_compute_capabilities: tuple[tuple[int, int], ...]
    has_tpu: bool
    cpu_fast_bfloat16: bool  # oneDNN has native bf16 kernels (AVX512-BF16 or AMX)


@dataclasses.dataclass(frozen=True)
class PolicyChoice:
    policy: str  # one of POLICIES
    reason: str  # why this policy, for the run card
    warning: str | None = None  # printed once when the choice will be slow here


@functools.cache
def detect_hardware() -> Hardware:
    capabilities = []
    for gpu in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(gpu)
        capabilities.append(tuple(details.get("compute_capability", (0, 0))))
    has_tpu = bool(tf.config.list_physical_devices("TPU"))
    return Hardware(tuple(capabilities), has_tpu, _cpu_has_fast_bfloat16())


def _cpu_has_fast_bfloat16() -> bool:
    # TensorFlow's x86 wheels route bf16 matmuls/convolutions through oneDNN, which has native
    # kernels only with AVX512-BF16 or AMX; elsewhere bf16 is emulated and slower than float32.
    if os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1") == "0":
        return False
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            flags = set(cpuinfo.read().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def resolve(precision: str, hardware: Hardware | None = None) -> PolicyChoice:
    """Turns a `--precision` value (see CHOICES) into a concrete Keras policy name."""
    if precision not in CHOICES:
        raise unknown("precision", precision, CHOICES)
    hardware = hardware or detect_hardware()
    capabilities = hardware.gpu_compute_capabilities
    tensor_core_gpus = bool(capabilities) and all(cc >= (7, 0) for cc in capabilities)
    if precision == "auto":
        if tensor_core_gpus:
            return PolicyChoice("mixed_float16", "auto: GPUs with compute capability >= 7.0")
        if hardware.has_tpu:
            return PolicyChoice("mixed_bfloat16", "auto: TPU")
        if not capabilities and hardware.cpu_fast_bfloat16:
            return PolicyChoice("mixed_bfloat16", "auto: CPU with native bfloat16 (oneDNN)")
        return PolicyChoice("float32", "auto: no fast half-precision unit found")
    if precision == "mixed":
        if capabilities:
            warning = (
                None
                if tensor_core_gpus
                else (
                    f"mixed_float16 on GPUs with compute capability {min(capabilities)} (< 7.0): "
                    "no Tensor Cores, so expect no speed-up, only the memory saving"
                )
            )
            return PolicyChoice("mixed_float16", "--mixed on GPU", warning)
        if hardware.has_tpu:
            return PolicyChoice("mixed_bfloat16", "--mixed on TPU")
        warning = (
            None
            if hardware.cpu_fast_bfloat16
            else (
                "mixed_bfloat16 on a CPU without AVX512-BF16/AMX: bfloat16 math is emulated and "
                "typically several times slower than float32 here; use --precision=auto for speed"
            )
        )
        return PolicyChoice("mixed_bfloat16", "--mixed on CPU", warning)
    warning = None
    if precision == "mixed_float16" and not capabilities:
        warning = (
            "mixed_float16 on a CPU: float16 kernels are emulated and much slower than "
            "float32 (4-6x slower measured for a small CNN); use it here only to test the GPU path"
        )
    return PolicyChoice(precision, "requested", warning)


def compute_dtype(policy: str) -> str:
    return keras.DTypePolicy(policy).compute_dtype


@keras.saving.register_keras_serializable(package="tfmp")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Keras 3 dynamic loss scaling whose skip decision is shared by all replicas and workers.

    Keras takes the "finite" verdict from replica 0 (MirroredStrategy) or from each replica on its
    own (MultiWorkerMirroredStrategy, which would diverge or hang). Summing the count of replicas
    that saw a non-finite gradient makes every replica take the same branch: on overflow anywhere,
    the step is skipped everywhere and the scale halves. Works in `model.fit` and custom loops.
    """

    def check_finite(self, grads):
        finite = super().check_finite(grads)
        replica_context = tf.distribute.get_replica_context()
        if replica_context is None or replica_context.num_replicas_in_sync == 1:
            return finite
        overflowed = tf.cast(tf.logical_not(finite), tf.float32)
        overflowed_replicas = replica_context.all_reduce(tf.distribute.ReduceOp.SUM, overflowed)
        return tf.equal(overflowed_replicas, 0.0)


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
    if not value > 0 or value == float("inf"):
        raise UsageError(f"--loss_scale={loss_scale} must be a positive finite number, e.g. 1024")
    return value


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
    optimizer.loss_scale_factor = float(loss_scale)
    return optimizer


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


def model_compute_dtypes(model: keras.Model) -> set[str]:
    """The compute dtypes of a model's layers (a mixed_float16 model has float16 and float32)."""
    return {
        layer.dtype_policy.compute_dtype
        for layer in models.all_layers(model)
        if getattr(layer, "dtype_policy", None) is not None and layer.weights
    }


def ensure_loss_scaling(
    model: keras.Model, strategy: tf.distribute.Strategy
) -> tuple[keras.optimizers.Optimizer, str | None]:
    """The optimizer a user's compiled model should train with under tfmp, and what changed.

    A model that computes in float16 needs loss scaling: a plain optimizer gets tfmp's
    replica-safe `LossScaleOptimizer`, and Keras' own `LossScaleOptimizer` (which `compile`
    adds under a global mixed_float16 policy) is replaced by tfmp's with the same settings,
    because Keras' skips an overflow only when replica 0 sees it. A fixed
    `loss_scale_factor` the user chose is kept. Returns (optimizer, note or None).
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
