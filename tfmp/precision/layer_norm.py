"""LayerNormalization and RMSNormalization that keep half precision half: float32 statistics per
normalised row, a hand-written gradient.

    from tfmp.precision.layer_norm import layer_norm
    y = layer_norm(x, gamma, beta, features=256, mode="layer", epsilon=1e-3)   # x [..., 256]

`tfmp.precision.fuse_normalization` puts each fusable `keras.layers.LayerNormalization` (also with
`rms_scaling=True`) and `keras.layers.RMSNormalization` on it (`fused_call`, `unfusable_reason`);
`tfmp.precision.fused_norm` says how and what stays Keras'.

Why: Keras 3.15 on TensorFlow casts a float16/bfloat16 input to float32 ("Computes in at least
float32 precision", keras/src/ops/nn.py `_layer_normalization`, `_rms_normalization`) and
normalises with separate element-wise ops, so TensorFlow's automatic gradient keeps float32
copies of every normalised activation (the cast input of `x * inv` and of the moments) until the
backward pass, and each op is one more pass over the activation. On the torch backend the same
layer calls PyTorch's fused kernel; on TensorFlow nothing does.

Here the forward pass computes Keras' formula in float32 over each row of the trailing
(normalised) axes, term for term in Keras' order, and rounds to the input's dtype once:
- "layer" (LayerNormalization): mean and the mean of squared differences (`tf.nn.moments`'s two
  passes), `inv = rsqrt(variance + epsilon) * gamma`, `x * inv + (beta - mean * inv)`;
- "variance_scaled" (LayerNormalization(rms_scaling=True), deprecated in Keras because it scales
  by the variance, not the mean square): `x * rsqrt(variance + epsilon) * gamma`, no centring,
  no beta;
- "rms" (RMSNormalization): `x * rsqrt(mean(x * x) + epsilon) * scale`.
The backward pass keeps only the input in its own dtype and two float32 numbers per row (the
mean, zero for "rms", and r = 1 / sqrt(variance or mean square + epsilon)); it recomputes with
c = x - mean (x for "rms") and g = dy * gamma:
- "layer": dx = r (g - mean(g) - x^ mean(g x^)) with x^ = c r; dgamma = sum(dy x^), dbeta = sum(dy);
- "variance_scaled" and "rms": dx = r g - r^3 c mean(g x); dgamma = sum(dy x r)
(means over the row, sums over the rows). Both passes are XLA-compiled kernels (`jit_compile=True`,
one compilation per input shape and dtype, inlined into an XLA-compiled step): XLA fuses the
element-wise work into one or two loops over the activation, and the float32 temporaries live
only inside a kernel.

Why not tf.keras 2's route (the rows reshaped to [1, rows, features, 1] onto FusedBatchNormV3,
gamma and beta applied after it): measured on this 2-core AMD EPYC (AVX2, no AVX-512; forward +
backward of a chain of layers, docs/mixed-precision.md "Transformers"), it was 2-4x slower than
Keras' own layer in every precision (the CPU kernel transposes NCHW, and gamma's gradient needs
a normalised copy kept beside the input), where these kernels are 1.5-2x faster; it rounds three
times in half precision (the normalised output, times gamma, plus beta) instead of once, and
covers neither RMS variant.
"""

from __future__ import annotations

import functools
import math

import keras
import tensorflow as tf

FUSED_DTYPES = ("float16", "bfloat16", "float32")
# Below this many elements an XLA kernel's launch costs more than it saves (measured on the 2-core
# EPYC: at 8x64x128 the compiled and the plain ops take the same time, below it the plain ops
# win by up to 1.7x in half precision): smaller inputs run the same ops one by one.
COMPILED_FROM_ELEMENTS = 65536
LAYER, VARIANCE_SCALED, RMS = "layer", "variance_scaled", "rms"


def layer_norm(x, gamma, beta, features: int, mode: str, epsilon: float):
    """Normalises each row of `x`'s trailing axes holding `features` elements (float16, bfloat16
    or float32); `gamma` and `beta` float32 of `features` elements (beta unused unless `mode` is
    LAYER); the output in `x`'s dtype. Differentiable in all three."""
    forward, backward = _kernels(mode, float(epsilon), compiled(x))
    gamma, beta = tf.reshape(gamma, [features]), tf.reshape(beta, [features])

    @tf.custom_gradient
    def normalise(x, gamma, beta):
        rows = tf.reshape(x, [-1, features])
        outputs, mean, rstd = forward(rows, gamma, beta)

        def gradient(upstream):
            d_x, d_gamma, d_beta = backward(rows, tf.reshape(upstream, [-1, features]), mean, rstd, gamma)
            return tf.reshape(d_x, tf.shape(x)), d_gamma, d_beta

        return tf.reshape(outputs, tf.shape(x)), gradient

    return normalise(x, gamma, beta)


def compiled(x) -> bool:
    """Whether `x` is large enough for the XLA kernels (or of a size unknown when traced)."""
    elements = x.shape.num_elements()
    return elements is None or elements >= COMPILED_FROM_ELEMENTS


def fused_call(self, inputs):
    """`LayerNormalization.call` or `RMSNormalization.call` (each its class's signature) on
    `layer_norm`, with Keras' numbers within rounding."""
    if isinstance(self, keras.layers.RMSNormalization):
        return _rms_call(self, inputs)
    if inputs.dtype.name not in FUSED_DTYPES or not trailing_axes(self.axis, len(inputs.shape)):
        # float64, or an input whose trailing axes are not the normalised ones: Keras' own.
        return keras.layers.LayerNormalization.call(self, inputs)
    features = _features(self, inputs)
    gamma = _float32(self.gamma) if self.gamma is not None else tf.ones([features], tf.float32)
    beta = _float32(self.beta) if self.beta is not None else tf.zeros([features], tf.float32)
    mode = VARIANCE_SCALED if self.rms_scaling else LAYER
    # As Keras: computed in the input's dtype (LayerNormalization does not autocast: a float32
    # input is normalised in float32), returned in the compute dtype.
    return tf.cast(layer_norm(inputs, gamma, beta, features, mode, self.epsilon), self.compute_dtype)


