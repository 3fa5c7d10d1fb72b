"""Faster R-CNN's box bookkeeping (Ren et al. 2015, with FPN's per-level proposals), in float32.

    labels, targets = rpn_targets(anchors, gt_boxes, gt_classes)           # RPN loss targets
    rois, valid = propose(anchors, level_sizes, scores, deltas, 128, 2000, 1000)
    rois, weights = sample_rois(rois, valid, gt_boxes, gt_classes, 512)      # training only
    classes, box_targets = roi_targets(rois, gt_boxes, gt_classes)          # 2nd-stage targets

Everything is batched over the images of a replica with static shapes: ground truth comes
padded (`gt_boxes` [B, M, 4] xyxy pixels, `gt_classes` [B, M] int32, -1 for padding rows),
proposals come padded to `post_nms_top_k` with a validity mask, and every decision is made per
image. The random choices of sampling are keyed by the image's own ground truth (not by its
row in the batch), so a batch split over N replicas samples exactly what one device samples.

* RPN targets: an anchor with IoU >= 0.7 with a box is positive, < 0.3 negative (each box's
  best anchors are positive too); 256 anchors per image are sampled, at most half positive.
  Labels: 1 positive, 0 negative, -1 not sampled.
* Proposals: per level the `pre_nms_top_k` best anchors by objectness, decoded (clamped
  log-size deltas) and clipped to the image, then one NMS (IoU 0.7) over all levels per image
  keeps the `post_nms_top_k` best (Detectron's FPN defaults: 2000 / 1000).
* ROI sampling (training): the ground-truth boxes join the proposals; `rois_per_image` are
  sampled, at most `positive_fraction` (0.25) of them foreground (IoU >= 0.5), the rest
  background; when there are too few candidates the rest are padding (weight 0).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmp.detection import boxes
from tfmp.detection.targets import match_anchors

RPN_POSITIVE_IOU, RPN_NEGATIVE_IOU = 0.7, 0.3
RPN_SAMPLES_PER_IMAGE, RPN_POSITIVE_FRACTION = 256, 0.5
PRE_NMS_TOP_K, POST_NMS_TOP_K, PROPOSAL_NMS_IOU = 2000, 1000, 0.7
ROIS_PER_IMAGE, ROI_POSITIVE_FRACTION, ROI_FOREGROUND_IOU = 512, 0.25, 0.5
_RPN_SALT, _ROI_SALT = 17, 29  # different random streams for the two samplers


def image_seeds(gt_boxes, gt_classes, salt: int):
    """Stateless-random seeds int32 [B, 2] made from each image's own ground truth."""
    weights = tf.range(1.0, tf.cast(tf.shape(gt_boxes)[1], tf.float32) * 4.0 + 1.0)
    flat = tf.reshape(tf.cast(gt_boxes, tf.float32), [tf.shape(gt_boxes)[0], -1])
    digest = tf.bitcast(tf.reduce_sum(flat * weights, axis=-1), tf.int32)
    classes = tf.reduce_sum(tf.cast(gt_classes, tf.int32) + 1, axis=-1)
    return tf.stack([digest, classes * 1009 + salt], axis=-1)


def _uniform(seeds, count):
    """Per-image uniform noise [B, count] from per-image seeds [B, 2]."""
    return tf.map_fn(
        lambda seed: tf.random.stateless_uniform([count], seed),
        seeds,
        fn_output_signature=tf.TensorSpec([None], tf.float32),
    )


def _rank(priority):
    """0 for the largest value of each row, 1 for the next, ..."""
    order = tf.argsort(priority, axis=-1, direction="DESCENDING", stable=True)
    return tf.argsort(order, axis=-1, stable=True)


def sample_balanced(positive, negative, noise, samples: int, positive_fraction: float):
    """Masks (positives, negatives) [B, N] of a random sample of at most `samples` per image,
    at most `positive_fraction` of them positive (the rest filled with negatives)."""
    positives = tf.reduce_sum(tf.cast(positive, tf.int32), axis=-1, keepdims=True)
    take_positive = tf.minimum(positives, int(samples * positive_fraction))
    take_negative = samples - take_positive
    chosen_positive = positive & (_rank(tf.where(positive, noise, -1.0)) < take_positive)
    chosen_negative = negative & (_rank(tf.where(negative, noise, -1.0)) < take_negative)
    return chosen_positive, chosen_negative


