"""Detection through tfmp's one engine: every strategy x precision x XLA cell trains the tiny
RetinaNet, 2 replicas equal 1 device (the global positive-anchor normaliser), an overflow on one
replica skips the step, and apps.detect trains, predicts float32 boxes and refuses bad input."""

import json

import keras
import numpy as np
import pytest
import rounding
import tensorflow as tf
from conftest import identical_detection_cells, run_python
from PIL import Image

from tfmp import precision
from tfmp.detection import boxes, data, retinanet
from tfmp.detection.task import compile_detector
from tfmp.training.engine import Engine

SIZE, BATCH = 64, 4
# One conv + GroupNorm per subnet instead of the registry's two: the cells test strategy x
# precision x XLA, not depth, and each XLA cell compiles 2 replicas x (forward, backward) of it
# (a mirrored bfloat16 XLA cell: 32 -> 27 CPU-seconds).
HEAD_DEPTH = 1
ANCHORS = boxes.generate_anchors(SIZE, retinanet.anchor_config("retinanet_tiny"))


def _engine(strategy, policy="float32", xla=False, learning_rate=0.01):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = retinanet.build_detector("retinanet_tiny", SIZE, 6, dtype=policy, head_depth=HEAD_DEPTH)
        optimizer = precision.wrap_optimizer(
            keras.optimizers.SGD(learning_rate, momentum=0.9), policy, initial_scale=1024.0
        )
    compile_detector(model, optimizer, strategy, int(ANCHORS.shape[0]))
    return Engine(strategy, model, optimizer, xla=xla)


def _batches(strategy, poisoned_replica=None):
    """The shapes scenes on `strategy`; `poisoned_replica`'s images are non-finite (inf, NaN on black)."""

    def dataset_fn(context):
        dataset = data.load(
            "shapes", "train", BATCH, anchors=ANCHORS, image_size=SIZE, input_context=context
        )[0]
        if poisoned_replica is not None:
            # One input pipeline feeds the in-process replicas in turn (replica 0, 1, 0, 1, ...;
            # tests/test_data.py), so every other per-replica batch is the poisoned replica's.
            replicas = strategy.num_replicas_in_sync
            dataset = dataset.enumerate().map(
                lambda index, element: (
                    element[0] * tf.where(index % replicas == poisoned_replica, np.inf, 1.0),
                    element[1],
                )
            )
        return dataset

    return iter(strategy.distribute_datasets_from_function(dataset_fn))


def _replica_values(model):
    return [[v.numpy() for v in getattr(w.value, "values", [w.value])] for w in model.trainable_weights]


# XLA compiles per replica device, so a mirrored XLA cell covers what the default strategy's
# would (the Engine's one-device XLA path is test_matrix's); each costs 15-40 s of compiling.
# Every precision with XLA trains identically on 2 launched workers (the shared group,
# test_multi_worker_cells_train_every_precision_and_xla_identically below), so in-process one
# mirrored XLA cell suffices: float16's, the one whose loss scaler's skip and all-reduced verdict
# compile into the step. Slow-marked: it is most of `-m "not slow"`'s time otherwise.
CELLS = [(name, policy, False) for name in ("default", "mirrored") for policy in precision.POLICIES] + [
    pytest.param("mirrored", "mixed_float16", True, marks=pytest.mark.slow)
]


@pytest.mark.parametrize("strategy_name, policy, xla", CELLS)
def test_every_strategy_precision_and_xla_cell_trains(mirrored, strategy_name, policy, xla):
    strategy = mirrored if strategy_name == "mirrored" else tf.distribute.get_strategy()
    engine = _engine(strategy, policy, xla)
    result = engine.train(_batches(strategy), 2)
    assert np.isfinite(result.metrics["loss"]) and result.nonfinite_steps == 0
    for weight, copies in zip(engine.model.trainable_weights, _replica_values(engine.model)):
        assert weight.dtype == "float32"
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0])  # replicas identical


