"""tfmp.fit / tfmp.evaluate on a user's own compiled model: the numbers are model.fit's."""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import peer_errors_once_formed
from fit_worker import GLOBAL_BATCH, StepLosses, compile_tutorial, tutorial_data, tutorial_model

import tfmp
from tfmp import precision, pruning
from tfmp.errors import TrainingDiverged, UsageError


def _tutorial(strategy=None):
    keras.utils.set_random_seed(0)
    with (strategy or tf.distribute.get_strategy()).scope():
        return compile_tutorial(tutorial_model())


def _dataset(images, labels, *extra):
    return tf.data.Dataset.from_tensor_slices((images, labels, *extra)).batch(GLOBAL_BATCH)


def _weights(model):
    return [w.numpy() for w in model.weights]


def _single_device_reference():
    """Keras' own model.fit on one device: per-step losses and final weights."""
    images, labels = tutorial_data()
    model, recorder = _tutorial(), StepLosses()
    history = model.fit(_dataset(images, labels), epochs=1, callbacks=[recorder], verbose=0, shuffle=False)
    return recorder.losses, history.history, _weights(model)


@pytest.fixture(scope="module")
def reference():
    return _single_device_reference()


def test_fit_equals_model_fit_on_one_device(reference, tmp_path):
    losses, history, weights = reference
    images, labels = tutorial_data()
    model, recorder = _tutorial(), StepLosses()
    ours = tfmp.fit(model, _dataset(images, labels), epochs=1, callbacks=[recorder], verbose=0)
    np.testing.assert_allclose(recorder.losses, losses, atol=1e-5)
    assert set(ours.history) == set(history)  # same keys: loss, accuracy
    assert ours.history["accuracy"] == pytest.approx(history["accuracy"], abs=1e-6)
    for a, b in zip(_weights(model), weights):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_fit_on_two_replicas_equals_one_device(reference, mirrored):
    losses, _, weights = reference
    images, labels = tutorial_data()
    model, recorder = _tutorial(mirrored), StepLosses()
    tfmp.fit(model, _dataset(images, labels), epochs=1, callbacks=[recorder], verbose=0)
    np.testing.assert_allclose(recorder.losses, losses, atol=1e-5)
    for a, b in zip(_weights(model), weights):
        np.testing.assert_allclose(a, b, atol=1e-5)
    for weight in model.weights:  # both replicas hold the same values
        copies = [v.numpy() for v in weight.value.values]
        np.testing.assert_array_equal(copies[0], copies[1])


def _two_output_model(strategy):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        inputs = keras.Input((6,), name="features")
        hidden = keras.layers.Dense(8, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3))(
            inputs
        )
        model = keras.Model(
            inputs,
            {
                "kind": keras.layers.Dense(3, name="kind")(hidden),
                "size": keras.layers.Dense(1, name="size")(hidden),
            },
        )
        model.compile(
            keras.optimizers.SGD(0.1),
            loss={
                "kind": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                "size": keras.losses.MeanSquaredError(),
            },
            loss_weights={"kind": 1.0, "size": 0.5},
            metrics={"kind": ["accuracy"]},
        )
    return model


def _two_output_data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 6)).astype(np.float32)
    y = {"kind": (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0), "size": x[:, 2:3] * 2.0}
    weights = rng.uniform(0.2, 2.0, size=64).astype(np.float32)
    return x, y, weights


