"""Residual networks: the CIFAR family of He et al. (2016) and an ImageNet ResNet-50.

Provides:

* `resnet_cifar(..., depth=20)` - the CIFAR-10 networks of "Deep Residual Learning for Image
  Recognition" section 4.2: a 3x3 16-filter stem, three stages of (depth - 2) / 6 basic blocks
  with 16/32/64 filters (the first block of stages 2 and 3 halves the map), global average pool
  and the softmax head. Shortcuts are option A of the paper (identity, or subsample + zero-pad the
  new channels), so ResNet-20 has the published 0.27M parameters and ResNet-56 0.85M.
  The registry exposes depth 20 and 56 as "resnet20" and "resnet56".
* `resnet50` - ResNet-50 v1.5 for ImageNet: 7x7/2 stem and 3x3/2 max pool, bottleneck blocks in
  stages of [3, 4, 6, 3] with the stride on the 3x3 conv (the v1.5 change that torchvision and
  NVIDIA use), 1x1-conv projection shortcuts, global average pool, softmax head. 25.6M
  parameters with 1000 classes.
* `ChannelPadShortcut`, the parameter-free option-A shortcut layer.

Usage (normally through the registry):

    model = tfmp.models.build("resnet20", (32, 32, 3), 10, dtype="mixed_float16", weight_decay=1e-4)

`dtype` (a Keras dtype-policy name, or None for the global policy) goes to every layer including
BatchNormalization, except the float32 classifier head. `weight_decay` uses the SGD convention of
the paper and PyTorch (the gradient gains `weight_decay * kernel`), i.e. it adds
`keras.regularizers.L2(weight_decay / 2)` to every conv and dense kernel; the penalties are in
`model.losses`, which a custom training loop must add to its loss.
"""

from __future__ import annotations

import keras

from tfmp.errors import UsageError
from tfmp.models.cnn import classifier_head, functional_model, image_input

# PyTorch's (and the paper-era Torch's) BatchNorm settings: Keras' defaults (0.99 / 1e-3) average
# the statistics over ~100 steps, too slow for the short CIFAR schedules and small per-replica
# batches this toolkit trains with.
BATCH_NORM_MOMENTUM = 0.9
BATCH_NORM_EPSILON = 1e-5
RESNET50_STAGE_BLOCKS = (3, 4, 6, 3)


