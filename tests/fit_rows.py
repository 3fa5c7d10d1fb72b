"""The conformance table of `tfmp.fit` against `model.fit` (tests/test_fit_conformance.py), shared
with the launched 2-worker group (tests/fit_worker.py runs the `MULTI_WORKER` rows there).

Each row's `arguments()` are fresh each call: generators and callbacks are used up by a fit.
`OWN_STEPS` are the patterns of Keras' guide "Customizing what happens in fit()": models whose
own `train_step` (and `test_step`, `predict_step`, `compile`) tfmp must run as Keras does.
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


def single_output(strategy, model_class=keras.Model):
    with strategy.scope():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((FEATURES,), name="features")
        hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
        model = model_class(inputs, keras.layers.Dense(CLASSES, name="logits")(hidden))
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


class ScaledLoss(keras.Model):
    """The guide's first pattern: its own train_step on the compiled loss (`compute_loss`), here
    doubled, so a trainer that ran its own step instead would log and learn something else."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = 2.0 * self.compute_loss(y=y, y_pred=y_pred)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {metric.name: metric.result() for metric in self.metrics}


class OwnTrackers(keras.Model):
    """The guide's lower-level pattern: compile(optimizer) only, its own loss and metric trackers
    (a `metrics` property), a test_step whose logs are not its metrics' names, and a
    predict_step that returns a dict; subclassed, its layers built on the first call (seeded
    initializers: two copies start alike whenever each is built)."""

    def __init__(self):
        super().__init__()
        seeded = {"kernel_initializer": keras.initializers.GlorotUniform(seed=3)}
        self.hidden = keras.layers.Dense(8, activation="tanh", **seeded)
        self.value = keras.layers.Dense(1, **seeded)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae = keras.metrics.MeanAbsoluteError(name="mae")

    def call(self, inputs):
        return self.value(self.hidden(inputs))

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae]

    def _track(self, x, y, training):
        y_pred = self(x, training=training)
        loss = keras.ops.mean(keras.ops.square(y_pred - y))
        self.loss_tracker.update_state(loss)
        self.mae.update_state(y, y_pred)
        return loss

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self._track(x, y, training=True)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return {"loss": self.loss_tracker.result(), "mae": self.mae.result()}

    def test_step(self, data):
        self._track(*data, training=False)
        return {"loss": self.loss_tracker.result(), "error": self.mae.result()}

    def predict_step(self, data):
        y_pred = self(data[0] if isinstance(data, tuple) else data, training=False)
        return {"value": y_pred, "doubled": 2.0 * y_pred}


LATENT, PIXELS = 4, 6


class GAN(keras.Model):
    """The guide's GAN: its own compile(d_optimizer, g_optimizer, loss_fn), two optimizers built on
    first use, noise from its own seed generator, images without labels, and no `call`."""

    def __init__(self, discriminator, generator):
        super().__init__()
        self.discriminator, self.generator = discriminator, generator
        self.seed_generator = keras.random.SeedGenerator(1337)

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def train_step(self, real_images):
        if isinstance(real_images, tuple):
            real_images = real_images[0]
        batch_size = tf.shape(real_images)[0]
        noise = keras.random.normal((batch_size, LATENT), seed=self.seed_generator)
        images = tf.concat([self.generator(noise), real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(images))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply(grads, self.discriminator.trainable_weights)
        noise = keras.random.normal((batch_size, LATENT), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(tf.zeros((batch_size, 1)), self.discriminator(self.generator(noise)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply(grads, self.generator.trainable_weights)
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def scaled_loss(strategy):
    return single_output(strategy, ScaledLoss)


def own_trackers(strategy):
    with strategy.scope():
        model = OwnTrackers()
        model.compile(optimizer=keras.optimizers.Adam(0.01))
    return model


def gan(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(5)
        discriminator = keras.Sequential(
            [keras.Input((PIXELS,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
        )
        generator = keras.Sequential(
            [keras.Input((LATENT,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(PIXELS)]
        )
        model = GAN(discriminator, generator)
        model.compile(
            keras.optimizers.Adam(1e-3),
            keras.optimizers.Adam(1e-3),
            keras.losses.BinaryCrossentropy(from_logits=True),
        )
    return model


def keras_can_fit(model):
    """Lets Keras' own fit train the GAN under a strategy, as the oracle for tfmp's: Keras would
    build its optimizers inside `strategy.run` (which fails) and cannot build a model with no
    `call`, so both are done here, before the fit."""
    with model.distribute_strategy.scope():
        model.d_optimizer.build(model.discriminator.trainable_weights)
        model.g_optimizer.build(model.generator.trainable_weights)
    model.built = True
    return model


REAL_IMAGES = np.tanh(np.random.default_rng(2).normal(size=(EXAMPLES // 2, PIXELS))).astype("float32")
OWN_STEPS = {
    "scaled_compute_loss": Row(lambda: dict(x=X, y=Y, batch_size=16, epochs=2), build=scaled_loss),
    "own_trackers_and_test_step": Row(
        lambda: dict(x=X, y=Y_VALUE, batch_size=16, epochs=2, validation_data=(X[:32], Y_VALUE[:32])),
        build=own_trackers,
    ),
    "gan_without_labels": Row(lambda: dict(x=REAL_IMAGES, batch_size=16, epochs=2), build=gan),
}
# Own-step patterns the 2-worker group runs; Keras' fit on 2 mirrored replicas is their oracle.
OWN_MULTI_WORKER = ("scaled_compute_loss", "own_trackers_and_test_step")
