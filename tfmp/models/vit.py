"""Vision Transformers: ViT (Dosovitskiy et al. 2021) with DeiT's class-token head.

Provides:

* `vit(input_shape, num_classes, dtype=None, name="vit", *, patch_size, width, depth, heads, ...)`
  - the functional builder: non-overlapping `patch_size` x `patch_size` patches embedded by a
  strided convolution, a learned class token, learned position embeddings, `depth` pre-norm
  encoder blocks (LayerNormalization -> MultiHeadAttention -> residual add, LayerNormalization
  -> Dense GELU -> Dense -> residual add), a final LayerNormalization, and the float32 softmax
  head on the class token. `stochastic_depth=0.1` (DeiT's drop path) makes each block's two
  residual adds `StochasticDepth` layers (`tfmp.models.stochastic_depth`), at DeiT's linear
  per-block rates (`drop_rates`).
* `ClassToken` and `PositionEmbedding`, the two small layers Keras has no built-in for.
* `VIT_TINY` and `VIT_B16`, the option sets of the registry's `vit_tiny` (DeiT-Tiny's width
  192 and 3 heads, 6 blocks, 4x4 patches: 65 tokens at the built-in 32x32 data) and `vit_b16`
  (ViT-B/16: 16x16 patches, 12 blocks of width 768, 12 heads, MLP 3072; 86.6M parameters and
  35.1 GFLOPs per 224x224 image with 1000 classes).

Usage (normally through the registry):

    model = tfmp.models.build("vit_tiny", (32, 32, 3), 10, dtype="mixed_bfloat16")
    model = tfmp.models.build("vit_tiny", (32, 32, 3), 10, stochastic_depth=0.1)   # DeiT's
    python -m apps.classify --model=vit_tiny --epochs=2

Why a class token and not global average pooling: it is what DeiT and ViT-B/16 use, so the
parameter counts, the FLOPs and the published training recipes (configs/vit_b16_imagenet_8gpu.cfg)
apply to these models as they are. Average pooling trains as well with a tuned learning rate
(Dosovitskiy et al., appendix D.3; Beyer et al. 2022), but it is another model.

`dtype` goes to every layer (the two below included: they keep their variables in float32 and
Keras casts them to the compute dtype in `call`), except the float32 head. Every size check is
made before a layer is built, as a `UsageError` naming the values and the fix.
"""

from __future__ import annotations

import math

import keras

from tfmp.errors import UsageError
from tfmp.models.cnn import classifier_head, functional_model, image_input
from tfmp.models.stochastic_depth import StochasticDepth, check_rate

# ViT's and DeiT's LayerNormalization epsilon (Keras' default is 1e-3).
LAYER_NORM_EPSILON = 1e-6
VIT_TINY = {"patch_size": 4, "width": 192, "depth": 6, "heads": 3}
VIT_B16 = {"patch_size": 16, "width": 768, "depth": 12, "heads": 12}


@keras.saving.register_keras_serializable(package="tfmp")
class ClassToken(keras.layers.Layer):
    """Prepends one learned token (initialised N(0, 0.05), as keras-hub's ViT) to a (batch, tokens, width)
    sequence."""

    def build(self, input_shape):
        self.token = self.add_weight(shape=(1, 1, input_shape[-1]), initializer="random_normal", name="token")

    def call(self, inputs):
        batch = keras.ops.shape(inputs)[0]
        token = keras.ops.broadcast_to(keras.ops.cast(self.token, inputs.dtype), (batch, 1, inputs.shape[-1]))
        return keras.ops.concatenate([token, inputs], axis=1)

    def compute_output_shape(self, input_shape):
        batch, tokens, width = input_shape
        return (batch, None if tokens is None else tokens + 1, width)


