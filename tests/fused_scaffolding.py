"""What the fused-normalization tests share (tests/test_fused_norm.py, test_fused_group_norm.py,
test_fused_layer_norm.py): the tolerances a fused layer is held to against Keras' own, a fused
layer and its Keras twin, plain SGD steps, one Engine step on a strategy's replicas, and the
2-worker cell run in the shared launched group (tests/mwms_worker.py) with its check.

Tolerances: `roundings` epsilons of the compute dtype (each side rounds each value once) plus
float32 epsilon x the summed terms (float32 sums in another order), times the values' scale.
"""

import json
import os

import keras
import numpy as np
import tensorflow as tf

from tfmp.precision.fused_norm import fuse_normalization, is_fused
from tfmp.training.engine import Engine

EPS32 = float(np.finfo(np.float32).eps)

# A fresh process that imports only keras and numpy: loads argv[1], predicts argv[2] into argv[3].
LOAD_WITHOUT_TFMP = """
import json, sys
import keras, numpy
model = keras.saving.load_model(sys.argv[1])
numpy.save(sys.argv[3], numpy.asarray(model(numpy.load(sys.argv[2]), training=False), "float32"))
print(json.dumps({"tfmp": sorted(m for m in sys.modules if m.split(".")[0] == "tfmp"),
                  "classes": sorted({type(layer).__name__ for layer in model.layers})}))
"""


def eps(dtype) -> float:
    return float(np.finfo(tf.as_dtype(dtype).as_numpy_dtype).eps)


def relative_tolerance(dtype, terms: int, roundings: int = 2) -> float:
    """`roundings` epsilons of `dtype` + float32 epsilon x `terms`."""
    return roundings * eps(dtype) + terms * EPS32


def assert_close(actual, desired, dtype, terms: int, roundings: int = 2, scale=None, what=""):
    """Within `relative_tolerance` x the values' scale (by default the largest |desired|)."""
    desired = np.asarray(desired, np.float64)
    scale = np.abs(desired).max() if scale is None else scale
    tolerance = relative_tolerance(dtype, terms, roundings) * scale
    np.testing.assert_allclose(np.asarray(actual, np.float64), desired, rtol=0, atol=tolerance, err_msg=what)


def fused_twin(make_layer, shape, initial_value) -> tuple:
    """([fused layer, Keras copy], fuse_normalization's report): two `make_layer()` built for
    `shape` holding the same random weights, `initial_value(weight, rng)` each; the first
    passed to fuse_normalization in a one-layer model named "pair"."""
    rng = np.random.default_rng(0)
    layers = [make_layer() for _ in range(2)]
    for layer in layers:
        layer.build(shape)
    weights = [initial_value(weight, rng) for weight in layers[0].weights]
    for layer in layers:
        layer.set_weights(weights)
    return layers, fuse_normalization(keras.Sequential([keras.Input(shape[1:]), layers[0]], name="pair"))


def layer_pair(make_layer, shape, initial_value):
    """(fused layer, Keras copy) from `fused_twin`; the first fused (and only it)."""
    layers, result = fused_twin(make_layer, shape, initial_value)
    assert result.fused == ("pair/" + layers[0].name,) and not is_fused(layers[1])
    return layers


def forward_backward(layer, xla: bool):
    """A traced (XLA on or off) `run(x, upstream)`: the layer's output and the gradients of
    sum(output * upstream) to x and to each trainable weight."""

    @tf.function(jit_compile=xla)
    def run(x, upstream):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * upstream)
        return y, tape.gradient(loss, [x, *layer.trainable_weights])

    return run


def sgd_losses(model, batches, xla: bool = False) -> list[float]:
    """The per-step losses of plain SGD(0.1) steps (sparse cross-entropy from logits, a traced
    step, XLA on or off) on `batches`, a list of (x, labels)."""
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_weights)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=xla)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.apply(tape.gradient(loss, model.trainable_weights), model.trainable_weights)
        return loss

    return [float(step(x, y)) for x, y in batches]


def replica_batches(strategy, arrays, global_batch: int, shard: bool = True):
    """An iterator of `arrays` (a tuple of NumPy arrays) in global batches distributed over
    `strategy`'s replicas: each input pipeline (one per worker) its shard of the rows, or with
    `shard=False` every pipeline the same rows from the first."""

    def dataset_fn(context):
        dataset = tf.data.Dataset.from_tensor_slices(arrays)
        if shard:
            dataset = dataset.shard(context.num_input_pipelines, context.input_pipeline_id)
        return dataset.batch(context.get_per_replica_batch_size(global_batch))

    return iter(strategy.distribute_datasets_from_function(dataset_fn))


def engine_step(strategy, build_model, arrays, global_batch: int, shard=True, xla=False, watched=None):
    """(values before, the model) around one Engine step (SGD 0.1, sparse cross-entropy from
    logits) of `build_model()`, made and compiled in `strategy`'s scope, on `replica_batches`;
    `watched(model)` picks the variables whose values before are returned (default: all)."""
    with strategy.scope():
        model = build_model()
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    engine = Engine(strategy, model, xla=xla)
    before = [w.numpy() for w in (watched or (lambda m: m.weights))(model)]
    engine.train(replica_batches(strategy, arrays, global_batch, shard), 1)
    return before, model


def assert_replicas_identical(model, replicas: int = 2):
    """Every replica's copy of every model variable bitwise the same."""
    for weight in model.weights:
        copies = [value.numpy() for value in weight.value.values]
        assert len(copies) == replicas, weight.path
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0], err_msg=weight.path)


def print_worker_cell(strategy, kind: str, out_dir: str, weights, **fields) -> None:
    """A launched worker's cell (tests/mwms_worker.py): `weights` (arrays) to
    `out_dir`/<kind>-<task>.npz and one JSON line of `kind`, its task, replicas and `fields`."""
    task = getattr(getattr(strategy, "cluster_resolver", None), "task_id", 0) or 0
    np.savez(os.path.join(out_dir, f"{kind}-{task}.npz"), *weights)
    record = {"kind": kind, "task": task, "replicas": strategy.num_replicas_in_sync, **fields}
    print(json.dumps(record), flush=True)


def launched_cell(launched_workers, kind: str):
    """(the 2 records, worker 0's weights) of the shared launched group's cell `kind`, after
    checking both workers ran it with 2 replicas and ended with bitwise identical weights."""
    assert launched_workers.returncode == 0, launched_workers.tail
    by_worker = launched_workers.records[kind]
    assert sorted(by_worker) == [0, 1]
    records = [by_worker[task][0] for task in (0, 1)]
    assert [len(by_worker[task]) for task in (0, 1)] == [1, 1]
    assert all(record["replicas"] == 2 for record in records), records
    saved = [np.load(launched_workers.out / f"{kind}-{task}.npz") for task in (0, 1)]
    weights = [[worker[f"arr_{index}"] for index in range(len(worker.files))] for worker in saved]
    for index, (mine, theirs) in enumerate(zip(*weights)):
        np.testing.assert_array_equal(mine, theirs, err_msg=f"{kind} weight {index}")
    return records, weights[0]
