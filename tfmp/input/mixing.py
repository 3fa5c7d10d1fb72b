"""Mixup (Zhang et al. 2018) and CutMix (Yun et al. 2019) of a batch with itself reversed.

    images, soft_labels = mixing.mix_batch(images, labels, key, num_classes=10, mixup_alpha=0.8,
                                           cutmix_alpha=1.0, label_smoothing=0.1)

Each example is mixed with its partner, the example at the mirrored place of the batch (the
batch reversed, as timm does: no random permutation to draw, any batch size). One lambda per
batch is drawn from Beta(alpha, alpha) (two stateless Gamma draws); when both alphas are above 0
the batch is cut-mixed with probability `switch_prob`, else mixed up; an alpha of 0 turns its
method off. Mixup: lam * image + (1 - lam) * partner. CutMix: a box of area (1 - lam) of the
image, centred uniformly at random and clipped to the image, is pasted from the partner, and lam
becomes the fraction of the image left unpasted. Labels (int class ids [B] or one-hot/soft
[B, K]) become float32 [B, K]: smoothed to (1 - e) one-hot + e / K first, then mixed with the
same lam, as are sample weights (class weights arrive as sample weights).

Everything is drawn from `key` (an int32/int64 shape [2] tensor, as `tf.random.stateless_*`
take): the same key mixes the same way in eager, graph mode and tf.data maps, for a static or
unknown batch size. `Mixing` holds the settings a data pipeline is given.
"""

import dataclasses
import math
import numbers

import tensorflow as tf

from tfmp.errors import UsageError, spelt


def check(
    mixup_alpha: float,
    cutmix_alpha: float,
    *,
    switch_prob: float = 0.5,
    label_smoothing: float = 0.0,
    as_flags: bool = False,
) -> None:
    """Raises `UsageError` (one line naming the value) for an alpha that is negative, NaN or
    infinite (0 is off), `switch_prob` outside [0, 1] or `label_smoothing` outside [0, 1);
    `as_flags` names the alphas as the apps' flags (--mixup_alpha=...)."""
    for name, alpha in (("mixup_alpha", mixup_alpha), ("cutmix_alpha", cutmix_alpha)):
        if not _is_number(alpha) or not math.isfinite(alpha) or alpha < 0:
            raise UsageError(
                f"{spelt(name, alpha, as_flags)} must be a finite number >= 0 (0 turns it off; "
                "DeiT: mixup 0.8, cutmix 1.0)"
            )
    if not _is_number(switch_prob) or not 0 <= switch_prob <= 1:
        raise UsageError(f"mixing switch_prob {switch_prob!r} must be in [0, 1] (the chance of CutMix)")
    if not _is_number(label_smoothing) or not 0 <= label_smoothing < 1:
        raise UsageError(f"label_smoothing {label_smoothing!r} must be in [0, 1)")


def _is_number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Mixing:
    """What `mix_batch` does to each training batch of a pipeline (checked when made).

    `num_classes` None: the dataset's. Made from a dict with `Mixing.of`."""

    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    switch_prob: float = 0.5
    label_smoothing: float = 0.0
    num_classes: int | None = None

    def __post_init__(self):
        check(
            self.mixup_alpha,
            self.cutmix_alpha,
            switch_prob=self.switch_prob,
            label_smoothing=self.label_smoothing,
        )
        classes = self.num_classes
        if classes is not None and (
            isinstance(classes, bool) or not isinstance(classes, numbers.Integral) or classes < 1
        ):
            raise UsageError(f"mixing num_classes {classes!r} must be a positive integer")

    @classmethod
    def of(cls, value: "Mixing | dict") -> "Mixing":
        """`value` itself, or a `Mixing` of a dict of its fields (an unknown key is a UsageError)."""
        if isinstance(value, Mixing):
            return value
        if not isinstance(value, dict):
            raise UsageError(f"mixing must be a dict or tfmp.input.mixing.Mixing, got {value!r}")
        fields = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise UsageError(
                f"unknown mixing setting(s) {', '.join(unknown)}; choose from: {', '.join(fields)}"
            )
        return cls(**value)


def sample_beta(key: tf.Tensor, alpha, shape=()) -> tf.Tensor:
    """float32 samples of Beta(alpha, alpha): X / (X + Y) of two stateless Gamma(alpha) draws."""
    first_key, second_key = tf.unstack(tf.random.experimental.stateless_split(key, 2))
    alpha = tf.cast(alpha, tf.float64)  # float64: Gamma draws of a small alpha underflow float32 to 0
    first = tf.random.stateless_gamma(shape, first_key, alpha, dtype=tf.float64)
    second = tf.random.stateless_gamma(shape, second_key, alpha, dtype=tf.float64)
    total = first + second
    return tf.cast(tf.where(total > 0, tf.math.divide_no_nan(first, total), 0.5), tf.float32)


