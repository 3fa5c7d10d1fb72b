"""fuse_normalization on LayerNormalization and RMSNormalization: tfmp.precision.layer_norm computes
Keras' numbers; a tiny transformer encoder (LayerNormalization, MultiHeadAttention, RMSNormalization)
fused trains like Keras' on one device, 2 in-process replicas and 2 launched workers.

    .venv/bin/python -m pytest tests/test_fused_layer_norm.py -q -n 0

As tests/test_fused_norm.py does for BatchNormalization, every check compares a fused layer or
model with a Keras copy holding identical weights: within epsilons of the compute dtype (each
side rounds) plus float32 epsilon x the summed terms, times the values' scale.
"""

import json
import os
import sys
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
    assert_replicas_identical,
    engine_step,
    forward_backward,
    launched_cell,
    layer_pair,
    print_worker_cell,
    relative_tolerance,
    sgd_losses,
)
from rounding import assert_same_update  # noqa: E402

from tfmp.precision import layer_norm  # noqa: E402
from tfmp.precision.fused_norm import fuse_normalization, status, unfused  # noqa: E402

POLICIES = ["float32", "mixed_float16", "mixed_bfloat16"]
# (class, input shape, config): the normalised axes are always the trailing ones.
VARIANTS = {
    "layer-defaults": (keras.layers.LayerNormalization, (3, 5, 8), {}),
    "layer-two-axes-no-center": (
        keras.layers.LayerNormalization,
        (2, 3, 4, 6),
        {"axis": [2, 3], "center": False},
    ),
    "layer-no-scale": (keras.layers.LayerNormalization, (4, 16), {"scale": False, "epsilon": 1e-5}),
    "layer-rms-scaling": (keras.layers.LayerNormalization, (3, 5, 8), {"rms_scaling": True, "epsilon": 1e-2}),
    "rms-defaults": (keras.layers.RMSNormalization, (3, 5, 8), {}),
    "rms-two-axes": (keras.layers.RMSNormalization, (2, 3, 4, 6), {"axis": [-2, -1], "epsilon": 1e-3}),
    # 65,536 elements: the XLA-compiled kernels (smaller inputs run the same ops one by one).
    "layer-compiled": (keras.layers.LayerNormalization, (4, 64, 256), {}),
}
TOKENS, VOCABULARY, WIDTH, HEADS, CLASSES, BATCH, STEPS = 6, 11, 16, 2, 3, 4, 3


def _layer_pair(policy, cls, shape, config):
    """A fused layer and a Keras copy with the same random weights (scales in 0.5..2)."""
    return layer_pair(
        lambda: cls(dtype=policy, **config),
        shape,
        lambda w, rng: rng.uniform(0.5, 2, w.shape) if "beta" not in w.name else rng.normal(0, 1, w.shape),
    )


@pytest.mark.parametrize("xla", [False, True], ids=["xla-off", "xla-on"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("policy", POLICIES)
def test_layer_matches_keras(policy, variant, xla):
    """Output, input gradient and weight gradients of sum(output * upstream), with and without
    XLA, in each policy: the output and the input gradient in the compute dtype."""
    cls, shape, config = VARIANTS[variant]
    fused, reference = _layer_pair(policy, cls, shape, config)
    compute = fused.compute_dtype
    rng = np.random.default_rng(1)
    x = tf.cast(rng.normal(1.0, 3.0, shape).astype(np.float32), compute)  # what a dense layer hands it
    upstream = rng.normal(0, 1, shape).astype(np.float32)
    y, grads = forward_backward(fused, xla)(x, upstream)
    y_ref, grads_ref = forward_backward(reference, xla)(x, upstream)
    assert y.dtype == y_ref.dtype == compute and grads[0].dtype == grads_ref[0].dtype == compute
    features = int(np.prod([shape[axis] for axis in fused.axis]))  # the terms each row statistic sums
    assert_close(y, y_ref, compute, terms=features, what="output")
    assert_close(grads[0], grads_ref[0], compute, terms=features, what="input gradient")
    # Weight gradients: float32 sums over the rows of terms each at most |upstream| x |normalised
    # input| (<= sqrt(features)); the normalised input rounds once in the compute dtype on Keras' side.
    rows = int(np.prod(shape)) // features
    scale = np.abs(upstream).reshape(rows, features).sum(0).max() * np.sqrt(features)
    assert (
        len(grads) == 1 + len(fused.trainable_weights)
        and len(fused.trainable_weights) > 0
        or "no-scale" in variant
    )
    for mine, theirs, weight in zip(grads[1:], grads_ref[1:], fused.trainable_weights):
        assert_close(mine, theirs, compute, terms=rows * features, scale=scale, what=weight.name)


def test_a_float32_input_in_a_mixed_policy_is_normalised_in_float32():
    """LayerNormalization does not autocast: Keras normalises a float32 input in float32 and
    returns the compute dtype; so does the fused layer."""
    fused, reference = _layer_pair("mixed_bfloat16", keras.layers.LayerNormalization, (3, 8), {})
    x = np.random.default_rng(2).normal(0, 1, (3, 8)).astype(np.float32)
    y, y_ref = fused(x), reference(x)
    assert y.dtype == y_ref.dtype == "bfloat16"
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))


