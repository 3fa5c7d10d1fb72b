"""One MultiWorkerMirroredStrategy worker for tests/test_multi_worker.py.

    TF_CONFIG=... python tests/mwms_worker.py

Trains LeNet on the built-in digits for a few steps under every precision, with and without
XLA, through the same Engine the apps use, then prints one JSON line per combination with
the loss, the examples seen and a checksum of the weights, for the test to compare across
workers; last, one float16 step with inf images on worker 1 only, which both must skip.
"""

import hashlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmp import models, precision  # noqa: E402
from tfmp.classification import data
from tfmp.classification.task import compile_classifier  # noqa: E402
from tfmp.distribute import strategies as distribute
from tfmp.training.engine import Engine  # noqa: E402

GLOBAL_BATCH = 32
STEPS = 3


def main():
    strategy = distribute.get_strategy("multi_worker")
    topology = distribute.describe(strategy)
    train = strategy.distribute_datasets_from_function(
        lambda context: data.load("digits", "train", GLOBAL_BATCH, input_context=context)[0]
    )
    evaluation = strategy.distribute_datasets_from_function(
        lambda context: data.load("digits", "eval", GLOBAL_BATCH, input_context=context, training=False)[
            0
        ].map(
            lambda images, labels: (
                images,
                tf.maximum(labels, 0),
                tf.cast(labels >= 0, tf.float32),
                tf.cast(labels >= 0, tf.float32),
            )
        )
    )
    for policy in precision.POLICIES:
        for xla in (False, True):
            keras.utils.set_random_seed(0)
            with strategy.scope():
                model = models.build("lenet", (28, 28, 1), 10, dtype=policy)
                optimizer = precision.wrap_optimizer(keras.optimizers.SGD(0.05), policy, "auto")
            compile_classifier(model, optimizer, strategy)
            engine = Engine(strategy, model, optimizer, xla=xla)
            trained = engine.train(iter(train), STEPS)
            evaluated = engine.evaluate(evaluation)
            weights = _weights(model)
            print(
                json.dumps(
                    {
                        "policy": policy,
                        "xla": xla,
                        "workers": topology.workers,
                        "replicas": strategy.num_replicas_in_sync,
                        "chief": topology.is_chief,
                        "loss": trained.metrics["loss"],
                        "eval_accuracy": evaluated["accuracy"],
                        "eval_loss": evaluated["loss"],
                        "local_eval": _local_eval(model),
                        "finite": bool(np.isfinite(weights).all()),
                        "checksum": _digest(weights),
                    }
                ),
                flush=True,
            )
    overflow_on_worker_1(strategy)


def overflow_on_worker_1(strategy):
    """Inf images on worker 1 only: the float16 step must be skipped on both workers."""

    def poisoned(context):
        dataset = data.load("digits", "train", GLOBAL_BATCH, input_context=context)[0]
        if context.input_pipeline_id == 1:
            dataset = dataset.map(lambda images, labels: (images * np.inf, labels))
        return dataset

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = models.build("lenet", (28, 28, 1), 10, dtype="mixed_float16")
        optimizer = precision.wrap_optimizer(keras.optimizers.SGD(0.05), "mixed_float16", "dynamic")
    compile_classifier(model, optimizer, strategy)
    engine = Engine(strategy, model, optimizer)
    before = _digest(_weights(model))
    totals = engine.train(iter(strategy.distribute_datasets_from_function(poisoned)), 1)
    print(
        json.dumps(
            {
                "overflow": True,
                "unchanged": _digest(_weights(model)) == before,
                "nonfinite_steps": totals.nonfinite_steps,
                "loss_scale": precision.current_loss_scale(optimizer),
            }
        ),
        flush=True,
    )


def _local_eval(model):
    """(loss, accuracy) over the whole eval split computed by this worker alone, for comparison."""
    losses, correct, total = [], 0, 0
    # Batches of the per-replica size: kernels pick algorithms by batch size.
    for images, labels in data.load("digits", "eval", GLOBAL_BATCH // 2, training=False)[0]:
        valid = labels.numpy() >= 0
        # A plain call: Keras' predict under the strategy would return every replica's rows.
        probabilities = model(images, training=False).numpy().astype(np.float64)[valid]
        truth = labels.numpy()[valid]
        losses.extend(-np.log(np.clip(probabilities[np.arange(len(truth)), truth], 1e-7, 1.0)))
        correct += int((probabilities.argmax(-1) == truth).sum())
        total += int(valid.sum())
    assert total == data.DIGITS_EVAL_EXAMPLES
    return float(np.mean(losses)), correct / total


def _weights(model):
    return np.concatenate([w.numpy().ravel() for w in model.trainable_weights])


def _digest(weights):
    return hashlib.sha256(weights.tobytes()).hexdigest()


if __name__ == "__main__":
    main()
