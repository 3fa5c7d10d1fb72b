"""What a bench cell's gradient all-reduce sends per step, and how long it takes on its own.

    fields = gradient_sums.measure(cell, strategy, model, optimizer)   # a cell's schema fields

The cell's plan (`plan_for`: its "allreduce_dtype" and "allreduce_bucket_bytes", as
`--allreduce_dtype` and `--allreduce_bucket_bytes` give the apps) is the one its Engine sums
gradients with; `collective_seconds` times that all-reduce alone on zeros shaped like the
trainable variables: what the backward pass does not hide of it is at most that. Only engine
training cells on several replicas sum gradients; the others report none.
"""

from __future__ import annotations

import statistics
import time

import keras
import tensorflow as tf

from tfmp.distribute import allreduce


def plan_for(cell, strategy, model, optimizer) -> allreduce.Plan:
    """How the cell's gradients are summed: its `allreduce_dtype` and `allreduce_bucket_bytes`
    (None, one device: auto and the default buckets)."""
    bucket_bytes = cell.get("allreduce_bucket_bytes")
    return allreduce.resolve(
        cell.get("allreduce_dtype") or "auto",
        model.dtype_policy.name,
        isinstance(optimizer, keras.optimizers.LossScaleOptimizer),
        strategy.num_replicas_in_sync,
        allreduce.DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes,
    )


def collective_seconds(
    strategy, model, plan: allreduce.Plan, calls: int = 20, repeats: int = 5
) -> float | None:
    """Seconds one step's gradient all-reduce takes alone: zeros shaped like the trainable
    variables, summed with `plan` `calls` times in one traced call, median of `repeats`. What
    the backward pass does not hide of it is at most this; None on one replica."""
    if strategy.num_replicas_in_sync == 1:
        return None
    shapes = [variable.shape for variable in model.trainable_variables]

    def replica():
        context = tf.distribute.get_replica_context()
        allreduce.all_reduce(context, [tf.zeros(shape) for shape in shapes], plan)

    @tf.function
    def sum_gradients():
        # As the engine's loop: strategy.run inside tf.range (an all-reduce cannot sit in a
        # replica function's own loop under MirroredStrategy).
        for _ in tf.range(calls):
            strategy.run(replica)
        return tf.constant(0.0)

    sum_gradients()  # traces and warms up the collectives
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        sum_gradients().numpy()
        times.append((time.perf_counter() - started) / calls)
    return statistics.median(times)


def measure(cell, strategy, model, optimizer) -> dict:
    """What the cell's all-reduce sends per step and replica, and how long it takes alone."""
    plan = plan_for(cell, strategy, model, optimizer)
    summed = strategy.num_replicas_in_sync > 1 and cell["kind"] == "engine" and cell["mode"] == "train"
    return {
        "allreduce_dtype": plan.dtype if summed else None,
        "allreduce_bucket_bytes": plan.bucket_bytes if summed else None,
        "allreduce_buckets": len(allreduce.buckets(model.trainable_variables, plan.dtype, plan.bucket_bytes))
        if summed
        else 0,
        "gradient_bytes_per_step": allreduce.gradient_bytes(model.trainable_variables, plan.dtype)
        if summed
        else 0,
        "collective_seconds_per_step": collective_seconds(strategy, model, plan) if summed else None,
    }