class _OwnLayerNorm(keras.layers.LayerNormalization):
    def call(self, inputs):
        return super().call(inputs) * 2


class _HubStyleRMSNorm(keras.layers.Layer):
    """Like keras-hub's own RMSNormalization: a plain Layer, not Keras' class."""

    def build(self, input_shape):
        self.scale = self.add_weight(name="scale", shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        return x * tf.math.rsqrt(tf.reduce_mean(x * x, -1, keepdims=True) + 1e-6) * self.scale


def test_unfusable_layer_norms_are_listed_with_their_reasons():
    inputs = keras.Input((4, 6))
    x = keras.layers.LayerNormalization(name="fusable")(inputs)
    x = keras.layers.LayerNormalization(axis=1, name="tokens_axis")(x)
    x = keras.layers.LayerNormalization(dtype="float64", name="double")(x)
    x = _OwnLayerNorm(name="own")(x)
    x = keras.layers.RMSNormalization(axis=[1, 2], name="rms_all")(x)
    x = _HubStyleRMSNorm(name="hub_rms")(x)
    x = keras.layers.UnitNormalization(name="unit")(x)
    model = keras.Model(inputs, x, name="model")
    result = fuse_normalization(model)
    assert result.fused == ("model/fusable", "model/rms_all")
    assert result.left_alone == (
        ("model/tokens_axis", "axis [1] (fused: the trailing axes of the input)"),
        ("model/double", "compute dtype float64"),
        ("model/own", "_OwnLayerNorm overrides call"),
        (
            "model/hub_rms",
            "test_fused_layer_norm._HubStyleRMSNorm: not a layer tfmp fuses (its own computation)",
        ),
        (
            "model/unit",
            "keras.src.layers.normalization.unit_normalization.UnitNormalization: not a layer tfmp fuses "
            "(its own computation)",
        ),
    )
    assert status(model) == result and unfused(model) == ()
    unbuilt = fuse_normalization(keras.Sequential([keras.layers.LayerNormalization(name="ln")], name="seq"))
    assert unbuilt.left_alone == (("seq/ln", "not built: call or build the model first"),)


def test_keras_hub_normalization_subclasses_are_named():
    """keras-hub's BertBackbone (when keras_hub is installed): its 3 LayerNormalization (Keras'
    own) and its Dense(gelu_approximate) fused, its attention (dropout 0.1) left alone with the
    reason, none silently skipped (tests/test_keras_hub.py checks keras-hub's models in full)."""
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=20,
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=8,
    )
    state = fuse_normalization(backbone)
    # 3 LayerNormalization and the GELU Dense fused (tfmp.precision.activation), 1 attention left alone
    assert len(state.fused) == 4 and len(state.left_alone) == 1, state
    assert all(reason for _, reason in state.left_alone) and status(backbone) == state


