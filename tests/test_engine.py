"""The distributed step: replicas agree with one device, overflow skips everywhere, XLA computes
what the uncompiled step does (every precision under XLA on mirrored replicas: tests/test_matrix.py)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmp import models, precision
from tfmp.classification.task import compile_classifier
from tfmp.errors import UsageError
from tfmp.training.engine import Engine

GLOBAL_BATCH = 16
SHAPE = (16, 16, 1)


def _data(poison=None):
    """Fixed images/labels; `poison` = slice of the global batch whose images are inf."""
    rng = np.random.default_rng(0)
    images = rng.random((64, *SHAPE), dtype=np.float32)
    labels = rng.integers(0, 10, 64).astype(np.int32)
    if poison is not None:
        images[poison] = np.inf
    return images, labels


def _distributed(strategy, images, labels, repeat=True):
    def dataset_fn(input_context):
        dataset = tf.data.Dataset.from_tensor_slices((images, labels))
        dataset = dataset.repeat() if repeat else dataset
        return dataset.batch(input_context.get_per_replica_batch_size(GLOBAL_BATCH))

    return strategy.distribute_datasets_from_function(dataset_fn)


def _engine(strategy, policy="float32", xla=False, loss_scale="auto", learning_rate=0.05):
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = models.build("lenet", SHAPE, 10, dtype=policy)
        optimizer = precision.wrap_optimizer(
            keras.optimizers.SGD(learning_rate), policy, loss_scale, initial_scale=1024.0
        )
    compile_classifier(model, optimizer, strategy)
    return Engine(strategy, model, optimizer, xla=xla)


def _weights(model):
    return [np.asarray(w.numpy()) for w in model.trainable_weights]


def _replica_copies(model):
    """Every replica's copy of every trainable variable."""
    copies = []
    for weight in model.trainable_weights:
        variable = weight.value
        copies.append([v.numpy() for v in getattr(variable, "values", [variable])])
    return copies


def test_two_replicas_match_one_device(mirrored):
    """Same global batch on 1 device and on 2 replicas: same weights after 5 steps."""
    images, labels = _data()
    results = []
    for strategy in (tf.distribute.OneDeviceStrategy("/cpu:0"), mirrored):
        engine = _engine(strategy)
        result = engine.train(iter(_distributed(strategy, images, labels)), 5)
        results.append((_weights(engine.model), result.metrics["loss"]))
    (single, single_loss), (replicated, replicated_loss) = results
    for one, two in zip(single, replicated):
        # float32 sums in a different order: agreement to ~1e-6, tolerance 1e-5.
        np.testing.assert_allclose(one, two, atol=1e-5)
    assert single_loss == pytest.approx(replicated_loss, rel=1e-5)
    assert not np.allclose(single[0], _weights(_engine(mirrored).model)[0])  # it did train


def test_steps_per_execution_is_only_a_host_loop(mirrored):
    images, labels = _data()
    one_call, four_calls = _engine(mirrored), _engine(mirrored)
    one_call.train(iter(_distributed(mirrored, images, labels)), 4)
    iterator = iter(_distributed(mirrored, images, labels))
    for _ in range(4):
        four_calls.train(iterator, 1)
    for a, b in zip(_weights(one_call.model), _weights(four_calls.model)):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("poisoned_replica", [0, 1])
def test_overflow_on_one_replica_skips_the_step_on_all(mirrored, poisoned_replica):
    # Replica r receives rows [8r, 8r+8) of each global batch of 16.
    rows = slice(8 * poisoned_replica, 8 * poisoned_replica + 8)
    images, labels = _data(poison=rows)
    engine = _engine(mirrored, "mixed_float16")
    before = _weights(engine.model)
    result = engine.train(iter(_distributed(mirrored, images, labels)), 1)
    # The replicas' gradients are summed before the verdict: the overflow counts on both.
    assert result.nonfinite_steps == mirrored.num_replicas_in_sync
    for variable, start in zip(_replica_copies(engine.model), before):
        for copy in variable:
            assert np.isfinite(copy).all()
            np.testing.assert_array_equal(copy, start)
    assert precision.current_loss_scale(engine.optimizer) == 512.0


def test_fit_with_tfmp_loss_scaler_also_skips_replica_1_overflow(mirrored):
    """The fix lives in the optimizer, so Keras' own fit loop gets it too."""
    images, labels = _data(poison=slice(8, 16))
    keras.utils.set_random_seed(1)
    with mirrored.scope():
        model = models.build("lenet", SHAPE, 10, dtype="mixed_float16")
        optimizer = precision.wrap_optimizer(
            keras.optimizers.SGD(0.05), "mixed_float16", "dynamic", initial_scale=1024.0
        )
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    before = _weights(model)
    model.fit(images[:16], labels[:16], batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)
    for variable, start in zip(_replica_copies(model), before):
        for copy in variable:
            np.testing.assert_array_equal(copy, start)
    assert precision.current_loss_scale(optimizer) == 512.0


