"""`tfmp.fit` is `model.fit`: one row per argument, input type and callback.

Each row trains two copies of one tiny model from the same weights, one with Keras' own
`model.fit` (one device) and one with `tfmp.fit` (one device, and two mirrored replicas where
the row makes sense there), and compares the History (keys, values, `epoch`, `params`) and the
final weights. Shuffling is off so both read the same batches. Tolerance: float32's epsilon,
times the values' scale (~1) and the number of steps whose rounding can differ (summation
order in the gradient reductions), times a safety factor of 16.
"""

import json
import os
import re
import signal
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from fit_rows import (
    CLASSES,
    EXAMPLES,
    FEATURES,
    MULTI_WORKER,
    OWN_MULTI_WORKER,
    OWN_STEPS,
    REAL_IMAGES,
    ROWS,
    TOLERANCE,
    Y_VALUE,
    Batches,
    Row,
    X,
    Y,
    gan,
    keras_can_fit,
    scaled_loss,
    single_output,
)

import tfmp
from tfmp import precision as tfmp_precision
from tfmp.errors import Preempted, UsageError
from tfmp.training import fitting


def _fit_both(row: Row, strategy) -> tuple:
    keras_model, tfmp_model = row.build(tf.distribute.get_strategy()), row.build(strategy)
    tfmp_model.set_weights(keras_model.get_weights())
    expected = keras_model.fit(**row.arguments(), shuffle=False, verbose=0)
    ours = tfmp.fit(tfmp_model, **row.arguments(), shuffle=False, verbose=0)
    return expected, ours, keras_model, tfmp_model


def _assert_same(expected, ours, keras_model, tfmp_model):
    assert ours.history.keys() == expected.history.keys()
    for key, values in expected.history.items():
        np.testing.assert_allclose(ours.history[key], values, rtol=TOLERANCE, atol=TOLERANCE, err_msg=key)
    assert ours.epoch == expected.epoch
    assert ours.params == expected.params
    for ours_weight, keras_weight in zip(tfmp_model.get_weights(), keras_model.get_weights()):
        np.testing.assert_allclose(ours_weight, keras_weight, rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize("name", list(ROWS))
def test_one_device_equals_model_fit(name):
    _assert_same(*_fit_both(ROWS[name], tf.distribute.get_strategy()))


@pytest.mark.parametrize("name", [name for name, row in ROWS.items() if row.mirrored])
def test_two_replicas_equal_model_fit(name, mirrored):
    _assert_same(*_fit_both(ROWS[name], mirrored))


class Interrupt(keras.callbacks.Callback):
    """Stands for a crash at the start of epoch `at` (0-based)."""

    def __init__(self, at):
        super().__init__()
        self.at = at

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.at:
            raise RuntimeError("interrupted")


def test_backup_and_restore_runs_only_the_remaining_epochs_as_keras(tmp_path):
    runs = {}
    for who in ("keras", "tfmp"):
        model = single_output(tf.distribute.get_strategy())
        fit = model.fit if who == "keras" else lambda **kw: tfmp.fit(model, **kw)
        arguments = dict(x=X[:32], y=Y[:32], batch_size=16, epochs=4, shuffle=False, verbose=0)
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / who))
        with pytest.raises(RuntimeError, match="interrupted"):
            fit(**arguments, callbacks=[backup, Interrupt(at=2)])
        history = fit(**arguments, callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / who))])
        runs[who] = history, model
    (expected, keras_model), (ours, tfmp_model) = runs["keras"], runs["tfmp"]
    assert expected.epoch == [2, 3]
    _assert_same(expected, ours, keras_model, tfmp_model)
    assert int(tfmp_model.optimizer.iterations.numpy()) == int(keras_model.optimizer.iterations.numpy()) == 8


