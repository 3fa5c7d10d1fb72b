"""The launched 2-worker group the multi-worker tests share: one start of TensorFlow in two
worker processes checks every multi-worker cell (starting a group costs more than its cells).

    python -m tfmp.launch --workers=2 -- python tests/mwms_worker.py    (conftest's `launched_workers`)

Prints one JSON line per check, each with a "kind", for the tests to compare across workers:
- "classify" (tests/test_matrix.py): LeNet on the built-in digits for a few steps under every
  precision, with and without XLA, through the same Engine the apps use: loss, eval over the
  whole split against this worker's own count, and a digest of every model and optimizer variable;
  its weights are also the data-parallel reference of tests/test_pipeline_2d.py (`dp_*.npz`);
- "pipeline_2d*" (tests/test_pipeline_2d.py): the same LeNet cells as a 2-stage pipeline on each
  worker's 2 logical CPUs (tests/pipeline_2d_worker.py);
- "overflow" and "overflow_float16_sum": one float16 step with inf images on worker 1 only, and
  one whose huge images overflow worker 1's gradients summed in float16, which both must skip;
- "detect" and "faster_rcnn" (tests/test_detect_app.py, tests/test_faster_rcnn.py): the tiny
  RetinaNet and Faster R-CNN in every precision x XLA cell;
- "fit" (tests/test_fit.py): a user's tfmp.fit script (tests/fit_worker.py) on this strategy;
- "fused_transformer" (tests/test_fused_layer_norm.py): one Engine step of a tiny encoder with
  fused LayerNormalization, MultiHeadAttention and RMSNormalization (`worker_cells`);
- "fused_norm" (tests/test_fused_norm.py): one Engine step of a tiny conv model with fused
  BatchNormalization, both workers reading the same rows (`worker_cells`).
The strategy comes from `get_strategy("auto", one_replica_per_worker=True)`: on CPU the same
MultiWorkerMirroredStrategy as a user's script gets under the launcher (one CPU replica per
worker), whose workers' CPUs are split in 2 logical devices for the pipeline's stages.
"""

import hashlib
import json
import math
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fit_worker  # noqa: E402
import keras  # noqa: E402
import mwms_detect_worker  # noqa: E402
import numpy as np  # noqa: E402
import pipeline_2d_worker  # noqa: E402
import rounding  # noqa: E402
import tensorflow as tf  # noqa: E402
import test_fused_layer_norm  # noqa: E402
import test_fused_norm  # noqa: E402

from tfmp import compat, models, precision  # noqa: E402
from tfmp.classification import data  # noqa: E402
from tfmp.classification.task import compile_classifier  # noqa: E402
from tfmp.distribute import allreduce  # noqa: E402
from tfmp.distribute import strategies as distribute  # noqa: E402
from tfmp.training.engine import Engine  # noqa: E402

GLOBAL_BATCH = 32
STEPS = 3
# Digits drawn at LeNet's smallest input: float16 is emulated on CPU, and at 28x28 the two
# float16 cells' eval passes (2 x 2000 images) cost more than every other check here.
IMAGE_SIZE = 16


def main():
    # As in the pytest processes (tests/conftest.py): no Grappler rewrites of the freshly traced
    # graphs these cells run for a few steps; the reference runs of test_fit compare alike.
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    # 2 logical CPUs per worker for the pipeline cells' stages; on CPU the strategy with one
    # replica per worker is the one every other cell gets too (one CPU replica per worker).
    distribute.split_cpu(2, "--pipeline_stages")
    strategy = distribute.get_strategy("auto", one_replica_per_worker=True)
    multi_worker = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
    # Not named "heartbeat...": the tests grep the group's output for that word (conftest.PEER_ERRORS).
    peer_timeout_ms = compat.coordination_heartbeat_timeout_ms()
    print(
        json.dumps({"kind": "strategy", "multi_worker": multi_worker, "peer_timeout_ms": peer_timeout_ms}),
        flush=True,
    )
    classification_cells(strategy)
    pipeline_2d_worker.cells(strategy, IMAGE_SIZE, STEPS)
    overflow_on_worker_1(strategy)
    mwms_detect_worker.detection_cells(strategy)
    fit_worker.run(strategy)
    test_fused_layer_norm.worker_cells(strategy, os.environ["FIT_WORKER_OUT"])
    test_fused_norm.worker_cells(strategy, os.environ["FIT_WORKER_OUT"])
    fit_worker.conformance_rows(strategy)


