"""Two-dimensional parallelism benchmark: N workers x 2 stages beside N-worker data parallelism
and the 1-worker pipeline, timed in turn in the same launched worker processes.

    python -m tfmp.launch --workers=2 -- python -m tfmp.bench.cell '{"kind": "pipeline_2d", ...}'
    rows = pipeline_2d.measure("seed_cnn", image_size=32, per_worker_batch=32, micro_batches=4)

Runs in every worker of a `tfmp.launch` group (`apps.bench --pipeline_2d_workers=2` plans the
cell; `tfmp.bench.runner` launches it): the CPU of each worker is split in 2 logical devices
before TensorFlow starts, and the strategy is MultiWorkerMirroredStrategy with one replica per
worker. Three engines train the same model on synthetic in-memory batches of `per_worker_batch`
rows per worker (weak scaling):

* "2-D": each worker's 2-stage pipeline (M micro-batches), stage gradients all-reduced across
  the workers (`training.engine`'s worker-local mode);
* "data-parallel": the unsplit model, one replica per worker (mirrored variables);
* "1-worker pipeline": the same 2-stage pipeline under no strategy, on each worker alone (the
  workers run it at the same time, each on its own core, without communicating).

They are timed in turns (`pipeline.round_robin`: every worker calls the same runs in the same
order, so the collectives pair up), so drifting load hits all three alike. Each row has
images/s over the rows it trains per step (N x the per-worker batch, or the per-worker batch
for the 1-worker pipeline), the ratio to data parallelism, the bubble (GPipe's (K-1)/(M+K-1) and
the measured idle fraction from each stage timed alone, as in `tfmp.bench.pipeline`) and each
device's parameters and activation bytes.

On this CPU the stages are logical devices on the worker's one pinned core: they cannot run
beside each other, so a pipeline adds its overhead and gains nothing; what the cell can show is
that 2-D training runs, what the all-reduce and the micro-batching cost relative to data
parallelism, and how the parameters split. On GPUs the stages overlap and each device holds
half of the weights and activations.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import tensorflow as tf

from tfmp import models, precision
from tfmp.bench import pipeline as bench_pipeline
from tfmp.classification.task import compile_classifier
from tfmp.distribute import strategies as distribute
from tfmp.pipeline import plan as pipeline
from tfmp.training.engine import Engine

STAGES = 2


def _strategy() -> tf.distribute.Strategy:
    if not tf.config.list_physical_devices("GPU"):
        distribute.split_cpu(STAGES, "--pipeline_stages")  # before the strategy starts TensorFlow
    return distribute.get_strategy("multi_worker", one_replica_per_worker=True)


def _model(model_name, image_size, policy, strategy, split, micro_batches):
    """(engine, plan or None): built outside the scope when `split`, compiled in `strategy`."""
    keras.utils.set_random_seed(0)
    with contextlib.nullcontext() if split else strategy.scope():
        model = models.build(model_name, (image_size, image_size, 3), 10, dtype=policy)
        optimizer = precision.wrap_optimizer(keras.optimizers.SGD(0.01, momentum=0.9), policy, "auto")
    plan = None
    if split:
        plan = pipeline.plan(model, pipeline.stage_devices(STAGES), micro_batches=micro_batches)
        pipeline.place(model, plan)
    compile_classifier(model, optimizer, strategy)
    engine = Engine(
        strategy,
        model,
        optimizer,
        gradients=pipeline.gradients_fn(plan) if plan else None,
        forward=pipeline.forward_fn(plan) if plan else None,
    )
    return engine, plan


def measure(
    model_name: str = "seed_cnn",
    image_size: int = 32,
    per_worker_batch: int = 32,
    micro_batches: int = 4,
    steps: int = 5,
    repeats: int = 3,
    policy: str = "float32",
) -> list[dict]:
    """Rows for 2-D, data-parallel and the 1-worker pipeline; see the module docstring."""
    strategy = _strategy()
    workers = strategy.num_replicas_in_sync
    pipeline.check_batch(micro_batches, per_worker_batch, workers)
    rng = np.random.default_rng(0)
    images = rng.random((per_worker_batch, image_size, image_size, 3), dtype=np.float32)
    labels = rng.integers(0, 10, per_worker_batch).astype(np.int32)
    local = tf.data.Dataset.from_tensors((images, labels)).repeat()
    distributed = strategy.distribute_datasets_from_function(lambda context: local)
    layouts = (
        ("2-D", strategy, True, distributed, per_worker_batch * workers),
        ("data-parallel", strategy, False, distributed, per_worker_batch * workers),
        ("1-worker pipeline", tf.distribute.get_strategy(), True, local, per_worker_batch),
    )
    setups, runs = [], []
    for name, layout_strategy, split, dataset, rows in layouts:
        engine, plan = _model(model_name, image_size, policy, layout_strategy, split, micro_batches)
        iterator = iter(dataset)
        runs.append(lambda count, engine=engine, iterator=iterator: engine.train(iterator, count))
        if name == "2-D":  # each stage alone, for the measured bubble (no collectives in it)
            runs.extend(
                bench_pipeline.stage_run(stage, per_worker_batch, micro_batches) for stage in plan.stages
            )
        setups.append((name, engine, plan, rows))
    seconds = iter(bench_pipeline.round_robin(runs, steps, repeats))
    result = []
    for name, engine, plan, rows in setups:
        step = next(seconds)
        busy = [next(seconds) for _ in plan.stages] if name == "2-D" else []
        result.append(
            _row(name, engine, plan, rows, step, busy, workers, micro_batches, policy, per_worker_batch)
        )
    data_parallel = next(row for row in result if row["layout"] == "data-parallel")
    for row in result:
        row["relative"] = row["images_per_second"] / data_parallel["images_per_second"]
    return result


def _row(name, engine, plan, rows, step, busy, workers, micro_batches, policy, per_worker_batch) -> dict:
    row = {
        "layout": name,
        "model": engine.model.name,
        "policy": policy,
        "workers": 1 if name == "1-worker pipeline" else workers,
        "stages": len(plan.stages) if plan else 1,
        "micro_batches": micro_batches if plan else None,
        "global_batch": rows,
        "images_per_second": rows / step,
        "step_seconds": step,
        "devices": bench_pipeline.device_memory(engine.model, plan, per_worker_batch),
    }
    if plan is None:
        row["devices"][0]["device"] = distribute.describe(engine.strategy).devices[0]
        return row
    row["bubble_theory"] = plan.bubble
    if busy:
        row["bubble_measured"] = 1 - (sum(busy) / len(busy)) / step
    for device, stage in zip(row["devices"], plan.stages):
        device["device"] = stage.device
    return row
