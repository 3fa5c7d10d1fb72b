"""fuse_normalization on GroupNormalization: tfmp.precision.group_norm computes Keras' numbers.

    .venv/bin/python -m pytest tests/test_fused_group_norm.py -q -n 0

As tests/test_fused_norm.py does for BatchNormalization, every check compares a fused layer or
model with a Keras copy holding identical weights: outputs within 2 epsilons of the compute
dtype (each side rounds once) plus float32 epsilon x the summed terms, times the values' scale.
"""

import json
import os
import sys
import types
import zipfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from fused_scaffolding import (  # noqa: E402
    LOAD_WITHOUT_TFMP,
    assert_close,
    forward_backward,
    layer_pair,
    relative_tolerance,
    replica_batches,
    sgd_losses,
)
from rounding import assert_replicas_step_like_one_device  # noqa: E402

from tfmp.detection import retinanet  # noqa: E402
from tfmp.precision import conv  # noqa: E402
from tfmp.precision.fused_norm import fuse_normalization, status  # noqa: E402
from tfmp.training.engine import Engine  # noqa: E402

POLICIES = ["float32", "mixed_float16", "mixed_bfloat16"]
# (groups, input shape, other config): channels-last 4-D with Keras' defaults, instance norm
# (groups=-1) without centre or scale, layer norm (1 group), and a 3-D (sequence) input.
VARIANTS = {
    "defaults": (4, (3, 5, 6, 16), {}),
    "instance-no-center-no-scale": (-1, (2, 4, 4, 8), {"center": False, "scale": False, "epsilon": 1e-5}),
    "one-group": (1, (2, 4, 4, 8), {"epsilon": 1e-2}),
    "3-d": (2, (3, 7, 8), {}),
}
IMAGE, CLASSES, BATCH, STEPS = (8, 8, 3), 4, 4, 3


def _layer_pair(policy, groups, shape, config):
    """A fused GroupNormalization and a Keras copy with the same random weights (gamma in 0.5..2)."""
    return layer_pair(
        lambda: keras.layers.GroupNormalization(groups, dtype=policy, **config),
        shape,
        lambda w, rng: rng.uniform(0.5, 2, w.shape) if "gamma" in w.name else rng.normal(0, 1, w.shape),
    )