def tiny_encoder(policy="float32", seed=1, causal=False) -> keras.Model:
    """Token embedding (0 pads: a Keras mask) -> LayerNormalization-pre-norm self-attention block
    -> RMSNormalization-pre-norm GELU MLP block -> LayerNormalization -> masked mean -> a float32
    Dense head (logits); seeded weights."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((TOKENS,), dtype="int32")
    x = keras.layers.Embedding(VOCABULARY, WIDTH, mask_zero=True, dtype=policy, name="embed")(tokens)
    h = keras.layers.LayerNormalization(epsilon=1e-5, dtype=policy, name="ln0")(x)
    h = keras.layers.MultiHeadAttention(HEADS, WIDTH // HEADS, dtype=policy, name="mha")(
        h, h, use_causal_mask=causal
    )
    x = keras.layers.Add(dtype=policy)([x, h])
    h = keras.layers.RMSNormalization(dtype=policy, name="rms")(x)  # passes no mask on: the Add keeps x's
    h = keras.layers.Dense(2 * WIDTH, activation="gelu", dtype=policy, name="mlp0")(h)
    x = keras.layers.Add(dtype=policy)([x, keras.layers.Dense(WIDTH, dtype=policy, name="mlp1")(h)])
    x = keras.layers.LayerNormalization(dtype=policy, name="ln1")(x)
    x = keras.layers.GlobalAveragePooling1D(dtype=policy)(x)
    return keras.Model(tokens, keras.layers.Dense(CLASSES, dtype="float32", name="head")(x), name="encoder")


FUSED = ("encoder/ln0", "encoder/mha", "encoder/rms", "encoder/mlp0", "encoder/ln1")  # mlp0: its GELU


def tiny_tokens(examples=BATCH * STEPS, seed=2):
    """Tokens 1..10 with the last 0-2 positions of each row padding (0); labels 0..2."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCABULARY, (examples, TOKENS)).astype(np.int32)
    for row, pad in enumerate(rng.integers(0, 3, examples)):
        tokens[row, TOKENS - pad :] = 0
    return tokens, rng.integers(0, CLASSES, examples).astype(np.int32)


def _train(model, xla=False):
    """Per-step losses of STEPS plain SGD steps (a tf.function step, XLA on or off)."""
    tokens, labels = tiny_tokens()
    rows = [slice(i * BATCH, (i + 1) * BATCH) for i in range(STEPS)]
    return sgd_losses(model, [(tokens[step], labels[step]) for step in rows], xla)


def _comparable(weights) -> list:
    """All but the attention's key bias, whose gradient is zero in exact arithmetic (a softmax
    ignores a shift common to a row's logits, which is all q . b_key adds): what each side
    computes for it is rounding noise, with no scale to compare it against."""
    return [weight for weight in weights if not weight.path.endswith("mha/key/bias")]


# Per step, the outputs may round once differently on each side, forward and backward (measured:
# at most 2.4 epsilons in half precision); sums of at most BATCH x TOKENS x 2 WIDTH terms.
ENCODER_ROUNDINGS, ENCODER_TERMS = 2 * 2, BATCH * TOKENS * 2 * WIDTH


@pytest.mark.parametrize("xla", [False, True], ids=["xla-off", "xla-on"])
@pytest.mark.parametrize("policy", POLICIES)
def test_encoder_trains_like_keras(policy, xla):
    """STEPS SGD steps of the tiny encoder, fused vs Keras: loss curves and every final weight
    within the compute dtype's rounding."""
    fused, reference = tiny_encoder(policy), tiny_encoder(policy)
    start = [w.numpy() for w in fused.weights]
    reference.set_weights(start)
    result = fuse_normalization(fused)
    assert result.fused == FUSED and result.left_alone == ()
    losses, reference_losses = _train(fused, xla), _train(reference, xla)
    compute = keras.mixed_precision.Policy(policy).compute_dtype
    tolerance = dict(dtype=compute, terms=STEPS * ENCODER_TERMS, roundings=STEPS * ENCODER_ROUNDINGS)
    np.testing.assert_allclose(losses, reference_losses, rtol=relative_tolerance(**tolerance))
    paths = {weight.path for weight in _comparable(fused.weights)}
    comparable = [index for index, weight in enumerate(fused.weights) if weight.path in paths]
    for index in comparable:
        before, mine, theirs = start[index], fused.weights[index], reference.weights[index]
        update = theirs.numpy() - before
        assert_close(mine.numpy() - before, update, **tolerance, what=mine.path)
        assert np.abs(update).max() > 0, f"{mine.path} did not change"