@keras.saving.register_keras_serializable(package="tfmp")
class ChannelPadShortcut(keras.layers.Layer):
    """Option-A shortcut: keep every `stride`-th pixel and zero-pad the channels up to `filters`.

    A layer rather than a projection conv because the paper's CIFAR results (and parameter
    counts) are for this parameter-free shortcut.
    """

    def __init__(self, filters: int, stride: int, **kwargs):
        super().__init__(**kwargs)
        self.filters = filters
        self.stride = stride

    def call(self, inputs):
        subsampled = inputs[:, :: self.stride, :: self.stride, :]
        missing = self.filters - inputs.shape[-1]
        # Where the zeros go is irrelevant to the network; half each side matches the common
        # PyTorch CIFAR ResNet, so checkpoints ported from it line up channel for channel.
        padding = [[0, 0], [0, 0], [0, 0], [missing // 2, missing - missing // 2]]
        return keras.ops.pad(subsampled, padding)

    def compute_output_shape(self, input_shape):
        # ceil(size / stride), the same as the strided "same"-padded conv on the other branch.
        batch, *spatial, _ = input_shape
        spatial = [None if size is None else -(-size // self.stride) for size in spatial]
        return (batch, *spatial, self.filters)

    def get_config(self):
        return {**super().get_config(), "filters": self.filters, "stride": self.stride}


def _regularizer(weight_decay: float) -> keras.regularizers.Regularizer | None:
    if weight_decay < 0:
        raise UsageError(f"weight_decay must be >= 0, got {weight_decay}")
    return keras.regularizers.L2(weight_decay / 2) if weight_decay else None


def _conv_bn(x, filters, kernel_size, stride, name, dtype, regularizer, relu=True):
    """Conv (no bias: the BatchNorm beta replaces it) -> BatchNorm -> optional relu."""
    x = keras.layers.Conv2D(
        filters,
        kernel_size,
        strides=stride,
        padding="same",
        use_bias=False,
        kernel_initializer="he_normal",  # the paper's initialisation (He et al. 2015)
        kernel_regularizer=regularizer,
        dtype=dtype,
        name=f"{name}_conv",
    )(x)
    x = keras.layers.BatchNormalization(
        momentum=BATCH_NORM_MOMENTUM, epsilon=BATCH_NORM_EPSILON, dtype=dtype, name=f"{name}_bn"
    )(x)
    if relu:
        x = keras.layers.Activation("relu", dtype=dtype, name=f"{name}_relu")(x)
    return x


def _basic_block(x, filters, stride, name, dtype, regularizer):
    """Two 3x3 conv-bn layers plus the option-A shortcut, relu after the addition."""
    shortcut = x
    if stride != 1 or x.shape[-1] != filters:
        shortcut = ChannelPadShortcut(filters, stride, dtype=dtype, name=f"{name}_shortcut")(x)
    x = _conv_bn(x, filters, 3, stride, f"{name}_1", dtype, regularizer)
    x = _conv_bn(x, filters, 3, 1, f"{name}_2", dtype, regularizer, relu=False)
    x = keras.layers.Add(dtype=dtype, name=f"{name}_add")([shortcut, x])
    return keras.layers.Activation("relu", dtype=dtype, name=f"{name}_out")(x)


def _bottleneck_block(x, filters, stride, name, dtype, regularizer):
    """1x1 reduce, 3x3 (strided, v1.5), 1x1 expand to 4*filters; projection shortcut if needed."""
    shortcut = x
    if stride != 1 or x.shape[-1] != 4 * filters:
        shortcut = _conv_bn(x, 4 * filters, 1, stride, f"{name}_shortcut", dtype, regularizer, relu=False)
    x = _conv_bn(x, filters, 1, 1, f"{name}_1", dtype, regularizer)
    x = _conv_bn(x, filters, 3, stride, f"{name}_2", dtype, regularizer)
    x = _conv_bn(x, 4 * filters, 1, 1, f"{name}_3", dtype, regularizer, relu=False)
    x = keras.layers.Add(dtype=dtype, name=f"{name}_add")([shortcut, x])
    return keras.layers.Activation("relu", dtype=dtype, name=f"{name}_out")(x)


def _pool_and_head(x, num_classes, name, dtype, regularizer, images) -> keras.Model:
    x = keras.layers.GlobalAveragePooling2D(dtype=dtype, name=f"{name}_pool")(x)
    probabilities = classifier_head(x, num_classes, name, kernel_regularizer=regularizer)
    return functional_model(images, probabilities, name, dtype)


def resnet_cifar(
    input_shape: tuple[int, ...],
    num_classes: int,
    dtype: str | None = None,
    name: str | None = None,
    *,
    depth: int = 20,
    weight_decay: float = 0.0,
) -> keras.Model:
    """CIFAR ResNet with depth = 6n + 2 (20, 32, 44, 56, 110, ...); `name` defaults to
    f"resnet{depth}". Layers: `{name}_stem_*`, `{name}_stage{s}_block{b}_*`, `{name}_pool`."""
    name = name or f"resnet{depth}"
    if not isinstance(depth, int) or depth < 8 or (depth - 2) % 6:
        raise UsageError(f"CIFAR ResNet depth must be 6n+2 with n >= 1 (20, 32, 44, 56, 110), got {depth}")
    blocks_per_stage = (depth - 2) // 6
    regularizer = _regularizer(weight_decay)
    images = image_input(input_shape, name)
    x = _conv_bn(images, 16, 3, 1, f"{name}_stem", dtype, regularizer)
    for stage, filters in enumerate((16, 32, 64), start=1):
        for block in range(1, blocks_per_stage + 1):
            stride = 2 if stage > 1 and block == 1 else 1
            block_name = f"{name}_stage{stage}_block{block}"
            x = _basic_block(x, filters, stride, block_name, dtype, regularizer)
    return _pool_and_head(x, num_classes, name, dtype, regularizer, images)


def resnet50(
    input_shape: tuple[int, ...],
    num_classes: int,
    dtype: str | None = None,
    name: str = "resnet50",
    *,
    weight_decay: float = 0.0,
) -> keras.Model:
    """ImageNet ResNet-50 v1.5 (224x224x3 in the paper; any size works, the map shrinks 32x).
    Layers: `{name}_stem_*`, `{name}_stem_maxpool`, `{name}_stage{s}_block{b}_*`, `{name}_pool`."""
    regularizer = _regularizer(weight_decay)
    images = image_input(input_shape, name)
    x = _conv_bn(images, 64, 7, 2, f"{name}_stem", dtype, regularizer)
    x = keras.layers.MaxPooling2D(3, strides=2, padding="same", dtype=dtype, name=f"{name}_stem_maxpool")(x)
    stages = zip((64, 128, 256, 512), RESNET50_STAGE_BLOCKS)
    for stage, (filters, blocks) in enumerate(stages, start=1):
        for block in range(1, blocks + 1):
            stride = 2 if stage > 1 and block == 1 else 1
            block_name = f"{name}_stage{stage}_block{block}"
            x = _bottleneck_block(x, filters, stride, block_name, dtype, regularizer)
    return _pool_and_head(x, num_classes, name, dtype, regularizer, images)
