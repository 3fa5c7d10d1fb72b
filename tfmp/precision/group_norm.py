"""GroupNormalization that keeps half precision half: float32 statistics, a hand-written gradient.

    from tfmp.precision.group_norm import group_norm
    y = group_norm(x, gamma, beta, groups=8, epsilon=1e-3)   # x channels-last, any rank >= 2

`tfmp.precision.fuse_normalization` puts each fusable `keras.layers.GroupNormalization` on it
(`fused_call`, `unfusable_reason`); `tfmp.precision.fused_norm` says how and what stays Keras'.

Why: Keras 3.15's `GroupNormalization.call` casts a float16/bfloat16 input to float32 and
normalises with separate element-wise ops (keras/src/layers/normalization/
group_normalization.py `_apply_normalization`), so TensorFlow's automatic gradient keeps float32
copies of the activation (the cast input of `x * inv` and of `squared_difference`) until the
backward pass, and every op is a pass over the whole activation.

Here the forward pass computes Keras' formula in float32 (the per-(example, group) mean, then
the mean of squared differences, `inv = rsqrt(variance + epsilon) * gamma`, `x * inv + (beta -
mean * inv)`, one rounding to the input's dtype at the end) and keeps for the backward pass only
the input in its own dtype and the float32 per-(example, group) mean and 1 / sqrt(variance +
epsilon). The gradient recomputes from them with the standard formula: with x^ = (x - mean) * r
and g = dy * gamma, dx = r * (g - mean(g) - x^ * mean(g * x^)) over the group, dgamma =
sum(dy * x^) and dbeta = sum(dy) over examples and positions; every reduction needs only
sum(dy) and sum(dy * (x - mean)) per (example, channel). Both passes are XLA-compiled kernels
(`jit_compile=True`, one compilation per input shape and dtype, inlined into an XLA-compiled
step): XLA fuses the element-wise work into a few loops instead of one pass per op, and the
float32 temporaries live only inside a kernel.
"""

from __future__ import annotations

import functools

import keras
import tensorflow as tf

FUSED_DTYPES = ("float16", "bfloat16", "float32")


def group_norm(x, gamma, beta, groups: int, epsilon: float):
    """Channels-last group norm of `x` (float16, bfloat16 or float32); `gamma` and `beta` float32
    vectors of the channel count; the output in `x`'s dtype. Differentiable in all three."""
    forward, backward = _kernels(int(groups), float(epsilon))

    @tf.custom_gradient
    def normalise(x, gamma, beta):
        outputs, mean, rstd = forward(x, gamma, beta)
        return outputs, lambda upstream: backward(x, upstream, mean, rstd, gamma)

    return normalise(x, gamma, beta)


def fused_call(self, inputs):
    """`GroupNormalization.call` (same signature and numbers within rounding) on `group_norm`."""
    if inputs.dtype.name not in FUSED_DTYPES:  # float64: Keras' own computation, as before
        return keras.layers.GroupNormalization.call(self, inputs)
    channels = inputs.shape[-1]
    gamma = tf.cast(self.gamma.value, tf.float32) if self.scale else tf.ones([channels], tf.float32)
    beta = tf.cast(self.beta.value, tf.float32) if self.center else tf.zeros([channels], tf.float32)
    # As Keras: computed in the input's dtype (the layer does not autocast), returned in the
    # compute dtype.
    return tf.cast(group_norm(inputs, gamma, beta, self.groups, self.epsilon), self.compute_dtype)


def unfusable_reason(layer) -> str | None:
    """Why `group_norm` cannot stand in for this GroupNormalization, or None if it can."""
    if type(layer).call is not keras.layers.GroupNormalization.call:
        return f"{type(layer).__name__} overrides call"
    if not layer.built or layer.input_spec is None or layer.input_spec.ndim is None:
        return "not built: call or build the model first"
    ndim = layer.input_spec.ndim
    if not isinstance(layer.axis, int) or layer.axis not in (-1, ndim - 1):
        return f"axis {layer.axis} (fused: the last axis, channels-last)"
    if layer.compute_dtype not in FUSED_DTYPES:
        return f"compute dtype {layer.compute_dtype}"
    return None


@functools.cache
def _kernels(groups: int, epsilon: float):
    """The XLA-compiled forward and backward kernels of one (groups, epsilon)."""

    @tf.function(jit_compile=True, reduce_retracing=True)
    def forward(x, gamma, beta):
        grouped, axes = _grouped(x, groups)
        x32 = tf.cast(grouped, tf.float32)
        mean = tf.reduce_mean(x32, axes, keepdims=True)  # [N, 1.., G, 1]
        variance = tf.reduce_mean(tf.math.squared_difference(x32, mean), axes, keepdims=True)
        rstd = tf.math.rsqrt(variance + epsilon)
        inv = rstd * tf.reshape(gamma, [groups, -1])
        outputs = x32 * inv + (tf.reshape(beta, [groups, -1]) - mean * inv)  # Keras' order
        return tf.reshape(tf.cast(outputs, x.dtype), tf.shape(x)), mean, rstd

    @tf.function(jit_compile=True, reduce_retracing=True)
    def backward(x, upstream, mean, rstd, gamma):
        grouped, axes = _grouped(x, groups)
        gamma = tf.reshape(gamma, [groups, -1])
        centred = tf.cast(grouped, tf.float32) - mean
        dy = tf.cast(tf.reshape(upstream, tf.shape(grouped)), tf.float32)
        positions, examples = axes[:-1], list(range(len(grouped.shape) - 2))
        dy_sum = tf.reduce_sum(dy, positions, keepdims=True)  # [N, 1.., G, C / G]
        dy_x_sum = tf.reduce_sum(dy * centred, positions, keepdims=True)
        count = tf.cast(tf.size(grouped) // tf.size(mean), tf.float32)  # elements per group
        mean_g = tf.reduce_sum(gamma * dy_sum, -1, keepdims=True) / count  # mean(dy * gamma)
        mean_g_x = tf.reduce_sum(gamma * dy_x_sum, -1, keepdims=True) / count
        # r * (g - mean(g) - x^ mean(g x^)) with x^ = (x - mean) r, mean(g x^) = r mean_g_x.
        d_x = (rstd * gamma) * dy - (rstd**3 * mean_g_x * centred + rstd * mean_g)
        d_gamma = tf.reshape(tf.reduce_sum(dy_x_sum * rstd, examples), [-1])
        d_beta = tf.reshape(tf.reduce_sum(dy_sum, examples), [-1])
        return tf.reshape(tf.cast(d_x, x.dtype), tf.shape(x)), d_gamma, d_beta

    return forward, backward


def _grouped(x, groups: int):
    """`x` [N, ..., C] as [N, ..., G, C / G], and the axes one group's statistics reduce over
    (every axis but the first and the group axis)."""
    rank = len(x.shape)
    grouped = tf.reshape(x, tf.concat([tf.shape(x)[:-1], [groups, -1]], 0))
    return grouped, [*range(1, rank - 1), rank]