def test_terminate_on_nan_stops_and_returns_the_history_as_keras():
    poisoned = X[:64].copy()
    poisoned[40] = np.inf  # batch 2 of 16
    histories = {}
    for who in ("keras", "tfmp"):
        model = single_output(tf.distribute.get_strategy())
        fit = model.fit if who == "keras" else lambda **kw: tfmp.fit(model, **kw)
        histories[who] = fit(
            x=poisoned, y=Y[:64], batch_size=16, epochs=3, shuffle=False, verbose=0,
            callbacks=[keras.callbacks.TerminateOnNaN()],
        )  # fmt: skip
        if who == "tfmp":  # tfmp never applies a non-finite step: the weights stay finite
            assert all(np.isfinite(weight).all() for weight in model.get_weights())
    expected, ours = histories["keras"], histories["tfmp"]
    assert ours.epoch == expected.epoch == [0]
    assert ours.history.keys() == expected.history.keys()
    assert np.isnan(expected.history["loss"][0]) and np.isnan(ours.history["loss"][0])


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(x=tf.data.Dataset.from_tensor_slices((X, Y)).batch(16), validation_split=0.2), "needs arrays"),
        (dict(x=X, y=Y, validation_split=1.5), "between 0 and 1"),
        (dict(x=X, y=Y, class_weight={0: 1.0}, sample_weight=np.ones(EXAMPLES)), "at the same time"),
        (dict(x=tf.data.Dataset.from_tensor_slices((X, Y)).batch(16), y=Y), "y must be None"),
        (dict(x=X, y=Y[:10]), "different numbers of examples"),
        (dict(x=X, y=Y, validation_freq=0), "validation_freq=0"),
        (dict(x=X, y=Y, initial_epoch=-1), "initial_epoch=-1"),
        (dict(x=(row for row in [(X[:16], Y[:16])])), "no length and is read once"),
    ],
    ids=[
        "split_of_a_dataset",
        "split_above_one",
        "class_and_sample_weight",
        "y_beside_a_dataset",
        "lengths_differ",
        "validation_freq_zero",
        "negative_initial_epoch",
        "generator_without_steps",
    ],
)
def test_what_keras_refuses_is_one_usage_error_and_writes_nothing(arguments, message, tmp_path):
    model = single_output(tf.distribute.get_strategy())
    with pytest.raises(UsageError, match=message) as raised:
        tfmp.fit(model, **arguments, verbose=0, model_dir=str(tmp_path / "run"))
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "run").exists()


def test_class_weight_with_a_sequence_output_is_refused_as_keras():
    with tf.distribute.get_strategy().scope():
        inputs = keras.Input((4, FEATURES))
        model = keras.Model(inputs, keras.layers.Dense(CLASSES)(inputs))
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    labels = np.zeros((EXAMPLES, 4, 1), "int32")
    with pytest.raises(UsageError, match="rank 1 or 2"):
        tfmp.fit(
            model, np.zeros((EXAMPLES, 4, FEATURES), "float32"), labels, class_weight={0: 2.0}, verbose=0
        )


