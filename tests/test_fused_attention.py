"""fuse_normalization on MultiHeadAttention: tfmp.precision.attention computes Keras' numbers with
masks and causal masks, and its backward pass keeps half-precision probabilities.

    .venv/bin/python -m pytest tests/test_fused_attention.py -q -n 0

The fused encoder's training, 2-replica, 2-worker and plain-Keras-loading checks are in
tests/test_fused_layer_norm.py (its tiny encoder has LayerNormalization, MultiHeadAttention with
padding masks, and RMSNormalization). As there, every check compares with a Keras copy holding
identical weights, within epsilons of the compute dtype plus float32 epsilon x the summed terms.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from fused_scaffolding import assert_close  # noqa: E402

from tfmp.precision.fused_norm import fuse_normalization, is_fused  # noqa: E402

POLICIES = ["float32", "mixed_float16", "mixed_bfloat16"]
BATCH, QUERIES, KEYS, WIDTH, HEADS = 2, 5, 7, 8, 2
# (keys, attention_mask, use_causal_mask): self-attention unless keys differ from QUERIES.
MASKS = {
    "none": (KEYS, False, False),
    "padding": (KEYS, True, False),  # a random [B, T, S] mask with one query row masked everywhere
    "causal": (QUERIES, False, True),  # Keras' causal-only route (is_causal, no mask tensor)
    "causal-and-padding": (QUERIES, True, True),
}
# Each side rounds the probabilities, the logits' gradient, the einsum's and the projection's
# outputs in the compute dtype: 4 roundings each, and tfmp's gradient reads the probabilities
# rounded once more (Keras reads its float32 copy). The output alone has the same 4 roundings
# per side: over 40 random weight draws its error reached 3.3 single-rounding tolerances
# (mixed_float16, padding mask), so 2 roundings failed about one run in a few dozen.
FORWARD_ROUNDINGS = 2 * 4
ROUNDINGS = FORWARD_ROUNDINGS + 1


def _layer_pair(policy):
    """A fused MultiHeadAttention and a Keras copy with the same random weights (seeded, so a
    failure reproduces; the tolerances hold for any draw)."""
    keras.utils.set_random_seed(0)
    layers = [
        keras.layers.MultiHeadAttention(HEADS, WIDTH // HEADS, dtype=policy, name=f"mha{i}") for i in range(2)
    ]
    for layer in layers:
        layer.build((BATCH, QUERIES, WIDTH), (BATCH, KEYS, WIDTH))
    layers[1].set_weights(layers[0].get_weights())
    query, value = keras.Input((QUERIES, WIDTH)), keras.Input((KEYS, WIDTH))
    result = fuse_normalization(keras.Model([query, value], layers[0](query, value), name="pair"))
    assert result.fused == ("pair/mha0",) and not is_fused(layers[1])
    return layers


def _inputs(keys, masked, compute):
    rng = np.random.default_rng(1)
    query = tf.cast(rng.normal(0, 2, (BATCH, QUERIES, WIDTH)).astype(np.float32), compute)
    value = tf.cast(rng.normal(0, 2, (BATCH, keys, WIDTH)).astype(np.float32), compute)
    mask = None
    if masked:
        mask = rng.random((BATCH, QUERIES, keys)) > 0.3
        mask[0, 1] = False  # attends nowhere: Keras' softmax of equal fills is uniform
    upstream = rng.normal(0, 1, (BATCH, QUERIES, WIDTH)).astype(np.float32)
    return query, value, mask, upstream


def _weights(layer) -> list:
    """The layer's weights but the key bias: its gradient is zero in exact arithmetic (a softmax
    ignores a shift common to a row's logits), rounding noise on either side."""
    return [w for w in layer.trainable_weights if not w.path.endswith("key/bias")]


def _forward_backward(layer, xla, causal):
    @tf.function(jit_compile=xla)
    def run(query, value, mask, upstream):
        with tf.GradientTape() as tape:
            tape.watch([query, value])
            y = layer(query, value, attention_mask=mask, use_causal_mask=causal)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * upstream)
        return y, tape.gradient(loss, [query, value, *_weights(layer)])

    return run


@pytest.mark.parametrize("xla", [False, True], ids=["xla-off", "xla-on"])
@pytest.mark.parametrize("masks", MASKS)
@pytest.mark.parametrize("policy", POLICIES)
def test_attention_matches_keras(policy, masks, xla):
    """Output, query and value gradients and weight gradients of sum(output * upstream), with
    and without XLA, in each policy and mask: the output and input gradients in the compute dtype."""
    keys, masked, causal = MASKS[masks]
    fused, reference = _layer_pair(policy)
    compute = fused.compute_dtype
    query, value, mask, upstream = _inputs(keys, masked, compute)
    y, grads = _forward_backward(fused, xla, causal)(query, value, mask, upstream)
    y_ref, grads_ref = _forward_backward(reference, xla, causal)(query, value, mask, upstream)
    names = [w.path for w in _weights(fused)]
    assert y.dtype == y_ref.dtype == compute and grads[0].dtype == grads_ref[0].dtype == compute
    terms = keys * WIDTH  # the most terms an output or input gradient sums
    assert_close(y, y_ref, compute, terms=terms, roundings=FORWARD_ROUNDINGS, what="output")
    for mine, theirs, name in zip(grads, grads_ref, ["query", "value", *names]):
        assert_close(mine, theirs, compute, terms=BATCH * terms, roundings=ROUNDINGS, what=f"{name} gradient")


