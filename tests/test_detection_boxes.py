"""Tests for tfmp.detection.boxes and .evaluation: anchors, encoding, matching, NMS, COCO mAP.

Hand-made cases with a few boxes; the file runs in a few seconds on CPU.
"""

import numpy as np
import pytest
import tensorflow as tf

from tfmp.detection import boxes
from tfmp.detection.evaluation import CocoEvaluator, coco_metrics
from tfmp.errors import UsageError


def test_anchors_follow_levels_scales_and_ratios():
    config = boxes.AnchorConfig(levels=(3, 4, 5))
    anchors = boxes.generate_anchors(64, config).numpy()
    assert anchors.dtype == np.float32
    assert anchors.shape == ((8 * 8 + 4 * 4 + 2 * 2) * 9, 4)
    first = anchors[:9]  # the 9 anchors of P3's top-left cell, centred at (4, 4)
    np.testing.assert_allclose((first[:, :2] + first[:, 2:]) / 2, 4.0, atol=1e-5)
    heights, widths = first[:, 3] - first[:, 1], first[:, 2] - first[:, 0]
    np.testing.assert_allclose(heights / widths, np.repeat([0.5, 1.0, 2.0], 3), rtol=1e-5)
    np.testing.assert_allclose(np.sqrt(heights * widths)[3:6], 32 * 2 ** (np.arange(3) / 3), rtol=1e-5)
    with pytest.raises(UsageError, match="image_size"):
        boxes.generate_anchors(16, config)


def test_encode_decode_round_trips_boxes():
    anchors = boxes.generate_anchors(64, boxes.AnchorConfig(levels=(3, 4)))
    rng = np.random.default_rng(0)
    corner = rng.uniform(0, 40, [anchors.shape[0], 2])
    targets = np.concatenate([corner, corner + rng.uniform(2, 24, corner.shape)], 1).astype(np.float32)
    deltas = boxes.encode(anchors, targets)
    assert deltas.dtype == tf.float32
    np.testing.assert_allclose(boxes.decode(anchors, deltas).numpy(), targets, atol=1e-3)
    # float16 deltas (a mixed-precision head) still decode to float32 boxes
    assert boxes.decode(anchors, tf.cast(deltas, tf.float16)).dtype == tf.float32


def test_matching_assigns_positive_ignored_negative_and_forced_anchors():
    anchors = tf.constant(
        [
            [0, 0, 10, 10],  # IoU 1 with box 0: positive
            [0, 0, 10, 12],  # IoU 0.83: positive
            [0, 0, 10, 22],  # IoU 0.45: ignored
            [0, 0, 10, 30],  # IoU 0.33: negative
            [50, 50, 60, 60],
        ],  # IoU 0.47 with box 1, its best anchor: positive
        tf.float32,
    )
    gt_boxes = tf.constant([[0, 0, 10, 10], [48, 48, 58, 58], [0, 0, 10, 30]], tf.float32)
    gt_classes = tf.constant([3, 1, -1])  # the last row is padding: it must match nothing
    classes, targets = boxes.match(anchors, gt_boxes, gt_classes)
    np.testing.assert_array_equal(classes, [3, 3, boxes.IGNORE, boxes.BACKGROUND, 1])
    np.testing.assert_array_equal(targets[:, 4], [1, 1, 0, 0, 1])
    np.testing.assert_allclose(targets[0, :4], 0.0, atol=1e-6)
    decoded = boxes.decode(anchors, targets[:, :4]).numpy()
    np.testing.assert_allclose(decoded[[0, 1, 4]], gt_boxes.numpy()[[0, 0, 1]], atol=1e-4)
    np.testing.assert_array_equal(targets[2:4], 0.0)  # no box target off the positives