def _progress_lines(text: str) -> list[str]:
    """Keras' progress output reduced to what does not depend on timing: the "Epoch i/n" lines
    and each bar's final state ("n/n ... - loss: #"), colours, times and numbers blanked."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", text)
    segments = [segment.strip() for segment in re.split(r"[\r\n\x08]+", plain)]
    final = [s for s in segments if s.startswith("Epoch") or re.match(r"(\d+)/\1\b", s)]
    timeless = [re.sub(r"\d+(\.\d+)?(ms|us|s)\b", "#t", line) for line in final]
    return [re.sub(r"\d+(\.\d+)?", "#", line) for line in timeless]


@pytest.mark.parametrize("verbose", [2, 1])
def test_output_is_keras_progress_bar_and_no_run_card_without_model_dir(verbose, capsys):
    model = single_output(tf.distribute.get_strategy())
    arguments = dict(x=X[:32], y=Y[:32], batch_size=16, epochs=2, validation_data=(X[:16], Y[:16]))
    model.fit(**arguments, verbose=verbose)
    expected = capsys.readouterr().out
    tfmp.fit(model, **arguments, verbose=verbose)
    ours = capsys.readouterr().out
    assert len(_progress_lines(expected)) == 4  # two epochs: a header and a final bar each
    assert _progress_lines(ours) == _progress_lines(expected)
    assert "run card" not in ours


def test_a_second_fit_in_one_process_traces_nothing_again(tmp_path, capsys):
    # Counted on this model's own functions: TensorFlow's "triggered tf.function retracing"
    # warning counts every Engine's traces of the same code together (earlier tests' included)
    # and stops after two, so it would pass or fail by which tests ran before in this process.
    model = single_output(tf.distribute.get_strategy())

    def fit_and_evaluate():
        tfmp.fit(model, X, Y, batch_size=16, verbose=0, validation_data=(X[:16], Y[:16]))
        tfmp.evaluate(model, X, Y, verbose=0)
        _, engine = getattr(model, fitting._ENGINE_ATTRIBUTE)
        functions = {"train": engine._train_fn, "eval": engine._eval_fn, "read": engine._read_fn}
        return engine, {
            name: function.experimental_get_tracing_count() for name, function in functions.items()
        }

    engine, traced = fit_and_evaluate()
    assert traced == {"train": 1, "eval": 1, "read": 1}
    for _ in range(3):
        assert fit_and_evaluate() == (engine, traced)
    tfmp.fit(model, X, Y, batch_size=16, verbose=1, model_dir=str(tmp_path))
    assert "tfmp run card" in capsys.readouterr().out  # shown where a model_dir is written


@pytest.mark.slow
def test_two_launched_workers_equal_model_fit(launched_workers, mirrored):
    """tests/fit_rows.py's MULTI_WORKER rows run by tests/fit_worker.py in conftest's shared
    2-worker group (one replica each) end like Keras' model.fit on one device, and its
    OWN_MULTI_WORKER rows (a model's own train_step and test_step) like Keras' fit on 2 mirrored
    replicas; a generator is refused there with the conversion to make."""
    assert launched_workers.returncode == 0, launched_workers.tail
    for name in MULTI_WORKER:
        _assert_worker_records(launched_workers, name, *_keras_fit(ROWS[name], tf.distribute.get_strategy()))
    for name in OWN_MULTI_WORKER:  # a step of one's own logs per-replica values: Keras on 2 replicas
        _assert_worker_records(launched_workers, name, *_keras_fit(OWN_STEPS[name], mirrored))
    refusals = [r["message"] for worker in (0, 1) for r in launched_workers.records["fit_refused"][worker]]
    assert len(refusals) == 2 and all("tf.data.Dataset" in (message or "") for message in refusals), refusals


def _keras_fit(row: Row, strategy) -> tuple:
    model = row.build(strategy)
    return model.fit(**row.arguments(), shuffle=False, verbose=0), model


def _assert_worker_records(launched_workers, name: str, expected, keras_model) -> None:
    records = [
        r for worker in (0, 1) for r in launched_workers.records["fit_row"][worker] if r["name"] == name
    ]
    assert sorted(record["task"] for record in records) == [0, 1], name
    for record in records:
        assert record["epoch"] == expected.epoch and record["history"].keys() == expected.history.keys(), name
        for key, values in expected.history.items():
            np.testing.assert_allclose(record["history"][key], values, rtol=TOLERANCE, atol=TOLERANCE)
        saved = np.load(launched_workers.out / f"row-{name}-{record['task']}.npz")
        for index, weight in enumerate(keras_model.get_weights()):
            np.testing.assert_allclose(saved[f"arr_{index}"], weight, rtol=TOLERANCE, atol=TOLERANCE)


def test_a_py_datasets_on_epoch_end_is_called_as_keras_calls_it():
    calls = {}

    class Counted(Batches):
        def on_epoch_end(self):
            calls[who] = calls.get(who, 0) + 1

    for who in ("keras", "tfmp"):
        model = single_output(tf.distribute.get_strategy())
        fit = model.fit if who == "keras" else lambda **kw: tfmp.fit(model, **kw)
        fit(x=Counted(X, Y), epochs=3, verbose=0)
    assert calls["tfmp"] == calls["keras"]


@pytest.mark.parametrize("replicated", [False, True], ids=["one_device", "two_replicas"])
def test_evaluate_and_predict_return_what_keras_returns(replicated, mirrored):
    keras_model = single_output(tf.distribute.get_strategy())
    model = single_output(mirrored if replicated else tf.distribute.get_strategy())
    model.set_weights(keras_model.get_weights())
    expected = keras_model.evaluate(X, Y, batch_size=16, verbose=0)
    ours = tfmp.evaluate(model, X, Y, batch_size=16, verbose=0)
    assert isinstance(ours, list) and len(ours) == len(expected) == 2  # [loss, accuracy]
    np.testing.assert_allclose(ours, expected, rtol=TOLERANCE)
    as_dict = tfmp.evaluate(model, X, Y, batch_size=16, verbose=0, return_dict=True)
    assert as_dict.keys() == keras_model.evaluate(X, Y, batch_size=16, verbose=0, return_dict=True).keys()
    np.testing.assert_allclose(
        tfmp.predict(model, X[:40], batch_size=16, verbose=0),  # a short last batch, split over replicas
        keras_model.predict(X[:40], batch_size=16, verbose=0),
        rtol=TOLERANCE,
        atol=TOLERANCE,
    )


@pytest.mark.parametrize("replicated", [False, True], ids=["one_device", "two_replicas"])
@pytest.mark.parametrize("name", list(OWN_STEPS))
def test_a_models_own_steps_run_as_model_fit_runs_them(name, replicated, mirrored):
    """Keras' guide's patterns (fit_rows.OWN_STEPS) through tfmp.fit, evaluate and predict against
    Keras' own on the same strategy: a step of one's own reports per-replica values (its loss
    divided by the replicas, say), so N replicas compare with Keras on N."""
    strategy = mirrored if replicated else tf.distribute.get_strategy()
    row = OWN_STEPS[name]
    keras_model, tfmp_model = row.build(strategy), row.build(strategy)
    tfmp_model.set_weights(keras_model.get_weights())
    if replicated and name == "gan_without_labels":
        keras_can_fit(keras_model)
    expected = keras_model.fit(**row.arguments(), shuffle=False, verbose=0)
    ours = tfmp.fit(tfmp_model, **row.arguments(), shuffle=False, verbose=0)
    _assert_same(expected, ours, keras_model, tfmp_model)
    if name == "gan_without_labels":  # both optimizers stepped, the noise drawn as often
        for attribute in ("d_optimizer", "g_optimizer"):
            assert getattr(tfmp_model, attribute).iterations.numpy() == 6
        assert (tfmp_model.seed_generator.state.numpy() == keras_model.seed_generator.state.numpy()).all()
    if name == "own_trackers_and_test_step":
        for return_dict in (False, True):
            arguments = dict(x=X, y=Y_VALUE, batch_size=16, verbose=0, return_dict=return_dict)
            np.testing.assert_allclose(
                tf.nest.flatten(tfmp.evaluate(tfmp_model, **arguments)),
                tf.nest.flatten(keras_model.evaluate(**arguments)),
                rtol=TOLERANCE,
            )
        ours, expected = (
            predict(model, X[:40], batch_size=16, verbose=0)
            for predict, model in ((tfmp.predict, tfmp_model), (keras.Model.predict, keras_model))
        )
        assert ours.keys() == expected.keys() == {"value", "doubled"}
        for key in expected:
            np.testing.assert_allclose(ours[key], expected[key], rtol=TOLERANCE, atol=TOLERANCE)


def test_run_eagerly_runs_every_step_as_python_and_jit_compile_means_xla(tmp_path):
    calls = []

    class Probe(keras.layers.Layer):
        def call(self, inputs):
            calls.append(tf.executing_eagerly())  # a user's print or pdb here runs when this is True
            return inputs

    def probed(**compiled):
        with tf.distribute.get_strategy().scope():
            keras.utils.set_random_seed(3)
            inputs = keras.Input((FEATURES,))
            model = keras.Model(inputs, keras.layers.Dense(CLASSES)(Probe()(inputs)))
            model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True), **compiled)
        return model

    arguments = dict(x=X[:64], y=Y[:64], batch_size=16, shuffle=False, verbose=0)
    expected = probed().fit(**arguments)
    calls.clear()
    eager = probed(run_eagerly=True)
    history = tfmp.fit(eager, **arguments, model_dir=str(tmp_path / "eager"))
    assert calls[-4:] == [True] * 4  # each of the 4 steps ran as Python (before them: the data check)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=TOLERANCE)
    card = (tmp_path / "eager" / "run_card.json").read_text()
    assert "every step runs as Python" in card
    jitted = probed(jit_compile=True)
    calls.clear()
    history = tfmp.fit(jitted, **arguments, model_dir=str(tmp_path / "xla"))
    assert calls and not any(calls)  # traced once, compiled
    assert json.loads((tmp_path / "xla" / "run_card.json").read_text())["xla"].startswith(
        "on (compile(jit_compile=True)"
    )
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)


class Counts(keras.metrics.Metric):
    """A matrix result: counts of (true class, predicted class) pairs of one-hot labels."""

    def __init__(self, **kwargs):
        super().__init__(name="counts", **kwargs)
        self.table = self.add_variable((CLASSES, CLASSES), initializer="zeros", name="table")

    def update_state(self, y_true, y_pred, sample_weight=None):
        pairs = tf.stack([tf.argmax(y_true, -1, tf.int32), tf.argmax(y_pred, -1, tf.int32)], 1)
        self.table.assign_add(tf.scatter_nd(pairs, tf.ones(tf.shape(pairs)[:1]), (CLASSES, CLASSES)))

    def result(self):
        return tf.convert_to_tensor(self.table)


def test_vector_and_matrix_metrics_are_logged_as_keras_logs_them(tmp_path, mirrored):
    def model(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(3)
            inputs = keras.Input((FEATURES,))
            model = keras.Model(inputs, keras.layers.Dense(CLASSES, activation="softmax")(inputs))
            model.compile("sgd", "categorical_crossentropy", metrics=[keras.metrics.F1Score(), Counts()])
        return model

    one_hot = np.eye(CLASSES, dtype="float32")[Y]
    arguments = dict(x=X, y=one_hot, batch_size=16, epochs=2, shuffle=False, verbose=0)
    arguments["validation_data"] = (X[:32], one_hot[:32])
    expected = model(tf.distribute.get_strategy()).fit(**arguments)
    ours = tfmp.fit(model(mirrored), **arguments, model_dir=str(tmp_path))
    assert ours.history.keys() == expected.history.keys()
    for key, values in expected.history.items():
        assert np.shape(ours.history[key]) == np.shape(values) and np.ndim(values) > 1 or key.endswith("loss")
        np.testing.assert_allclose(ours.history[key], values, rtol=TOLERANCE, atol=TOLERANCE, err_msg=key)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last = [record for record in records if record["split"] == "train"][-1]
    assert last["counts"] == expected.history["counts"][-1].tolist()  # a matrix as lists of lists
    assert len(last["f1_score"]) == CLASSES


class ReturnsNoDict(keras.Model):
    def __init__(self, returns, **kwargs):
        super().__init__(**kwargs)
        self.returns, self.dense = returns, keras.layers.Dense(1)

    def call(self, inputs):
        return self.dense(inputs)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(self(x) - y))
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return {"list": [loss], "none": None, "tensor": loss, "string": {"loss": "low"}}[self.returns]


@pytest.mark.parametrize("returns", ["list", "none", "tensor", "string", "no_optimizer"])
def test_a_step_keras_cannot_log_is_one_usage_error_naming_it_and_writes_nothing(returns, tmp_path):
    model = ReturnsNoDict("tensor" if returns == "no_optimizer" else returns)
    model.compile(optimizer=None if returns == "no_optimizer" else "sgd")
    with pytest.raises(UsageError, match=r"ReturnsNoDict\.train_step") as raised:
        tfmp.fit(model, X, Y_VALUE, batch_size=16, verbose=0, model_dir=str(tmp_path / "run"))
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "run").exists()


def test_xla_with_a_models_own_step_on_two_replicas_is_refused(mirrored):
    model = scaled_loss(mirrored)
    with pytest.raises(UsageError, match=r"ScaledLoss\.train_step on 2 replicas.*xla=False"):
        tfmp.fit(model, X, Y, batch_size=16, verbose=0, xla=True)


class TerminatedAfter(keras.callbacks.Callback):
    """A scheduler's preemption notice: SIGTERM to this process after batch `batch` of the first
    epoch, then a pause in which tfmp's signal watcher (a thread) notes it."""

    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)


