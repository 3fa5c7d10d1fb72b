"""Magnitude pruning: schedules, masks enforced after every update, replicas agree, resume, strip."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmp import precision, pruning
from tfmp.errors import UsageError

SHAPE = (6, 6, 1)
GLOBAL_BATCH = 8


def _model(dtype=None, constraint=None, name="tiny"):
    """Conv 4 -> Dense 16 -> float32 head: two prunable kernels and a head left dense."""
    inputs = keras.Input(SHAPE, name=f"{name}_images")
    features = keras.layers.Conv2D(4, 3, activation="relu", dtype=dtype, name=f"{name}_conv")(inputs)
    features = keras.layers.Flatten(dtype=dtype, name=f"{name}_flatten")(features)
    features = keras.layers.Dense(
        16, activation="relu", kernel_constraint=constraint, dtype=dtype, name=f"{name}_dense"
    )(features)
    outputs = keras.layers.Dense(3, activation="softmax", dtype="float32", name=f"{name}_logits")(features)
    return keras.Model(inputs, outputs, name=name)


def _data(examples=64):
    rng = np.random.default_rng(0)
    return rng.random((examples, *SHAPE), dtype=np.float32), rng.integers(0, 3, examples).astype(np.int32)


def _components(variable):
    """Every replica's copy of a (possibly mirrored) keras.Variable."""
    value = variable.value
    return [v.numpy() for v in getattr(value, "values", [value])]


def test_polynomial_schedule_reaches_target_at_end_step():
    schedule = pruning.PolynomialSchedule(target_sparsity=0.8, begin_step=10, end_step=110, every=30)
    assert schedule.sparsity(0) == 0.0 and schedule.sparsity(10) == 0.0
    assert schedule.sparsity(60) == pytest.approx(0.8 - 0.8 * 0.5**3)
    assert schedule.sparsity(110) == pytest.approx(0.8) and schedule.sparsity(500) == pytest.approx(0.8)
    assert all(a <= b for a, b in zip(*[[schedule.sparsity(s) for s in range(k, 120 + k)] for k in (0, 1)]))
    updates, step = [], 0
    while (step := schedule.next_update_step(step)) is not None:
        updates.append(step)
        step += 1
    assert updates == [10, 40, 70, 100, 110]  # every 30 from begin, and end_step itself


def test_constant_schedule_and_factory():
    schedule = pruning.make_schedule("constant", 0.5, begin_step=4, end_step=8, every=2)
    assert isinstance(schedule, pruning.ConstantSchedule)
    assert [schedule.sparsity(s) for s in (3, 4, 8, 20)] == [0.0, 0.5, 0.5, 0.5]
    assert [schedule.next_update_step(s) for s in (0, 5, 8, 9)] == [4, 6, 8, None]
    assert isinstance(pruning.make_schedule("polynomial", 0.5, 0, 8, 2), pruning.PolynomialSchedule)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(target_sparsity=1.0, begin_step=0, end_step=10), "must be in [0, 1)"),
        (dict(target_sparsity=-0.1, begin_step=0, end_step=10), "must be in [0, 1)"),
        (dict(target_sparsity=0.5, begin_step=10, end_step=5), "before begin_step"),
        (dict(target_sparsity=0.5, begin_step=0, end_step=10, every=0), "every=0"),
    ],
)
def test_bad_schedules_are_usage_errors(arguments, message):
    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace(")", r"\)")):
        pruning.PolynomialSchedule(**arguments)
    with pytest.raises(UsageError, match="choose one of"):
        pruning.make_schedule("cubic", 0.5, 0, 10, 1)


def test_bad_models_are_usage_errors():
    schedule = pruning.ConstantSchedule(0.5, 0, 10, 1)
    head_only = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="only")])
    with pytest.raises(UsageError, match="no Dense/Conv kernel left to prune"):
        pruning.Pruner(head_only, schedule)
    assert [layer.name for layer in pruning.Pruner(head_only, schedule, include_head=True).layers] == ["only"]
    with pytest.raises(UsageError, match="already pruned"):
        pruning.Pruner(head_only, schedule, include_head=True)
    with pytest.raises(UsageError, match="not layers of model"):
        pruning.Pruner(_model(), schedule, skip_layers=["nonesuch"])
    pruner = pruning.Pruner(_model(), schedule, skip_layers="tiny_conv")
    assert pruner.names == ["tiny_dense"] and pruner.skipped == ["tiny_conv", "tiny_logits"]


