"""The conformance table of `tfmp.fit` against `model.fit` (tests/test_fit_conformance.py), shared
with the launched 2-worker group (tests/fit_worker.py runs the `MULTI_WORKER` rows there).

Each row's `arguments()` are fresh each call: generators and callbacks are used up by a fit.
"""

import dataclasses
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

EXAMPLES, FEATURES, CLASSES = 96, 5, 3
MAX_STEPS = 12  # the most steps a row runs
TOLERANCE = 16 * MAX_STEPS * np.finfo(np.float32).eps


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(EXAMPLES,)).astype("int32")
    return x, y


def single_output(strategy):
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


def two_inputs_two_outputs(strategy):
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


def endless(x, y):
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
    build: Callable = single_output
    mirrored: bool = True  # also run tfmp.fit on two replicas


X, Y = _data()
X_VALUE = np.random.default_rng(1).normal(size=(EXAMPLES, 2)).astype("float32")
Y_VALUE = X[:, :1] * 0.5
ROWS = {
    "numpy_default_batch_32": Row(lambda: dict(x=X, y=Y, epochs=2)),
    "tensors": Row(lambda: dict(x=tf.constant(X), y=tf.constant(Y), batch_size=24)),
    "tf_data": Row(lambda: dict(x=tf.data.Dataset.from_tensor_slices((X, Y)).batch(16), epochs=2)),
    "lists_in_and_out": Row(
        lambda: dict(x=[X, X_VALUE], y=[Y, Y_VALUE], batch_size=16), build=two_inputs_two_outputs
    ),
    "dicts_in_and_out": Row(
        lambda: dict(x={"left": X, "right": X_VALUE}, y={"classes": Y, "value": Y_VALUE}, batch_size=16),
        build=two_inputs_two_outputs,
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
    "generator": Row(lambda: dict(x=endless(X, Y), steps_per_epoch=3, epochs=2), mirrored=False),
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

# Rows the 2-worker group runs: each worker reads its half of every global batch.
MULTI_WORKER = (
    "numpy_default_batch_32",
    "class_weight",
    "validation_split",
    "validation_freq",
    "steps_per_epoch_shorter_than_data",
    "stop_training_in_a_batch",
)