def classification_cells(strategy):
    topology = distribute.describe(strategy)
    assert GLOBAL_BATCH == pipeline_2d_worker.GLOBAL_BATCH  # the 2-D cells' batches
    evaluation = strategy.distribute_datasets_from_function(
        lambda context: data.load(
            "digits", "eval", GLOBAL_BATCH, image_size=IMAGE_SIZE, input_context=context, training=False
        )[0].map(
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
            started = time.process_time()
            keras.utils.set_random_seed(0)
            with strategy.scope():
                model = models.build("lenet", (IMAGE_SIZE, IMAGE_SIZE, 1), 10, dtype=policy)
                optimizer = precision.wrap_optimizer(keras.optimizers.SGD(0.05), policy, "auto")
            compile_classifier(model, optimizer, strategy)
            engine = Engine(strategy, model, optimizer, xla=xla)
            # A new dataset for each cell (its first batches are the 2-D cells' and the 1-worker
            # pipeline's), so these weights are the unsplit data-parallel run test_pipeline_2d
            # compares the 2 x 2 layout with: one training serves both tests.
            trained = engine.train(pipeline_2d_worker.batches(strategy, IMAGE_SIZE), STEPS)
            pipeline_2d_worker.save(f"dp_{policy}_{xla}", strategy, model)
            evaluated = engine.evaluate(evaluation)
            weights = _weights(model)
            print(
                json.dumps(
                    {
                        "kind": "classify",
                        "policy": policy,
                        "xla": xla,
                        "workers": topology.workers,
                        "replicas": strategy.num_replicas_in_sync,
                        "chief": topology.is_chief,
                        "loss": trained.metrics["loss"],
                        "eval_accuracy": evaluated["accuracy"],
                        "eval_loss": evaluated["loss"],
                        "eval_examples": _examples_counted(engine, evaluation),
                        # Only the chief's is compared (test_matrix), so only the chief computes it.
                        "local_eval": _local_eval(model, policy) if topology.is_chief else None,
                        "finite": bool(np.isfinite(weights).all()),
                        "checksum": _variables_digest(model, optimizer),
                        "cpu_seconds": round(time.process_time() - started, 1),  # for speed work
                    }
                ),
                flush=True,
            )


def overflow_on_worker_1(strategy):
    """Inf images on worker 1 only: the float16 step must be skipped on both workers."""
    _overflow_cell(strategy, "overflow", np.inf, allreduce_plan=None)
    # Gradients summed in float16 (--allreduce_dtype=float16): worker 1's finite but huge images
    # overflow its float16 gradients; the sum is inf on both workers and both skip the step.
    plan = allreduce.resolve("float16", "mixed_float16", True, strategy.num_replicas_in_sync)
    _overflow_cell(strategy, "overflow_float16_sum", 3e4, allreduce_plan=plan)


def _overflow_cell(strategy, kind, worker_1_image_scale, allreduce_plan):
    """One float16 LeNet step (dynamic loss scale) whose images are multiplied by
    `worker_1_image_scale` on worker 1 only, gradients all-reduced by `allreduce_plan` (None: the
    optimizer's float32 sum); prints whether the weights stayed unchanged, the skipped steps, the
    non-finite inputs seen and the loss scale after."""

    def poisoned(context):
        dataset = data.load("digits", "train", GLOBAL_BATCH, image_size=IMAGE_SIZE, input_context=context)[0]
        if context.input_pipeline_id == 1:
            dataset = dataset.map(lambda images, labels: (images * worker_1_image_scale, labels))
        return dataset

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = models.build("lenet", (IMAGE_SIZE, IMAGE_SIZE, 1), 10, dtype="mixed_float16")
        optimizer = precision.wrap_optimizer(keras.optimizers.SGD(0.05), "mixed_float16", "dynamic")
    compile_classifier(model, optimizer, strategy)
    engine = Engine(strategy, model, optimizer, allreduce_plan=allreduce_plan)
    before = _digest(_weights(model))
    totals = engine.train(iter(strategy.distribute_datasets_from_function(poisoned)), 1)
    record = {"kind": kind, "unchanged": _digest(_weights(model)) == before}
    record.update(
        nonfinite_steps=totals.nonfinite_steps,
        nonfinite_inputs=list(totals.nonfinite_inputs),
        loss_scale=precision.current_loss_scale(optimizer),
    )
    print(json.dumps(record), flush=True)


def _examples_counted(engine, evaluation):
    """The real (unpadded) rows one pass over `evaluation` counts, summed over every replica and
    worker: the loss tracker in `model.metrics` is a Mean whose `count` sums the weights the
    engine gives each replica's batch loss, its real rows. `Engine.evaluate` resets the metrics
    after reading them, so this pass is `Engine.infer` (the same replica step, no reset after)."""
    engine.infer(iter(evaluation), math.ceil(data.DIGITS_EVAL_EXAMPLES / GLOBAL_BATCH))
    tracker = next(metric for metric in engine.model.metrics if metric.name == "loss")
    return float(tracker.count.numpy())


def _local_eval(model, policy):
    """(loss, accuracy, near ties) over the whole eval split computed by this worker alone
    (near ties: see tests/rounding.py)."""
    losses, correct, ties, total = [], 0, 0, 0
    # A plain call (Keras' predict under the strategy would return every replica's rows), traced
    # once: called eagerly, Keras' per-layer dispatch cost more than the 6 cells' training.
    forward = tf.function(lambda images: model(images, training=False))
    # Batches of the per-replica size: kernels pick algorithms by batch size.
    for images, labels in data.load(
        "digits", "eval", GLOBAL_BATCH // 2, image_size=IMAGE_SIZE, training=False
    )[0]:
        valid = labels.numpy() >= 0
        probabilities = forward(images).numpy().astype(np.float64)[valid]
        truth = labels.numpy()[valid]
        losses.extend(-np.log(np.clip(probabilities[np.arange(len(truth)), truth], 1e-7, 1.0)))
        correct += int((probabilities.argmax(-1) == truth).sum())
        ties += rounding.count_near_ties(probabilities, policy)
        total += int(valid.sum())
    assert total == data.DIGITS_EVAL_EXAMPLES
    return float(np.mean(losses)), correct / total, ties


def _weights(model):
    return np.concatenate([w.numpy().ravel() for w in model.trainable_weights])


def _digest(weights):
    return hashlib.sha256(weights.tobytes()).hexdigest()


def _variables_digest(model, optimizer):
    """Digest of every model and optimizer variable (weights, iterations, loss scale, slots)."""
    digest = hashlib.sha256()
    for variable in model.variables + optimizer.variables:
        digest.update(variable.path.encode())
        digest.update(np.asarray(variable.numpy()).tobytes())
    return digest.hexdigest()


if __name__ == "__main__":
    main()