def rpn_targets(
    anchors,
    gt_boxes,
    gt_classes,
    positive_iou: float = RPN_POSITIVE_IOU,
    negative_iou: float = RPN_NEGATIVE_IOU,
    samples: int = RPN_SAMPLES_PER_IMAGE,
    positive_fraction: float = RPN_POSITIVE_FRACTION,
):
    """Objectness labels float32 [B, A] (1, 0, -1 = not sampled) and encoded box targets
    [B, A, 4] (meaningful where the label is 1) for anchors [A, 4]: `targets.match_anchors`
    (each real box's best anchor positive too), then the balanced sample."""
    gt_boxes, gt_classes = tf.cast(gt_boxes, tf.float32), tf.cast(gt_classes, tf.int32)
    matched = match_anchors(anchors, gt_boxes, gt_classes, gt_classes >= 0, positive_iou, negative_iou)
    negative = ~matched.positive & ~matched.ignore  # an image without boxes: every anchor
    noise = _uniform(image_seeds(gt_boxes, gt_classes, _RPN_SALT), tf.shape(anchors)[0])
    positive, negative = sample_balanced(matched.positive, negative, noise, samples, positive_fraction)
    return tf.where(positive, 1.0, tf.where(negative, 0.0, -1.0)), matched.box_deltas


def roi_targets(rois, gt_boxes, gt_classes, foreground_iou: float = ROI_FOREGROUND_IOU):
    """Second-stage targets of boxes `rois` [B, R, 4]: class int32 [B, R] (0 background, c + 1
    for class c) and encoded deltas [B, R, 4] to the matched box (0 for background)."""
    gt_classes = tf.cast(gt_classes, tf.int32)
    matched = match_anchors(
        rois, gt_boxes, gt_classes, gt_classes >= 0, foreground_iou, foreground_iou, force_best_anchor=False
    )
    return tf.where(matched.positive, matched.classes + 1, 0), matched.box_deltas


def sample_rois(
    proposals,
    valid,
    gt_boxes,
    gt_classes,
    rois_per_image: int = ROIS_PER_IMAGE,
    positive_fraction: float = ROI_POSITIVE_FRACTION,
    foreground_iou: float = ROI_FOREGROUND_IOU,
):
    """Training ROIs [B, rois_per_image, 4] and weights [B, rois_per_image] (1 sampled, 0
    padding) from proposals [B, P, 4] (`valid` [B, P]) plus the ground-truth boxes."""
    gt_boxes, gt_classes = tf.cast(gt_boxes, tf.float32), tf.cast(gt_classes, tf.int32)
    candidates = tf.concat([tf.cast(proposals, tf.float32), gt_boxes], axis=1)
    usable = tf.concat([tf.cast(valid, tf.bool), gt_classes >= 0], axis=1)
    # Fewer candidates than ROIs to return (small top-k): unusable zero boxes fill the gap.
    missing = tf.maximum(rois_per_image - tf.shape(candidates)[1], 0)
    candidates = tf.pad(candidates, [[0, 0], [0, missing], [0, 0]])
    usable = tf.pad(usable, [[0, 0], [0, missing]])
    best_iou = match_anchors(
        candidates, gt_boxes, gt_classes, gt_classes >= 0, force_best_anchor=False
    ).matched_iou
    positive = usable & (best_iou >= foreground_iou)
    negative = usable & ~positive
    noise = _uniform(image_seeds(gt_boxes, gt_classes, _ROI_SALT), tf.shape(candidates)[1])
    positive, negative = sample_balanced(positive, negative, noise, rois_per_image, positive_fraction)
    chosen = positive | negative
    # The sampled candidates first (in random order), padding after them.
    _, picked = tf.math.top_k(tf.where(chosen, 1.0 + noise, noise - 1.0), k=rois_per_image)
    rois = tf.gather(candidates, picked, batch_dims=1)
    weights = tf.cast(tf.gather(chosen, picked, batch_dims=1), tf.float32)
    return tf.stop_gradient(rois * weights[..., None]), weights