def test_magnitude_mask_is_exact_and_breaks_ties_by_position():
    mask = pruning.magnitude_mask(np.array([[0.5, -0.1], [0.3, 0.1]]), 0.5)
    np.testing.assert_array_equal(mask, [[1, 0], [1, 0]])
    ties = pruning.magnitude_mask(np.full(10, 0.25, np.float32), 0.3)
    np.testing.assert_array_equal(ties, [0, 0, 0] + [1] * 7)
    assert pruning.magnitude_mask(np.ones(4), 0.0).min() == 1.0


def test_mixed_float16_two_replicas_keep_pruned_weights_zero_under_momentum(mirrored):
    """model.fit + PruningCallback: target reached at end_step, then 20 more momentum steps."""
    keras.utils.set_random_seed(0)
    images, labels = _data()
    schedule = pruning.PolynomialSchedule(target_sparsity=0.75, begin_step=2, end_step=10, every=4)
    with mirrored.scope():
        model = _model(dtype="mixed_float16")
        optimizer = precision.LossScaleOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9), initial_scale=1024.0
        )
        model.compile(optimizer, "sparse_categorical_crossentropy", jit_compile=False)
        pruner = pruning.Pruner(model, schedule)
    callback = pruning.PruningCallback(pruner)
    dataset = tf.data.Dataset.from_tensor_slices((images, labels)).repeat().batch(GLOBAL_BATCH)
    model.fit(dataset, epochs=1, steps_per_epoch=7, callbacks=[callback], verbose=0)
    # The last update ran before step 7, at step 6: the schedule's value there.
    assert pruner.sparsity()["overall"] == pytest.approx(schedule.sparsity(6), abs=0.01)
    assert 0 < pruner.sparsity()["overall"] < 0.75
    history = model.fit(dataset, epochs=1, steps_per_epoch=23, callbacks=[callback], verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 30
    sparsity = pruner.sparsity()
    assert sparsity["tiny_conv"] == pytest.approx(0.75, abs=1 / 36)
    assert sparsity["overall"] == pytest.approx(0.75, abs=0.01)
    assert history.history["sparsity"][-1] == sparsity["overall"]
    inner = model.optimizer.inner_optimizer
    for layer, mask in zip(pruner.layers, pruner.masks):
        masks = _components(mask)
        for other in masks[1:]:
            np.testing.assert_array_equal(masks[0], other)  # identical on every replica
        assert len(masks) == 2
        for kernel in _components(layer.kernel):
            assert np.all(kernel[masks[0] == 0] == 0) and np.all(kernel[masks[0] == 1] != 0)
        # Momentum keeps pushing the pruned weights: only the constraint holds them at zero.
        # fit built the optimizer on model.trainable_variables: one momentum each, in that order.
        index = [variable.path for variable in model.trainable_variables].index(layer.kernel.path)
        velocity = inner.momentums[index].numpy()
        assert np.any(velocity[masks[0] == 0] != 0)
    assert model.layers[-1].kernel.constraint is None  # the float32 head is not pruned


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_custom_strategy_run_loop_with_adam(mirrored, policy):
    """The loop's way: strategy.run steps, update on the host between calls."""
    keras.utils.set_random_seed(0)
    images, labels = _data()
    schedule = pruning.ConstantSchedule(target_sparsity=0.5, begin_step=0, end_step=0, every=1)
    with mirrored.scope():
        model = _model(dtype=policy)
        optimizer = keras.optimizers.Adam(0.01)
        optimizer.build(model.trainable_variables)
        pruner = pruning.Pruner(model, schedule)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(reduction="sum")

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True)) / GLOBAL_BATCH
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    @tf.function
    def train(iterator, steps):
        for _ in tf.range(steps):
            mirrored.run(replica_step, args=next(iterator))

    dataset = tf.data.Dataset.from_tensor_slices((images, labels)).repeat().batch(GLOBAL_BATCH)
    iterator = iter(mirrored.experimental_distribute_dataset(dataset))
    assert pruner.next_update_step(0) == 0
    pruner.update(0)
    assert pruner.next_update_step(1) is None
    train(iterator, tf.constant(10))
    assert pruner.sparsity()["overall"] == pytest.approx(0.5, abs=0.01)
    for layer, mask in zip(pruner.layers, pruner.masks):
        for kernel in _components(layer.kernel):
            assert np.all(kernel[mask.numpy() == 0] == 0)