@keras.saving.register_keras_serializable(package="tfmp")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned (positions, width) table to a (batch, tokens, width) sequence; a sequence
    shorter than the table uses its first rows (as BERT does), a longer one is refused when the
    layer is built."""

    def __init__(self, positions: int, **kwargs):
        super().__init__(**kwargs)
        self.positions = positions

    def build(self, input_shape):
        tokens = input_shape[1]
        if tokens is None or tokens > self.positions:
            raise UsageError(
                f"layer {self.name!r}: a sequence of {tokens} tokens does not fit its "
                f"{self.positions} position embeddings; give it positions >= {tokens}"
            )
        self.table = self.add_weight(
            shape=(self.positions, input_shape[-1]),
            initializer=keras.initializers.TruncatedNormal(stddev=0.02),  # ViT's and DeiT's
            name="table",
        )

    def call(self, inputs):
        table = keras.ops.cast(self.table[: inputs.shape[1]], inputs.dtype)
        return inputs + table[None]

    def get_config(self):
        return {**super().get_config(), "positions": self.positions}


def check_vit_sizes(
    name: str,
    input_shape: tuple[int, ...],
    *,
    patch_size: int,
    width: int,
    depth: int,
    heads: int,
    positions: int | None,
) -> int:
    """The sequence length (patches + class token) the input makes; UsageError, before any layer
    exists, for an image that is not a whole number of patches, heads that do not divide the
    width, or a sequence longer than `positions`."""
    for option, value in (("patch_size", patch_size), ("width", width), ("depth", depth), ("heads", heads)):
        if not isinstance(value, int) or value < 1:
            raise UsageError(f"model {name!r} needs a positive integer {option}, got {value!r}")
    if positions is not None and (not isinstance(positions, int) or positions < 2):
        raise UsageError(
            f"model {name!r} needs positions >= 2 (the class token and a patch), got {positions!r}"
        )
    if width % heads:
        divisors = [count for count in range(1, width + 1) if width % count == 0]
        nearest = sorted(sorted(divisors, key=lambda count: abs(count - heads))[:2])
        raise UsageError(
            f"model {name!r}: {heads} heads do not divide its width {width}; use "
            f"{' or '.join(map(str, sorted(set(nearest))))} heads, or a width that is a multiple of {heads}"
        )
    height, image_width = input_shape[:2]
    if height % patch_size or image_width % patch_size:
        smaller = [size // patch_size * patch_size for size in (height, image_width)]
        larger = [math.ceil(size / patch_size) * patch_size for size in (height, image_width)]
        fits = [sides for sides in (smaller, larger) if min(sides) > 0]  # no 0x0 below one patch
        raise UsageError(
            f"model {name!r} cuts images into {patch_size}x{patch_size} patches, and "
            f"{height}x{image_width} is not a multiple of {patch_size}; use images of "
            f"{' or '.join(f'{sides[0]}x{sides[1]}' for sides in fits)} "
            f"(--image_size={' or '.join(str(sides[0]) for sides in fits)} in the apps)"
        )
    sequence = (height // patch_size) * (image_width // patch_size) + 1
    if positions is not None and sequence > positions:
        largest = math.isqrt(positions - 1) * patch_size if positions > 1 else 0
        raise UsageError(
            f"model {name!r} makes a sequence of {sequence} tokens ({sequence - 1} patches of "
            f"{height}x{image_width} images + the class token), more than its {positions} position "
            f"embeddings; use images of at most {largest}x{largest} or positions >= {sequence}"
        )
    return sequence


def _encoder_block(x, name, dtype, *, heads, mlp_dim, dropout, attention_dropout, drop_rate):
    """Pre-norm block: x + Attention(LN(x)), then x + MLP(LN(x)) with a GELU MLP; each residual
    add a StochasticDepth layer at `drop_rate` (None: Keras' Add, the model without the option)."""
    width = x.shape[-1]
    normed = keras.layers.LayerNormalization(epsilon=LAYER_NORM_EPSILON, dtype=dtype, name=f"{name}_norm1")(x)
    attended = keras.layers.MultiHeadAttention(
        heads, key_dim=width // heads, dropout=attention_dropout, dtype=dtype, name=f"{name}_attention"
    )(normed, normed)
    if dropout:
        attended = keras.layers.Dropout(dropout, dtype=dtype, name=f"{name}_attention_dropout")(attended)
    x = _residual_add(f"{name}_add1", dtype, drop_rate)([x, attended])
    normed = keras.layers.LayerNormalization(epsilon=LAYER_NORM_EPSILON, dtype=dtype, name=f"{name}_norm2")(x)
    hidden = keras.layers.Dense(mlp_dim, activation="gelu", dtype=dtype, name=f"{name}_mlp1")(normed)
    if dropout:
        hidden = keras.layers.Dropout(dropout, dtype=dtype, name=f"{name}_mlp_dropout1")(hidden)
    hidden = keras.layers.Dense(width, dtype=dtype, name=f"{name}_mlp2")(hidden)
    if dropout:
        hidden = keras.layers.Dropout(dropout, dtype=dtype, name=f"{name}_mlp_dropout2")(hidden)
    return _residual_add(f"{name}_add2", dtype, drop_rate)([x, hidden])


def _residual_add(name, dtype, drop_rate):
    """The residual add layer: Keras' Add, or StochasticDepth (called the same) when the model
    drops paths, so layer names, float32_layers patterns and pipeline boundaries stay valid."""
    if drop_rate is None:
        return keras.layers.Add(dtype=dtype, name=name)
    return StochasticDepth(drop_rate, dtype=dtype, name=name)


def drop_rates(stochastic_depth: float, depth: int) -> list[float]:
    """Each block's stochastic depth rate, DeiT's and timm's linear rule: block 1 of `depth` drops
    nothing, block b `stochastic_depth` * (b - 1) / (depth - 1), the last the full rate (a
    single block: 0, as timm's `linspace(0, rate, 1)`)."""
    if depth == 1:
        return [0.0]
    return [stochastic_depth * (block / (depth - 1)) for block in range(depth)]  # the last: exactly


def vit(
    input_shape: tuple[int, ...],
    num_classes: int,
    dtype: str | None = None,
    name: str = "vit",
    *,
    patch_size: int,
    width: int,
    depth: int,
    heads: int,
    mlp_ratio: int = 4,
    dropout: float = 0.0,
    attention_dropout: float = 0.0,
    positions: int | None = None,
    stochastic_depth: float = 0.0,
) -> keras.Model:
    """A ViT classifier. `mlp_ratio` * `width` is the MLP's hidden width; `dropout` follows the
    attention output and both MLP layers (and the embeddings), `attention_dropout` the attention
    probabilities (DeiT: both 0; ViT from scratch on ImageNet: 0.1 and 0). `positions` is the size
    of the position-embedding table, None: exactly the sequence the input makes.
    `stochastic_depth` in [0, 1) drops each block's two residual branches per example in training
    at the rates of `drop_rates` (DeiT trains every size with 0.1); the adds become
    `StochasticDepth` layers of the same names. 0: Keras' Add layers, the model exactly as
    without the option.

    Layers: `{name}_patches` (the patch embedding), `{name}_tokens`, `{name}_class_token`,
    `{name}_positions`, `{name}_block{b}_{norm1,attention,add1,norm2,mlp1,mlp2,add2}`,
    `{name}_norm`, `{name}_pool`, `{name}_features`, then the head.
    """
    input_shape = tuple(input_shape)
    images = image_input(input_shape, name)
    sequence = check_vit_sizes(
        name, input_shape, patch_size=patch_size, width=width, depth=depth, heads=heads, positions=positions
    )
    for option, rate in (("dropout", dropout), ("attention_dropout", attention_dropout)):
        if not 0 <= rate < 1:
            raise UsageError(f"model {name!r} needs {option} in [0, 1), got {rate}")
    check_rate(stochastic_depth)
    # None: Keras' Add layers, the model exactly as without the option.
    rates = drop_rates(stochastic_depth, depth) if stochastic_depth else [None] * depth
    x = keras.layers.Conv2D(
        width,
        patch_size,
        strides=patch_size,
        # Keras' default (Glorot), as keras-hub's ViT: see the head's comment.
        dtype=dtype,
        name=f"{name}_patches",
    )(images)
    x = keras.layers.Reshape((sequence - 1, width), dtype=dtype, name=f"{name}_tokens")(x)
    x = ClassToken(dtype=dtype, name=f"{name}_class_token")(x)
    x = PositionEmbedding(positions or sequence, dtype=dtype, name=f"{name}_positions")(x)
    if dropout:
        x = keras.layers.Dropout(dropout, dtype=dtype, name=f"{name}_embedding_dropout")(x)
    for block, drop_rate in enumerate(rates, start=1):
        x = _encoder_block(
            x,
            f"{name}_block{block}",
            dtype,
            heads=heads,
            mlp_dim=mlp_ratio * width,
            dropout=dropout,
            attention_dropout=attention_dropout,
            drop_rate=drop_rate,
        )
    x = keras.layers.LayerNormalization(epsilon=LAYER_NORM_EPSILON, dtype=dtype, name=f"{name}_norm")(x)
    # The class token's output is the image's features: crop the sequence to it, drop the axis.
    x = keras.layers.Cropping1D((0, sequence - 1), dtype=dtype, name=f"{name}_pool")(x)
    features = keras.layers.Flatten(dtype=dtype, name=f"{name}_features")(x)
    # keras-hub's ViT initialisers (Glorot patch embedding and head, a N(0, 0.05) class token), not
    # big_vision's zero head and class token and lecun-normal patches: the blocks' first gradients
    # pass through the head, zero at the start. On the built-in shapes with vit_tiny's recipe (rate 5e-4
    # then) over 2 epochs these reach 0.61 / 0.86 after epochs 1 / 2 against 0.31 / 0.54 (docs/recipes.md).
    probabilities = classifier_head(features, num_classes, name)
    return functional_model(images, probabilities, name, dtype)