def mix_batch(
    images,
    labels,
    key,
    *,
    num_classes: int,
    mixup_alpha: float = 0.0,
    cutmix_alpha: float = 0.0,
    switch_prob: float = 0.5,
    label_smoothing: float = 0.0,
    sample_weight=None,
):
    """(images, soft labels float32 [B, num_classes]) mixed as the module docstring says, plus
    the mixed sample weights (float32 [B]) when `sample_weight` is given. Images keep their dtype
    (integer images are rounded). Both alphas 0: only the label smoothing and one-hot encoding."""
    check(mixup_alpha, cutmix_alpha, switch_prob=switch_prob, label_smoothing=label_smoothing)
    images = tf.convert_to_tensor(images)
    targets = _soft_labels(labels, num_classes, label_smoothing)
    weights = None if sample_weight is None else tf.cast(sample_weight, tf.float32)
    if mixup_alpha > 0 or cutmix_alpha > 0:
        mode_key, lambda_key, box_key = tf.unstack(tf.random.experimental.stateless_split(key, 3))
        partner = tf.reverse(images, axis=[0])
        if mixup_alpha > 0 and cutmix_alpha > 0:
            use_cutmix = tf.random.stateless_uniform([], mode_key) < switch_prob
            alpha = tf.where(
                use_cutmix, tf.constant(cutmix_alpha, tf.float64), tf.constant(mixup_alpha, tf.float64)
            )
            lam = sample_beta(lambda_key, alpha)
            images, lam = tf.cond(
                use_cutmix,
                lambda: _cutmix(images, partner, lam, box_key),
                lambda: (_mixup(images, partner, lam), lam),
            )
        elif cutmix_alpha > 0:
            images, lam = _cutmix(images, partner, sample_beta(lambda_key, cutmix_alpha), box_key)
        else:
            lam = sample_beta(lambda_key, mixup_alpha)
            images = _mixup(images, partner, lam)
        targets = lam * targets + (1.0 - lam) * tf.reverse(targets, axis=[0])
        if weights is not None:
            weights = lam * weights + (1.0 - lam) * tf.reverse(weights, axis=[0])
    return (images, targets) if weights is None else (images, targets, weights)


def _soft_labels(labels, num_classes, label_smoothing):
    """float32 [B, num_classes]: class ids one-hot encoded, then smoothed."""
    labels = tf.convert_to_tensor(labels)
    if labels.shape.rank == 1 and labels.dtype.is_integer:
        targets = tf.one_hot(labels, num_classes, dtype=tf.float32)
    elif labels.shape.rank == 2 and labels.shape[1] in (None, num_classes):
        targets = tf.cast(labels, tf.float32)
    else:
        raise ValueError(f"mix_batch needs int class ids [B] or soft labels [B, {num_classes}], got {labels}")
    if label_smoothing:
        targets = targets * (1.0 - label_smoothing) + label_smoothing / num_classes
    return targets


def _mixup(images, partner, lam):
    if images.dtype.is_floating:
        weight = tf.cast(lam, images.dtype)
        return weight * images + (1 - weight) * partner
    mixed = lam * tf.cast(images, tf.float32) + (1.0 - lam) * tf.cast(partner, tf.float32)
    return tf.saturate_cast(tf.round(mixed), images.dtype)


def _cutmix(images, partner, lam, key):
    """(images with a box pasted from `partner`, the fraction of each image not pasted over)."""
    shape = tf.shape(images)
    height, width = shape[1], shape[2]
    side = tf.sqrt(1.0 - lam)  # the box's side over the image's: area 1 - lam before clipping
    box_height = tf.cast(side * tf.cast(height, tf.float32), tf.int32)
    box_width = tf.cast(side * tf.cast(width, tf.float32), tf.int32)
    y_key, x_key = tf.unstack(tf.random.experimental.stateless_split(key, 2))
    centre_y = tf.random.stateless_uniform([], y_key, 0, height, dtype=tf.int32)
    centre_x = tf.random.stateless_uniform([], x_key, 0, width, dtype=tf.int32)
    top = tf.clip_by_value(centre_y - box_height // 2, 0, height)
    bottom = tf.clip_by_value(centre_y - box_height // 2 + box_height, 0, height)
    left = tf.clip_by_value(centre_x - box_width // 2, 0, width)
    right = tf.clip_by_value(centre_x - box_width // 2 + box_width, 0, width)
    rows, columns = tf.range(height), tf.range(width)
    inside = ((rows >= top) & (rows < bottom))[:, None] & ((columns >= left) & (columns < right))[None, :]
    pasted = tf.where(inside[None, :, :, None], partner, images)
    pasted_area = tf.cast((bottom - top) * (right - left), tf.float32)
    return pasted, 1.0 - pasted_area / tf.cast(height * width, tf.float32)