@pytest.mark.parametrize("replicated", [False, True], ids=["one_device", "two_replicas"])
def test_two_outputs_dict_labels_loss_weights_and_sample_weight_equal_model_fit(mirrored, replicated):
    x, y, sample_weight = _two_output_data()
    keras_model = _two_output_model(tf.distribute.get_strategy())
    expected = keras_model.fit(
        x, y, sample_weight=sample_weight, batch_size=16, epochs=2, shuffle=False, verbose=0
    ).history
    model = _two_output_model(mirrored if replicated else tf.distribute.get_strategy())
    history = tfmp.fit(
        model, x, y, sample_weight=sample_weight, batch_size=16, epochs=2, shuffle=False, verbose=0
    ).history
    assert set(history) == set(expected)  # loss, kind_loss, size_loss, kind_accuracy
    for key in expected:
        np.testing.assert_allclose(history[key], expected[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for a, b in zip(_weights(model), _weights(keras_model)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_validation_and_evaluate_match_keras(reference):
    images, labels = tutorial_data()
    model = _tutorial()
    history = tfmp.fit(
        model,
        images,
        labels,
        batch_size=GLOBAL_BATCH,
        shuffle=False,
        epochs=1,
        validation_data=(images[:40], labels[:40]),
        verbose=0,
    ).history
    expected = model.evaluate(images[:40], labels[:40], batch_size=GLOBAL_BATCH, return_dict=True, verbose=0)
    assert history["val_loss"][0] == pytest.approx(expected["loss"], rel=1e-5)
    assert history["val_accuracy"][0] == pytest.approx(expected["accuracy"])
    ours = tfmp.evaluate(
        model, images[:40], labels[:40], batch_size=GLOBAL_BATCH, return_dict=True, verbose=0
    )
    assert ours["loss"] == pytest.approx(expected["loss"], rel=1e-5)


def test_mixed_float16_model_gets_replica_safe_loss_scaling(mirrored, tmp_path):
    keras.mixed_precision.set_global_policy("mixed_float16")  # as the mixed-precision article does
    model = _tutorial(mirrored)
    assert type(model.optimizer) is keras.optimizers.LossScaleOptimizer  # Keras' own, from compile
    images, labels = tutorial_data()
    history = tfmp.fit(model, _dataset(images, labels), epochs=1, verbose=0, model_dir=str(tmp_path))
    assert isinstance(model.optimizer, precision.LossScaleOptimizer)
    assert "loss_scale" not in history.history  # Keras' keys; the scale is in metrics.jsonl
    card = json.load(open(tmp_path / "run_card.json"))
    assert "replaced Keras' LossScaleOptimizer" in card["tfmp changed"]
    assert card["loss scale"].startswith("dynamic")
    assert np.isfinite(history.history["loss"][0])
    # An overflow on replica 1 alone (rows 8..15 of the global batch) skips the step on both:
    # 1e5 is a finite float32 input that float16 cannot hold (its largest is 65504), so the
    # model overflows; an inf input would stop the run as bad data (tests/test_bad_numbers.py).
    before = [[v.numpy() for v in w.value.values] for w in model.trainable_weights]
    poisoned = images[:GLOBAL_BATCH].copy()
    poisoned[8:] = 1e5
    tfmp.fit(model, _dataset(poisoned, labels[:GLOBAL_BATCH]), epochs=1, verbose=0)
    for weight, copies in zip(model.trainable_weights, before):
        for replica_value, start in zip(weight.value.values, copies):
            np.testing.assert_array_equal(replica_value.numpy(), start)
    assert precision.current_loss_scale(model.optimizer) == 16384.0


def test_plain_optimizer_on_float16_model_is_wrapped():
    keras.utils.set_random_seed(0)
    mixed = keras.Sequential(
        [keras.Input((12, 12, 1)), keras.layers.Flatten(), keras.layers.Dense(10, dtype="mixed_float16")]
    )
    mixed.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    images, labels = tutorial_data(32)
    tfmp.fit(mixed, images, labels, batch_size=16, verbose=0)
    assert isinstance(mixed.optimizer, precision.LossScaleOptimizer)
    assert int(mixed.optimizer.iterations.numpy()) == 2  # both steps applied through the wrapper


def test_resume_from_model_dir_continues_at_the_exact_step(reference, tmp_path):
    _, _, weights = reference
    images, labels = tutorial_data()
    first = _tutorial()
    # Stop after 12 of 20 steps, as a preempted run would: steps_per_epoch=12 in a first call.
    tfmp.fit(first, _dataset(images, labels).take(12), epochs=1, verbose=0, model_dir=str(tmp_path))
    resumed = _tutorial()
    tfmp.fit(
        resumed, _dataset(images, labels), epochs=1, verbose=0, model_dir=str(tmp_path), steps_per_epoch=20
    )
    assert int(resumed.optimizer.iterations.numpy()) == 20
    for a, b in zip(_weights(resumed), weights):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert os.path.exists(tmp_path / "metrics.jsonl")


def test_bad_input_is_one_line_and_writes_nothing(mirrored, tmp_path):
    images, labels = tutorial_data(48)
    model_dir = tmp_path / "run"
    uncompiled = tutorial_model()
    cases = [
        (
            lambda: tfmp.fit(uncompiled, images, labels, batch_size=16, model_dir=str(model_dir)),
            "is not compiled; call model.compile",
        ),
        (
            lambda: tfmp.fit(
                _tutorial(mirrored), _dataset(images, labels).rebatch(15), model_dir=str(model_dir)
            ),
            "global batch 15 is not divisible by 2 replicas",
        ),
        (
            lambda: tfmp.fit(
                _tutorial(),
                np.zeros((32, 9, 9, 1), np.float32),
                labels[:32],
                batch_size=16,
                model_dir=str(model_dir),
            ),
            "the data do not fit model",
        ),
    ]
    outside = _tutorial()
    cases.append(
        (
            lambda: _fit_in_scope(mirrored, outside, images, labels, model_dir),
            "was built outside the scope of the MirroredStrategy",
        )
    )
    for call, message in cases:
        with pytest.raises(UsageError, match=message) as error:
            call()
        assert "\n" not in str(error.value)
        assert not model_dir.exists()


def test_labels_validation_data_and_model_dir_are_checked_before_anything_is_written(tmp_path):
    images, labels = tutorial_data(32)
    model_dir = tmp_path / "run"
    out_of_range, negative = labels.copy(), labels.copy()
    out_of_range[[3, 5]] = 12
    negative[3] = -1
    a_file = tmp_path / "a_file"
    a_file.write_text("")

    def fit(*data, model=None, model_dir=str(model_dir), **options):
        options.setdefault("batch_size", 16)
        return tfmp.fit(model or _tutorial(), *data, model_dir=model_dir, verbose=0, **options)

    binary = keras.Sequential([keras.Input((12, 12, 1)), keras.layers.Flatten(), keras.layers.Dense(1)])
    binary.compile(keras.optimizers.SGD(0.1), "binary_crossentropy")
    x, y, _ = _two_output_data()
    y["kind"][0] = 3
    cases = [
        (
            lambda: fit(images, out_of_range),
            r"^training data: label 12 \(2 of 32 checked\) is out of range for the 10-unit output of model "
            r"'sequential\w*': sparse_categorical_crossentropy takes class ids 0..9; fix the labels, or give "
            r"the output 13 units$",
        ),
        (
            lambda: fit(_dataset(images, out_of_range), batch_size=None),  # a dataset: its first batch
            r"^training data: label 12 \(2 of 16 checked\) is out of range",
        ),
        (
            lambda: fit(images, negative),
            r"label -1 \(1 of 32 checked\) is negative: .* ignore_class=-1 to the loss",
        ),
        (lambda: fit(images, labels.astype(str)), r"training data: the labels are strings; .*StringLookup"),
        (
            lambda: fit(images, labels, model=binary),
            r"label [2-9] .* is outside \[0, 1\]: binary_crossentropy",
        ),
        (
            lambda: fit(x, y, model=_two_output_model(tf.distribute.get_strategy())),
            r"label 3 for output 'kind' \(1 of 64 checked\) is out of range for the 3-unit output",
        ),
        (lambda: fit(images, labels, validation_data=(images, out_of_range)), r"^validation data: label 12 "),
        (
            lambda: fit(images, labels, validation_data=(images[:, :9, :9], labels)),
            r"^validation_data do not fit model .*\(\(None, 9, 9, 1\), \(None,\)\) vs training "
            r"\(\(None, 12, 12, 1\), \(None,\)\): give validation_data the training data's shapes$",
        ),
        (
            lambda: fit(images, labels, model_dir=str(a_file)),
            r"^model_dir=\S*a_file is a file, not a directory",
        ),
        (
            lambda: fit(images, labels, model_dir=str(a_file / "run")),
            r"a_file is a file, not a directory; name",
        ),
    ]
    for call, message in cases:
        with pytest.raises(UsageError, match=message) as error:
            call()
        assert "\n" not in str(error.value)
        assert not model_dir.exists()
    assert a_file.read_text() == "" and [path.name for path in tmp_path.iterdir()] == ["a_file"]
    # Validation labels shaped (N, 1) and int32 are not the training data's spec, but they fit.
    history = fit(
        images, labels, validation_data=(images, labels.reshape(-1, 1).astype(np.int32)), model_dir=None
    )
    assert np.isfinite(history.history["val_loss"][0])


def _fixed_scale_tutorial(scale):
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = tutorial_model()
    # auto_scale_loss=False: Keras' compile would wrap the optimizer and clear its fixed scale.
    model.compile(
        keras.optimizers.SGD(0.05, loss_scale_factor=scale),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        auto_scale_loss=False,
    )
    return model


def test_fixed_loss_scale_is_shown_recorded_and_its_overflow_stops_the_run(tmp_path):
    images, labels = tutorial_data(32)
    model = _fixed_scale_tutorial(1024.0)
    tfmp.fit(model, images, labels, batch_size=16, verbose=0, model_dir=str(tmp_path))
    card = json.load(open(tmp_path / "run_card.json"))
    assert card["loss scale"] == "fixed 1024, now 1024" and "tfmp changed" not in card
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [record["loss_scale"] for record in records if record["split"] == "train"] == [1024.0]
    # 1e30 fits float32 but overflows the float16 gradients; a fixed scale skips no step.
    with pytest.raises(
        TrainingDiverged,
        match=r"at step 1 .*\(loss scale: fixed 1e\+30; the inputs were finite\).*lower the loss scale",
    ):
        tfmp.fit(_fixed_scale_tutorial(1e30), images, labels, batch_size=16, verbose=0)


def _fit_in_scope(strategy, model, images, labels, model_dir):
    with strategy.scope():
        return tfmp.fit(model, images, labels, batch_size=16, model_dir=str(model_dir))


@pytest.mark.slow
def test_same_script_on_two_workers_equals_one_process(reference, launched_workers):
    """tests/fit_worker.py's body in conftest's shared launched group (2 workers, the strategy
    from get_strategy("auto") as the script gets it) equals Keras' model.fit on one device."""
    losses, _, weights = reference
    assert launched_workers.returncode == 0, launched_workers.tail
    records = [record for worker in (0, 1) for record in launched_workers.records["fit"][worker]]
    assert len(records) == 2 and sorted(record["task"] for record in records) == [0, 1]
    for record in records:
        assert record["replicas"] == 2
        np.testing.assert_allclose(record["losses"], losses, atol=1e-5)
        saved = np.load(launched_workers.out / f"weights-{record['task']}.npz")
        for index, want in enumerate(weights):
            np.testing.assert_allclose(saved[f"arr_{index}"], want, atol=1e-5)
    # The run ends at a barrier: no worker loses its coordination-service peer while finishing.
    assert not peer_errors_once_formed(launched_workers.output, ['"kind": "strategy"'])
    assert "Traceback" not in launched_workers.output


def test_a_users_model_is_pruned_through_the_keras_callback():
    images, labels = tutorial_data()
    model = _tutorial()
    pruner = pruning.Pruner(model, pruning.PolynomialSchedule(0.5, begin_step=2, end_step=10, every=2))
    history = tfmp.fit(
        model, _dataset(images, labels), epochs=1, verbose=0, callbacks=[pruning.PruningCallback(pruner)]
    )
    assert history.history["sparsity"] == [pytest.approx(0.5, abs=0.01)]
    dense = model.layers[-2].kernel.numpy()  # pruned, and kept at zero through later steps
    assert np.mean(dense == 0) == pytest.approx(0.5, abs=0.01)