def test_fixed_loss_scale_scales_the_gradients_not_the_update():
    """A fixed --loss_scale survives the task's compile: the step's gradients are those of the
    scaled loss (scale x the unscaled ones) and the applied update is the unscaled one."""
    strategy = tf.distribute.get_strategy()
    images, labels = _data()
    batch = (tf.constant(images[:GLOBAL_BATCH]), tf.constant(labels[:GLOBAL_BATCH]), None)
    runs = {}
    for scale in (None, 1024.0):  # None: mixed_float16 without loss scaling
        engine = _engine(strategy, "mixed_float16", loss_scale=scale)
        assert engine.model.optimizer is engine.optimizer  # compile did not wrap it
        gradients = [g.numpy() for g in engine._forward_backward(*batch)[2]]
        before = _weights(engine.model)
        engine.train(iter(_distributed(strategy, images, labels)), 1)
        updates = [after - start for after, start in zip(_weights(engine.model), before)]
        runs[scale] = gradients, updates
    assert precision.loss_scale_mode(engine.optimizer) == "fixed 1024"
    # Multiplying by a power of two is exact in float16 and float32: the two differ only where
    # unscaled float16 gradients are subnormal (what loss scaling is for). Measured: <= 1.3 eps
    # of each tensor's largest value; allowed: 4 float16 epsilons of it.
    tolerance = 4 * precision.EPSILON["float16"]
    (unscaled, plain_updates), (scaled, scaled_updates) = runs[None], runs[1024.0]
    for plain, times_1024 in zip(unscaled, scaled):
        np.testing.assert_allclose(times_1024 / 1024.0, plain, rtol=0, atol=tolerance * np.abs(plain).max())
    for plain, update in zip(plain_updates, scaled_updates):
        np.testing.assert_allclose(update, plain, rtol=0, atol=tolerance * np.abs(plain).max())


def test_engine_refuses_an_optimizer_that_compile_wrapped():
    """Keras' compile wraps a mixed_float16 model's plain optimizer and clears its fixed scale."""
    with tf.distribute.get_strategy().scope():
        model = models.build("mnist_mlp", SHAPE, 10, dtype="mixed_float16")
        optimizer = keras.optimizers.SGD(0.05, loss_scale_factor=1024.0)
        model.compile(optimizer, "sparse_categorical_crossentropy")
    assert optimizer.loss_scale_factor is None  # what Keras' LossScaleOptimizer did to it
    wrapped = r"^model.compile wrapped the SGD optimizer in Keras' dynamic LossScaleOptimizer .*auto_scale_loss=False"
    with pytest.raises(UsageError, match=wrapped):
        Engine(tf.distribute.get_strategy(), model, optimizer)


def test_float32_overflow_is_counted_for_the_stop_decision(mirrored):
    images, labels = _data(poison=slice(0, 1))
    result = _engine(mirrored).train(iter(_distributed(mirrored, images, labels)), 1)
    assert result.nonfinite_steps == mirrored.num_replicas_in_sync  # the summed gradients: on both


def test_xla_matches_no_xla(mirrored):
    images, labels = _data()
    compiled, plain = _engine(mirrored, xla=True), _engine(mirrored, xla=False)
    for engine in (compiled, plain):
        engine.train(iter(_distributed(mirrored, images, labels)), 3)
    for a, b in zip(_weights(compiled.model), _weights(plain.model)):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_evaluate_counts_every_example_once_and_ignores_padding(mirrored):
    images, labels = _data()
    engine = _engine(mirrored)
    valid = np.concatenate([np.ones(50, np.float32), np.zeros(14, np.float32)])  # 64 = 4 full batches
    padded = tf.data.Dataset.from_tensor_slices((images, np.where(valid > 0, labels, 0), valid, valid))
    results = engine.evaluate(mirrored.experimental_distribute_dataset(padded.batch(GLOBAL_BATCH)))
    probabilities = engine.model.predict(images[:50], verbose=0)
    expected_accuracy = np.mean(np.argmax(probabilities, -1) == labels[:50])
    expected_loss = np.mean(-np.log(probabilities[np.arange(50), labels[:50]]))
    assert results["accuracy"] == pytest.approx(expected_accuracy)
    assert results["loss"] == pytest.approx(expected_loss, rel=1e-5)
    # Metrics reset between passes: 16 examples alone give their own accuracy.
    again = engine.evaluate(
        mirrored.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((images[:16], labels[:16])).batch(GLOBAL_BATCH)
        )
    )
    expected_16 = np.mean(np.argmax(probabilities[:16], -1) == labels[:16])
    assert again["accuracy"] == pytest.approx(expected_16)


def test_one_device_evaluate_runs_the_model_in_its_own_graph_not_inside_tf_data():
    """A plain dataset (no strategy) is evaluated by an iterator loop in the eval function, as
    Keras does: a `Dataset.reduce` there would run the model inside tf.data, which places it on
    the host CPU even beside a GPU (tensorflow#32138), a slowdown no CPU test would time."""
    images, labels = _data()
    engine = _engine(tf.distribute.get_strategy())
    dataset = tf.data.Dataset.from_tensor_slices((images, labels)).batch(GLOBAL_BATCH)
    graph_def = engine._eval_fn.get_concrete_function(dataset).graph.as_graph_def()
    nodes = [
        *graph_def.node,
        *(node for function in graph_def.library.function for node in function.node_def),
    ]
    op_types = {node.op for node in nodes}
    assert "ReduceDataset" not in op_types and {"IteratorGetNextAsOptional", "MatMul"} <= op_types
    expected_loss, expected_accuracy = engine.model.evaluate(
        images, labels, batch_size=GLOBAL_BATCH, verbose=0
    )
    results = engine.evaluate(dataset)
    assert results["accuracy"] == pytest.approx(expected_accuracy)
    assert results["loss"] == pytest.approx(expected_loss, rel=1e-5)


def test_predict_gathers_every_row_once_in_input_order(mirrored):
    images, labels = _data()
    engine = _engine(mirrored)
    dataset = tf.data.Dataset.from_tensor_slices((images[:48], np.arange(48))).batch(GLOBAL_BATCH)
    outputs, (_, ids) = engine.predict(mirrored.experimental_distribute_dataset(dataset))
    assert outputs.shape == (48, 10) and sorted(ids.tolist()) == list(range(48))
    np.testing.assert_allclose(outputs, engine.model.predict(images[ids], verbose=0), atol=1e-5)
