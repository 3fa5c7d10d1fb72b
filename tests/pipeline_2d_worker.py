"""Two-dimensional parallelism cells of the launched group (tests/mwms_worker.py): a 2-stage
pipeline on each of the 2 workers (its 2 logical CPUs), gradients all-reduced across workers.

Run by `mwms_worker.main` on its strategy (MultiWorkerMirroredStrategy, one replica per worker).
The unsplit LeNet trained data-parallel (in the strategy's scope) on the same batches, seed and
optimizer is mwms_worker's "classify" cell of the same precision and XLA setting, so
tests/test_pipeline_2d.py can compare the layouts' weights (saved as
`<FIT_WORKER_OUT>/pipeline_2d_<policy>_<xla>_<worker>.npz` here and `dp_..._<worker>.npz` there).
Each engine reads a new distributed dataset: the training stream reshuffles on every `iter` of
the same dataset, and a new one starts with the same first batches as tests' 1-worker run.
Prints one JSON line per check:
- "pipeline_2d": every precision x XLA off/on, 3 steps: digest of every model and optimizer
  variable (equal on both workers), finite weights, and where each stage's variables live;
- "pipeline_2d_placement": Adam's slots of each stage's variables on that stage's device;
- "pipeline_2d_overflow": float16 with inf images on worker 1 only: the step is skipped on both;
- "pipeline_2d_pruning": a Pruner's masks on their kernels' devices, applied on both workers.
"""

import hashlib
import json
import os

import keras
import numpy as np

from tfmp import models, precision, pruning
from tfmp.classification import data
from tfmp.classification.task import compile_classifier
from tfmp.pipeline import plan as pipeline
from tfmp.training.engine import Engine

MICRO_BATCHES = 2
GLOBAL_BATCH = 32


def worker_index(strategy) -> int:
    return strategy.cluster_resolver.task_id or 0


def save(name: str, strategy, model) -> None:
    """The model's trainable weights, for tests/test_pipeline_2d.py to compare layouts."""
    path = os.path.join(os.environ["FIT_WORKER_OUT"], f"{name}_{worker_index(strategy)}.npz")
    np.savez(path, *[w.numpy() for w in model.trainable_weights])


def digest(model, optimizer) -> str:
    result = hashlib.sha256()
    for variable in model.variables + optimizer.variables:
        result.update(variable.path.encode())
        result.update(np.asarray(variable.numpy()).tobytes())
    return result.hexdigest()


def build_2d(strategy, policy, image_size, optimizer, xla=False):
    """LeNet split in 2 stages on this worker's 2 logical CPUs, made outside the strategy's
    scope (this worker's own variables), compiled in it (metrics summed over workers)."""
    keras.utils.set_random_seed(0)
    model = models.build("lenet", (image_size, image_size, 1), 10, dtype=policy)
    plan = pipeline.plan(model, pipeline.stage_devices(2), micro_batches=MICRO_BATCHES)
    pipeline.place(model, plan)
    compile_classifier(model, optimizer, strategy)
    engine = Engine(
        strategy,
        model,
        optimizer,
        xla=xla,
        gradients=pipeline.gradients_fn(plan),
        forward=pipeline.forward_fn(plan),
    )
    return model, plan, engine


def stage_of_each_variable(model, plan) -> dict:
    """{variable path: [its device's CPU index, its stage's]} for every model variable."""
    stage_device = {}
    for stage in plan.stages:
        for name in stage.layers:
            for variable in model.get_layer(name).variables:
                stage_device[variable.path] = stage.device
    return {
        path: [model_device(v), stage_device[path].rsplit(":", 1)[1]]
        for path, v in ((v.path, v) for v in model.variables)
    }


def model_device(variable) -> str:
    return variable.value.device.rsplit(":", 1)[1]


def batches(strategy, image_size: int):
    """A new iterator over the digits training stream in per-worker batches of a global 32."""
    return iter(
        strategy.distribute_datasets_from_function(
            lambda context: data.load(
                "digits", "train", GLOBAL_BATCH, image_size=image_size, input_context=context
            )[0]
        )
    )


