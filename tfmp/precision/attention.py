"""MultiHeadAttention whose backward pass keeps the attention probabilities in the compute dtype.

    from tfmp.precision import attention
    probabilities = attention.probabilities(logits, mask, scale=0.125, causal=False)  # [B, N, T, S]

`tfmp.precision.fuse_normalization` puts each fusable `keras.layers.MultiHeadAttention` on it
(`fused_compute_attention`, `unfusable_reason`) and lists it with the normalization layers.

Why: Keras 3.15's attention core on TensorFlow (keras/src/backend/tensorflow/nn.py
`_dot_product_attention_xla`, which `MultiHeadAttention._compute_attention` calls without
dropout) casts the half-precision logits to float32, scales and masks them there, and runs the
softmax in float32 ("Softmax is always carried out in high precision"); TensorFlow's automatic
gradient of that softmax keeps its float32 output, a (batch, heads, T, S) tensor per layer, until
the backward pass, beside the half-precision copy the second einsum keeps.

Here the logits come from the same einsum in the compute dtype; the scaling, the mask (Keras'
large negative fill, -0.7 x float32's largest) and the softmax compute in float32 exactly as
Keras does, and the probabilities are rounded to the compute dtype once, as Keras rounds them
before its second einsum. The hand-written gradient keeps only those half-precision
probabilities (the tensor the second einsum keeps anyway) and the boolean mask: with p the
probabilities and dp their gradient, dlogits = scale p (dp - sum(dp p)) over the keys, computed
in float32 and zero where masked (as Keras' `where` gives). So the probabilities' gradient sees
them rounded once to the compute dtype (Keras uses its float32 copy): a difference within that
dtype's rounding. From 65,536 logits up, both passes are XLA-compiled kernels (cast, scale,
mask, softmax and cast in one loop); below, the same ops run one by one (an XLA launch costs
more there).

What changes: `_compute_attention` is replaced on the instance (an instance attribute, never the
class), the hook Keras documents for a customised attention ("Users can override this function
for customized attention implementation"); Keras' own `call` still projects the query, key and
value, builds the mask from `attention_mask`, the inputs' Keras masks and `use_causal_mask`
(the causal-only case arrives as `use_causal_mask=True` without a mask, as in Keras), applies a
gate and the output projection. The layer's objects, variables, config and `.keras` file stay
Keras' own. Calls Keras routes to its explicit path run Keras' own `_compute_attention`:
`return_attention_scores=True`, and (left alone when fusing) `dropout` > 0 and attention over
other axes than the sequence, where Keras computes the softmax in the compute dtype itself
and keeps no float32 copy.

Subclasses: one that overrides `_compute_attention` keeps its own core (left alone, named). One
that overrides only `call` is fused when its `call` goes through `self._compute_attention`
(`calls_attention_core`: the method's code names the attribute), since the replaced core then
runs with the same projected tensors Keras' core would get: keras-hub's
`CachedMultiHeadAttention` (GPT-2, OPT, `TransformerDecoder`; without a cache its `call` is
Keras' projections, `_compute_attention` and the output projection; with one, the cached keys
and values go through the same core), `WhisperCachedMultiHeadAttention` and
`MoonshineMultiHeadAttention`. A subclass whose `call` never reads it (XLNet's
`TwoStreamRelativeAttention`, with its own `compute_attention`) is left alone, named.

The route depends on (Keras 3.15.1): `MultiHeadAttention.call` calling
`self._compute_attention(query, key, value, attention_mask, training, return_attention_scores
[, use_causal_mask=True])` with the projected [B, T, N, H] tensors; the public `key_dim`,
`dropout` and `attention_axes` (normalised by `build`); the private `_flash_attention` (TensorFlow
has no flash attention: Keras raises, so such a layer is left alone to raise as before).
"""

from __future__ import annotations

import functools
import inspect
import math

import keras
import tensorflow as tf

from tfmp import compat

FUSED_DTYPES = ("float16", "bfloat16", "float32")
COMPILED_FROM_ELEMENTS = 65536  # as tfmp.precision.layer_norm: smaller inputs skip XLA
# Keras' masked logit in float32 (backend/tensorflow/nn.py `_get_large_negative`).
LARGE_NEGATIVE = -0.7 * 3.38953e38


def probabilities(logits, mask, scale: float, causal: bool):
    """softmax(logits x scale, masked) over the last axis, computed in float32 and returned in
    `logits`' dtype; `mask` a boolean tensor broadcastable to `logits` [B, N, T, S] (True: attend)
    or None; `causal` also masks keys after each query. Differentiable in `logits`."""
    if mask is not None:
        mask = tf.cast(mask, tf.bool)
    elements = logits.shape.num_elements()
    compiled = elements is None or elements >= COMPILED_FROM_ELEMENTS
    forward, backward = _kernels(float(scale), causal, mask is not None, compiled)
    masks = () if mask is None else (mask,)

    @tf.custom_gradient
    def softmax(logits):
        probs = forward(logits, *masks)
        return probs, lambda upstream: backward(probs, upstream, *masks)

    return softmax(logits)


