"""Pipeline benchmark: K=2 stages with M micro-batches against the unsplit model, in one process.

    from tfmp.bench import pipeline as bench_pipeline
    rows = bench_pipeline.measure("seed_cnn", image_size=32, global_batch=64, micro_batches=(1, 2, 4, 8))
    print(bench_pipeline.table(rows))

Needs two local devices (two GPUs, or two logical CPUs: `measure` splits the CPU itself when
TensorFlow has not started yet). One row for the unsplit model on the first device and one per M:

* `images_per_second` and `relative` (to the unsplit row), from timed `Engine.train` calls on
  synthetic in-memory batches (warm-up excluded, best of `repeats`);
* `bubble_theory` = (K-1)/(M+K-1), and `bubble_measured` = 1 - mean_k(busy_k) / step, where
  busy_k is the time stage k alone needs for its forward and backward of the whole batch (its M
  micro-batches, timed on its device with nothing else running) and step the pipeline's
  measured step time: the fraction of the step an average device is idle;
* per device: parameters and their bytes (float32 weights + optimizer slots: SGD momentum), and
  activation bytes estimated from the layer output shapes of its stage: GPipe keeps every
  micro-batch's activations until its backward, i.e. the whole per-step batch.

Logical CPU devices share the same cores and thread pool: a stage cannot run "beside" another,
so a CPU pipeline only adds overhead and its measured bubble is about 1 - 1/K. On GPUs the point
is memory per device (each holds 1/K of the weights and activations) and overlap of stages.
"""

from __future__ import annotations

import contextlib
import math
import time

import keras
import numpy as np
import tensorflow as tf

from tfmp import models, precision
from tfmp.bench.report import pipeline_table as table  # noqa: F401  (the rows' table, parent side)
from tfmp.classification.task import compile_classifier
from tfmp.distribute import strategies as distribute
from tfmp.pipeline import plan as pipeline
from tfmp.training.engine import Engine


def _devices():
    if not tf.config.list_physical_devices("GPU"):  # listing logical devices would start TF
        distribute.split_cpu(2)  # refuses (one line) when TensorFlow already runs on one device
    return [
        device.name
        for device in (tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU"))
    ][:2]


def _build(model_name, image_size, policy, devices=None, micro_batches=1):
    """A compiled classifier and its engine: unsplit (devices None) or a 2-stage pipeline."""
    keras.utils.set_random_seed(0)
    strategy = tf.distribute.get_strategy()
    model = models.build(model_name, (image_size, image_size, 3), 10, dtype=policy)
    plan = None
    if devices:
        plan = pipeline.plan(model, devices, micro_batches=micro_batches)
        pipeline.place(model, plan)
    optimizer = precision.wrap_optimizer(keras.optimizers.SGD(0.01, momentum=0.9), policy, "auto")
    compile_classifier(model, optimizer, strategy)
    engine = Engine(strategy, model, optimizer, gradients=pipeline.gradients_fn(plan) if plan else None)
    return engine, plan


def round_robin(runs, steps: int, repeats: int) -> list[float]:
    """Best seconds per step of each run; timed in turns, so load that drifts (other jobs on the
    machine) hits every run alike instead of whichever happened to run at a bad moment."""
    for run in runs:
        run(steps)  # trace and warm up
    best = [math.inf] * len(runs)
    for _ in range(repeats):
        for index, run in enumerate(runs):
            started = time.perf_counter()
            run(steps)
            best[index] = min(best[index], time.perf_counter() - started)
    return [seconds / steps for seconds in best]


def stage_run(stage, rows: int, micro_batches: int):
    """`run(count)`: `count` steps of stage `stage` alone, forward + backward of M micro-batches."""
    spec = stage.model.inputs[0]
    with tf.device(stage.device):
        inputs = tf.cast(tf.random.uniform([rows // micro_batches, *spec.shape[1:]]), spec.dtype)
    variables = stage.model.trainable_variables

    @tf.function
    def run(count):
        total = tf.constant(0.0)
        for _ in tf.range(count):
            for _ in range(micro_batches):
                with tf.device(stage.device), tf.GradientTape() as tape:
                    tape.watch(inputs)
                    outputs = stage.model(inputs, training=True)
                gradients = tape.gradient(
                    outputs, variables + [inputs], output_gradients=tf.ones_like(outputs)
                )
                total += tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32)) for g in gradients])
        return total

    return lambda count: run(tf.constant(count)).numpy()


