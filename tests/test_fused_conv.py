"""fuse_normalization on float16 convolutions (tfmp.precision.conv): on a CPU their gradients are
computed from float32 copies (TensorFlow's float16 filter gradient runs on oneDNN's reference
kernel there, ~100-1000x slower); on a GPU, and in other dtypes, Keras' own op is untouched.

    .venv/bin/python -m pytest tests/test_fused_conv.py -q -n 0

Checked at graph level (which op and dtype compute each gradient), so it holds on every host,
and against Keras' layer with identical weights: within float16's rounding plus float32 epsilon x
the summed terms, times each element's own sum of |terms| (the same gradient of |x|, |w|, |dy|).
"""

import contextlib
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from fused_scaffolding import EPS32, eps, fused_twin  # noqa: E402

from tfmp.precision import conv, probe  # noqa: E402
from tfmp.precision.fused_norm import fuse_normalization, is_fused  # noqa: E402

FILTER_GRADIENTS = {"Conv2DBackpropFilter", "Conv3DBackpropFilterV2", "DepthwiseConv2dNativeBackpropFilter"}
INPUT_GRADIENTS = {"Conv2DBackpropInput", "Conv3DBackpropInputV2", "DepthwiseConv2dNativeBackpropInput"}
CONVOLUTIONS = FILTER_GRADIENTS | INPUT_GRADIENTS | {"Conv2D", "Conv3D", "DepthwiseConv2dNative"}
# (class, input shape, config): every Keras convolution class, with bias and activation variants.
VARIANTS = {
    "conv2d": (keras.layers.Conv2D, (2, 6, 6, 3), {"filters": 4, "kernel_size": 3, "activation": "relu"}),
    "conv2d-strided-dilated": (
        keras.layers.Conv2D,
        (2, 9, 9, 2),
        {"filters": 3, "kernel_size": 2, "strides": 2, "padding": "same", "use_bias": False},
    ),
    "conv2d-groups": (keras.layers.Conv2D, (2, 5, 5, 4), {"filters": 4, "kernel_size": 3, "groups": 2}),
    "conv1d-causal": (
        keras.layers.Conv1D,
        (2, 7, 3),
        {"filters": 2, "kernel_size": 3, "padding": "causal", "dilation_rate": 2},
    ),
    "conv3d": (keras.layers.Conv3D, (1, 4, 4, 4, 2), {"filters": 2, "kernel_size": 2}),
    "conv2d-transpose": (
        keras.layers.Conv2DTranspose,
        (2, 4, 4, 3),
        {"filters": 2, "kernel_size": 3, "strides": 2, "padding": "same"},
    ),
    "depthwise2d": (keras.layers.DepthwiseConv2D, (2, 6, 6, 3), {"kernel_size": 3, "depth_multiplier": 2}),
    "separable2d": (keras.layers.SeparableConv2D, (2, 6, 6, 3), {"filters": 4, "kernel_size": 3}),
}


def _ops(graph) -> set[tuple[str, str]]:
    """(op type, dtype) of every convolution op in `graph` and the functions it calls."""
    found = set()
    for op in graph.get_operations():
        if op.type in CONVOLUTIONS:
            found.add((op.type, op.get_attr("T").name))
    for function in graph._functions.values():  # noqa: SLF001 (the test reads the traced graph)
        found |= _ops(function.graph)
    return found


def _gradient_graph(layer, shape, device=None, backward=True):
    """The traced graph of the gradients of sum(layer(x)) to x and the layer's weights (with
    `backward=False`: of the forward pass alone), under `device`'s scope if given."""

    @tf.function
    def gradients(x):
        with tf.device(device) if device else contextlib.nullcontext():
            x = tf.identity(x)  # an input placed by the scope, as a model's layers get them
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(tf.cast(layer(x), tf.float32))
            return tape.gradient(loss, [x, *layer.trainable_weights]) if backward else loss

    return gradients.get_concrete_function(tf.TensorSpec(shape, tf.float16)).graph


def _fused_pair(cls, shape, config, policy="mixed_float16"):
    """A fused layer and a Keras twin with the same random weights, and fuse_normalization's report."""
    return fused_twin(lambda: cls(dtype=policy, **config), shape, _random_weight)


def _random_weight(weight, rng):
    return rng.normal(0, 0.5, weight.shape).astype(np.float32)


@pytest.mark.parametrize("variant", VARIANTS)
def test_float16_gradients_come_from_float32_on_cpu(variant):
    """Every convolution class in float16: fused, its filter gradients are float32 ops and the
    backward pass adds no float16 convolution to the forward's; Keras' twin computes them in
    float16."""
    cls, shape, config = VARIANTS[variant]
    (fused, keras_layer), result = _fused_pair(cls, shape, config)
    assert result.fused == (f"pair/{fused.name}",) and result.left_alone == ()
    fused_ops, keras_ops = _ops(_gradient_graph(fused, shape)), _ops(_gradient_graph(keras_layer, shape))
    forward = _ops(_gradient_graph(fused, shape, backward=False))
    assert {dtype for op, dtype in fused_ops if op in FILTER_GRADIENTS} == {"float32"}, fused_ops
    assert {(op, dtype) for op, dtype in fused_ops if dtype == "float16"} == forward, fused_ops
    assert "float16" in {dtype for op, dtype in keras_ops if op in FILTER_GRADIENTS}, keras_ops


