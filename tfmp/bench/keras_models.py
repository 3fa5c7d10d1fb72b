"""Classifiers for the bench only: plain Keras models (what a user writes without tfmp's
builders) and a longer-sequence ViT.

    from tfmp.bench import keras_models
    model = keras_models.build("keras_resnet", (64, 64, 3), 10, dtype="mixed_bfloat16")

Issue 25 asks whether mixed precision keeps its memory promise for "a plain Keras model with
keras.layers.BatchNormalization" trained through `tfmp.fit`; these models are that user's
model, trained by tfmp's Engine in the bench's engine cells like tfmp's own (`--models=...`):

* `keras_bn_cnn` - three Conv2D(3x3) -> BatchNormalization -> ReLU blocks of 32/64/128 filters,
  each followed by 2x2 max pooling, global average pooling, a float32 softmax. Tiny: tests.
* `keras_resnet` - a ResNet v1 in the layout of keras-hub's `ResNetBackbone` with the small
  configuration of its docstring (7x7/2 stem conv of 64, 3x3/2 max pool, three stacks of 64
  filters x 2 basic blocks, strides 1/2/2, a 1x1 projection shortcut where a stack starts
  strided, BatchNormalization epsilon 1e-5 and momentum 0.9 after every conv), then keras-hub
  ImageClassifier's head (global average pool, Dense), here with a float32 softmax because
  tfmp's classifier loss takes probabilities. 0.46M weights; at 64x64 its activations dominate.
* `vit_tiny_p2` - tfmp's `vit_tiny` (`tfmp.models.vit`: width 192, 3 heads, 6 blocks) on 2x2
  patches: 257 tokens at the built-in 32x32 data instead of 65, so each attention tensor
  (batch, heads, T, T) holds 4x what a (batch, T, width) activation does (at 65 tokens, 1x): the
  longer-sequence case of issue 33 that 2 cores can still train.
* `hub_vit` - keras-hub's own `ViTBackbone` built from its constructor (no weights downloaded)
  at issue 33's size: patch 4 (65 tokens at 32x32), 4 layers, width 128, 4 heads, MLP 512
  (4x), dropout 0, LayerNormalization epsilon 1e-6 (its defaults); then keras-hub
  ViTImageClassifier's "token" pooling (the class token) and a float32 softmax Dense. Needs
  keras-hub (`pip install 'keras-hub>=0.32,<0.33'`), imported only when this model is built:
  every other bench cell runs without it. Its BERT sibling takes tokens, which the bench's image
  data cannot feed: `tfmp.bench.hub_transformers` measures both through `tfmp.fit`.

In the two plain Keras models every layer is a stock `keras.layers` layer given the cell's
dtype policy, as a user under `keras.mixed_precision.set_global_policy(...)` gets it; the head
runs in float32 (the Keras mixed-precision guide's advice). No tfmp code builds or changes
them; the bench's
`fused_norm` setting runs `tfmp.precision.fuse_normalization` on them like on tfmp's models.
"""

from __future__ import annotations

import functools
import importlib

import keras

from tfmp.bench import matrix
from tfmp.errors import UsageError, unknown
from tfmp.models.vit import VIT_TINY, vit

BN = {"epsilon": 1e-5, "momentum": 0.9}  # keras-hub ResNet's BatchNormalization settings


def keras_bn_cnn(input_shape, num_classes: int, dtype=None, name: str = "keras_bn_cnn") -> keras.Model:
    """Three conv-BN-ReLU-pool blocks (32/64/128), global average pool, float32 softmax."""
    inputs = keras.Input(shape=input_shape, name=f"{name}_images")
    x = inputs
    for index, filters in enumerate((32, 64, 128)):
        x = keras.layers.Conv2D(
            filters, 3, padding="same", use_bias=False, dtype=dtype, name=f"{name}_conv{index}"
        )(x)
        x = keras.layers.BatchNormalization(dtype=dtype, name=f"{name}_bn{index}")(x)
        x = keras.layers.ReLU(dtype=dtype, name=f"{name}_relu{index}")(x)
        x = keras.layers.MaxPooling2D(2, dtype=dtype, name=f"{name}_pool{index}")(x)
    return _head(inputs, x, num_classes, dtype, name)


def _head(inputs, x, num_classes: int, dtype, name: str) -> keras.Model:
    x = keras.layers.GlobalAveragePooling2D(dtype=dtype, name=f"{name}_avg_pool")(x)
    outputs = keras.layers.Dense(num_classes, activation="softmax", dtype="float32", name=f"{name}_probs")(x)
    return keras.Model(inputs, outputs, name=name)