def device_memory(model, plan, rows):
    """Per device: (parameters, parameter bytes with SGD momentum, activation bytes)."""
    groups = [stage.layers for stage in plan.stages] if plan else [[layer.name for layer in model.layers]]
    result = []
    for names in groups:
        layers = [model.get_layer(name) for name in names]
        parameters = sum(math.prod(w.shape) for layer in layers for w in layer.weights)
        activations = sum(
            math.prod(layer.output.shape[1:]) * rows * np.dtype(layer.compute_dtype).itemsize
            for layer in layers
            if not isinstance(layer, keras.layers.InputLayer)
        )
        result.append(
            {
                "parameters": int(parameters),
                "parameter_bytes": int(parameters * 4 * 2),
                "activation_bytes": int(activations),
            }
        )
    return result


def measure(
    model_name: str = "seed_cnn",
    image_size: int = 32,
    global_batch: int = 64,
    micro_batches=(1, 2, 4, 8),
    steps: int = 5,
    repeats: int = 3,
    policy: str = "float32",
) -> list[dict]:
    """Rows for the unsplit model and K=2 pipelines with each M; see the module docstring."""
    devices = _devices()
    rng = np.random.default_rng(0)
    images = rng.random((global_batch, image_size, image_size, 3), dtype=np.float32)
    labels = rng.integers(0, 10, global_batch).astype(np.int32)
    dataset = tf.data.Dataset.from_tensors((images, labels)).repeat()
    setups, runs = [], []
    for micro in (None, *micro_batches):
        # The unsplit model runs on the first device; a pipeline places its stages itself.
        with tf.device(devices[0]) if micro is None else contextlib.nullcontext():
            stage_devices = None if micro is None else devices
            engine, plan = _build(model_name, image_size, policy, stage_devices, micro or 1)
        if plan:
            plan.check_batch(global_batch)
        iterator = iter(dataset)
        runs.append(lambda count, engine=engine, iterator=iterator: engine.train(iterator, count))
        runs.extend(stage_run(stage, global_batch, micro) for stage in (plan.stages if plan else ()))
        setups.append((engine, plan, micro))
    seconds = iter(round_robin(runs, steps, repeats))
    rows = []
    for engine, plan, micro in setups:
        step = next(seconds)
        busy = [next(seconds) for _ in (plan.stages if plan else ())]
        rows.append(_row(engine, plan, micro, step, busy, global_batch, policy, devices))
    for row in rows:
        row["relative"] = row["images_per_second"] / rows[0]["images_per_second"]
    return rows


def _row(engine, plan, micro, step, busy, global_batch, policy, devices) -> dict:
    row = {
        "model": engine.model.name,
        "policy": policy,
        "global_batch": global_batch,
        "stages": len(plan.stages) if plan else 1,
        "micro_batches": micro,
        "images_per_second": global_batch / step,
        "step_seconds": step,
        "devices": device_memory(engine.model, plan, global_batch),
    }
    if plan is None:
        row["devices"][0]["device"] = devices[0]
        return row
    row.update(
        bubble_theory=plan.bubble,
        bubble_measured=1 - (sum(busy) / len(busy)) / step,
        stage_busy_seconds=busy,
        layers=[f"{s.layers[0]}..{s.layers[-1]}" for s in plan.stages],
    )
    for device, stage in zip(row["devices"], plan.stages):
        device["device"] = stage.device
    return row