@pytest.mark.parametrize("xla", [False, True], ids=["xla-off", "xla-on"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("policy", POLICIES)
def test_layer_matches_keras(policy, variant, xla):
    """Output, input gradient and gamma/beta gradients of sum(output * upstream), with and
    without XLA, in each policy: the output and the input gradient in the compute dtype."""
    groups, shape, config = VARIANTS[variant]
    fused, reference = _layer_pair(policy, groups, shape, config)
    compute = fused.compute_dtype
    rng = np.random.default_rng(1)
    x = tf.cast(rng.normal(1.0, 3.0, shape).astype(np.float32), compute)  # what a conv hands it
    upstream = rng.normal(0, 1, shape).astype(np.float32)
    y, grads = forward_backward(fused, xla)(x, upstream)
    y_ref, grads_ref = forward_backward(reference, xla)(x, upstream)
    assert y.dtype == y_ref.dtype == compute and grads[0].dtype == grads_ref[0].dtype == compute
    terms = int(np.prod(shape[1:])) // fused.groups  # the elements each group statistic sums
    assert_close(y, y_ref, compute, terms=terms, what="output")
    assert_close(grads[0], grads_ref[0], compute, terms=terms, what="input gradient")
    # gamma's and beta's gradients: float32 sums over the examples and positions of terms each
    # at most |upstream| x |normalised input| (<= sqrt(group size)).
    scale = np.abs(upstream).reshape(-1, shape[-1]).sum(0).max() * np.sqrt(terms)
    assert len(grads) == 1 + 2 * bool(config.get("scale", True))
    for mine, theirs, weight in zip(grads[1:], grads_ref[1:], fused.trainable_weights):
        assert_close(mine, theirs, "float32", terms=shape[0] * terms, scale=scale, what=weight.name)


def tiny_gn_model(policy="float32", seed=1) -> keras.Model:
    """conv -> GroupNorm -> relu twice, global pool, a float32 Dense head; seeded weights."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(IMAGE)
    x = inputs
    for index in range(2):
        x = keras.layers.Conv2D(8, 3, padding="same", use_bias=False, dtype=policy, name=f"conv{index}")(x)
        x = keras.layers.GroupNormalization(4, dtype=policy, name=f"gn{index}")(x)
        x = keras.layers.ReLU(dtype=policy)(x)
    x = keras.layers.GlobalAveragePooling2D(dtype=policy)(x)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, dtype="float32", name="head")(x), name="tiny")


def _train(model, xla=False):
    """Per-step losses of STEPS plain SGD steps (a tf.function step, XLA on or off)."""
    rng = np.random.default_rng(2)
    images = rng.normal(0.5, 1.0, (STEPS, BATCH, *IMAGE)).astype(np.float32)
    labels = rng.integers(0, CLASSES, (STEPS, BATCH)).astype(np.int32)
    return sgd_losses(model, list(zip(images, labels)), xla)


@pytest.mark.parametrize("xla", [False, True], ids=["xla-off", "xla-on"])
@pytest.mark.parametrize("policy", POLICIES)
def test_conv_model_trains_like_keras(policy, xla):
    """STEPS SGD steps of the tiny GroupNorm model, fused vs Keras: loss curves and every final
    weight within the compute dtype's rounding."""
    fused, reference = tiny_gn_model(policy), tiny_gn_model(policy)
    start = [w.numpy() for w in fused.weights]
    reference.set_weights(start)
    fused_layers = {path for path in fuse_normalization(fused).fused if "/conv" not in path}
    assert fused_layers == {"tiny/gn0", "tiny/gn1"}  # and float16's convolutions (tfmp.precision.conv)
    # The reference's float16 convolutions take their gradients as the fused model's do, as in
    # tests/test_fused_norm.py: TensorFlow's float16 Conv2DBackpropFilter on a CPU is itself off
    # by up to 4 float16 epsilons (vs float64), which the steps carry past GroupNorm's rounding.
    for layer in reference.layers:
        if policy == "mixed_float16" and isinstance(layer, keras.layers.Conv2D):
            layer.call = types.MethodType(conv.fused_call, layer)
    losses, reference_losses = _train(fused, xla), _train(reference, xla)
    compute = keras.mixed_precision.Policy(policy).compute_dtype
    terms = BATCH * IMAGE[0] * IMAGE[1] * 2  # a group statistic's or a weight gradient's terms, at most
    tolerance = dict(dtype=compute, terms=STEPS * terms, roundings=STEPS * 2 * 2)
    np.testing.assert_allclose(losses, reference_losses, rtol=relative_tolerance(**tolerance))
    for before, mine, theirs in zip(start, fused.weights, reference.weights):
        update = theirs.numpy() - before
        assert_close(mine.numpy() - before, update, **tolerance, what=mine.path)
        assert np.abs(update).max() > 0, f"{mine.path} did not change"


@pytest.mark.parametrize("xla", [False, True], ids=["xla-off", "xla-on"])
def test_mirrored_replicas_step_like_one_device(mirrored, xla):
    """One Engine step of the fused tiny model on 2 in-process replicas (each its half of the
    batch: group statistics are per example) moves every weight as one device does."""
    rng = np.random.default_rng(5)
    images = rng.normal(0.5, 1.0, (2 * BATCH, *IMAGE)).astype(np.float32)
    labels = rng.integers(0, CLASSES, 2 * BATCH).astype(np.int32)

    def build_engine(strategy):
        with strategy.scope():
            model = tiny_gn_model()
            assert len(fuse_normalization(model).fused) == 2
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
        return Engine(strategy, model, xla=xla)

    def batches(strategy):
        return replica_batches(strategy, (images, labels), 2 * BATCH)

    # A weight gradient sums the global batch's positions x 2 channels per group.
    assert_replicas_step_like_one_device(build_engine, batches, mirrored, 2 * BATCH * IMAGE[0] * IMAGE[1] * 2)


def test_retinanet_tiny_fuses_every_group_norm_and_predicts_like_keras():
    """The detector's 14 GroupNormalization layers (10 in the backbone, 2 per subnet, shared by
    the three pyramid levels, so called on three shapes) are fused; its float32 outputs are
    Keras' within float32 rounding."""
    model = retinanet.build_detector("retinanet_tiny", 64, num_classes=3)
    reference = retinanet.build_detector("retinanet_tiny", 64, num_classes=3)
    reference.set_weights(model.get_weights())
    result = fuse_normalization(model)
    norms = [layer for layer in model.layers if isinstance(layer, keras.layers.GroupNormalization)]
    assert len(result.fused) == len(norms) == 14 and result.left_alone == ()
    assert status(model).fused == result.fused
    images = np.random.default_rng(3).uniform(0, 1, (2, 64, 64, 3)).astype(np.float32)
    outputs, expected = model(images, training=True), reference(images, training=True)
    for key in ("classes", "boxes"):
        # Each of the ~12 layers between input and output may round once differently.
        assert_close(outputs[key], expected[key], "float32", terms=12 * 64 * 9, what=key)


class _OwnGroupNorm(keras.layers.GroupNormalization):
    def call(self, inputs):
        return super().call(inputs) * 2


def test_unfusable_group_norms_are_listed_with_their_reasons():
    inputs = keras.Input((4, 4, 8))
    x = keras.layers.GroupNormalization(2, name="fusable")(inputs)
    x = keras.layers.GroupNormalization(2, axis=1, name="channels_first")(x)
    x = keras.layers.GroupNormalization(2, dtype="float64", name="double")(x)
    x = _OwnGroupNorm(2, name="own")(x)
    result = fuse_normalization(keras.Model(inputs, x, name="model"))
    assert result.fused == ("model/fusable",)
    assert result.left_alone == (
        ("model/channels_first", "axis 1 (fused: the last axis, channels-last)"),
        ("model/double", "compute dtype float64"),
        ("model/own", "_OwnGroupNorm overrides call"),
    )
    unbuilt = fuse_normalization(
        keras.Sequential([keras.layers.GroupNormalization(2, name="gn")], name="seq")
    )
    assert unbuilt.left_alone == (("seq/gn", "not built: call or build the model first"),)


def test_saved_fused_model_loads_in_plain_keras(tmp_path):
    """A fused, trained GroupNorm model saved to .keras: the config.json of the unfused model,
    and a fresh process that imports only keras and numpy predicts what the fused model does."""
    from conftest import run_python

    model = tiny_gn_model()
    model.save(tmp_path / "unfused.keras")
    fuse_normalization(model)
    _train(model)
    images = np.random.default_rng(4).normal(0.5, 1.0, (BATCH, *IMAGE)).astype(np.float32)
    predictions = np.asarray(model(images, training=False))
    model.save(tmp_path / "fused.keras")
    config_json = [
        zipfile.ZipFile(tmp_path / f"{name}.keras").read("config.json") for name in ("unfused", "fused")
    ]
    assert config_json[0] == config_json[1]
    np.save(tmp_path / "images.npy", images)
    paths = [str(tmp_path / name) for name in ("fused.keras", "images.npy", "loaded.npy")]
    result = run_python(["-c", LOAD_WITHOUT_TFMP, *paths], cwd=str(tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded["tfmp"] == [] and "GroupNormalization" in loaded["classes"]
    assert_close(np.load(paths[2]), predictions, "float32", terms=2 * 72, what="predictions")
