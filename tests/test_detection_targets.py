"""Tests for tfmp.detection.targets: the batched on-device matcher equals the per-example one.

Random scenes plus the edge cases (no boxes, padded rows, ties, one anchor best for two boxes),
compared image by image with `boxes.match`; and the whole thing compiles with XLA.
"""

import numpy as np
import pytest
import tensorflow as tf

from tfmp.detection import boxes, targets

ANCHORS = boxes.generate_anchors(64, boxes.AnchorConfig(levels=(3, 4, 5)))


def _random_truth(seed, batch=5, max_boxes=6):
    rng = np.random.default_rng(seed)
    corner = rng.uniform(-8, 56, [batch, max_boxes, 2])
    size = rng.uniform(1, 48, [batch, max_boxes, 2])
    ground_truth = np.concatenate([corner, corner + size], -1).astype(np.float32)
    classes = rng.integers(0, 4, [batch, max_boxes]).astype(np.int32)
    count = rng.integers(0, max_boxes + 1, [batch])
    valid = np.arange(max_boxes)[None] < count[:, None]
    valid[0] = False  # an image without boxes
    # A padded row is class -1 and zeros for the per-example matcher; padding must not match.
    ground_truth = np.where(valid[..., None], ground_truth, 0.0).astype(np.float32)
    return ground_truth, np.where(valid, classes, -1).astype(np.int32), valid


def _assert_equal_to_per_example(anchors, ground_truth, classes, valid, **kwargs):
    found = targets.match_anchors(anchors, ground_truth, classes, valid, **kwargs)
    labels = targets.loss_labels(found)
    for image in range(ground_truth.shape[0]):
        image_anchors = anchors if anchors.shape.rank == 2 else anchors[image]
        expected_classes, expected_boxes = boxes.match(
            image_anchors, ground_truth[image], classes[image], **kwargs
        )
        np.testing.assert_array_equal(labels["classes"][image], expected_classes)
        np.testing.assert_array_equal(labels["boxes"][image], expected_boxes)
    np.testing.assert_array_equal(found.positive, labels["classes"] >= 0)
    np.testing.assert_array_equal(found.ignore, labels["classes"] == boxes.IGNORE)
    return found


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_targets_equal_the_per_example_matcher_on_random_scenes(seed):
    found = _assert_equal_to_per_example(ANCHORS, *_random_truth(seed))
    assert found.classes.dtype == tf.int32 and found.box_deltas.dtype == tf.float32
    assert found.box_deltas.shape == (5, ANCHORS.shape[0], 4)
    assert not found.positive[0].numpy().any()  # no boxes: all background or ignored, no NaN
    assert np.isfinite(found.box_deltas.numpy()).all()


def test_other_thresholds_and_per_image_anchors_match_too():
    ground_truth, classes, valid = _random_truth(3)
    _assert_equal_to_per_example(ANCHORS, ground_truth, classes, valid, positive_iou=0.7, negative_iou=0.3)
    per_image = tf.stack([ANCHORS + float(shift) for shift in range(5)])  # e.g. proposals
    _assert_equal_to_per_example(per_image, ground_truth, classes, valid)


def test_ties_and_one_anchor_best_for_two_boxes():
    anchors = tf.constant([[0, 0, 10, 10], [0, 0, 10, 10], [20, 0, 30, 10], [40, 40, 44, 44]], tf.float32)
    ground_truth = np.array(
        [
            [[0, 0, 10, 20], [0, 0, 20, 10], [38, 38, 46, 46], [0, 0, 0, 0]],  # IoU 0.5 with anchors 0, 1
            [[1, 1, 9, 9], [0, 0, 9, 9], [0, 0, 0, 0], [0, 0, 0, 0]],  # anchor 0 is best for both
        ],
        np.float32,
    )
    classes = np.array([[1, 2, 3, -1], [4, 5, -1, -1]], np.int32)
    found = _assert_equal_to_per_example(anchors, ground_truth, classes, classes >= 0)
    # Both boxes' best anchor is anchor 0 (the first of equal ones): the higher row takes it;
    # anchor 1 is not forced and takes the first of its equal boxes; box 2 forces anchor 3.
    np.testing.assert_array_equal(found.classes[0], [2, 1, boxes.BACKGROUND, 3])
    np.testing.assert_array_equal(found.matched_box[0, :2], [1, 0])
    np.testing.assert_array_equal(found.classes[1], [5, 5, boxes.BACKGROUND, boxes.BACKGROUND])


def test_without_forced_anchors_only_the_iou_decides():
    anchors = tf.constant([[0, 0, 10, 10], [50, 50, 60, 60]], tf.float32)
    ground_truth = tf.constant([[[0, 0, 10, 10], [48, 48, 58, 58]]], tf.float32)  # IoU 1 and 0.47
    found = targets.match_anchors(anchors, ground_truth, [[0, 1]], [[True, True]], force_best_anchor=False)
    np.testing.assert_array_equal(found.classes[0], [0, boxes.IGNORE])
    np.testing.assert_array_equal(found.matched_box[0], [0, 1])


def test_matching_compiles_with_xla_for_a_whole_batch():
    ground_truth, classes, valid = _random_truth(4)
    compiled = tf.function(
        lambda *args: targets.loss_labels(targets.match_anchors(ANCHORS, *args)), jit_compile=True
    )
    found = compiled(ground_truth, classes, valid)
    eager = targets.loss_labels(targets.match_anchors(ANCHORS, ground_truth, classes, valid))
    np.testing.assert_array_equal(found["classes"], eager["classes"])
    # XLA may fuse the delta arithmetic differently: equal to float32 rounding of deltas ~1-10.
    np.testing.assert_allclose(found["boxes"], eager["boxes"], rtol=0, atol=10 * 8 * np.finfo(np.float32).eps)