def test_returned_scores_are_keras_own():
    """`return_attention_scores=True` runs Keras' explicit path: the same outputs and scores."""
    fused, reference = _layer_pair("mixed_bfloat16")
    query, value, mask, _ = _inputs(KEYS, True, "bfloat16")
    mine = fused(query, value, attention_mask=mask, return_attention_scores=True)
    theirs = reference(query, value, attention_mask=mask, return_attention_scores=True)
    for a, b in zip(mine, theirs):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


class _OwnCall(keras.layers.MultiHeadAttention):
    def call(self, query, value, key=None, **kwargs):
        return super().call(query, value, key, **kwargs) * 2


class _OwnCore(keras.layers.MultiHeadAttention):
    def _compute_attention(self, *args, **kwargs):
        return super()._compute_attention(*args, **kwargs)


def test_unfusable_attention_is_listed_with_its_reason():
    tokens = keras.Input((4, 8))
    image = keras.Input((3, 3, 8))
    outputs = [
        keras.layers.MultiHeadAttention(2, 4, name="fusable")(tokens, tokens),
        keras.layers.MultiHeadAttention(2, 4, dropout=0.1, name="dropout")(tokens, tokens),
        keras.layers.MultiHeadAttention(2, 4, attention_axes=(1, 2), name="two_axes")(image, image),
        keras.layers.MultiHeadAttention(2, 4, dtype="float64", name="double")(tokens, tokens),
        _OwnCall(2, 4, name="own_call")(tokens, tokens),
        _OwnCore(2, 4, name="own_core")(tokens, tokens),
        keras.layers.GroupQueryAttention(4, 2, 1, name="grouped")(tokens, tokens),
    ]
    result = fuse_normalization(keras.Model([tokens, image], outputs, name="model"))
    explicit = "Keras' explicit path, whose softmax computes and keeps its probabilities in the compute dtype already"
    assert result.fused == ("model/fusable",)
    assert result.left_alone == (
        ("model/dropout", f"dropout 0.1: {explicit}"),
        ("model/two_axes", f"attention_axes (1, 2): {explicit}"),
        ("model/double", "compute dtype float64"),
        ("model/own_call", "_OwnCall overrides call without calling self._compute_attention"),
        ("model/own_core", "_OwnCore overrides _compute_attention"),
        (
            "model/grouped",
            "keras.src.layers.attention.grouped_query_attention.GroupedQueryAttention: not a layer tfmp fuses "
            "(its own computation)",
        ),
    )


# Bytes a forward pass leaves alive for its backward pass through DEPTH layers, Keras' vs fused, in
# bfloat16, in a process with TensorFlow's BFC CPU allocator (the only one that keeps the
# statistic), counted by the bench's own measure (`tfmp.bench.bn_study.kept_mb`: the forward as a
# tf.function called under a tape returns the intermediates its gradient needs, so what stays
# alive after the call is what the backward pass keeps, whatever order the ops ran in).
MEMORY_SCRIPT = """
import json, os, sys
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
sys.path.insert(0, os.getcwd())
import keras, tensorflow as tf
from tfmp.bench.bn_study import kept_mb
from tfmp.precision.fused_norm import fuse_normalization
DEPTH, BATCH, TOKENS, WIDTH = 4, 8, 64, 64

def kept(kind, fused):
    keras.utils.set_random_seed(0)
    x = inputs = keras.Input((TOKENS, WIDTH))
    for _ in range(DEPTH):
        if kind == "attention":
            x = keras.layers.MultiHeadAttention(4, WIDTH // 4, dtype="mixed_bfloat16")(x, x)
        else:
            x = keras.layers.LayerNormalization(dtype="mixed_bfloat16")(x)
    model = keras.Model(inputs, x)
    if fused:
        assert len(fuse_normalization(model).fused) == DEPTH
    forward = tf.function(lambda data: model(data, training=True))
    return kept_mb(forward, tf.random.normal((BATCH, TOKENS, WIDTH))) * 2**20

print(json.dumps({kind: [kept(kind, False), kept(kind, True)] for kind in sys.argv[1:]}))
"""


def measured_kept_bytes(*kinds) -> dict:
    """{kind: [bytes Keras' layers keep, bytes the fused layers keep]}, from a fresh process (see
    MEMORY_SCRIPT)."""
    from conftest import run_python

    result = run_python(["-c", MEMORY_SCRIPT, *kinds], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_backward_keeps_half_precision_activations():
    """In bfloat16, 4 fused attention layers keep at least one float32 (batch, heads, T, T)
    tensor per layer less for their backward pass than Keras' (which keeps its float32
    probabilities), and 4 fused LayerNormalization layers at least one float32 (batch, T, width)
    tensor less per layer after the first (Keras keeps float32 copies of each normalised input; the
    first layer's input is the model's float32 data, which both normalise in float32). About 6 s:
    one TensorFlow start."""
    kept = measured_kept_bytes("attention", "layer")
    float32_probabilities, float32_activation = 8 * 4 * 64 * 64 * 4, 8 * 64 * 64 * 4
    keras_kept, fused_kept = kept["attention"]
    assert fused_kept <= keras_kept - 4 * float32_probabilities, kept
    keras_kept, fused_kept = kept["layer"]
    assert fused_kept <= keras_kept - (4 - 1) * float32_activation, kept
