"""The matmul peak: the FLOP/s ceiling the bench's cells are compared to, per precision.

    from tfmp.bench import peak
    result = peak.measure("mixed_bfloat16", sizes=(1024, 2048, 4096), repeats=3)
    result["peak_flops"], result["matmul_size"], result["method"]

Runs in a fresh cell process (`{"kind": "peak", "precision": POLICY, "sizes": [...],
"repeats": N}`) started exactly like the 1-replica cells: same environment, TensorFlow's default
thread pools, nothing else in the process. For every size, a chain of square matmuls in the
policy's compute dtype runs inside one tf.function call (no Python between matmuls); the
number of matmuls per call grows until a call lasts MIN_CALL_SECONDS, then `repeats` calls are
timed. The peak is the best FLOP/s over every size and repeat: the highest rate this process
state reached, which is what a "% of peak" figure should divide by. Which size wins depends on
the hardware (cache sizes, oneDNN's blocking, load from other processes), so several are tried.
"""

from __future__ import annotations

import time

import tensorflow as tf

from tfmp import precision

SIZES = (1024, 2048, 4096)
REPEATS = 3
MIN_CALL_SECONDS = 0.5  # timer and dispatch noise well below 1% of a timed call


def describe(sizes, repeats: int, min_call_seconds: float = MIN_CALL_SECONDS) -> str:
    """The method, as the output states it."""
    return (
        f"best of square matmuls {'/'.join(map(str, sizes))} x {repeats} timed calls of >= "
        f"{min_call_seconds:g} s each, in a fresh process like the cells"
    )


def _chained_matmuls(size: int, dtype: str):
    """`run(count)`: `count` matmuls of two size x size matrices in one call; returns seconds."""
    a = tf.cast(tf.random.uniform([size, size], dtype=tf.float32), dtype)
    b = tf.cast(tf.random.uniform([size, size], dtype=tf.float32), dtype)

    @tf.function
    def repeat_matmul(count):
        total = tf.zeros([], tf.float32)
        for _ in tf.range(count):
            # One element of each product feeds the total: every matmul must run, and the
            # reduction costs nothing next to it.
            total += tf.cast(tf.linalg.matmul(a, b)[0, 0], tf.float32)
        return total

    def run(count: int) -> float:
        started = time.perf_counter()
        repeat_matmul(tf.constant(count)).numpy()
        return time.perf_counter() - started

    return run


def measure_size(size: int, dtype: str, repeats: int = REPEATS, min_call_seconds=MIN_CALL_SECONDS) -> dict:
    """FLOP/s of `repeats` timed calls at one size, after a warm-up call."""
    run = _chained_matmuls(size, dtype)
    run(1)  # trace, compile, pick kernels
    count, seconds = 1, run(1)
    while seconds < min_call_seconds:
        count = max(count + 1, int(count * 1.5 * min_call_seconds / max(seconds, 1e-6)))
        seconds = run(count)
    flops = [2 * size**3 * count / run(count) for _ in range(repeats)]
    return {"size": size, "matmuls_per_call": count, "flops": flops, "best_flops": max(flops)}


def measure(policy: str, sizes=SIZES, repeats: int = REPEATS, min_call_seconds=MIN_CALL_SECONDS) -> dict:
    """The best FLOP/s over `sizes` x `repeats`, and every size's figures."""
    dtype = precision.compute_dtype(policy)
    by_size = [measure_size(size, dtype, repeats, min_call_seconds) for size in sizes]
    best = max(by_size, key=lambda row: row["best_flops"])
    return {
        "peak_flops": best["best_flops"],
        "matmul_size": best["size"],
        "dtype": dtype,
        "sizes": by_size,
        "method": describe(sizes, repeats, min_call_seconds),
    }
