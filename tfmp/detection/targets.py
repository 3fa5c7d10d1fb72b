"""Anchor matching on the device, batched over the whole (per-replica) batch, in float32 TF ops.

    targets = match_anchors(anchors, boxes, classes, valid, POSITIVE_IOU, NEGATIVE_IOU)
    targets.classes      # int32 [B, N]: class id, BACKGROUND (-1) or IGNORE (-2)
    targets.box_deltas   # float32 [B, N, 4]: encoded deltas of positives, 0 elsewhere
    targets.positive, targets.ignore      # bool [B, N]
    labels = loss_labels(targets)         # the {"classes", "boxes"} encoding of detection.losses

The input pipeline hands the step ground truth padded to `max_boxes` rows with a validity mask
(`boxes` [B, M, 4] xyxy pixels, `classes` [B, M] int32, `valid` [B, M] bool); this module turns
it into per-anchor targets inside the step, one batched IoU matrix [B, N, M] instead of one
`Dataset.map` call per image. Shapes are static and there is no data-dependent control flow
(no `boolean_mask`, no scatter), so it runs inside an XLA cluster.

The rule is `tfmp.detection.boxes.match` (Lin et al. 2017), and the targets equal its targets
image by image (tests/test_detection_targets.py):

* IoU >= `positive_iou` with the best-overlapping valid box: positive; < `negative_iou`:
  background; in between: ignored;
* with `force_best_anchor` (default), each valid box's best anchor (the first of equal ones) is
  positive too if it overlaps the box at all, and takes that box; an anchor that is the best of
  several boxes takes the one with the highest row index (as the per-example scatter does);
* ties between boxes for an anchor go to the lowest row index (`argmax`).

`anchors` may be [N, 4] (the same anchors for every image: RetinaNet, an RPN) or [B, N, 4]
(per-image candidates, e.g. a second stage's proposals). `matched_box` ([B, N] int32, the row of
the box each anchor matched, meaningful where `positive`) and `matched_iou` let a caller sample
or weight anchors further.
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from tfmp.detection.boxes import BACKGROUND, IGNORE, NEGATIVE_IOU, POSITIVE_IOU, compute_iou, encode


class AnchorTargets(NamedTuple):
    classes: tf.Tensor  # int32 [B, N]: class id (positive), BACKGROUND (-1) or IGNORE (-2)
    box_deltas: tf.Tensor  # float32 [B, N, 4]: `boxes.encode` deltas for positives, 0 elsewhere
    positive: tf.Tensor  # bool [B, N]
    ignore: tf.Tensor  # bool [B, N]: neither positive nor background
    matched_box: tf.Tensor  # int32 [B, N]: row of the matched ground-truth box
    matched_iou: tf.Tensor  # float32 [B, N]: IoU with the best valid box (-1 when there is none)


def _batched_anchors(anchors, batch):
    anchors = tf.convert_to_tensor(anchors, tf.float32)
    if anchors.shape.rank == 2:
        return tf.broadcast_to(anchors[None], tf.concat([[batch], tf.shape(anchors)], 0))
    if anchors.shape.rank != 3:
        raise ValueError(f"anchors must be [N, 4] or [B, N, 4], got shape {anchors.shape}")
    return anchors


def _forced_box(iou, valid):
    """Per anchor, the row of the valid box whose best anchor it is (highest row wins), or -1."""
    num_anchors, num_boxes = tf.shape(iou)[1], tf.shape(iou)[2]
    best_anchor = tf.argmax(iou, axis=1, output_type=tf.int32)  # [B, M], first of equal anchors
    forced = valid & (tf.reduce_max(iou, axis=1) > 0.0)  # [B, M]
    is_best = tf.equal(tf.range(num_anchors)[None, :, None], best_anchor[:, None, :]) & forced[:, None, :]
    rows = tf.broadcast_to(tf.range(num_boxes)[None, None, :], tf.shape(iou))
    return tf.reduce_max(tf.where(is_best, rows, -1), axis=2)  # [B, N]


def match_anchors(
    anchors,
    boxes,
    classes,
    valid,
    positive_iou: float = POSITIVE_IOU,
    negative_iou: float = NEGATIVE_IOU,
    *,
    force_best_anchor: bool = True,
) -> AnchorTargets:
    """Targets of every anchor of every image of a batch (see the module docstring).

    `anchors` [N, 4] or [B, N, 4], `boxes` [B, M, 4] xyxy pixels, `classes` [B, M] int32,
    `valid` [B, M] bool (False rows, e.g. padding, match nothing). Everything float32.
    """
    boxes = tf.convert_to_tensor(boxes, tf.float32)
    classes = tf.convert_to_tensor(classes, tf.int32)
    valid = tf.convert_to_tensor(valid, tf.bool)
    anchors = _batched_anchors(anchors, tf.shape(boxes)[0])
    iou = tf.where(valid[:, None, :], compute_iou(anchors, boxes), -1.0)  # [B, N, M]
    matched_box = tf.argmax(iou, axis=2, output_type=tf.int32)  # first of equal boxes
    matched_iou = tf.reduce_max(iou, axis=2)
    positive = matched_iou >= positive_iou
    if force_best_anchor:
        forced = _forced_box(iou, valid)
        matched_box = tf.where(forced >= 0, forced, matched_box)
        positive |= forced >= 0
    background = (matched_iou < negative_iou) & ~positive
    target_classes = tf.where(
        positive,
        tf.gather(classes, matched_box, batch_dims=1),
        tf.where(background, BACKGROUND, IGNORE),
    )
    deltas = encode(anchors, tf.gather(boxes, matched_box, batch_dims=1))
    # A product with 0 would keep a NaN/inf delta; where() does not.
    deltas = tf.where(positive[..., None], deltas, 0.0)
    return AnchorTargets(target_classes, deltas, positive, ~positive & ~background, matched_box, matched_iou)


def loss_labels(targets: AnchorTargets) -> dict:
    """The labels `tfmp.detection.losses` reads: {"classes": int32 [B, N], "boxes": float32
    [B, N, 5]} (deltas and a 5th column, 1.0 on positive anchors), as `boxes.match` encodes them."""
    weight = tf.cast(targets.positive, tf.float32)[..., None]
    return {"classes": targets.classes, "boxes": tf.concat([targets.box_deltas, weight], axis=-1)}
