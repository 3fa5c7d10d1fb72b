"""GELU, and a Dense layer's bias-add + activation, fused: float32 inside, one rounding, a
hand-written gradient that keeps only the input.

    from tfmp.precision import activation
    y = activation.gelu(x, approximate=False)                      # exact (erf) or tanh GELU
    y = activation.bias_activation(z, bias, activation.GELU)       # gelu(z + bias), z = x @ kernel

`tfmp.precision.fuse_normalization` puts `keras.layers.Dense(activation="gelu")` (and keras-hub's
`gelu_approximate`, as BERT and GPT-2 pass it) on `bias_activation`, `keras.layers.Activation("gelu")`
on `gelu` (`fused_call_of`, `unfusable_reason`), and lists them; keras-hub's ViT `MLP` holds such a
Dense and is found through its attributes. In float16 on a CPU it also puts every other Dense
with a bias and an activation on `bias_activation` (below).

Why GELU: Keras 3.15's GELU on TensorFlow is `tf.nn.gelu` (keras/src/backend/tensorflow/nn.py),
five element-wise ops (`0.5 x erfc(-x / sqrt 2)`; tanh: eight), each one pass over the
activation and each output one more tensor TensorFlow's automatic gradient keeps: three
(batch, tokens, 4 x width) tensors per transformer block, half of vit_tiny's kept activations.
Here the forward pass computes the same formula in float32 and rounds to the input's dtype once,
and the gradient recomputes from the input alone: exact, gelu'(u) = Phi(u) + u phi(u); tanh, with
t = tanh(k (u + 0.044715 u^3)), 0.5 (1 + t) + 0.5 u (1 - t^2) k (1 + 3 x 0.044715 u^2). From
65,536 elements both passes are XLA-compiled kernels (one loop over the activation), as
`tfmp.precision.layer_norm`'s; smaller inputs run the same ops one by one.

`bias_activation(z, bias, fn)` adds the bias in float32 inside the same kernel (Keras adds it in
the compute dtype and rounds once more) and keeps only z and the bias; its gradient gives dz and
the bias' (the sum of dz over the rows).

Why float16 on a CPU, every activation: TensorFlow's graph optimiser (Grappler's remapper)
rewrites MatMul + bias + activation into one `_FusedMatMul`, which oneDNN computes in float16 on
its reference kernel (`ref:any` in `ONEDNN_VERBOSE=1`): a Dense(128, relu) on a (128, 2048)
float16 input took 944 ms forward (seed_cnn's dense layer; float32: under 1 ms) on the 2-core
Intel Xeon with AMX (family 6 model 207). Computed here, the matmul's float16 output is cast to
float32 before the bias, so no such fusion forms; the activation's gradient comes from a float32
recomputation (TensorFlow's own gradient of the Keras activation) from z and the bias.
"""

from __future__ import annotations

import functools
import math

import keras
import tensorflow as tf
from keras import ops

from tfmp.precision import conv

GELU, GELU_TANH = "gelu", "gelu_tanh"
COMPILED_FROM_ELEMENTS = 65536  # as tfmp.precision.layer_norm: smaller inputs skip XLA
FUSED_DTYPES = ("float16", "bfloat16", "float32")
_SQRT_HALF = 1.0 / math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_CUBIC = 0.044715


def gelu(x, approximate: bool = False):
    """GELU of `x` (float16, bfloat16 or float32), computed in float32 and returned in `x`'s
    dtype; the gradient keeps only `x`."""
    return _fused(x, None, GELU_TANH if approximate else GELU)


def bias_activation(z, bias, fn):
    """fn(z + bias) computed in float32, returned in `z`'s dtype; `bias` a vector of z's last axis
    (any float dtype), `fn` GELU, GELU_TANH or a Keras activation function. Differentiable in both;
    the gradient keeps only `z` and `bias`."""
    return _fused(z, bias, fn)


def _fused(z, bias, fn):
    elements = z.shape.num_elements()
    compiled = elements is None or elements >= COMPILED_FROM_ELEMENTS
    forward, backward = _kernels(fn, bias is not None, compiled)
    biases = () if bias is None else (bias,)

    @tf.custom_gradient
    def activate(z, *biases):
        def gradient(upstream):
            d_z, d_bias = backward(z, upstream, *biases)
            return (d_z, d_bias) if biases else d_z

        return forward(z, *biases), gradient

    return activate(z, *biases)


@functools.cache
def _kernels(fn, biased: bool, compiled: bool):
    """The forward and backward kernels of one activation: XLA-compiled functions, or the same ops
    run one by one."""
    forward = functools.partial(_forward, fn=fn)
    backward = functools.partial(_backward, fn=fn)
    if not compiled:
        return forward, backward
    compile_ = functools.partial(tf.function, jit_compile=True, reduce_retracing=True)
    return compile_(forward), compile_(backward)


def _preactivation(z, bias):
    z32 = tf.cast(z, tf.float32)
    return z32 if bias is None else z32 + tf.cast(bias, tf.float32)


