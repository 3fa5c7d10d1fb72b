"""`tfmp.fit` is `model.fit`: one row per argument, input type and callback.

Each row trains two copies of one tiny model from the same weights, one with Keras' own
`model.fit` (one device) and one with `tfmp.fit` (one device, and two mirrored replicas where
the row makes sense there), and compares the History (keys, values, `epoch`, `params`) and the
final weights. Shuffling is off so both read the same batches. Tolerance: float32's epsilon,
times the values' scale (~1) and the number of steps whose rounding can differ (summation
order in the gradient reductions), times a safety factor of 16.
"""

import dataclasses
import logging
import re
from collections.abc import Callable

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from tfmp.errors import UsageError

EXAMPLES, FEATURES, CLASSES = 96, 5, 3
MAX_STEPS = 12  # the most steps a row runs
TOLERANCE = 16 * MAX_STEPS * np.finfo(np.float32).eps


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(EXAMPLES,)).astype("int32")
    return x, y


def _single_output(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((FEATURES,), name="features")
        hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(CLASSES, name="logits")(hidden))
        model.compile(
            keras.optimizers.SGD(0.1),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return model


def _two_inputs_two_outputs(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(4)
        left, right = keras.Input((FEATURES,), name="left"), keras.Input((2,), name="right")
        hidden = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([left, right]))
        classes = keras.layers.Dense(CLASSES, name="classes")(hidden)
        value = keras.layers.Dense(1, name="value")(hidden)
        model = keras.Model([left, right], [classes, value])
        model.compile(
            keras.optimizers.SGD(0.05),
            [keras.losses.SparseCategoricalCrossentropy(from_logits=True), keras.losses.MeanSquaredError()],
            loss_weights=[1.0, 0.5],
        )
    return model


class Batches(keras.utils.PyDataset):
    """A PyDataset of 16-example batches, as a Keras user writes one."""

    def __init__(self, x, y, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x) // 16

    def __getitem__(self, index):
        rows = slice(index * 16, (index + 1) * 16)
        return self.x[rows], self.y[rows]


def _endless(x, y):
    while True:
        for start in range(0, len(x), 16):
            yield x[start : start + 16], y[start : start + 16]


class StopAtBatch(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if self.model.optimizer.iterations.numpy() == 4:
            self.model.stop_training = True


@dataclasses.dataclass
class Row:
    arguments: Callable[[], dict]  # fresh each call: generators and callbacks are used up
    build: Callable = _single_output
    mirrored: bool = True  # also run tfmp.fit on two replicas


X, Y = _data()
X_VALUE = np.random.default_rng(1).normal(size=(EXAMPLES, 2)).astype("float32")
Y_VALUE = X[:, :1] * 0.5
ROWS = {
    "numpy_default_batch_32": Row(lambda: dict(x=X, y=Y, epochs=2)),
    "tensors": Row(lambda: dict(x=tf.constant(X), y=tf.constant(Y), batch_size=24)),
    "tf_data": Row(lambda: dict(x=tf.data.Dataset.from_tensor_slices((X, Y)).batch(16), epochs=2)),
    "lists_in_and_out": Row(
        lambda: dict(x=[X, X_VALUE], y=[Y, Y_VALUE], batch_size=16), build=_two_inputs_two_outputs
    ),
    "dicts_in_and_out": Row(
        lambda: dict(x={"left": X, "right": X_VALUE}, y={"classes": Y, "value": Y_VALUE}, batch_size=16),
        build=_two_inputs_two_outputs,
    ),
    "sample_weight": Row(lambda: dict(x=X, y=Y, batch_size=16, sample_weight=np.linspace(0.1, 2, EXAMPLES))),
    "class_weight": Row(lambda: dict(x=X, y=Y, batch_size=16, class_weight={0: 0.5, 2: 3.0})),
    "validation_split": Row(lambda: dict(x=X, y=Y, batch_size=16, validation_split=0.25, epochs=2)),
    "validation_data_and_batch_size": Row(
        lambda: dict(x=X, y=Y, batch_size=16, validation_data=(X[:40], Y[:40]), validation_batch_size=8)
    ),
    "validation_freq": Row(
        lambda: dict(
            x=X[:32], y=Y[:32], batch_size=16, validation_data=(X[:16], Y[:16]), epochs=4, validation_freq=2
        )
    ),
    "initial_epoch": Row(lambda: dict(x=X[:32], y=Y[:32], batch_size=16, epochs=4, initial_epoch=2)),
    "steps_per_epoch_shorter_than_data": Row(
        lambda: dict(x=X, y=Y, batch_size=16, steps_per_epoch=2, epochs=3)
    ),
    "generator": Row(lambda: dict(x=_endless(X, Y), steps_per_epoch=3, epochs=2), mirrored=False),
    "py_dataset": Row(lambda: dict(x=Batches(X, Y), epochs=2), mirrored=False),
    "early_stopping": Row(
        lambda: dict(
            x=X[:32],
            y=Y[:32],
            batch_size=16,
            epochs=6,
            callbacks=[keras.callbacks.EarlyStopping("loss", min_delta=10.0, patience=1)],
        )
    ),
    "reduce_lr_on_plateau": Row(
        lambda: dict(
            x=X[:32],
            y=Y[:32],
            batch_size=16,
            epochs=3,
            callbacks=[keras.callbacks.ReduceLROnPlateau("loss", factor=0.5, patience=0, min_delta=10.0)],
        )
    ),
    "stop_training_in_a_batch": Row(
        lambda: dict(x=X, y=Y, batch_size=16, epochs=2, callbacks=[StopAtBatch()])
    ),
}


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
        model = _single_output(tf.distribute.get_strategy())
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
        model = _single_output(tf.distribute.get_strategy())
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
    model = _single_output(tf.distribute.get_strategy())
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


def _digits_blanked(text: str) -> list[str]:
    return [re.sub(r"\d+(\.\d+)?", "#", line) for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("verbose", [2, 1])
def test_output_is_keras_progress_bar_and_no_run_card_without_model_dir(verbose, capsys):
    model = _single_output(tf.distribute.get_strategy())
    arguments = dict(x=X[:32], y=Y[:32], batch_size=16, epochs=2, validation_data=(X[:16], Y[:16]))
    model.fit(**arguments, verbose=verbose)
    expected = capsys.readouterr().out
    tfmp.fit(model, **arguments, verbose=verbose)
    ours = capsys.readouterr().out
    assert _digits_blanked(ours) == _digits_blanked(expected)
    assert "run card" not in ours


def test_a_second_fit_in_one_process_traces_nothing_again(tmp_path, capsys):
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("tensorflow").addHandler(handler)
    try:
        model = _single_output(tf.distribute.get_strategy())
        for _ in range(6):  # TensorFlow warns from the fifth retrace on
            tfmp.fit(model, X, Y, batch_size=16, verbose=0, validation_data=(X[:16], Y[:16]))
            tfmp.evaluate(model, X, Y, verbose=0)
    finally:
        logging.getLogger("tensorflow").removeHandler(handler)
    assert not [message for message in messages if "retracing" in message]
    tfmp.fit(model, X, Y, batch_size=16, verbose=1, model_dir=str(tmp_path))
    assert "tfmp run card" in capsys.readouterr().out  # shown where a model_dir is written
