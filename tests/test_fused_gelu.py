"""tfmp.precision.activation: the fused GELU (exact and tanh) and a Dense layer's bias-add +
activation; fuse_normalization puts Dense(activation="gelu"), Activation("gelu") and, in float16
on a CPU, every Dense with a bias and an activation on them.

    .venv/bin/python -m pytest tests/test_fused_gelu.py -q -n 0

Numbers against float64's GELU within the dtype's rounding (one rounding of a float32 result)
plus float32 epsilons x the values' scale, and against Keras' layer within the roundings Keras'
own ops make in the compute dtype (up to 8 in its gradient's chain).
"""

import math
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from fused_scaffolding import EPS32, eps, fused_twin  # noqa: E402

from tfmp.precision import activation  # noqa: E402
from tfmp.precision.fused_norm import fuse_normalization, is_fused  # noqa: E402

DTYPES = ["float32", "bfloat16", "float16"]
POLICIES = {"float32": "float32", "bfloat16": "mixed_bfloat16", "float16": "mixed_float16"}
KERAS_ROUNDINGS = 8  # Keras' GELU and its gradient: each op rounds in the compute dtype


def _reference(x, approximate):
    """GELU and its derivative in float64."""
    x = np.asarray(x, np.float64)
    if approximate:
        k = math.sqrt(2 / math.pi)
        t = np.tanh(k * (x + 0.044715 * x**3))
        return 0.5 * x * (1 + t), 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x**2)
    cdf = 0.5 * np.vectorize(math.erfc)(-x / math.sqrt(2))
    return x * cdf, cdf + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _value_and_gradient(fn, x, upstream):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = fn(x)
    return y, tape.gradient(y, x, output_gradients=upstream)


@pytest.mark.parametrize("shape", [(4, 50), (64, 1024)], ids=["ops", "xla-kernel"])
@pytest.mark.parametrize("approximate", [False, True], ids=["exact", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_matches_float64_and_keras(dtype, approximate, shape):
    """Value and gradient: one rounding of float64's (plus float32's arithmetic; subnormal
    results to the dtype's smallest step) on both the plain-ops and the XLA-kernel sizes; Keras'
    within its own roundings."""
    rng = np.random.default_rng(0)
    x = tf.cast(rng.normal(0, 3, shape), dtype)
    upstream = tf.cast(rng.normal(0, 1, shape), dtype)
    y, dx = _value_and_gradient(lambda v: activation.gelu(v, approximate), x, upstream)
    assert y.dtype == dx.dtype == x.dtype
    value, slope = _reference(np.asarray(tf.cast(x, tf.float64)), approximate)
    up = np.asarray(tf.cast(upstream, tf.float64))
    # float32's arithmetic errs by a few epsilons of the largest term: |x| for the value; for the
    # slope the tanh form's 0.5 |x| (1 - t^2) k (1 + 0.134 x^2) term, below (1 + |x|)^3.
    scale = np.abs(np.asarray(tf.cast(x, tf.float64))) + 1
    smallest = float(np.finfo(tf.as_dtype(dtype).as_numpy_dtype).smallest_subnormal)
    for actual, desired, terms_scale in ((y, value, scale), (dx, slope * up, np.abs(up) * scale**3)):
        error = np.abs(np.asarray(tf.cast(actual, tf.float64)) - desired)
        bound = eps(dtype) * np.abs(desired) + 16 * EPS32 * terms_scale + smallest  # one rounding
        assert np.all(error <= bound), (error - bound).max()
    # Keras': within its roundings in the compute dtype, plus both sides' float32 arithmetic.
    keras_y, keras_dx = _value_and_gradient(lambda v: keras.activations.gelu(v, approximate), x, upstream)
    for mine, theirs, terms_scale in ((y, keras_y, scale), (dx, keras_dx, np.abs(up) * scale**3)):
        theirs = np.asarray(tf.cast(theirs, tf.float64))
        bound = KERAS_ROUNDINGS * eps(dtype) * np.abs(theirs).max() + 2 * 16 * EPS32 * terms_scale
        assert np.all(np.abs(np.asarray(tf.cast(mine, tf.float64)) - theirs) <= bound)


def _pair(layer_fn, shape, policy):
    """A fused layer (in a model fuse_normalization saw) and a Keras twin with the same weights."""
    return fused_twin(
        lambda: layer_fn(policy),
        shape,
        lambda weight, rng: rng.normal(0, 0.5, weight.shape).astype(np.float32),
    )


LAYERS = {
    "dense-gelu": lambda policy: keras.layers.Dense(12, activation="gelu", dtype=policy),
    "dense-gelu-no-bias": lambda policy: keras.layers.Dense(
        12, activation="gelu", use_bias=False, dtype=policy
    ),
    "activation-gelu": lambda policy: keras.layers.Activation("gelu", dtype=policy),
}


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_layers_match_keras(dtype, kind):
    """Output and the gradients of sum(output * upstream) to the input and every weight, within
    Keras' roundings of the compute dtype times the values' scale (a weight gradient's terms:
    float32 epsilons x their count)."""
    shape = (3, 5, 8)
    (fused, reference), result = _pair(LAYERS[kind], shape, POLICIES[dtype])
    assert result.fused == (f"pair/{fused.name}",) and is_fused(fused) and not is_fused(reference)
    rng = np.random.default_rng(1)
    x = tf.cast(rng.normal(0, 1, shape), dtype)
    upstream = rng.normal(0, 1, reference(x).shape).astype(np.float32)

    def run(layer):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * upstream)
        return [y, *tape.gradient(loss, [x, *layer.trainable_weights])]

    tolerance = KERAS_ROUNDINGS * eps(dtype) + 15 * EPS32  # 15: the most terms a sum here has
    for mine, theirs in zip(run(fused), run(reference)):
        theirs = np.asarray(tf.cast(theirs, tf.float64))
        np.testing.assert_allclose(
            np.asarray(tf.cast(mine, tf.float64)), theirs, rtol=0, atol=tolerance * np.abs(theirs).max()
        )


def _kept_bytes(fn, x) -> int:
    """Bytes of the forward tensors (other than the input) the traced gradient's ops read: what
    the backward pass keeps."""

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)
        return tape.gradient(y, x)

    graph = step.get_concrete_function(tf.TensorSpec(x.shape, x.dtype)).graph
    kept = {
        tensor.ref(): tensor
        for op in graph.get_operations()
        if op.name.startswith("gradient_tape/")
        for tensor in op.inputs
        if not tensor.op.name.startswith("gradient_tape/") and tensor.op.type not in ("Placeholder", "Const")
    }
    return sum(t.shape.num_elements() * t.dtype.size for t in kept.values() if t.shape.num_elements() > 1)


