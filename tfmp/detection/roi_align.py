"""ROIAlign (He et al., "Mask R-CNN", 2017) over an FPN, built on `tf.image.crop_and_resize`.

    pooled = roi_align(pyramid, rois, levels=(3, 4, 5), output_size=7, sampling_ratio=2)
    # pyramid: [P3, P4, P5], each [B, H_l, W_l, C]; rois: [B, R, 4] float32 xyxy input pixels
    # pooled:  [B, R, 7, 7, C] float32

Each box is pooled from ONE pyramid level, chosen by its size (FPN paper, eq. 1):
`level = floor(canonical_level + log2(sqrt(w * h) / canonical_size))`, clipped to `levels`.
Within the level, the box is split into `output_size` x `output_size` bins, each bin is
sampled at `sampling_ratio` x `sampling_ratio` evenly spaced points (bilinear interpolation),
and the points are averaged: no coordinate is ever rounded ("aligned" ROIAlign, the
convention of Detectron2's `ROIAlign(aligned=True)`: a feature value sits at the centre of its
cell, so pixel x maps to feature index x / stride - 0.5).

How crop_and_resize does it: crop_and_resize samples a box at `n` evenly spaced points from
its first to its last coordinate, so the box handed to it spans exactly from the first to the
last sample point of ROIAlign (`n = output_size * sampling_ratio` points per axis); an average
pool of `sampling_ratio` then averages each bin. Points outside the feature map follow
Detectron2: within one cell of the border they take the border value (the map is padded by
one replicated cell), further out they are 0 (crop_and_resize's extrapolation value).

Everything about boxes is float32; the features are cast to float32 for the sampling (the
interpolation weights are box coordinates), and the caller casts the result to its compute
dtype. Shapes are static (every level pools every box, the other levels' results are masked
out), which costs `len(levels)` crops per box and keeps the graph free of data-dependent shapes.
"""

from __future__ import annotations

import keras
import tensorflow as tf

CANONICAL_SIZE, CANONICAL_LEVEL = 224.0, 4  # the FPN paper's ImageNet-size box on P4


def assign_levels(
    rois, levels, canonical_size: float = CANONICAL_SIZE, canonical_level: int = CANONICAL_LEVEL
):
    """The pyramid level (int32 [B, R]) each xyxy box [B, R, 4] is pooled from."""
    rois = tf.cast(rois, tf.float32)
    width = tf.maximum(rois[..., 2] - rois[..., 0], 0.0)
    height = tf.maximum(rois[..., 3] - rois[..., 1], 0.0)
    size = tf.sqrt(width * height)
    level = tf.floor(canonical_level + tf.math.log(size / canonical_size + 1e-8) / tf.math.log(2.0))
    return tf.cast(tf.clip_by_value(level, float(min(levels)), float(max(levels))), tf.int32)


def _crop_level(features, rois, stride: float, points: int):
    """Bilinear samples [B * R, points, points, C] of every box on one level (see module doc)."""
    features = tf.cast(features, tf.float32)
    # One replicated cell around the map: points within a cell of the border clamp to it.
    padded = tf.pad(features, [[0, 0], [1, 1], [1, 1], [0, 0]], mode="SYMMETRIC")
    height = tf.cast(tf.shape(padded)[1], tf.float32)
    width = tf.cast(tf.shape(padded)[2], tf.float32)
    x1, y1, x2, y2 = tf.unstack(tf.cast(rois, tf.float32) / stride, axis=-1)
    # First and last sample point in feature indices (+1 for the padding cell).
    step_x, step_y = (x2 - x1) / points, (y2 - y1) / points
    first_x, last_x = x1 + 0.5 * step_x - 0.5 + 1.0, x2 - 0.5 * step_x - 0.5 + 1.0
    first_y, last_y = y1 + 0.5 * step_y - 0.5 + 1.0, y2 - 0.5 * step_y - 0.5 + 1.0
    normalised = tf.stack(
        [first_y / (height - 1.0), first_x / (width - 1.0), last_y / (height - 1.0), last_x / (width - 1.0)],
        axis=-1,
    )
    batch, count = tf.shape(rois)[0], tf.shape(rois)[1]
    box_indices = tf.repeat(tf.range(batch), count)
    return tf.image.crop_and_resize(
        padded,
        tf.reshape(normalised, [-1, 4]),
        box_indices,
        [points, points],
        method="bilinear",
        extrapolation_value=0.0,
    )


def roi_align(
    pyramid,
    rois,
    levels,
    output_size: int = 7,
    sampling_ratio: int = 2,
    canonical_size: float = CANONICAL_SIZE,
    canonical_level: int = CANONICAL_LEVEL,
):
    """Pooled features float32 [B, R, output_size, output_size, C] of boxes `rois` [B, R, 4]
    (xyxy pixels of the input image), each from the level `assign_levels` picks; `pyramid`
    lists the maps of `levels` (level l has stride 2**l)."""
    rois = tf.cast(rois, tf.float32)
    if len(pyramid) != len(levels):
        raise ValueError(f"roi_align got {len(pyramid)} feature maps for {len(levels)} levels {levels}")
    assigned = tf.reshape(assign_levels(rois, levels, canonical_size, canonical_level), [-1])
    points = output_size * sampling_ratio
    pooled = None
    for level, features in zip(levels, pyramid):
        samples = _crop_level(features, rois, 2.0**level, points)
        bins = tf.nn.avg_pool2d(samples, sampling_ratio, sampling_ratio, "VALID")
        bins = tf.where(tf.equal(assigned, level)[:, None, None, None], bins, 0.0)
        pooled = bins if pooled is None else pooled + bins
    channels = pooled.shape[-1] if pooled.shape[-1] is not None else tf.shape(pooled)[-1]
    shape = tf.concat([tf.shape(rois)[:2], [output_size, output_size, channels]], axis=0)
    return tf.reshape(pooled, shape)


@keras.saving.register_keras_serializable(package="tfmp")
class ROIAlign(keras.layers.Layer):
    """`roi_align` as a layer: call with `[rois, P_a, ..., P_b]`; float32 in and out (its dtype
    is float32 whatever the policy: the box coordinates must not round to float16)."""

    def __init__(
        self,
        levels,
        output_size: int = 7,
        sampling_ratio: int = 2,
        canonical_size: float = CANONICAL_SIZE,
        canonical_level: int = CANONICAL_LEVEL,
        **kwargs,
    ):
        kwargs["dtype"] = "float32"
        super().__init__(**kwargs)
        self.levels = tuple(levels)
        self.output_size, self.sampling_ratio = output_size, sampling_ratio
        self.canonical_size, self.canonical_level = canonical_size, canonical_level

    def call(self, inputs):
        rois, *pyramid = inputs
        return roi_align(
            pyramid,
            rois,
            self.levels,
            self.output_size,
            self.sampling_ratio,
            self.canonical_size,
            self.canonical_level,
        )

    def compute_output_shape(self, input_shapes):
        rois, features = input_shapes[0], input_shapes[1]
        return (rois[0], rois[1], self.output_size, self.output_size, features[-1])

    def get_config(self):
        return {
            **super().get_config(),
            "levels": list(self.levels),
            "output_size": self.output_size,
            "sampling_ratio": self.sampling_ratio,
            "canonical_size": self.canonical_size,
            "canonical_level": self.canonical_level,
        }