def propose(
    anchors,
    level_sizes,
    scores,
    deltas,
    image_size: int,
    pre_nms_top_k: int = PRE_NMS_TOP_K,
    post_nms_top_k: int = POST_NMS_TOP_K,
    nms_iou: float = PROPOSAL_NMS_IOU,
):
    """Proposals [B, post_nms_top_k, 4] (xyxy, clipped, best first) and their validity [B, P]
    from RPN logits `scores` [B, A] and `deltas` [B, A, 4]; `level_sizes` counts the anchors
    of each level in order (the per-level top-k)."""
    anchors = tf.cast(anchors, tf.float32)
    scores, deltas = tf.cast(scores, tf.float32), tf.cast(deltas, tf.float32)
    picked_scores, picked_boxes, start = [], [], 0
    for size in level_sizes:
        top_scores, top = tf.math.top_k(scores[:, start : start + size], k=min(pre_nms_top_k, size))
        level_deltas = tf.gather(deltas[:, start : start + size], top, batch_dims=1)
        level_anchors = tf.gather(anchors[start : start + size], top)
        picked_boxes.append(boxes.decode(level_anchors, level_deltas))
        picked_scores.append(top_scores)
        start += size
    candidates = tf.clip_by_value(tf.concat(picked_boxes, axis=1), 0.0, float(image_size))
    probabilities = tf.sigmoid(tf.concat(picked_scores, axis=1))
    kept, _, _, count = tf.image.combined_non_max_suppression(
        candidates[:, :, None, :],
        probabilities[:, :, None],
        max_output_size_per_class=post_nms_top_k,
        max_total_size=post_nms_top_k,
        iou_threshold=nms_iou,
        score_threshold=0.0,
        pad_per_class=False,
        clip_boxes=False,
    )
    valid = tf.range(post_nms_top_k)[None, :] < count[:, None]
    return tf.stop_gradient(kept), valid


@keras.saving.register_keras_serializable(package="tfmp")
class Proposals(keras.layers.Layer):
    """`propose` as a float32 layer: `[scores, deltas]` -> {"rois", "valid"}; the anchors are
    rebuilt from the image size and anchor config, so the layer has no weights."""

    def __init__(self, image_size, levels, scales, ratios, size, pre_nms_top_k, post_nms_top_k, **kwargs):
        kwargs["dtype"] = "float32"
        kwargs["trainable"] = False
        super().__init__(**kwargs)
        self.image_size, self.pre_nms_top_k, self.post_nms_top_k = image_size, pre_nms_top_k, post_nms_top_k
        self.config = boxes.AnchorConfig(tuple(levels), tuple(scales), tuple(ratios), size)

    def call(self, inputs):
        scores, deltas = inputs
        anchors = boxes.generate_anchors(self.image_size, self.config)
        per_location = self.config.anchors_per_location
        level_sizes = [
            boxes.feature_size(self.image_size, level) ** 2 * per_location for level in self.config.levels
        ]
        rois, valid = propose(
            anchors, level_sizes, scores, deltas, self.image_size, self.pre_nms_top_k, self.post_nms_top_k
        )
        return {"rois": rois, "valid": tf.cast(valid, tf.float32)}

    def compute_output_spec(self, inputs):
        scores = inputs[0]
        shape = (scores.shape[0], self.post_nms_top_k)
        return {
            "rois": keras.KerasTensor(shape + (4,), "float32"),
            "valid": keras.KerasTensor(shape, "float32"),
        }

    def get_config(self):
        return {
            **super().get_config(),
            "image_size": self.image_size,
            "levels": list(self.config.levels),
            "scales": list(self.config.scales),
            "ratios": list(self.config.ratios),
            "size": self.config.size,
            "pre_nms_top_k": self.pre_nms_top_k,
            "post_nms_top_k": self.post_nms_top_k,
        }


@keras.saving.register_keras_serializable(package="tfmp")
class SampleROIs(keras.layers.Layer):
    """Training: `sample_rois` (ground truth joins the proposals); inference: the proposals
    as they are. `[rois, valid, gt_boxes, gt_classes]` -> {"rois", "weights"}."""

    def __init__(self, rois_per_image, positive_fraction=ROI_POSITIVE_FRACTION, **kwargs):
        kwargs["dtype"] = "float32"
        kwargs["trainable"] = False
        super().__init__(**kwargs)
        self.rois_per_image, self.positive_fraction = rois_per_image, positive_fraction

    def call(self, inputs, training=None):
        rois, valid, gt_boxes, gt_classes = inputs
        if not training:
            return {"rois": rois, "weights": valid}
        rois, weights = sample_rois(
            rois, valid > 0, gt_boxes, gt_classes, self.rois_per_image, self.positive_fraction
        )
        return {"rois": rois, "weights": weights}

    def compute_output_spec(self, inputs, training=None):
        shape = (inputs[0].shape[0], None)
        return {
            "rois": keras.KerasTensor(shape + (4,), "float32"),
            "weights": keras.KerasTensor(shape, "float32"),
        }

    def get_config(self):
        return {
            **super().get_config(),
            "rois_per_image": self.rois_per_image,
            "positive_fraction": self.positive_fraction,
        }