def test_a_gpu_device_keeps_keras_float16_gradients(monkeypatch):
    """Traced under a GPU device scope (no GPU needed to trace), the fused layer's gradients are
    Keras' float16 ops; an unplaced tensor counts as a CPU only where no GPU is visible."""
    cls, shape, config = VARIANTS["conv2d"]
    (fused, _), _ = _fused_pair(cls, shape, config)
    assert ("Conv2DBackpropFilter", "float16") in _ops(_gradient_graph(fused, shape, "/GPU:0"))
    assert ("Conv2DBackpropFilter", "float32") in _ops(_gradient_graph(fused, shape, "/CPU:0"))
    assert conv.runs_on_cpu("/job:worker/replica:0/task:1/device:CPU:1")
    assert not conv.runs_on_cpu("/job:localhost/replica:0/task:0/device:GPU:0")
    monkeypatch.setattr(
        tf.config, "list_logical_devices", lambda kind=None: ["GPU:0"] if kind == "GPU" else []
    )
    assert not conv.runs_on_cpu("") and conv.runs_on_cpu("/device:CPU:0")


@pytest.mark.parametrize("variant", VARIANTS)
def test_outputs_and_gradients_equal_keras(variant):
    """Output (the same float16 op), input and weight gradients of sum(output * upstream):
    within float16's rounding of Keras' float16 kernels, each element against its sum of |terms|."""
    cls, shape, config = VARIANTS[variant]
    (fused, keras_layer), _ = _fused_pair(cls, shape, config)
    rng = np.random.default_rng(1)
    x = tf.constant(rng.normal(0, 1, shape), tf.float16)
    upstream = rng.normal(0, 1, keras_layer(x).shape).astype(np.float32)

    def run(layer, x, upstream, weights=None):
        with tf.GradientTape() as tape:
            tape.watch([x, *(weights or [])])
            y = layer(x) if weights is None else layer.stateless_call(weights, [], x)[0]
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * upstream)
        return y, tape.gradient(loss, [x, *(weights or layer.trainable_weights)])

    (y, grads), (y_keras, grads_keras) = run(fused, x, upstream), run(keras_layer, x, upstream)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_keras, np.float32))
    # Each element's scale: the same gradient of |x|, |w| and |upstream| in float32 (no relu: a
    # relu only zeroes terms), i.e. the sum of the absolute values of its terms.
    linear = cls(**dict(config, activation=None))
    linear.build(shape)
    absolute = [tf.abs(tf.constant(w)) for w in keras_layer.get_weights()]
    _, scales = run(linear, tf.abs(tf.cast(x, tf.float32)), np.abs(upstream), absolute)
    tolerance = 4 * eps("float16") + np.prod(shape) * EPS32
    for grad, reference, scale in zip(grads, grads_keras, scales):
        np.testing.assert_array_less(
            np.abs(np.asarray(grad, np.float64) - np.asarray(reference, np.float64)),
            tolerance * np.asarray(scale, np.float64) + 1e-30,
        )


def test_only_float16_convolutions_are_listed():
    """float32 and bfloat16 convolutions are neither changed nor listed; a float16 subclass that
    overrides call is listed, left alone with its reason."""

    class OwnConv(keras.layers.Conv2D):
        def call(self, inputs):
            return super().call(inputs)

    for policy in ("float32", "mixed_bfloat16"):
        model = keras.Sequential([keras.Input((6, 6, 3)), keras.layers.Conv2D(2, 3, dtype=policy)], name="m")
        assert fuse_normalization(model) == fuse_normalization(model).__class__((), ())
        assert not is_fused(model.layers[0])
    inputs = keras.Input((6, 6, 3))
    x = keras.layers.Conv2D(2, 3, dtype="mixed_float16", name="plain")(inputs)
    x = OwnConv(2, 3, dtype="mixed_float16", name="own")(x)
    result = fuse_normalization(keras.Model(inputs, x, name="m"))
    assert result.fused == ("m/plain",)
    assert result.left_alone == (("m/own", "OwnConv overrides call"),)


def test_the_probe_times_the_fused_float16_convolution():
    """The precision probe's float16 convolution computes its gradients as a fused model does."""
    graph = probe.WORKLOADS["conv"]("float16").get_concrete_function().graph
    assert {dtype for op, dtype in _ops(graph) if op in FILTER_GRADIENTS | INPUT_GRADIENTS} == {"float32"}
