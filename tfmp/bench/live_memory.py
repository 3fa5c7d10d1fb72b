"""What a bench cell's steps hold in memory, read inside the cell process (TensorFlow side).

    live_memory.reset()                   # after the warm-up: count the timed steps only
    ...                                   # the timed steps
    figures = live_memory.figures(base)   # base = live_memory.process_peak_mb() before the model

Two figures, for two questions:
- the live peak (`peak_mb`): TensorFlow's allocator peak of live tensors since `reset` (weights,
  optimizer slots, activations, workspaces: what a bigger batch runs out of), per GPU or of the
  one CPU allocator, which logical CPU devices share. On CPU it exists only with the BFC allocator
  (`TF_CPU_ALLOCATOR_USE_BFC=true`, which `tfmp.bench.runner` sets for its cells);
- the process's peak resident memory (`process_peak_mb`, getrusage), which also counts the
  runtime, Python and the pages malloc keeps after a free.
Used by the engine and fit cells (`tfmp.bench.cell`), the normalization studies
(`tfmp.bench.bn_study`) and the keras-hub transformer cells (`tfmp.bench.hub_transformers`).
"""

from __future__ import annotations

import math
import resource

import tensorflow as tf


def devices() -> list[str]:
    """Where TensorFlow's allocators count live tensors: each GPU, or the one CPU allocator
    (logical CPU devices share it: its figure is every replica's together)."""
    gpus = tf.config.list_logical_devices("GPU")
    return [f"GPU:{index}" for index in range(len(gpus))] or ["CPU:0"]


def source() -> str:
    """ "gpu" or "cpu": which allocator `peak_mb` reads."""
    return "gpu" if tf.config.list_logical_devices("GPU") else "cpu"


def reset() -> None:
    """Starts counting the live peak afresh from what is allocated now."""
    for device in devices():
        tf.config.experimental.reset_memory_stats(device)


def peaks_mb() -> list[float]:
    """The live peak of each device of `devices()` since `reset`, in MiB."""
    return [tf.config.experimental.get_memory_info(device)["peak"] / 2**20 for device in devices()]


def peak_mb() -> float:
    """The largest device's live peak since `reset`, in MiB."""
    return max(peaks_mb())


def current_bytes() -> int:
    """Bytes alive now on the first device of `devices()` (a difference of two readings is
    what a computation keeps)."""
    return tf.config.experimental.get_memory_info(devices()[0])["current"]


def process_peak_mb() -> float:
    """This process's peak resident memory so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def variables_mb(model, optimizer) -> float:
    """MiB of the model's variables and the optimizer's (slots, step, loss scale): what the live
    peak holds whatever the batch. One replica's copy of each variable."""
    variables = {id(v): v for v in [*model.variables, *optimizer.variables]}.values()
    return sum(math.prod(v.shape) * tf.as_dtype(v.dtype).size for v in variables) / 2**20


def figures(before_model_mb: float) -> dict:
    """A cell's memory fields (`tfmp.bench.schema`): the live peak of its timed steps and the
    process's resident peak, whose base `before_model_mb` was read before the model was built."""
    live, allocator = peaks_mb(), source()
    return {
        "peak_memory_mb": max(live),
        "peak_memory_source": allocator,
        "peak_host_memory_mb": process_peak_mb(),
        "host_memory_before_model_mb": before_model_mb,
        "peak_gpu_memory_mb": live if allocator == "gpu" else [],
    }
