"""The training augmentation of `tfmp.classification.data.load`: per example, then per batch.

Per example, keyed by (seed, stream position), so a resumed run augments identically:

* ``augment=True``: a random horizontal flip (not for digits) and a random crop of the image
  padded by 1/8 of its side (reflected);
* ``randaugment=(num_ops, magnitude)``: `tfmp.input.randaugment.rand_augment` after that, on a
  key folded from the same one: the flip and crop draw the same with or without it.

Per batch, ``mixing`` (a `tfmp.input.mixing.Mixing` or a dict of its fields) mixes each training
batch (a replica's own batch, with an input context) with `tfmp.input.mixing.mix_batch`, keyed
by (seed, the stream position of the batch's first example): a run resumed at a whole batch
(skip_examples a multiple of the batch size) draws the same lambdas, boxes and Mixup/CutMix
choices. The labels become float32 [batch, num_classes]. Eval is never augmented or mixed.

    augmenting = augmentation.settings(spec, augment=True, randaugment=(2, 9), mixing=None,
                                       num_classes=10, training=True)
    image = augmenting.example(image, key, flip_ok=True, image_shape=(32, 32, 3))  # per example
    dataset = augmenting.mix(dataset, seed=1, num_classes=10)   # (positions, images, labels) batches
"""

import dataclasses

import tensorflow as tf

from tfmp.errors import UsageError
from tfmp.input import mixing as batch_mixing
from tfmp.input import randaugment as rand_augmentation

# Folded into an example's (seed, position) key: independent draws for each kind of randomness.
_RANDAUGMENT_STREAM, _MIXING_STREAM = 1, 2


@dataclasses.dataclass(frozen=True)
class Augmentation:
    """What one pipeline does to its examples and batches (checked; nothing for eval)."""

    flip_and_crop: bool = False
    randaugment: tuple[int, float] | None = None  # (num_ops, magnitude)
    mixing: batch_mixing.Mixing | None = None

    @property
    def per_example(self) -> bool:
        return self.flip_and_crop or self.randaugment is not None

    def example(self, image, key, *, flip_ok: bool, image_shape) -> tf.Tensor:
        """One training image, keyed by `key` (seed, position): flip and crop, then RandAugment."""
        if self.flip_and_crop:
            image = _flip_and_crop(image, key, flip_ok)
        if self.randaugment is not None:
            image = tf.ensure_shape(image, image_shape)  # RandAugment's ops need the static shape
            randaugment_key = tf.random.experimental.stateless_fold_in(key, _RANDAUGMENT_STREAM)
            image = rand_augmentation.rand_augment(image, randaugment_key, *self.randaugment)
        return image

    def mix(self, dataset: tf.data.Dataset, *, seed: int, num_classes: int) -> tf.data.Dataset:
        """(images, float32 [batch, num_classes] labels) of a dataset of (positions, images,
        labels) batches, each mixed on the key (seed, its first example's stream position)."""
        seed_tensor, mixing = tf.constant(seed, tf.int64), self.mixing

        def mix_one(positions, images, labels):
            key = tf.stack([seed_tensor, positions[0]])
            return batch_mixing.mix_batch(
                images,
                labels,
                tf.random.experimental.stateless_fold_in(key, _MIXING_STREAM),
                num_classes=num_classes,
                mixup_alpha=mixing.mixup_alpha,
                cutmix_alpha=mixing.cutmix_alpha,
                switch_prob=mixing.switch_prob,
                label_smoothing=mixing.label_smoothing,
            )

        return dataset.map(mix_one, num_parallel_calls=tf.data.AUTOTUNE)


def settings(spec: str, *, augment, randaugment, mixing, num_classes: int, training: bool) -> Augmentation:
    """The checked `Augmentation` of a pipeline: an empty one for eval (never augmented). Raises
    `UsageError` for a bad value, a mixing num_classes that is not the dataset's, or randaugment
    or mixing asked of the ``synthetic`` dataset's training stream (one fixed random batch,
    nothing to augment; its eval stream ignores them, as every eval stream does)."""
    if randaugment is not None:
        if not isinstance(randaugment, tuple | list) or len(randaugment) != 2:
            raise UsageError(f"randaugment {randaugment!r} must be (num_ops, magnitude), e.g. (2, 9)")
        rand_augmentation.check(*randaugment)
        randaugment = tuple(randaugment)
    if mixing is not None:
        mixing = batch_mixing.Mixing.of(mixing)
        if mixing.num_classes not in (None, num_classes):
            raise UsageError(
                f"mixing num_classes {mixing.num_classes} is not the dataset's {num_classes} classes"
            )
    if not training:
        return Augmentation()
    if spec == "synthetic" and (randaugment is not None or mixing is not None):
        raise UsageError(
            "randaugment and mixing do not apply to the synthetic dataset (one fixed random batch); "
            "leave them off"
        )
    return Augmentation(bool(augment), randaugment, mixing)


def _flip_and_crop(image, key, flip_ok):
    """Random horizontal flip and a random crop of the image padded by 1/8 of its size."""
    flip_key, crop_key = tf.unstack(tf.random.experimental.stateless_split(key, 2))
    if flip_ok:
        image = tf.image.stateless_random_flip_left_right(image, flip_key)
    height, width, channels = image.shape
    pad = max(1, height // 8)
    padded = tf.pad(image, [[pad, pad], [pad, pad], [0, 0]], mode="REFLECT")
    return tf.image.stateless_random_crop(padded, [height, width, channels], crop_key)