def _conv_bn(x, filters: int, kernel: int, stride: int, dtype, name: str, relu: bool = True):
    """keras-hub's conv -> BN (-> ReLU): a strided conv pads explicitly and is "valid"."""
    if stride > 1 and kernel > 1:
        x = keras.layers.ZeroPadding2D((kernel - 1) // 2, dtype=dtype, name=f"{name}_pad")(x)
    padding = "valid" if stride > 1 else "same"
    x = keras.layers.Conv2D(
        filters, kernel, strides=stride, padding=padding, use_bias=False, dtype=dtype, name=f"{name}_conv"
    )(x)
    x = keras.layers.BatchNormalization(dtype=dtype, name=f"{name}_bn", **BN)(x)
    return keras.layers.ReLU(dtype=dtype, name=f"{name}_relu")(x) if relu else x


def _basic_block(x, filters: int, stride: int, projection: bool, dtype, name: str):
    shortcut = _conv_bn(x, filters, 1, stride, dtype, f"{name}_0", relu=False) if projection else x
    x = _conv_bn(x, filters, 3, stride, dtype, f"{name}_1")
    x = _conv_bn(x, filters, 3, 1, dtype, f"{name}_2", relu=False)
    x = keras.layers.Add(dtype=dtype, name=f"{name}_add")([shortcut, x])
    return keras.layers.ReLU(dtype=dtype, name=f"{name}_out")(x)


def keras_resnet(input_shape, num_classes: int, dtype=None, name: str = "keras_resnet") -> keras.Model:
    """keras-hub's ResNetBackbone (docstring configuration, v1) + ImageClassifier head."""
    inputs = keras.Input(shape=input_shape, name=f"{name}_images")
    x = keras.layers.ZeroPadding2D(3, dtype=dtype, name=f"{name}_conv1_pad")(inputs)
    x = keras.layers.Conv2D(64, 7, strides=2, use_bias=False, dtype=dtype, name=f"{name}_conv1_conv")(x)
    x = keras.layers.BatchNormalization(dtype=dtype, name=f"{name}_conv1_bn", **BN)(x)
    x = keras.layers.ReLU(dtype=dtype, name=f"{name}_conv1_relu")(x)
    x = keras.layers.ZeroPadding2D(1, dtype=dtype, name=f"{name}_pool1_pad")(x)
    x = keras.layers.MaxPooling2D(3, strides=2, dtype=dtype, name=f"{name}_pool1_pool")(x)
    for stack, stride in enumerate((1, 2, 2)):
        for block in range(2):
            # keras-hub: a projection shortcut only where a basic-block stack after the first starts.
            first = block == 0
            x = _basic_block(
                x, 64, stride if first else 1, first and stack > 0, dtype, f"{name}_stack{stack}_block{block}"
            )
    return _head(inputs, x, num_classes, dtype, name)


# issue 33's keras-hub ViT: ViTBackbone's arguments.
HUB_VIT = {"patch_size": 4, "num_layers": 4, "num_heads": 4, "hidden_dim": 128, "mlp_dim": 512}


def keras_hub_module():
    """keras_hub, imported on first use: an optional dependency of the bench's keras-hub models
    (it costs seconds to import and is absent from a plain install)."""
    try:
        return importlib.import_module("keras_hub")
    except ImportError as error:
        _, requirement = matrix.OPTIONAL_PACKAGES["hub_vit"]
        raise UsageError(
            f"the keras-hub bench models need keras-hub ({error}); pip install '{requirement}'"
        ) from None


def hub_vit(input_shape, num_classes: int, dtype=None, name: str = "hub_vit", **backbone) -> keras.Model:
    """keras-hub's ViTBackbone (HUB_VIT, overridden by `backbone`) -> class token -> float32 softmax."""
    vit_backbone = keras_hub_module().models.ViTBackbone(
        image_shape=tuple(input_shape), dtype=dtype, name=f"{name}_backbone", **{**HUB_VIT, **backbone}
    )
    images = keras.Input(shape=input_shape, name=f"{name}_images")
    token = vit_backbone(images)[:, 0, :]  # ViTImageClassifier's pooling="token"
    outputs = keras.layers.Dense(num_classes, activation="softmax", dtype="float32", name=f"{name}_probs")(
        token
    )
    return keras.Model(images, outputs, name=name)


MODELS = {
    "keras_bn_cnn": keras_bn_cnn,
    "keras_resnet": keras_resnet,
    "vit_tiny_p2": functools.partial(vit, **dict(VIT_TINY, patch_size=2)),
    "hub_vit": hub_vit,
}


def build(name: str, input_shape, num_classes: int, dtype=None) -> keras.Model:
    if name not in MODELS:
        raise unknown("plain Keras bench model", name, MODELS)
    return MODELS[name](tuple(input_shape), num_classes, dtype=dtype, name=name)
