"""RetinaNet losses: focal loss for classes, Huber for boxes, both over the GLOBAL positive count.

    matcher = targets.AnchorMatcher(128, anchor_config)       # anchors matched in the step
    model.compile(optimizer, loss={"classes": ClassLoss(matcher=matcher), "boxes": BoxLoss(matcher=matcher)})
    model.fit(dataset.map(lambda image, truth: (image, ground_truth_labels(truth))))

With a `matcher`, the labels are the padded ground truth of each image (`ground_truth_labels`
of a `tfmp.detection.data` element: the same packed [B, M, 6] tensor under both keys) and each
loss matches the anchors of its replica's batch itself (`tfmp.detection.targets.match_anchors`:
one IoU matrix [B, A, M], small next to the model; the two losses' matchings are the same).
Without one, the labels are per-anchor targets already (`data.load(..., anchors=...)`):

* `y_true["classes"]`: int32 [B, A]; class id >= 0 for a positive anchor, -1 (`BACKGROUND`) for
  a negative, -2 (`IGNORE`) for an anchor with 0.4 <= IoU < 0.5 that counts in neither loss.
* `y_true["boxes"]`: float32 [B, A, 5]; encoded target deltas and a 5th column, 1.0 for
  positive anchors (the only ones the box loss sees) and 0.0 otherwise.

The predictions are the model's "classes" logits [B, A, K] and "boxes" deltas [B, A, 4].

Both losses are summed over anchors and divided by the number of positive anchors in the
*global* batch (`tfmp.distribute.strategies.global_sum`: all replicas and workers), and have
`reduction="sum"`: Keras then neither averages over the batch nor divides by the replica count,
so the gradients summed over N replicas are exactly the single-device gradients of the global
batch. Each returns one value per image (its share of the batch loss), whose sum is the loss.
Both compute in float32 (`keras.losses.Loss.__call__` casts float16 predictions to the loss
dtype first), so float16 logits give a finite loss.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmp.detection import targets as anchor_targets
from tfmp.distribute.strategies import global_sum

FOCAL_ALPHA, FOCAL_GAMMA = 0.25, 2.0
HUBER_DELTA = 1.0  # on deltas scaled by boxes.BOX_VARIANCE (~unit spread)


def ground_truth_labels(truth: dict) -> dict:
    """Labels for losses with a matcher from a `tfmp.detection.data` ground-truth dict."""
    packed = anchor_targets.pack_ground_truth(truth["boxes"], truth["classes"], truth["box_valid"])
    return {"classes": packed, "boxes": packed}


def _matcher(matcher):
    if matcher is None or isinstance(matcher, anchor_targets.AnchorMatcher):
        return matcher
    return anchor_targets.AnchorMatcher.from_config(matcher)  # from a saved loss config


def _global_positives(positive):
    """Positive anchors in the global batch, at least 1 (an image may have no objects)."""
    return tf.maximum(global_sum(tf.reduce_sum(tf.cast(positive, tf.float32))), 1.0)


@keras.saving.register_keras_serializable(package="tfmp")
class ClassLoss(keras.losses.Loss):
    """Sigmoid focal loss (alpha 0.25, gamma 2) summed over classes and non-ignored anchors,
    per image, divided by the global positive-anchor count. Uses
    `keras.losses.BinaryFocalCrossentropy` for the per-class terms."""

    def __init__(
        self,
        alpha: float = FOCAL_ALPHA,
        gamma: float = FOCAL_GAMMA,
        name: str = "class_focal_loss",
        matcher: anchor_targets.AnchorMatcher | dict | None = None,
        **kwargs,
    ):
        kwargs.setdefault("reduction", "sum")
        kwargs.setdefault("dtype", "float32")
        super().__init__(name=name, **kwargs)
        self.alpha, self.gamma, self.matcher = alpha, gamma, _matcher(matcher)
        self._focal = keras.losses.BinaryFocalCrossentropy(
            apply_class_balancing=True,
            alpha=alpha,
            gamma=gamma,
            from_logits=True,
            reduction=None,
            dtype="float32",
        )

    def call(self, y_true, y_pred):
        targets = self.matcher(y_true).classes if self.matcher else tf.cast(y_true, tf.int32)
        num_classes = y_pred.shape[-1] or tf.shape(y_pred)[-1]
        one_hot = tf.one_hot(tf.maximum(targets, -1), num_classes, dtype=tf.float32)  # -1 -> 0s
        # BinaryFocalCrossentropy averages over the class axis; the paper sums over it.
        per_anchor = self._focal(one_hot[..., None], y_pred[..., None])
        per_anchor = tf.reduce_sum(per_anchor, axis=-1)
        counted = tf.cast(targets != -2, tf.float32)  # boxes.IGNORE
        per_image = tf.reduce_sum(per_anchor * counted, axis=-1)
        return per_image / _global_positives(targets >= 0)

    def get_config(self):
        matcher = self.matcher.get_config() if self.matcher else None
        return {**super().get_config(), "alpha": self.alpha, "gamma": self.gamma, "matcher": matcher}


@keras.saving.register_keras_serializable(package="tfmp")
class BoxLoss(keras.losses.Loss):
    """Huber (smooth-L1) loss of the encoded deltas of positive anchors, summed over the 4
    coordinates and anchors per image, divided by the global positive-anchor count."""

    def __init__(
        self,
        delta: float = HUBER_DELTA,
        name: str = "box_huber_loss",
        matcher: anchor_targets.AnchorMatcher | dict | None = None,
        **kwargs,
    ):
        kwargs.setdefault("reduction", "sum")
        kwargs.setdefault("dtype", "float32")
        super().__init__(name=name, **kwargs)
        self.delta, self.matcher = delta, _matcher(matcher)
        self._huber = keras.losses.Huber(delta=delta, reduction=None, dtype="float32")

    def call(self, y_true, y_pred):
        if self.matcher:
            found = self.matcher(y_true)
            targets, positive = found.box_deltas, tf.cast(found.positive, tf.float32)
        else:
            targets, positive = y_true[..., :4], y_true[..., 4]
        # Huber averages over its last axis: per coordinate, then summed back.
        per_coordinate = self._huber(targets[..., None], y_pred[..., None])
        per_anchor = tf.reduce_sum(per_coordinate, axis=-1)
        per_image = tf.reduce_sum(per_anchor * positive, axis=-1)
        return per_image / _global_positives(positive > 0)

    def get_config(self):
        matcher = self.matcher.get_config() if self.matcher else None
        return {**super().get_config(), "delta": self.delta, "matcher": matcher}
