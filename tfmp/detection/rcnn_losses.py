"""Faster R-CNN's four losses, every normaliser a count of the GLOBAL batch (all replicas/workers).

    loss = FasterRCNNLoss(class_loss="focal")      # or "softmax"
    model.compile(optimizer, loss=loss)            # a tfmp.detection.faster_rcnn.FasterRCNN
    terms = loss.terms(inputs, outputs, anchors)   # {"rpn_class": ..., "rpn_box": ..., ...}

* `rpn_class`: binary cross-entropy of the objectness logits of the sampled anchors (256 per
  image, `proposals.rpn_targets`), `rpn_box`: Huber (smooth-L1) of the encoded deltas of the
  positive ones; both divided by the number of sampled anchors in the global batch (Detectron's
  normaliser, made global).
* `rcnn_class`: over the sampled ROIs (`proposals.sample_rois`; weight 0 for padding), either
  softmax cross-entropy over background + K classes, or its focal form
  `-(1 - p_t)**gamma * log(p_t)` (gamma 2, the default: the mixed-precision article's choice),
  which down-weights the many easy background ROIs; `rcnn_box`: Huber of the deltas the head
  predicts FOR THE TARGET CLASS of each foreground ROI. Both divided by the global ROI count.

Targets are computed here, inside the replica step, from the padded ground truth the model
takes as inputs (`inputs["gt_boxes"]`, `inputs["gt_classes"]`) and the ROIs it sampled, all in
float32. Each term is this replica's share: summed over replicas it is the global-batch loss,
so the all-reduced gradients equal one device's (`tfmp.distribute.strategies.global_sum`).
"""

from __future__ import annotations

import tensorflow as tf

from tfmp.detection import proposals
from tfmp.distribute.strategies import global_sum
from tfmp.errors import unknown

CLASS_LOSSES = ("focal", "softmax")
FOCAL_GAMMA = 2.0
HUBER_DELTA = 1.0  # deltas are scaled by boxes.BOX_VARIANCE (~unit spread), as RetinaNet's


def _huber(difference, delta: float = HUBER_DELTA):
    absolute = tf.abs(difference)
    return tf.where(absolute <= delta, 0.5 * tf.square(absolute), delta * (absolute - 0.5 * delta))


def _global_count(mask):
    return tf.maximum(global_sum(tf.reduce_sum(tf.cast(mask, tf.float32))), 1.0)


def rpn_losses(anchors, scores, deltas, gt_boxes, gt_classes) -> dict:
    """The RPN's objectness and box losses (this replica's share of the global-batch loss)."""
    labels, targets = proposals.rpn_targets(anchors, gt_boxes, gt_classes)
    sampled, positive = labels >= 0.0, labels > 0.0
    count = _global_count(sampled)
    scores, deltas = tf.cast(scores, tf.float32), tf.cast(deltas, tf.float32)
    cross_entropy = tf.nn.sigmoid_cross_entropy_with_logits(labels=tf.maximum(labels, 0.0), logits=scores)
    box = tf.reduce_sum(_huber(targets - deltas), axis=-1)
    return {
        "rpn_class": tf.reduce_sum(tf.where(sampled, cross_entropy, 0.0)) / count,
        "rpn_box": tf.reduce_sum(tf.where(positive, box, 0.0)) / count,
    }


def rcnn_losses(rois, weights, logits, deltas, gt_boxes, gt_classes, class_loss: str = "focal") -> dict:
    """The second stage's class and box losses over the sampled ROIs [B, R, 4] (`weights` [B, R]:
    1 sampled, 0 padding); `logits` [B, R, K + 1], `deltas` [B, R, 4 K]."""
    if class_loss not in CLASS_LOSSES:
        raise unknown("--rcnn_class_loss value", class_loss, CLASS_LOSSES)
    classes, targets = proposals.roi_targets(rois, gt_boxes, gt_classes)
    weights = tf.cast(weights, tf.float32)
    count = tf.maximum(global_sum(tf.reduce_sum(weights)), 1.0)
    logits = tf.cast(logits, tf.float32)
    log_probabilities = tf.nn.log_softmax(logits, axis=-1)
    log_p_true = tf.gather(log_probabilities, classes, batch_dims=2)
    per_roi = -log_p_true
    if class_loss == "focal":
        per_roi = per_roi * tf.pow(1.0 - tf.exp(log_p_true), FOCAL_GAMMA)
    foreground = tf.cast(classes > 0, tf.float32) * weights
    # The head predicts 4 deltas per class; the loss sees those of the target class only.
    per_class = tf.reshape(tf.cast(deltas, tf.float32), tf.concat([tf.shape(deltas)[:2], [-1, 4]], 0))
    predicted = tf.gather(per_class, tf.maximum(classes - 1, 0), batch_dims=2)
    box = tf.reduce_sum(_huber(targets - predicted), axis=-1)
    return {
        "rcnn_class": tf.reduce_sum(per_roi * weights) / count,
        "rcnn_box": tf.reduce_sum(box * foreground) / count,
    }


class FasterRCNNLoss:
    """The sum of the four terms; `class_loss` "focal" (default) or "softmax" for the 2nd stage."""

    def __init__(self, class_loss: str = "focal"):
        if class_loss not in CLASS_LOSSES:
            raise unknown("--rcnn_class_loss value", class_loss, CLASS_LOSSES)
        self.class_loss = class_loss

    def terms(self, inputs: dict, outputs: dict, anchors) -> dict:
        gt_boxes, gt_classes = inputs["gt_boxes"], inputs["gt_classes"]
        return {
            **rpn_losses(anchors, outputs["rpn_scores"], outputs["rpn_deltas"], gt_boxes, gt_classes),
            **rcnn_losses(
                outputs["rois"],
                outputs["roi_weights"],
                outputs["roi_classes"],
                outputs["roi_deltas"],
                gt_boxes,
                gt_classes,
                self.class_loss,
            ),
        }

    def __call__(self, inputs: dict, outputs: dict, anchors):
        return tf.add_n(list(self.terms(inputs, outputs, anchors).values()))
