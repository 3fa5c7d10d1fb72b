"""A user's training script, run as one process, on 2 replicas or as 2 workers of tfmp.launch.

    python tests/fit_worker.py                                          # one device
    python -m tfmp.launch --workers=2 -- python tests/fit_worker.py     # two workers
    (tests/mwms_worker.py runs it in the multi-worker group the tests share)

The TensorFlow multi-worker tutorial's kind of model (logits, `from_logits=True`, SGD,
`metrics=["accuracy"]`), shrunk to seconds, trained with `tfmp.fit`. Prints one JSON line:
the per-step running losses, and writes every weight to `$FIT_WORKER_OUT/weights-<task>.npz`
(one file per worker: a long JSON line could interleave with the other worker's output).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fit_rows  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmp  # noqa: E402
from tfmp.distribute import strategies as distribute  # noqa: E402
from tfmp.errors import UsageError  # noqa: E402

GLOBAL_BATCH, STEPS = 16, 20


def tutorial_model() -> keras.Model:
    """The tutorial's CNN (Conv -> Flatten -> Dense -> Dense(10) logits) at 12x12."""
    return keras.Sequential(
        [
            keras.Input((12, 12, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def compile_tutorial(model: keras.Model) -> keras.Model:
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def tutorial_data(examples=GLOBAL_BATCH * STEPS):
    rng = np.random.default_rng(0)
    images = rng.random((examples, 12, 12, 1), dtype=np.float32)
    labels = (images.reshape(examples, -1)[:, :10].argmax(-1)).astype(np.int64)  # learnable
    return images, labels


class StepLosses(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def main():
    run(distribute.get_strategy("auto"))


def run(strategy):
    """The script's body on `strategy` (the shared multi-worker group calls it with its own)."""
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = compile_tutorial(tutorial_model())
    images, labels = tutorial_data()
    dataset = tf.data.Dataset.from_tensor_slices((images, labels)).batch(GLOBAL_BATCH)
    recorder = StepLosses()
    history = tfmp.fit(model, dataset, epochs=1, callbacks=[recorder], verbose=0)
    task = getattr(getattr(strategy, "cluster_resolver", None), "task_id", 0) or 0
    if os.environ.get("FIT_WORKER_OUT"):
        np.savez(
            os.path.join(os.environ["FIT_WORKER_OUT"], f"weights-{task}.npz"),
            *[w.numpy() for w in model.weights],
        )
    print(
        json.dumps(
            {
                "kind": "fit",
                "losses": recorder.losses,
                "history": history.history,
                "replicas": strategy.num_replicas_in_sync,
                "task": task,
            }
        ),
        flush=True,
    )


def conformance_rows(strategy):
    """tests/fit_rows.py's MULTI_WORKER and OWN_MULTI_WORKER rows through tfmp.fit on `strategy`; a
    generator is refused."""
    rows = [(name, fit_rows.ROWS[name]) for name in fit_rows.MULTI_WORKER]
    rows += [(name, fit_rows.OWN_STEPS[name]) for name in fit_rows.OWN_MULTI_WORKER]
    for name, row in rows:
        model = row.build(strategy)
        history = tfmp.fit(model, **row.arguments(), shuffle=False, verbose=0)
        task = getattr(getattr(strategy, "cluster_resolver", None), "task_id", 0) or 0
        if os.environ.get("FIT_WORKER_OUT"):
            np.savez(
                os.path.join(os.environ["FIT_WORKER_OUT"], f"row-{name}-{task}.npz"), *model.get_weights()
            )
        record = {
            "kind": "fit_row",
            "name": name,
            "task": task,
            "history": history.history,
            "epoch": history.epoch,
        }
        print(json.dumps(record), flush=True)
    try:
        tfmp.fit(
            fit_rows.single_output(strategy), fit_rows.endless(fit_rows.X, fit_rows.Y), steps_per_epoch=2
        )
        refused = None
    except UsageError as error:
        refused = str(error)
    print(json.dumps({"kind": "fit_refused", "message": refused}), flush=True)


if __name__ == "__main__":
    main()