def test_a_gan_preempted_by_sigterm_resumes_to_the_uninterrupted_runs_weights(tmp_path):
    """Both optimizers (built in the step, restored into), the seed generator's noise and the step
    count come back: the resumed run ends where the uninterrupted one does."""
    arguments = dict(x=REAL_IMAGES, batch_size=16, epochs=2, shuffle=False, verbose=0)  # 3 steps an epoch
    uninterrupted = gan(tf.distribute.get_strategy())
    tfmp.fit(uninterrupted, **arguments)
    run = str(tmp_path / "run")
    with pytest.raises(Preempted, match="checkpoint saved at step 3"):
        tfmp.fit(
            gan(tf.distribute.get_strategy()), **arguments, model_dir=run, callbacks=[TerminatedAfter(1)]
        )
    resumed = gan(tf.distribute.get_strategy())
    history = tfmp.fit(resumed, **arguments, model_dir=run)
    assert history.epoch == [1]  # step 3 ended epoch 0: the resumed run trains epoch 1
    for attribute in ("d_optimizer", "g_optimizer"):
        ours, theirs = getattr(resumed, attribute), getattr(uninterrupted, attribute)
        assert ours.iterations.numpy() == theirs.iterations.numpy() == 6
        for mine, expected in zip(ours.variables, theirs.variables):
            np.testing.assert_allclose(mine.numpy(), expected.numpy(), rtol=TOLERANCE, atol=TOLERANCE)
    assert (resumed.seed_generator.state.numpy() == uninterrupted.seed_generator.state.numpy()).all()
    for mine, expected in zip(resumed.get_weights(), uninterrupted.get_weights()):
        np.testing.assert_allclose(mine, expected, rtol=TOLERANCE, atol=TOLERANCE)


