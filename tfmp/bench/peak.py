"""The matmul peak: the FLOP/s ceiling the bench's cells are compared to, per precision.

    from tfmp.bench import peak
    peak.measure("mixed_bfloat16")    # {"peak_flops": ..., "matmul_size": ..., "dtype": "bfloat16"}

Runs in a fresh cell process (`{"kind": "peak", "precision": POLICY}`), like the cells.
"""

from __future__ import annotations

import time

import tensorflow as tf

from tfmp import precision


def measure(policy: str) -> dict:
    """FLOP/s of a large square matmul in the policy's compute dtype, the cells' ceiling."""
    dtype = precision.compute_dtype(policy)
    size = 4096 if tf.config.list_physical_devices("GPU") else 1024
    a = tf.random.uniform([size, size], dtype=tf.float32)
    a, b = tf.cast(a, dtype), tf.cast(tf.transpose(a), dtype)

    @tf.function
    def repeat_matmul(count):
        total = tf.zeros([], tf.float32)
        for _ in tf.range(count):
            total += tf.cast(tf.reduce_sum(tf.linalg.matmul(a, b)[0, :1]), tf.float32)
        return total

    repeat_matmul(tf.constant(2)).numpy()  # compile and warm up
    count, seconds = 4, 0.0
    while seconds < 1.0:  # grow until a repeat takes a second: timer noise below 1%
        count *= 2
        started = time.perf_counter()
        repeat_matmul(tf.constant(count)).numpy()
        seconds = time.perf_counter() - started
    runs = []
    for _ in range(3):
        started = time.perf_counter()
        repeat_matmul(tf.constant(count)).numpy()
        runs.append(2 * size**3 * count / (time.perf_counter() - started))
    return {"peak_flops": max(runs), "matmul_size": size, "dtype": dtype}