def fused_compute_attention(
    self,
    query,
    key,
    value,
    attention_mask=None,
    training=None,
    return_attention_scores=False,
    use_causal_mask=False,
):
    """`MultiHeadAttention._compute_attention` (same signature and numbers within rounding) on
    `probabilities`."""
    if return_attention_scores or self.dropout > 0.0 or len(query.shape) != 4:
        # Keras' explicit path (softmax in the compute dtype, scores returned): Keras' own.
        extra = {"use_causal_mask": True} if use_causal_mask else {}
        return compat.keras_attention_core(
            self, query, key, value, attention_mask, training, return_attention_scores, **extra
        )
    if attention_mask is not None:
        # As Keras: [B, T, S] -> [B, 1, T, S] (a mask of lower rank gains the head axis first).
        for _ in range(4 - len(attention_mask.shape)):
            attention_mask = tf.expand_dims(attention_mask, -3)
    # Keras' two einsums as batched matmuls over (batch, heads): the same products, but
    # TensorFlow's bfloat16 Einsum kernel is up to 11x slower than its BatchMatMulV2 on CPUs
    # without native bfloat16 (vit_tiny's logits: 39.8 vs 3.5 ms, 2-core AVX2 EPYC).
    heads_first = [0, 2, 1, 3]  # (batch, tokens, heads, size) <-> (batch, heads, tokens, size)
    query, key, value = (tf.transpose(tensor, heads_first) for tensor in (query, key, value))
    logits = tf.matmul(query, key, transpose_b=True)
    probs = probabilities(logits, attention_mask, 1.0 / math.sqrt(float(self.key_dim)), use_causal_mask)
    return tf.transpose(tf.matmul(probs, value), heads_first), None


def unfusable_reason(layer) -> str | None:
    """Why `fused_compute_attention` cannot stand in for this MultiHeadAttention's, or None."""
    base, name = keras.layers.MultiHeadAttention, type(layer).__name__
    if getattr(type(layer), compat.ATTENTION_CORE) is not getattr(base, compat.ATTENTION_CORE):
        return f"{name} overrides {compat.ATTENTION_CORE}"
    if type(layer).call is not base.call and not calls_attention_core(type(layer)):
        return f"{name} overrides call without calling self.{compat.ATTENTION_CORE}"
    if compat.uses_flash_attention(layer):
        return "flash_attention=True (TensorFlow has none: Keras' layer raises)"
    if not layer.built:
        return "not built: call or build the model first"
    if layer.dropout > 0.0:
        return (
            f"dropout {layer.dropout:g}: Keras' explicit path, whose softmax computes and keeps its "
            "probabilities in the compute dtype already"
        )
    if tuple(layer.attention_axes) != (1,):
        return (
            f"attention_axes {tuple(layer.attention_axes)}: Keras' explicit path, whose softmax computes "
            "and keeps its probabilities in the compute dtype already"
        )
    if layer.compute_dtype not in FUSED_DTYPES:
        return f"compute dtype {layer.compute_dtype}"
    return None


def calls_attention_core(cls) -> bool:
    """Whether `cls.call` (a subclass's own) reads `self._compute_attention`: its code names the
    attribute (keras-hub's `CachedMultiHeadAttention.call` does; XLNet's
    `TwoStreamRelativeAttention.call`, with its own core, does not)."""
    code = getattr(inspect.unwrap(cls.call), "__code__", None)
    return code is not None and compat.ATTENTION_CORE in code.co_names


@functools.cache
def _kernels(scale: float, causal: bool, masked: bool, compiled: bool):
    """The forward and backward softmax kernels of one (scale, causal, masked): XLA-compiled
    functions, or the same ops run one by one."""
    forward = functools.partial(_forward, scale=scale, causal=causal)
    backward = functools.partial(_backward, scale=scale, causal=causal)
    if not compiled:
        return forward, backward
    compile_ = functools.partial(tf.function, jit_compile=True, reduce_retracing=True)
    return compile_(forward), compile_(backward)


def _keep(logits, mask, causal: bool):
    """Where attention is allowed (None: everywhere), broadcastable to `logits`."""
    if causal:
        shape = tf.shape(logits)
        lower = tf.linalg.band_part(tf.ones((shape[2], shape[3]), tf.bool), -1, 0)
        mask = lower if mask is None else tf.logical_and(mask, lower)
    return mask


def _forward(logits, mask=None, scale=1.0, causal=False):
    # Keras' order: cast, scale, mask, softmax in float32, one rounding to the compute dtype.
    scaled = tf.cast(logits, tf.float32) * scale
    keep = _keep(logits, mask, causal)
    if keep is not None:
        scaled = tf.where(keep, scaled, LARGE_NEGATIVE)
    return tf.cast(tf.nn.softmax(scaled, axis=-1), logits.dtype)


def _backward(probs, upstream, mask=None, scale=1.0, causal=False):
    p = tf.cast(probs, tf.float32)
    dp = tf.cast(upstream, tf.float32)
    # The rounded probabilities no longer sum to exactly 1; dividing by their sum keeps each
    # row's gradient summing to zero, as the softmax's does (a shift common to a row's logits
    # changes nothing), so gradients that cancel across keys still cancel.
    mean_dp = tf.reduce_sum(dp * p, -1, keepdims=True) / tf.reduce_sum(p, -1, keepdims=True)
    d_logits = scale * p * (dp - mean_dp)
    keep = _keep(probs, mask, causal)
    if keep is not None:  # a row masked everywhere has uniform probabilities: Keras' where zeroes it
        d_logits = tf.where(keep, d_logits, 0.0)
    return tf.cast(d_logits, probs.dtype)