def cells(strategy, image_size: int, steps: int) -> None:
    for policy in precision.POLICIES:
        for xla in (False, True):
            optimizer = precision.wrap_optimizer(keras.optimizers.SGD(0.05), policy, "auto")
            model, plan, engine = build_2d(strategy, policy, image_size, optimizer, xla)
            result = engine.train(batches(strategy, image_size), steps)
            save(f"pipeline_2d_{policy}_{xla}", strategy, model)
            weights = np.concatenate([w.numpy().ravel() for w in model.trainable_weights])
            record = {
                "kind": "pipeline_2d",
                "policy": policy,
                "xla": xla,
                "replicas": strategy.num_replicas_in_sync,
                "worker_local": engine.worker_local,
                "loss": result.metrics["loss"],
                "nonfinite": result.nonfinite_steps,
                "finite": bool(np.isfinite(weights).all()),
                "checksum": digest(model, optimizer),
                "placement": stage_of_each_variable(model, plan),
            }
            print(json.dumps(record), flush=True)
    placement(strategy, image_size)
    overflow_on_worker_1(strategy, image_size)
    prune(strategy, image_size)


def placement(strategy, image_size: int) -> None:
    optimizer = keras.optimizers.Adam(1e-3)
    model, plan, engine = build_2d(strategy, "float32", image_size, optimizer)
    per_device = {}
    for variable in optimizer.variables:
        per_device[model_device(variable)] = per_device.get(model_device(variable), 0) + 1
    trainable = {}
    for variable in model.trainable_variables:
        trainable[model_device(variable)] = trainable.get(model_device(variable), 0) + 1
    record = {"kind": "pipeline_2d_placement", "slots": per_device, "trainable": trainable}
    print(json.dumps(record), flush=True)


def overflow_on_worker_1(strategy, image_size: int) -> None:
    """Inf images on worker 1 only: stage 0 of worker 1 overflows; both workers must skip."""

    def poisoned(context):
        dataset = data.load("digits", "train", 32, image_size=image_size, input_context=context)[0]
        if context.input_pipeline_id == 1:
            dataset = dataset.map(lambda images, labels: (images * np.inf, labels))
        return dataset

    optimizer = precision.wrap_optimizer(keras.optimizers.SGD(0.05), "mixed_float16", "dynamic")
    model, _, engine = build_2d(strategy, "mixed_float16", image_size, optimizer)
    before = [w.numpy() for w in model.trainable_weights]
    result = engine.train(iter(strategy.distribute_datasets_from_function(poisoned)), 1)
    record = {
        "kind": "pipeline_2d_overflow",
        "unchanged": all(np.array_equal(a, w.numpy()) for a, w in zip(before, model.trainable_weights)),
        "nonfinite_steps": result.nonfinite_steps,
        "loss_scale": precision.current_loss_scale(optimizer),
    }
    print(json.dumps(record), flush=True)


def prune(strategy, image_size: int) -> None:
    optimizer = keras.optimizers.SGD(0.05)
    model, _, engine = build_2d(strategy, "float32", image_size, optimizer)
    pruner = pruning.Pruner(model, pruning.ConstantSchedule(0.5, begin_step=0, end_step=2, every=1))
    iterator = batches(strategy, image_size)
    for step in range(2):
        pruner.update(step)
        engine.train(iterator, 1)
    masks_on_kernels = all(
        model_device(mask) == model_device(layer.kernel) for layer, mask in zip(pruner.layers, pruner.masks)
    )
    record = {
        "kind": "pipeline_2d_pruning",
        "sparsity": pruner.sparsity()["overall"],
        "pruned_weights_zero": all(
            bool(np.all(layer.kernel.numpy()[mask.numpy() == 0] == 0))
            for layer, mask in zip(pruner.layers, pruner.masks)
        ),
        "masks_on_kernels": masks_on_kernels,
        "checksum": digest(model, optimizer),
    }
    print(json.dumps(record), flush=True)