def _forward(z, bias=None, fn=GELU):
    u = _preactivation(z, bias)
    if fn == GELU:  # tf.nn.gelu's formulas, term for term
        y = 0.5 * u * tf.math.erfc(-u * _SQRT_HALF)
    elif fn == GELU_TANH:
        y = 0.5 * u * (1.0 + tf.tanh(_SQRT_2_OVER_PI * (u + _CUBIC * u * u * u)))
    else:
        y = fn(u)
    return tf.cast(y, z.dtype)


def _backward(z, upstream, bias=None, fn=GELU):
    u = _preactivation(z, bias)
    dy = tf.cast(upstream, tf.float32)
    if fn == GELU:
        slope = 0.5 * tf.math.erfc(-u * _SQRT_HALF) + u * tf.exp(-0.5 * u * u) / math.sqrt(2.0 * math.pi)
        d_u = dy * slope
    elif fn == GELU_TANH:
        t = tf.tanh(_SQRT_2_OVER_PI * (u + _CUBIC * u * u * u))
        slope = 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _CUBIC * u * u)
        d_u = dy * slope
    else:
        with tf.GradientTape() as tape:
            tape.watch(u)
            y = fn(u)
        d_u = tape.gradient(y, u, output_gradients=dy)
    if bias is None:
        return tf.cast(d_u, z.dtype), None
    d_bias = tf.reduce_sum(tf.reshape(d_u, [-1, tf.shape(d_u)[-1]]), 0)
    return tf.cast(d_u, z.dtype), tf.cast(d_bias, bias.dtype)


# ----------------------------------------------------------------------------- Keras layers
def gelu_kind(fn) -> str | None:
    """GELU or GELU_TANH when `fn` is Keras' `keras.activations.gelu` (exact, its default) or
    keras-hub's `gelu_approximate` (recognised by its module and name: tfmp does not import
    keras-hub), else None."""
    if fn is keras.activations.gelu:
        return GELU
    if getattr(fn, "__name__", "") == "gelu_approximate" and getattr(fn, "__module__", "").startswith(
        "keras_hub"
    ):
        return GELU_TANH
    return None


def _float16_trap(layer) -> bool:
    """A float16 Dense with a bias and an activation: Grappler's MatMul + bias + activation fusion
    runs on oneDNN's float16 reference kernel on a CPU."""
    return (
        layer.compute_dtype == "float16"
        and layer.use_bias
        and layer.activation is not keras.activations.linear
        and conv.runs_on_cpu("")
    )


def listed(layer) -> bool:
    """Whether `fuse_normalization` lists this layer: Dense or Activation with GELU, or (float16
    on a CPU without GPUs) a Dense with a bias and any activation."""
    if isinstance(layer, keras.layers.Activation):
        return gelu_kind(layer.activation) is not None
    if isinstance(layer, keras.layers.Dense):
        return gelu_kind(layer.activation) is not None or _float16_trap(layer)
    return False


def unfusable_reason(layer) -> str | None:
    """Why `fused_call` cannot stand in for this Dense's or Activation's `call`, or None."""
    base = keras.layers.Dense if isinstance(layer, keras.layers.Dense) else keras.layers.Activation
    if type(layer).call is not base.call:
        return f"{type(layer).__name__} overrides call"
    if layer.compute_dtype not in FUSED_DTYPES:
        return f"compute dtype {layer.compute_dtype}"
    if getattr(layer, "quantization_mode", None):
        return f"quantized ({layer.quantization_mode}): Keras' quantized call"
    return None


def fused_activation_call(self, inputs):
    """`Activation.call` (same signature; Keras' numbers within the compute dtype's rounding) on
    the fused GELU."""
    kind = gelu_kind(self.activation)
    return gelu(inputs, approximate=kind == GELU_TANH) if kind else self.activation(inputs)


def fused_dense_call(self, inputs, training=None):
    """`Dense.call` (same signature; Keras' numbers within the compute dtype's rounding) with its
    bias-add + activation fused: GELU always, any activation in float16 on a CPU."""
    z = ops.matmul(inputs, self.kernel)
    fn = gelu_kind(self.activation) or self.activation
    if fn is self.activation and not (self.compute_dtype == "float16" and conv.runs_on_cpu(z.device)):
        # Not GELU, and not float16 on a CPU (a GPU, say): Keras' own bias and activation.
        z = ops.add(z, self.bias) if self.bias is not None else z
        return self.activation(z)
    if self.bias is None:
        return _fused(z, None, fn)
    # Read in the layer's autocast scope, as Keras reads it (a variable read inside the custom
    # gradient would need gradients of its own).
    return bias_activation(z, tf.convert_to_tensor(self.bias), fn)


def fused_call_of(layer):
    """The fused `call` for this Dense or Activation layer."""
    return fused_dense_call if isinstance(layer, keras.layers.Dense) else fused_activation_call
