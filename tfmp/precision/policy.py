"""Precision policies: which Keras dtype policy a `--precision` value means on this hardware.

    from tfmp.precision import policy
    choice = policy.resolve("auto")            # or "mixed", "float32", "mixed_float16", ...
    choice.policy, choice.reason, choice.warning

A policy keeps variables in float32 ("master weights") and computes in float16 or bfloat16.
`auto` and `mixed` (what `--mixed` asks for) time this host (`tfmp.precision.probe`, cached) and
`choose` a half precision only where it beats float32 by MARGIN, else float32, saying why in
`choice.reason` (the run card's line). `by_rule` is the choice from the hardware alone: with
TFMP_PRECISION_PROBE=off, with several workers, and when the probe fails (one warning line).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable

import keras
import tensorflow as tf

from tfmp import models
from tfmp.errors import unknown
from tfmp.precision import probe

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


# A half precision is chosen only when the probe finds it at least this much faster than float32.
# The probe times the matmuls and convolutions alone; a mixed step adds what it leaves out (casts
# between float32 variables and half-precision compute, the float32 layers such as softmax and
# normalization statistics, loss scaling), 5-10% of a small model's step, and a shared VM's
# timings wander by a few percent. Below 1.1x the end-to-end gain is within that: float32 wins ties.
MARGIN = 1.1


def resolve(
    precision: str,
    hardware: Hardware | None = None,
    timings: Callable[[], tuple[dict, str]] | None = None,
    workers: int = 1,
) -> PolicyChoice:
    """Turns a `--precision` value (see CHOICES) into a concrete Keras policy name.

    "auto" and "mixed" measure (`tfmp.precision.probe`, cached per host) and `choose` from the
    table; explicit policies never measure. `timings() -> (table, note)` is the probe (default
    `probe.cached_timings`, skipped when TFMP_PRECISION_PROBE=off). With `workers` > 1 the
    hardware rule decides alone: each worker timing its own host could choose differently, and
    every worker must run the same policy. A probe that fails falls back to the rule, with one
    warning line."""
    if precision not in CHOICES:
        raise unknown("precision", precision, CHOICES)
    hardware = hardware or detect_hardware()
    rule = by_rule(precision, hardware)
    if precision not in ("auto", "mixed") or hardware.has_tpu:
        return rule
    if workers > 1:
        return dataclasses.replace(rule, reason=f"{rule.reason}; {workers} workers: by rule, not measured")
    if timings is None:
        if not probe.enabled():
            return dataclasses.replace(rule, reason=f"{rule.reason}; {probe.ENVIRONMENT_VARIABLE}=off")
        timings = probe.cached_timings
    try:
        table, note = timings()
        probe.speedups(table)  # a table without a dtype or a time is a failed probe too
    except Exception as error:  # noqa: BLE001 - any fault of a speed probe: choose as without one
        failed = (
            f"precision probe failed ({type(error).__name__}: {_gist(error)}); chose {rule.policy} by rule"
        )
        return dataclasses.replace(rule, warning="; ".join(filter(None, [failed, rule.warning])))
    return choose(table, hardware, precision, note)


def _gist(error: Exception) -> str:
    """An error's message on one line: a traced function's error ends with the op's own message
    ("in user code: ... ValueError: Dimensions must be equal ..."), so its last line is kept."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    if last.startswith(f"{type(error).__name__}: "):
        last = last[len(type(error).__name__) + 2 :]
    return last[:200]


def choose(table: dict, hardware: Hardware, precision: str, note: str = "") -> PolicyChoice:
    """The policy for "auto" or "mixed" from the probe's timing table ({dtype: {workload:
    seconds}}, `probe.measure`), compared by `probe.speedups`. On GPUs the compute-capability rule stands
    unless the probe finds its half precision slower than float32; elsewhere the fastest half
    precision (on CPUs: bfloat16) wins when it is at least MARGIN times float32's speed, else float32. The reason is
    the run card's line: what was measured and how to force the other choice."""
    speeds = probe.speedups(table)
    device = "GPU" if hardware.gpu_compute_capabilities else "CPU"
    measured = f"probe {note}" if note else "probe"
    asked = "auto" if precision == "auto" else "--mixed"
    rule = by_rule(precision, hardware)
    if device == "GPU" and rule.policy != "float32":
        speed = speeds[compute_dtype(rule.policy)]
        if speed >= 1.0:
            line = f"{rule.reason}; {rule.policy} {speed:.2f}x float32's speed ({measured})"
            return PolicyChoice(rule.policy, line, rule.warning)
        measured += f"; overrides the compute-capability rule's {rule.policy}, {speed:.2f}x"
    # On CPUs only bfloat16 competes: float16 training there costs far more than the probe's
    # matmul and convolution show (loss scaling and float16 kernels, ~100x float32 for a small CNN
    # on AVX2 and AVX-512 hosts alike, issue 31); it stays in the table, chosen on GPUs only.
    candidates = probe.HALF_DTYPES if device == "GPU" else ("bfloat16",)
    fastest = max(candidates, key=speeds.get)
    policy, speed = f"mixed_{fastest}", speeds[fastest]
    if speed >= MARGIN:
        line = f"{asked}: {policy} {speed:.2f}x float32's speed on this {device} ({measured})"
        return PolicyChoice(policy, line)
    line = (
        f"{asked}: {policy} {speed:.2f}x float32's speed on this {device}, under the {MARGIN}x needed "
        f"({measured}): using float32; --precision={policy} forces it"
    )
    return PolicyChoice("float32", line)


def by_rule(precision: str, hardware: Hardware) -> PolicyChoice:
    """The choice from the hardware alone (compute capability, CPU flags): no measurement."""
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
            "float32 (3.5-6x slower measured for a small CNN); use it here only to test the GPU path"
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