@pytest.mark.parametrize("approximate", [False, True], ids=["exact", "tanh"])
def test_the_backward_pass_keeps_only_the_input(approximate):
    """Keras' GELU keeps at least two activation-sized tensors besides its input; the fused one
    none (its gradient recomputes from the input)."""
    x = tf.zeros((64, 1024), tf.bfloat16)
    activation_bytes = 64 * 1024 * 2
    assert _kept_bytes(lambda v: activation.gelu(v, approximate), x) == 0
    assert _kept_bytes(lambda v: keras.activations.gelu(v, approximate), x) >= 2 * activation_bytes


def test_float16_dense_keeps_its_matmul_away_from_the_fused_kernel():
    """float16 on a CPU: a Dense with a bias and an activation (relu) is fused and its MatMul's
    output goes to a Cast, not to the bias-add Grappler folds with the activation into a
    `_FusedMatMul` (oneDNN's float16 reference kernel); in float32 and bfloat16 nothing is listed."""
    shape = (4, 16)
    (fused, reference), result = _pair(
        lambda p: keras.layers.Dense(8, activation="relu", dtype=p), shape, "mixed_float16"
    )
    assert result.fused == (f"pair/{fused.name}",)
    graph = tf.function(fused).get_concrete_function(tf.TensorSpec(shape, tf.float16)).graph
    matmuls = [op for op in graph.get_operations() if op.type == "MatMul"]
    consumers = {c.type for op in matmuls for c in op.outputs[0].consumers()}
    assert matmuls and "Cast" in consumers and not consumers & {"BiasAdd", "AddV2", "Add"}, consumers
    x = tf.constant(np.random.default_rng(2).normal(0, 1, shape), tf.float16)
    np.testing.assert_allclose(
        np.asarray(fused(x), np.float32), np.asarray(reference(x), np.float32), atol=4 * eps("float16") * 8
    )
    for policy in ("float32", "mixed_bfloat16"):
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8, activation="relu", dtype=policy)])
        assert fuse_normalization(model) == type(result)((), ())


def test_keras_hub_gelu_approximate_is_recognised_by_name():
    """keras-hub's `gelu_approximate` (BERT, GPT-2) is the tanh GELU; other functions are not GELU."""

    def gelu_approximate(x):
        return keras.activations.gelu(x, approximate=True)

    gelu_approximate.__module__ = "keras_hub.src.utils.keras_utils"
    assert activation.gelu_kind(gelu_approximate) == activation.GELU_TANH
    assert activation.gelu_kind(keras.activations.gelu) == activation.GELU
    assert activation.gelu_kind(keras.activations.relu) is None