class LossScaledStep(keras.Model):
    """The guide's train_step as Keras' own is written: `self.optimizer.scale_loss`, then `apply`."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            scaled = self.optimizer.scale_loss(loss)
        self.optimizer.apply(tape.gradient(scaled, self.trainable_variables), self.trainable_variables)
        return self.compute_metrics(x, y, y_pred)


def test_a_models_own_step_under_float16_gets_the_replica_safe_loss_scaler(mirrored, tmp_path):
    keras.mixed_precision.set_global_policy("mixed_float16")
    with mirrored.scope():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((FEATURES,))
        model = LossScaledStep(
            inputs, keras.layers.Dense(CLASSES, dtype="float32")(keras.layers.Dense(8)(inputs))
        )
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # An overflow on replica 1 alone (rows 8..15): 1e5 is finite in float32, beyond float16's 65504.
    before = [[value.numpy() for value in weight.value.values] for weight in model.trainable_weights]
    poisoned = X[:16].copy()
    poisoned[8:] = 1e5
    tfmp.fit(model, poisoned, Y[:16], batch_size=16, verbose=0, model_dir=str(tmp_path))
    assert isinstance(
        model.optimizer, tfmp_precision.LossScaleOptimizer
    )  # what Keras' compile gave, made safe
    for weight, copies in zip(model.trainable_weights, before):
        for replica_value, start in zip(weight.value.values, copies):
            np.testing.assert_array_equal(replica_value.numpy(), start)  # skipped on both replicas
    assert tfmp_precision.current_loss_scale(model.optimizer) == 16384.0
    card = json.loads((tmp_path / "run_card.json").read_text())
    assert card["own steps"].startswith("LossScaledStep.train_step run per replica")
    assert "do not apply" in card["own steps"] and "loss scaling applies" in card["own steps"]