def _engine_step(strategy, fused, xla=False):
    """(comparable weights before, the model) around one Engine step of the tiny encoder on
    `strategy`, each replica its shard of the same global batch."""

    def build():
        model = tiny_encoder()
        if fused:
            assert fuse_normalization(model).fused == FUSED
        return model

    watched = lambda model: _comparable(model.trainable_weights)  # noqa: E731
    return engine_step(strategy, build, tiny_tokens(2 * BATCH), 2 * BATCH, xla=xla, watched=watched)


@pytest.fixture(scope="module")
def one_device_keras():
    """Keras' own layers, one Engine step on one device: (weights before, weights after)."""
    before, model = _engine_step(tf.distribute.OneDeviceStrategy("/cpu:0"), fused=False)
    return before, [w.numpy() for w in _comparable(model.trainable_weights)]


# A weight gradient sums the global batch's tokens x the widest layer's units.
SUMMED_TERMS = 2 * BATCH * TOKENS * 2 * WIDTH


@pytest.mark.parametrize("xla", [False, True], ids=["xla-off", "xla-on"])
def test_mirrored_replicas_identical_and_like_one_device(mirrored, one_device_keras, xla):
    """The fused encoder on 2 in-process replicas: every replica's copy of every variable
    identical, and each weight moved as Keras' layers move it on one device."""
    _, model = _engine_step(mirrored, fused=True, xla=xla)
    assert_replicas_identical(model)
    before, reference = one_device_keras
    assert_same_update(
        before, reference, [w.numpy() for w in _comparable(model.trainable_weights)], SUMMED_TERMS
    )


def worker_cells(strategy, out_dir):
    """The launched group's cell (tests/mwms_worker.py): one fused Engine step of the tiny encoder
    on this strategy, its weights to `out_dir`/fused_transformer-<task>.npz and one JSON line."""
    _, model = _engine_step(strategy, fused=True)
    weights = [w.numpy() for w in _comparable(model.trainable_weights)]
    print_worker_cell(strategy, "fused_transformer", out_dir, weights, fused=list(status(model).fused))


@pytest.mark.slow
def test_two_workers_identical_and_like_one_device(launched_workers, one_device_keras):
    """The shared launched group's 2 workers (one replica each, each its shard of the batch) end
    the fused encoder's step with identical weights, Keras' one-device step's within rounding."""
    records, weights = launched_cell(launched_workers, "fused_transformer")
    assert all(tuple(record["fused"]) == FUSED for record in records), records
    before, reference = one_device_keras
    assert_same_update(before, reference, weights, SUMMED_TERMS)


def test_saved_fused_encoder_loads_in_plain_keras(tmp_path):
    """A fused, trained encoder saved to .keras: the config.json of the unfused model, and a
    fresh process that imports only keras and numpy predicts what the fused model does."""
    from conftest import run_python

    model = tiny_encoder("mixed_bfloat16")
    model.save(tmp_path / "unfused.keras")
    config = model.get_config()
    fuse_normalization(model)
    assert model.get_config() == config
    _train(model)
    tokens, _ = tiny_tokens(BATCH, seed=4)
    predictions = np.asarray(model(tokens, training=False))
    model.save(tmp_path / "fused.keras")
    config_json = [
        zipfile.ZipFile(tmp_path / f"{name}.keras").read("config.json") for name in ("unfused", "fused")
    ]
    assert config_json[0] == config_json[1]
    np.save(tmp_path / "tokens.npy", tokens)
    paths = [str(tmp_path / name) for name in ("fused.keras", "tokens.npy", "loaded.npy")]
    result = run_python(["-c", LOAD_WITHOUT_TFMP, *paths], cwd=str(tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded["tfmp"] == [] and {"LayerNormalization", "MultiHeadAttention", "RMSNormalization"} <= set(
        loaded["classes"]
    )
    # Each of the 4 fused layers' outputs may round once differently on each side.
    assert_close(np.load(paths[2]), predictions, "bfloat16", terms=ENCODER_TERMS, roundings=2 * 4)


def test_small_inputs_skip_xla_and_large_ones_compile():
    assert not layer_norm.compiled(tf.zeros([4, 64, 255]))
    assert layer_norm.compiled(tf.zeros([4, 64, 256]))
