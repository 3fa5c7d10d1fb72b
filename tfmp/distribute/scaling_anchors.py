"""The published results the scaling model (tfmp.distribute.scaling) is held to: per anchor, both
throughputs from one table, the run's link, buckets and overheads, each value from a named
source or a measurement on this host (the command is named beside it).

    from tfmp.distribute import scaling_anchors
    anchor = scaling_anchors.ANCHORS["resnet50_a100_amp"]
    anchor.published_efficiency, anchor.predict().efficiency_overlapped      # 0.916, 0.956
    scaling_anchors.residual(anchor)                                          # +0.040

    python -m apps.scaling                                    # the anchor table, last

An anchor is met when |residual| <= ANCHOR_TOLERANCE; one that is not is printed with its
residual (issue 43: the model names its terms and says what it misses, it is not fitted to
the number). Pure Python.
"""

from __future__ import annotations

import dataclasses

from tfmp.distribute.scaling import LINKS, Overheads, Prediction, gradient_bytes, predict

# The terms of NVIDIA's TensorFlow ResNet-50 runs on a DGX A100 (TF 20.06 NGC container,
# Horovod over NCCL, `mpiexec --bind-to socket -np 8`, real TFRecords on the CPU, XLA).
RESNET50_PARAMETERS = 25_557_032  # tfmp.models' resnet50 at 224x224, 1000 classes
HOROVOD_CYCLE_SECONDS = 5e-3  # HOROVOD_CYCLE_TIME's default until Horovod 0.21.0 (release notes, #2468)
HOROVOD_FUSION_BYTES = 64 * 2**20  # HOROVOD_FUSION_THRESHOLD's default then (docs/tensor-fusion.rst)
# NVIDIA's own A100 40GB ResNet-50 TF32 + XLA latency table (same README), batch 256: mean
# 100.45 ms, 90th percentile 102.34 ms; for a normal, p90 = mean + 1.2816 sigma.
A100_STEP_CV = (102.34 - 100.45) / 1.2816 / 100.45
# CPU seconds per training example of NVIDIA's preprocessing (decode, random crop, flip,
# resize to 224) on one core of this host's AMD EPYC (Zen 2 class: AVX2, SHA, no VAES, as the
# DGX A100's EPYC 7742), a 512x600 photograph (matplotlib's grace_hopper.jpg):
# `python -m apps.scaling --measure_input`, 2026-12-06 18:50 UTC, process CPU time, median of
# 5 repeats of 512 examples (1.76-1.83 ms; load average 13 on the 2 cores).
INPUT_CPU_SECONDS_PER_EXAMPLE = 1.79e-3
# DGX A100: two 64-core AMD EPYC 7742 (hardwaretimes.com's report of NVIDIA's launch, 2020-05).
DGX_A100_CORES = 128
ANCHOR_TOLERANCE = 0.02  # issue 43: met within 0.02 of the published efficiency


def dgx_a100_overheads(batch_per_device: int) -> Overheads:
    """The terms of an 8-GPU DGX A100 Horovod run, each from its source above."""
    return Overheads(
        sync_seconds=HOROVOD_CYCLE_SECONDS / 2,  # the last gradients wait for the next cycle
        blocking_collectives=0,  # per-GPU batch norm, static loss scale (DGXA100_RN50_AMP_90E.sh)
        step_cv=A100_STEP_CV,
        input_core_seconds=batch_per_device * INPUT_CPU_SECONDS_PER_EXAMPLE,
        host_cores=DGX_A100_CORES,
        devices_per_host=8,
    )


@dataclasses.dataclass(frozen=True)
class Anchor:
    """A published N-device result the model is held to: both throughputs from one table, the
    run's link, buckets and overheads; residual = predicted - published efficiency."""

    name: str
    parameters: int
    allreduce_dtype: str
    devices: int
    link: str
    batch_per_device: int
    one_device_examples_per_sec: float
    examples_per_sec: float
    bucket_bytes: int
    overheads: Overheads
    source: str

    @property
    def published_efficiency(self) -> float:
        return self.examples_per_sec / (self.devices * self.one_device_examples_per_sec)

    def predict(self) -> Prediction:
        compute = self.batch_per_device / self.one_device_examples_per_sec
        nbytes = gradient_bytes(self.parameters, self.allreduce_dtype)
        return predict(
            compute, nbytes, self.devices, LINKS[self.link], self.bucket_bytes, overheads=self.overheads
        )


_NVIDIA_TF_RESNET50 = (
    "NVIDIA DeepLearningExamples, TensorFlow/Classification/ConvNets/resnet50v1.5/README.md, "
    "'Training performance: NVIDIA DGX A100 (8x A100 40GB)'"
)
ANCHORS = {
    "resnet50_a100_amp": Anchor(
        "ResNet-50, 8x A100, mixed precision + XLA",
        RESNET50_PARAMETERS,
        "float32",  # AMP keeps float32 variables, so Horovod sums float32 gradients
        8,
        "nvlink",
        256,
        2375.0,
        17400.0,
        HOROVOD_FUSION_BYTES,
        dgx_a100_overheads(256),
        _NVIDIA_TF_RESNET50 + ": 2,375 and 17,400 img/s (7.32x)",
    ),
    "resnet50_a100_tf32": Anchor(
        "ResNet-50, 8x A100, TF32 + XLA",
        RESNET50_PARAMETERS,
        "float32",
        8,
        "nvlink",
        256,
        909.0,
        7000.0,
        HOROVOD_FUSION_BYTES,
        dgx_a100_overheads(256),
        _NVIDIA_TF_RESNET50 + ": 909 and 7,000 img/s (7.70x)",
    ),
}


def residual(anchor: Anchor) -> float:
    """Predicted (overlapped, with the anchor's overheads) - published efficiency."""
    return anchor.predict().efficiency_overlapped - anchor.published_efficiency
