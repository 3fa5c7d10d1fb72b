"""Anchors, IoU, box encoding and anchor matching for RetinaNet, in float32 TensorFlow ops.

    config = boxes.AnchorConfig(levels=(3, 4, 5))
    anchors = boxes.generate_anchors(128, config)               # [A, 4] float32, xyxy pixels
    classes, box_targets = boxes.match(anchors, gt_boxes, gt_classes)   # inside Dataset.map
    detections = boxes.decode_detections(predictions, anchors)  # combined NMS, float32 out

Boxes are `xyxy` in pixels of the model's input image (x_min, y_min, x_max, y_max; pixel edges,
so a box covering pixel columns 3..5 is x 3.0 to 6.0). Anchors are a pure function of the image
size and the `AnchorConfig`, so the input pipeline (matching) and the decoder always agree, and
their order is the order of the model's outputs: level by level, then row, column, and the
`len(scales) * len(ratios)` anchors of one location (ratio-major).

Matching (Lin et al. 2017): IoU >= 0.5 with a ground-truth box is positive, < 0.4 negative, in
between ignored; each ground-truth box's best anchor is positive as well, so a box no anchor
overlaps well is still learned. Targets (the label encoding of `tfmp.detection.losses`):

* class target, int32 [A]: the class id (>= 0) for a positive anchor, `BACKGROUND` (-1) for a
  negative one, `IGNORE` (-2) for one that counts in neither loss;
* box target, float32 [A, 5]: the encoded deltas (center y, x, log h, log w, divided by
  `BOX_VARIANCE`, as `keras.utils.bounding_boxes.encode_box_to_deltas` computes them) and a 5th
  column that is 1.0 for positive anchors, 0.0 otherwise.

Everything has static shapes (ground truth padded with class -1 rows), so it runs inside
`tf.data.Dataset.map` and keeps the train step XLA-compilable.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import tensorflow as tf
from keras.utils import bounding_boxes

from tfmp.errors import UsageError

BACKGROUND, IGNORE = -1, -2
POSITIVE_IOU, NEGATIVE_IOU = 0.5, 0.4
# Scales the encoded deltas to roughly unit variance (the convention of keras-cv/keras-hub's
# RetinaNet), so a Huber loss with delta 1 weighs centre and size errors sensibly.
BOX_VARIANCE = (0.1, 0.1, 0.2, 0.2)
# exp() of a log-size delta above this is a box ~1000/16 times its anchor: clamp, as Detectron does.
MAX_LOG_SIZE_DELTA = math.log(1000.0 / 16.0)


@dataclasses.dataclass(frozen=True)
class AnchorConfig:
    """Which anchors a detector uses; its levels are also the FPN levels of the model.

    An anchor of level l is `size * 2**l * scale` pixels across (the paper's 32 px at P3 with
    `size=4`), stretched to each aspect ratio (height / width) at constant area.
    """

    levels: tuple[int, ...] = (3, 4, 5, 6, 7)
    scales: tuple[float, ...] = (1.0, 2 ** (1 / 3), 2 ** (2 / 3))
    ratios: tuple[float, ...] = (0.5, 1.0, 2.0)
    size: float = 4.0

    @property
    def anchors_per_location(self) -> int:
        return len(self.scales) * len(self.ratios)


def feature_size(image_size: int, level: int) -> int:
    """Side of the level-`level` map: "same"-padded stride-2 convs round up at every halving."""
    size = image_size
    for _ in range(level):
        size = -(-size // 2)
    return size


def generate_anchors(image_size: int, config: AnchorConfig = AnchorConfig()) -> tf.Tensor:
    """All anchors of a square `image_size` image, [A, 4] float32 xyxy (see module docstring)."""
    if not isinstance(image_size, int) or image_size < 2 ** max(config.levels, default=0):
        raise UsageError(
            f"bad detection image_size {image_size!r}; use an integer of at least "
            f"{2 ** max(config.levels, default=0)} for levels {config.levels}"
        )
    per_level = []
    for level in config.levels:
        stride, cells = 2.0**level, feature_size(image_size, level)
        # Anchor shapes of one location: ratio-major, matching the head's channel order.
        shapes = [
            (config.size * stride * scale * math.sqrt(ratio), config.size * stride * scale / math.sqrt(ratio))
            for ratio in config.ratios
            for scale in config.scales
        ]
        half = np.array(shapes, np.float64)[None, None] / 2  # [1, 1, K, (h, w)]
        centres = (np.arange(cells) + 0.5) * stride
        cy, cx = np.meshgrid(centres, centres, indexing="ij")
        cy, cx = cy[..., None], cx[..., None]
        level_anchors = np.stack(
            [cx - half[..., 1], cy - half[..., 0], cx + half[..., 1], cy + half[..., 0]], axis=-1
        )
        per_level.append(level_anchors.reshape(-1, 4))
    return tf.constant(np.concatenate(per_level), tf.float32)


def compute_iou(boxes1, boxes2) -> tf.Tensor:
    """IoU of every box in `boxes1` [..., N, 4] with every box in `boxes2` [..., M, 4] (xyxy)."""
    return bounding_boxes.compute_iou(
        tf.cast(boxes1, tf.float32), tf.cast(boxes2, tf.float32), bounding_box_format="xyxy"
    )


def encode(anchors, boxes) -> tf.Tensor:
    """Deltas [..., A, 4] that turn each anchor into its box (both xyxy, float32)."""
    return bounding_boxes.encode_box_to_deltas(
        tf.cast(anchors, tf.float32),
        tf.cast(boxes, tf.float32),
        anchor_format="xyxy",
        box_format="xyxy",
        variance=BOX_VARIANCE,
    )


def decode(anchors, deltas) -> tf.Tensor:
    """Boxes [..., A, 4] xyxy from deltas: the inverse of `encode`, always float32.

    Log-size deltas are clamped first: an untrained head can emit any value, and exp() of it
    would overflow into inf boxes that NMS cannot handle.
    """
    deltas = tf.cast(deltas, tf.float32)
    limit = MAX_LOG_SIZE_DELTA / BOX_VARIANCE[2]
    deltas = tf.concat([deltas[..., :2], tf.clip_by_value(deltas[..., 2:], -limit, limit)], -1)
    return bounding_boxes.decode_deltas_to_boxes(
        tf.cast(anchors, tf.float32), deltas, anchor_format="xyxy", box_format="xyxy", variance=BOX_VARIANCE
    )


def match(
    anchors, gt_boxes, gt_classes, positive_iou: float = POSITIVE_IOU, negative_iou: float = NEGATIVE_IOU
) -> tuple[tf.Tensor, tf.Tensor]:
    """Class targets int32 [A] and box targets float32 [A, 5] for one image.

    `gt_boxes` [M, 4] xyxy and `gt_classes` [M] int32, padded with class -1 rows (which match
    nothing). See the module docstring for the encoding.
    """
    anchors = tf.cast(anchors, tf.float32)
    gt_boxes, gt_classes = tf.cast(gt_boxes, tf.float32), tf.cast(gt_classes, tf.int32)
    valid = gt_classes >= 0
    iou = compute_iou(anchors, gt_boxes)  # [A, M]
    iou = tf.where(valid[None, :], iou, -1.0)
    best_gt = tf.argmax(iou, axis=1, output_type=tf.int32)
    best_iou = tf.reduce_max(iou, axis=1)
    # Each real box's best anchor is positive too (if it overlaps the box at all).
    best_anchor = tf.argmax(iou, axis=0, output_type=tf.int32)  # [M]
    forced = valid & (tf.reduce_max(iou, axis=0) > 0.0)
    forced_anchor = tf.boolean_mask(best_anchor, forced)
    best_gt = tf.tensor_scatter_nd_update(
        best_gt, forced_anchor[:, None], tf.boolean_mask(tf.range(tf.shape(gt_classes)[0]), forced)
    )
    forced_count = tf.scatter_nd(forced_anchor[:, None], tf.ones_like(forced_anchor), tf.shape(best_gt))
    positive = (best_iou >= positive_iou) | (forced_count > 0)
    negative = (best_iou < negative_iou) & ~positive
    classes = tf.where(positive, tf.gather(gt_classes, best_gt), tf.where(negative, BACKGROUND, IGNORE))
    deltas = encode(anchors, tf.gather(gt_boxes, best_gt))
    weight = tf.cast(positive, tf.float32)[:, None]
    return classes, tf.concat([deltas * weight, weight], axis=-1)


def decode_detections(
    predictions: dict,
    anchors,
    *,
    score_threshold: float = 0.05,
    iou_threshold: float = 0.5,
    max_detections: int = 100,
    pre_nms_top_k: int = 1000,
    image_size: int | None = None,
) -> dict:
    """Boxes, scores, classes and counts of detections from the model's outputs, in float32.

    `predictions` is the model's dict ({"classes": [B, A, K] logits, "boxes": [B, A, 4]}), any
    float dtype. Keeps the `pre_nms_top_k` anchors with the highest class score, then runs
    `tf.image.combined_non_max_suppression` per class. Returns a dict of `boxes` [B, D, 4] xyxy
    pixels (clipped to the image when `image_size` is given), `scores` [B, D], `classes` [B, D]
    int32 and `valid_detections` [B] int32, with D = `max_detections`; rows past the count are 0.
    """
    logits = tf.cast(predictions["classes"], tf.float32)
    boxes = decode(anchors, predictions["boxes"])
    scores = tf.sigmoid(logits)
    top_k = min(pre_nms_top_k, logits.shape[1]) if logits.shape[1] else pre_nms_top_k
    _, top = tf.math.top_k(tf.reduce_max(scores, axis=-1), k=top_k)
    scores = tf.gather(scores, top, batch_dims=1)
    boxes = tf.gather(boxes, top, batch_dims=1)
    if image_size is not None:
        boxes = tf.clip_by_value(boxes, 0.0, float(image_size))
    # combined NMS wants [y1, x1, y2, x2]; its IoU is the same for xyxy, but its clipping to
    # [0, 1] is not: clip_boxes=False, pixel boxes stay pixel boxes.
    nms_boxes, nms_scores, nms_classes, valid = tf.image.combined_non_max_suppression(
        boxes[:, :, None, :],
        scores,
        max_output_size_per_class=max_detections,
        max_total_size=max_detections,
        iou_threshold=iou_threshold,
        score_threshold=score_threshold,
        clip_boxes=False,
    )
    return {
        "boxes": tf.cast(nms_boxes, tf.float32),
        "scores": tf.cast(nms_scores, tf.float32),
        "classes": tf.cast(nms_classes, tf.int32),
        "valid_detections": tf.cast(valid, tf.int32),
    }
