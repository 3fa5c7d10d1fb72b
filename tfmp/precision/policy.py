"""Precision policies: which Keras dtype policy a `--precision` value means on this hardware.

    from tfmp.precision import policy
    choice = policy.resolve("auto")            # or "mixed", "float32", "mixed_float16", ...
    choice.policy, choice.reason, choice.warning

A policy keeps variables in float32 ("master weights") and computes in float16 or bfloat16.
`auto` picks the fastest policy the hardware runs well; `mixed` (what `--mixed` asks for) picks
the best *mixed* policy and, where that policy is slow on this hardware, says so once.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import keras
import tensorflow as tf

from tfmp import models
from tfmp.errors import unknown

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
CHOICES = POLICIES + ("auto", "mixed")


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


def model_compute_dtypes(model: keras.Model) -> set[str]:
    """The compute dtypes of a model's layers (a mixed_float16 model has float16 and float32)."""
    return {
        layer.dtype_policy.compute_dtype
        for layer in models.all_layers(model)
        if getattr(layer, "dtype_policy", None) is not None and layer.weights
    }
