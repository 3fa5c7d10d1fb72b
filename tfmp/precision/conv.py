"""float16 convolutions whose backward pass computes in float32 on a CPU.

    from tfmp.precision import conv
    outputs = conv.backward_in_float32(op, inputs, kernel)   # op(inputs, kernel): any convolution

`tfmp.precision.fuse_normalization` puts every Keras convolution layer that computes in float16
(`Conv1D`/`2D`/`3D`, their `Transpose`s, `DepthwiseConv1D`/`2D`, `SeparableConv1D`/`2D`) on it
(`fused_call`, `unfusable_reason`) and lists it; layers of other compute dtypes are not touched
nor listed. The precision probe (`tfmp.precision.probe`) times its float16 convolution the same
way, so it measures what a fused float16 model pays.

Why: TensorFlow 2.21's CPU kernels compute a float16 convolution's filter gradient on oneDNN's
reference kernel (`ref:any` in `ONEDNN_VERBOSE=1`): measured on a 2-core Intel Xeon (family 6
model 207: amx_bf16, amx_tile, avx512_bf16, avx512_fp16; oneDNN on), Conv2DBackpropFilter of a
(128, 32, 32, 16) input and a 3x3x16x16 filter takes 2,191 ms in float16 against 4.5 ms in
float32, 872-6,406 ms for the other ResNet-20 and seed_cnn shapes at batch 128, and the depthwise
filter gradient 137 ms against 1.0 ms; with oneDNN off (`TF_ENABLE_ONEDNN_OPTS=0`) Eigen's
float16 filter and input gradients of a (64, 32, 32, 16) input take 50 and 52 ms, 12 ms each
through float32. A mixed_float16 CNN step costs 20-100x a float32 step without this. The input
gradient is slower in float16 too (10.2 vs 6.5 ms with float32 operands; the depthwise one 16.6
vs 3.9), so both gradients are computed here from float32 copies of the operands and rounded
back to float16: 3.0-7.6 ms for those shapes, 0.7-1.4x float32's own gradients (the casts; the
depthwise ones 2-3.4x, on 1-2 ms). The forward pass stays Keras' float16 op: a float32 route was
faster for some shapes (6.8 vs 9.8 ms) and slower for others (3.9 vs 3.5 ms strided, 3.4 vs 2.1
ms depthwise).

Only float16 and only on a CPU: bfloat16's gradients run on native kernels (3.0 ms for the first
shape above), and a GPU computes float16 convolutions natively, so there the layer calls Keras'
own op unchanged. Which device: the input tensor's (eager tensors and ops traced under a
`tf.device` scope, as every MirroredStrategy replica's, name theirs); an input without one is
placed by TensorFlow, on a GPU when one is visible, so it counts as a CPU only without GPUs.
Under XLA the float16 gradient is already fast (22 ms against 25 ms through float32 for the
first shape): a step XLA compiles pays the casts for nothing.

The backward pass keeps only what Keras' keeps, the float16 input and kernels: its float32 copies
live only while the gradient is computed. It recomputes the convolution's gradient on them with
Keras' own op and TensorFlow's own gradient of it (a float32 forward op is traced for the tape,
and pruned, unused, from a `tf.function`; an eager step computes it). The gradients equal
float32's rounded to float16 once, where Keras' float16 kernels round their own way: equal within
float16's rounding.

The route depends on (Keras 3.15.1): each class's `call` computing `ops.conv` /
`ops.conv_transpose` / `ops.depthwise_conv` / `ops.separable_conv` on `self.kernel` (or
`self.depthwise_kernel` and `self.pointwise_kernel`), then the bias and the activation, and
`Conv1D`'s causal padding (`dilation_rate * (kernel_size - 1)` zeros before the sequence);
`BaseConv.convolution_op` (a subclass overriding it is left alone).
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

CONV = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
TRANSPOSE = (keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose, keras.layers.Conv3DTranspose)
DEPTHWISE = (keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D)
SEPARABLE = (keras.layers.SeparableConv1D, keras.layers.SeparableConv2D)
CLASSES = CONV + TRANSPOSE + DEPTHWISE + SEPARABLE
ROUTED_DTYPE = "float16"


def backward_in_float32(op, inputs, *kernels):
    """`op(inputs, *kernels)` (a convolution), whose gradients are computed from float32 copies
    and rounded to float16 when `inputs` is float16 on a CPU; otherwise just `op`'s call."""
    if inputs.dtype != tf.float16 or not runs_on_cpu(inputs.device):
        return op(inputs, *kernels)

    @tf.custom_gradient
    def convolve(inputs, *kernels):
        def gradient(upstream):
            operands = [tf.cast(tensor, tf.float32) for tensor in (inputs, *kernels)]
            with tf.GradientTape() as tape:
                tape.watch(operands)
                outputs = op(*operands)
            grads = tape.gradient(outputs, operands, output_gradients=tf.cast(upstream, tf.float32))
            return [tf.cast(grad, tf.float16) for grad in grads]

        return op(inputs, *kernels), gradient

    return convolve(inputs, *kernels)