def test_matching_runs_in_a_dataset_map_with_static_shapes():
    anchors = boxes.generate_anchors(64, boxes.AnchorConfig(levels=(3, 4, 5)))
    dataset = tf.data.Dataset.from_tensors((tf.constant([[8.0, 8, 40, 40]]), tf.constant([2])))
    dataset = dataset.map(lambda b, c: boxes.match(anchors, b, c))
    assert dataset.element_spec[0].shape == (anchors.shape[0],)
    assert dataset.element_spec[1].shape == (anchors.shape[0], 5)


def test_nms_keeps_the_best_of_overlapping_boxes_per_class():
    anchors = tf.constant([[10, 10, 50, 50], [12, 12, 52, 52], [70, 70, 90, 90]], tf.float32)
    logits = tf.constant([[[3.0, -9.0], [2.0, -9.0], [1.0, 2.5]]])  # sigmoid: .95, .88, .73/.92
    predictions = {"classes": tf.cast(logits, tf.float16), "boxes": tf.zeros([1, 3, 4], tf.float16)}
    found = boxes.decode_detections(predictions, anchors, score_threshold=0.5, max_detections=5)
    assert {key: value.dtype for key, value in found.items()} == {
        "boxes": tf.float32,
        "scores": tf.float32,
        "classes": tf.int32,
        "valid_detections": tf.int32,
    }
    count = int(found["valid_detections"][0])
    assert count == 3  # anchor 1 is suppressed by anchor 0 (same class, IoU 0.82)
    kept = sorted(
        zip(found["classes"][0, :count].numpy().tolist(), found["boxes"][0, :count].numpy().round(3).tolist())
    )
    assert kept == [(0, [10, 10, 50, 50]), (0, [70, 70, 90, 90]), (1, [70, 70, 90, 90])]
    np.testing.assert_allclose(found["scores"][0, 0], 1 / (1 + np.exp(-3.0)), rtol=1e-5)


GROUND_TRUTH = [
    {"boxes": [[10, 10, 50, 50], [60, 60, 90, 100]], "classes": [0, 1]},
    {"boxes": [[5, 5, 20, 30]], "classes": [1]},
]


def test_coco_metrics_are_one_for_perfect_and_zero_for_no_predictions():
    perfect = [
        {"boxes": truth["boxes"], "scores": [0.9] * len(truth["classes"]), "classes": truth["classes"]}
        for truth in GROUND_TRUTH
    ]
    metrics = coco_metrics(GROUND_TRUTH, perfect)
    assert metrics["mAP"] == pytest.approx(1.0) and metrics["AP50"] == pytest.approx(1.0)
    assert metrics["AP75"] == pytest.approx(1.0)
    none = [{"boxes": np.zeros([0, 4]), "scores": [], "classes": []}] * 2
    assert coco_metrics(GROUND_TRUTH, none)["mAP"] == 0.0
    wrong_class = [dict(found, classes=[1 - c for c in found["classes"]]) for found in perfect]
    assert coco_metrics(GROUND_TRUTH, wrong_class)["mAP"] == 0.0


def test_evaluator_skips_padding_and_scales_to_original_pixels():
    truth = {
        "image_id": np.array([0, 1, -1]),
        "valid": np.array([True, True, False]),
        "scale": np.array([2.0, 1.0, 1.0], np.float32),
        "boxes": np.array(
            [[[5, 5, 25, 25], [0, 0, 0, 0]], [[5, 5, 20, 30], [0, 0, 0, 0]], [[0, 0, 9, 9], [0, 0, 0, 0]]],
            np.float32,
        ),
        "classes": np.array([[0, -1], [1, -1], [-1, -1]]),
    }
    detections = {
        "boxes": truth["boxes"],
        "scores": np.full([3, 2], 0.8, np.float32),
        "classes": np.maximum(truth["classes"], 0),
        "valid_detections": np.array([1, 1, 2]),
    }
    evaluator = CocoEvaluator()
    evaluator.update(truth, detections)
    assert evaluator.num_images == 2
    assert evaluator._truth[0]["boxes"].tolist() == [[10, 10, 50, 50]]
    assert evaluator.result()["mAP"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="twice"):
        evaluator.update(truth, detections)