def test_masks_survive_checkpoint_restore(tmp_path):
    keras.utils.set_random_seed(0)
    schedule = pruning.ConstantSchedule(0.6, 0, 100, 10)
    model = _model()
    pruner = pruning.Pruner(model, schedule)
    pruner.update(0)
    path = tf.train.Checkpoint(model=model, **pruner.checkpoint_objects()).save(str(tmp_path / "ckpt"))

    keras.utils.set_random_seed(1)
    fresh = _model(name="tiny")
    fresh_pruner = pruning.Pruner(fresh, schedule)
    assert fresh_pruner.sparsity()["overall"] == 0.0
    tf.train.Checkpoint(model=fresh, **fresh_pruner.checkpoint_objects()).restore(path).assert_consumed()
    for old, new in zip(pruner.masks, fresh_pruner.masks):
        np.testing.assert_array_equal(old.numpy(), new.numpy())
    assert fresh_pruner.sparsity() == pruner.sparsity()
    # The restored masks hold during training of the fresh model.
    fresh.compile(keras.optimizers.SGD(0.1, momentum=0.9), "sparse_categorical_crossentropy")
    fresh.fit(*_data(), batch_size=GLOBAL_BATCH, epochs=1, steps_per_epoch=3, verbose=0)
    for layer, mask in zip(fresh_pruner.layers, fresh_pruner.masks):
        assert np.all(layer.kernel.numpy()[mask.numpy() == 0] == 0)


def test_strip_gives_a_plain_model_with_the_same_outputs_and_the_users_constraint():
    keras.utils.set_random_seed(0)
    model = _model(constraint=keras.constraints.NonNeg())
    pruner = pruning.Pruner(model, pruning.ConstantSchedule(0.5, 0, 10, 1))
    pruner.update(0)
    constraint = model.get_layer("tiny_dense").kernel.constraint
    assert isinstance(constraint, pruning.MaskConstraint) and isinstance(
        constraint.inner, keras.constraints.NonNeg
    )
    # Composition: the user's constraint, then the mask.
    model.compile(keras.optimizers.SGD(0.5, momentum=0.9), "sparse_categorical_crossentropy")
    model.fit(*_data(), batch_size=GLOBAL_BATCH, epochs=1, steps_per_epoch=3, verbose=0)
    dense = model.get_layer("tiny_dense").kernel.numpy()
    assert dense.min() >= 0 and np.all(dense[pruner.masks[1].numpy() == 0] == 0)

    stripped = pruning.strip(model)
    assert len(stripped.weights) == len(model.weights)
    assert all(not isinstance(w.constraint, pruning.MaskConstraint) for w in stripped.weights)
    assert isinstance(stripped.get_layer("tiny_dense").kernel.constraint, keras.constraints.NonNeg)
    assert stripped.get_layer("tiny_conv").kernel.constraint is None
    images, _ = _data(8)
    np.testing.assert_array_equal(stripped.predict(images, verbose=0), model.predict(images, verbose=0))
    kernel = stripped.get_layer("tiny_conv").kernel.numpy()
    assert np.mean(kernel == 0) == pytest.approx(0.5, abs=1 / 36)


def test_describe_for_the_run_card():
    pruner = pruning.Pruner(_model(), pruning.PolynomialSchedule(0.8, 0, 100, 10))
    card = pruner.describe()
    assert card["pruning"].startswith("polynomial") and card["pruning target"] == 0.8
    assert (
        card["pruned layers"].startswith("tiny_conv, tiny_dense") and card["unpruned layers"] == "tiny_logits"
    )
    assert card["pruning sparsity"] == 0.0


def test_masks_follow_the_models_strategy_without_an_explicit_scope(mirrored):
    with mirrored.scope():
        model = _model()
    pruner = pruning.Pruner(model, pruning.ConstantSchedule(0.5, 0, 0, 1))
    assert all(len(_components(mask)) == 2 for mask in pruner.masks)
    pruner.update(0)
    for layer, mask in zip(pruner.layers, pruner.masks):
        first, second = _components(mask)
        np.testing.assert_array_equal(first, second)
        assert all(np.all(kernel[first == 0] == 0) for kernel in _components(layer.kernel))


def test_gzip_size_of_80_percent_sparse_weights(tmp_path):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((128,))
    outputs = keras.layers.Dense(10, name="head")(keras.layers.Dense(256, name="hidden")(inputs))
    model = keras.Model(inputs, outputs)
    model.save_weights(tmp_path / "dense.weights.h5")
    pruner = pruning.Pruner(model, pruning.ConstantSchedule(0.8, 0, 0, 1))
    pruner.update(0)
    pruning.strip(model).save_weights(tmp_path / "sparse.weights.h5")
    dense, sparse = (pruning.gzip_size(str(tmp_path / f"{k}.weights.h5")) for k in ("dense", "sparse"))
    # Measured 0.32x: deflate spends ~32 bits on each kept float32 (random mantissa bytes) plus
    # ~12 on the zero run before it, so 80% sparsity alone cannot go far below 0.3x.
    assert sparse <= 0.35 * dense, (sparse, dense)
    with pytest.raises(UsageError, match="not a file"):
        pruning.gzip_size(str(tmp_path / "missing"))