def _rms_call(self, x):
    # RMSNormalization autocasts: x arrives in the compute dtype and its scale is read in it too
    # (Keras rounds the float32 scale to the compute dtype before its float32 arithmetic).
    if x.dtype.name not in FUSED_DTYPES or not trailing_axes(self.axis, len(x.shape)):
        return keras.layers.RMSNormalization.call(self, x)
    features = _features(self, x)
    epsilon = keras.config.epsilon() if self.epsilon is None else self.epsilon
    zeros = tf.zeros([features], tf.float32)
    return layer_norm(x, _float32(self.scale), zeros, features, RMS, epsilon)


def _float32(variable) -> tf.Tensor:
    # `.value` reads in the compute dtype inside the layer's autocast scope (RMSNormalization's
    # scale), in its own dtype otherwise (LayerNormalization's autocast=False gamma and beta).
    return tf.cast(variable.value, tf.float32)


def _features(layer, inputs) -> int:
    return math.prod(inputs.shape[axis] for axis in layer.axis)


def unfusable_reason(layer) -> str | None:
    """Why `layer_norm` cannot stand in for this LayerNormalization or RMSNormalization, or None
    if it can."""
    base = (
        keras.layers.RMSNormalization
        if isinstance(layer, keras.layers.RMSNormalization)
        else keras.layers.LayerNormalization
    )
    if type(layer).call is not base.call:
        return f"{type(layer).__name__} overrides call"
    if not layer.built or not isinstance(layer.axis, list):  # `build` makes the axis a list
        return "not built: call or build the model first"
    if not trailing_axes(layer.axis, _input_rank(layer)):
        return f"axis {layer.axis} (fused: the trailing axes of the input)"
    if layer.compute_dtype not in FUSED_DTYPES:
        return f"compute dtype {layer.compute_dtype}"
    return None


def trailing_axes(axes, rank: int | None) -> bool:
    """Whether `axes` are the last len(axes) axes of a `rank`-D input; with the rank unknown,
    whether negative axes are, or positive ones are contiguous (the call checks them again)."""
    if rank is not None:
        axes = sorted(axis % rank for axis in axes)
        return axes == list(range(rank - len(axes), rank))
    axes = sorted(axes)
    if all(axis < 0 for axis in axes):
        return axes == list(range(-len(axes), 0))
    return all(axis >= 0 for axis in axes) and axes == list(range(axes[0], axes[0] + len(axes)))


def _input_rank(layer) -> int | None:
    """The rank of the input the layer was first called on in a functional model (Keras'
    normalization layers set no input_spec), or None for a layer called inside another layer."""
    try:
        return len(layer.input.shape)
    except (AttributeError, ValueError):  # no inbound node: never called symbolically
        return None


@functools.cache
def _kernels(mode: str, epsilon: float, compiled: bool = True):
    """The forward and backward kernels of one (mode, epsilon) on [rows, features]: XLA-compiled
    functions, or (`compiled=False`) the same ops run one by one."""
    forward = functools.partial(_forward, mode=mode, epsilon=epsilon)
    backward = functools.partial(_backward, mode=mode)
    if not compiled:
        return forward, backward
    compile_ = functools.partial(tf.function, jit_compile=True, reduce_retracing=True)
    return compile_(forward), compile_(backward)


def _forward(x, gamma, beta, mode: str, epsilon: float):
    x32 = tf.cast(x, tf.float32)
    if mode == RMS:
        mean = tf.zeros_like(x32[:, :1])
        rstd = tf.math.rsqrt(tf.reduce_mean(tf.square(x32), -1, keepdims=True) + epsilon)
        outputs = x32 * rstd * gamma
    else:
        mean = tf.reduce_mean(x32, -1, keepdims=True)
        variance = tf.reduce_mean(tf.math.squared_difference(x32, mean), -1, keepdims=True)
        rstd = tf.math.rsqrt(variance + epsilon)
        if mode == LAYER:
            inv = rstd * gamma
            outputs = x32 * inv + (-mean * inv + beta)  # Keras' order
        else:
            outputs = x32 * rstd * gamma
    return tf.cast(outputs, x.dtype), mean, rstd


def _backward(x, upstream, mean, rstd, gamma, mode: str):
    x32 = tf.cast(x, tf.float32)
    dy = tf.cast(upstream, tf.float32)
    g = dy * gamma
    if mode == LAYER:
        normalised = (x32 - mean) * rstd
        mean_g = tf.reduce_mean(g, -1, keepdims=True)
        mean_g_x = tf.reduce_mean(g * normalised, -1, keepdims=True)
        d_x = rstd * (g - mean_g - normalised * mean_g_x)
        d_gamma = tf.reduce_sum(dy * normalised, 0)
    else:
        mean_g_x = tf.reduce_mean(g * x32, -1, keepdims=True)
        d_x = rstd * g - rstd**3 * (x32 - mean) * mean_g_x
        d_gamma = tf.reduce_sum(dy * x32 * rstd, 0)
    d_beta = tf.reduce_sum(dy, 0) if mode == LAYER else tf.zeros_like(gamma)
    return tf.cast(d_x, x.dtype), d_gamma, d_beta