def test_two_replicas_equal_one_device_with_the_global_positive_count(mirrored):
    """One step on 2 replicas moves every weight as one device does, within float32 rounding of
    gradient sums over at most BATCH x SIZE^2 terms (tests/rounding.py); a per-replica
    positive-anchor count would be off by about the replica count."""
    rounding.assert_replicas_step_like_one_device(_engine, _batches, mirrored, BATCH * SIZE * SIZE)


def test_overflow_on_one_replica_skips_the_step_everywhere(mirrored):
    engine = _engine(mirrored, "mixed_float16")
    before = _replica_values(engine.model)
    # Replica 0 gets inf images: replica 1 alone would have applied its gradients.
    result = engine.train(_batches(mirrored, poisoned_replica=0), 1)
    assert result.nonfinite_steps >= 1
    for start, now in zip(before, _replica_values(engine.model)):
        for replica_start, replica_now in zip(start, now):
            np.testing.assert_array_equal(replica_now, replica_start)
    assert precision.current_loss_scale(engine.optimizer) == 512.0


@pytest.mark.slow
def test_app_trains_mixed_and_predicts_float32_boxes_drawn_to_png(tmp_path):
    run = tmp_path / "run"
    result = run_python(
        [
            "-m",
            "apps.detect",
            "--mixed",
            "--steps=6",  # shorter than the default warmup: the app scales that to 6 * 60 // 600 = 0
            "--steps_per_epoch=6",
            f"--image_size={SIZE}",
            f"--global_batch_size={BATCH}",
            f"--model_dir={run}",
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = [line for line in result.stdout.splitlines() if line.startswith("tfmp summary:")][-1]
    assert (
        "eval mAP" in summary
        and "AP50" in summary
        and "images/s" in summary
        and "precision mixed_" in summary
    )
    assert "--warmup_steps=0" in (run / "flags.txt").read_text().splitlines()
    records = [json.loads(line) for line in open(run / "metrics.jsonl") if '"eval"' in line]
    assert {"mAP", "AP50", "AP75", "AP_small", "AP_medium", "AP_large"} <= set(records[-1])
    picture = tmp_path / "scene.png"
    Image.fromarray((np.random.default_rng(0).random((80, 100, 3)) * 255).astype(np.uint8)).save(picture)
    predicted = run_python(
        [
            "-m",
            "apps.detect",
            f"--model_dir={run}",
            f"--predict={picture}",
            "--score_threshold=0.0",
            f"--output_dir={tmp_path / 'drawn'}",
        ]
    )
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    record = json.loads(predicted.stdout.strip().splitlines()[-1])
    assert record["boxes_dtype"] == "float32" and record["scores_dtype"] == "float32"
    # With --score_threshold=0 NMS keeps up to max_detections (100) boxes, best first.
    scores = [detection["score"] for detection in record["detections"]]
    assert 1 <= len(scores) <= 100 and scores == sorted(scores, reverse=True)
    assert all(0.0 <= score <= 1.0 for score in scores)
    assert {detection["class"] for detection in record["detections"]} <= set(range(6))
    drawn = Image.open(record["png"])
    assert drawn.size == (100, 80)  # drawn on the original image


# Bad input (unknown detectors, a --predict without a run, COCO paths and files): tests/test_bad_inputs.py.


@pytest.mark.slow
def test_multi_worker_cells_train_every_precision_and_xla_identically(launched_workers):
    """2 workers (conftest's shared launched group) x every precision x XLA off/on: finite,
    float32 weights, no skipped step, every variable identical on both workers."""
    identical_detection_cells(launched_workers, "detect", precision.POLICIES)


# apps.detect under `tfmp.launch --workers=2` (identical weights, every eval image counted once)
# runs once, with Faster R-CNN (tests/test_faster_rcnn.py): the launcher and the app's eval are
# the same code for both detectors, and RetinaNet's multi-worker training is the shared group's.