def runs_on_cpu(device: str) -> bool:
    """Whether an op on a tensor of `device` (its `.device`; "" when unplaced) runs on a CPU."""
    kind = tf.DeviceSpec.from_string(device).device_type if device else None
    if kind:
        return kind.upper() == "CPU"
    return not tf.config.list_logical_devices("GPU")


def listed(layer) -> bool:
    """Whether `fuse_normalization` lists this layer: a Keras convolution computing in float16."""
    return isinstance(layer, CLASSES) and layer.compute_dtype == ROUTED_DTYPE


def unfusable_reason(layer) -> str | None:
    """Why `fused_call` cannot stand in for this convolution layer's `call`, or None if it can."""
    base = next(cls for cls in CLASSES if isinstance(layer, cls))
    name = type(layer).__name__
    if type(layer).call is not base.call:
        return f"{name} overrides call"
    if isinstance(layer, CONV) and type(layer).convolution_op is not base.convolution_op:
        return f"{name} overrides convolution_op"
    if not layer.built:
        return "not built: call or build the model first"
    return None


def fused_call(self, inputs):
    """The Keras convolution layer's `call` (its class's signature and numbers within float16's
    rounding), its convolution on `backward_in_float32`."""
    op, kernels, inputs = _convolution(self, inputs)
    # Read in the layer's autocast scope: compute-dtype tensors, as Keras' op reads them (a
    # variable read inside the custom gradient would need gradients of its own).
    kernels = [tf.convert_to_tensor(kernel) for kernel in kernels]
    outputs = backward_in_float32(op, inputs, *kernels)
    if self.use_bias:  # Keras' bias and activation, as each class's call adds them
        channels_last = self.data_format == "channels_last"
        channel_axis = len(outputs.shape) - 1 if channels_last else 1
        shape = [1] * len(outputs.shape)
        shape[channel_axis] = outputs.shape[channel_axis]
        outputs = ops.add(outputs, ops.reshape(self.bias, shape))
    if self.activation is not None:
        return self.activation(outputs)
    return outputs


def _convolution(self, inputs):
    """(op, kernels, inputs): Keras' convolution of this layer's class, as its `call` makes it."""
    spatial = {"padding": self.padding, "data_format": self.data_format, "dilation_rate": self.dilation_rate}
    if isinstance(self, SEPARABLE):
        return (
            lambda x, depthwise, pointwise: ops.separable_conv(
                x, depthwise, pointwise, strides=self.strides, **spatial
            ),
            (self.depthwise_kernel, self.pointwise_kernel),
            inputs,
        )
    if isinstance(self, DEPTHWISE):
        return (
            (lambda x, k: ops.depthwise_conv(x, k, strides=self.strides, **spatial)),
            (self.kernel,),
            inputs,
        )
    if isinstance(self, TRANSPOSE):
        return (
            lambda x, k: ops.conv_transpose(
                x, k, strides=list(self.strides), output_padding=self.output_padding, **spatial
            ),
            (self.kernel,),
            inputs,
        )
    if self.padding == "causal":  # Conv1D: Keras pads the inputs on the left and convolves "valid"
        left = self.dilation_rate[0] * (self.kernel_size[0] - 1)
        time_axis = 1 if self.data_format == "channels_last" else 2
        padding = [[0, 0], [0, 0], [0, 0]]
        padding[time_axis] = [left, 0]
        inputs = ops.pad(inputs, padding)
        spatial["padding"] = "valid"
    return (lambda x, k: ops.conv(x, k, strides=list(self.strides), **spatial)), (self.kernel,), inputs
