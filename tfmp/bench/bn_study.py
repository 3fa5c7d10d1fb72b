"""One normalization or attention layer alone: Keras' layer against the fused one, forward + backward.

    from tfmp.bench import bn_study
    result = bn_study.measure("mixed_bfloat16", shape=[64, 48, 48, 64], rounds=20)
    result["value"]      # fused / Keras seconds per call: the median of the rounds' ratios
    bn_study.measure("mixed_bfloat16", shape=[8, 64, 64, 64], rounds=20, groups=32)  # GroupNorm
    bn_study.measure("mixed_bfloat16", shape=[64, 65, 192], rounds=20, layer="LayerNormalization")
    bn_study.measure("mixed_bfloat16", shape=[64, 65, 192], rounds=20, layer="MultiHeadAttention", heads=3)
    bn_study.measure("mixed_bfloat16", shape=[64, 65, 768], rounds=20, layer="GELU")   # or "DenseGELU"

Runs in a cell process of its own, one per policy and layer (`python -m apps.bench --bn_study`
plans `{"kind": "bn_study", "precision": ..., "shape": [...], "rounds": N}` for float32,
mixed_bfloat16 and mixed_float16, and one more per `--bn_study_layers` entry with
`"layer": ...` (and `"heads": H` for attention); a cell with "groups": G studies
GroupNormalization(G) instead of BatchNormalization: `python -m tfmp.bench.cell '{...,
"groups": 32}'`). Two layers of the policy (Keras' defaults otherwise; ViT's epsilon 1e-6 for
LayerNormalization and RMSNormalization), one left as Keras computes it and one put on tfmp's
kernels by `tfmp.precision.fuse_normalization` (FusedBatchNormV3, `tfmp.precision.group_norm`,
`layer_norm` or `attention`), each in a `tf.function` of one training-mode forward and the
gradients with respect to the input and every weight (a fixed random upstream gradient, so the
backward pass is a real one), on the same input in the policy's compute dtype: what the layer
before hands the normalization inside a mixed-precision model. BatchNormalization and
GroupNormalization take a 4-D (batch, height, width, channels) input; LayerNormalization,
RMSNormalization (over the last axis), MultiHeadAttention (self-attention, `heads` heads of
width / heads, no mask), GELU (`Activation("gelu")`) and DenseGELU (`Dense(width,
activation="gelu")`, `tfmp.precision.activation`) a 3-D (batch, tokens, width) one.

The two are timed in turn, in one process: each round times `calls` calls of one function,
then of the other (the order alternates from round to round), so what the shared machine does
meanwhile falls on both alike; `value` is the median of the rounds' fused / Keras ratios. The
allocator's live peak of one call of each (reset just before it) is reported beside: the
inputs are live in both, the difference is what each computation holds at once. That peak is a
moment, and which intermediates meet in it depends on the order the executor ran the ops in; so
beside it is what each layer keeps for its backward pass (`*_kept_mb`): the forward alone as a
`tf.function` called under a tape, which TensorFlow rewrites to return the intermediates its
gradient needs, so the bytes alive after the call (the output included) are those, whatever the
order. It is what a model holds per layer between its forward and backward passes, the memory a
deeper model multiplies.
"""

from __future__ import annotations

import math
import statistics
import time

import keras
import tensorflow as tf

from tfmp import precision
from tfmp.bench import live_memory
from tfmp.bench.studies import ATTENTION, BATCH_NORMALIZATION, DENSE_GELU, GELU, study_layer_name

MIN_TIMING_SECONDS = 0.2  # one timed batch of calls: well above timer and dispatch noise
WARMUP_CALLS = 2  # the first call traces
SEQUENCE_EPSILON = 1e-6  # ViT's and DeiT's (tfmp.models.vit), as the ViT study shapes are


def _make_layer(layer: str, policy: str, shape: list[int], groups: int, heads: int):
    if layer == ATTENTION:
        return keras.layers.MultiHeadAttention(heads, key_dim=shape[-1] // heads, dtype=policy)
    if layer == GELU:
        return keras.layers.Activation("gelu", dtype=policy)
    if layer == DENSE_GELU:  # width -> width: the output is the input's shape, as the upstream
        return keras.layers.Dense(shape[-1], activation="gelu", dtype=policy)
    if layer in ("LayerNormalization", "RMSNormalization"):
        return getattr(keras.layers, layer)(epsilon=SEQUENCE_EPSILON, dtype=policy)
    if groups:
        return keras.layers.GroupNormalization(groups, dtype=policy)
    return keras.layers.BatchNormalization(dtype=policy)


def _forward_backward(
    policy: str,
    shape: list[int],
    fused: bool,
    groups: int = 0,
    layer: str = BATCH_NORMALIZATION,
    heads: int = 0,
):
    """Two tf.functions of one layer: its training forward and its gradients (input and weights),
    and its training forward alone."""
    study_layer = _make_layer(layer, policy, shape, groups, heads)

    def apply(inputs, **kwargs):  # attention attends over its own input (self-attention)
        return study_layer(inputs, inputs, **kwargs) if layer == ATTENTION else study_layer(inputs, **kwargs)

    inputs = keras.Input(shape=tuple(shape[1:]))
    model = keras.Model(inputs, apply(inputs))  # builds the layer for this shape
    if fused:
        assert precision.fuse_normalization(model).fused, "the study's layer was not fused"

    @tf.function
    def step(images, upstream):
        with tf.GradientTape() as tape:
            tape.watch(images)
            outputs = apply(images, training=True)
            loss = tf.reduce_sum(tf.cast(outputs, tf.float32) * upstream)
        gradients = tape.gradient(loss, [images, *study_layer.trainable_variables])
        # One scalar that needs every gradient: fetching it waits for the whole backward pass.
        return tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32)) for g in gradients])

    return step, tf.function(lambda images: apply(images, training=True))


def _live_peak_mb(step, arguments) -> float:
    live_memory.reset()
    step(*arguments).numpy()
    return live_memory.peak_mb()


def kept_mb(forward, inputs) -> float:
    """MiB alive after `forward(inputs)` (a `tf.function`) under a tape: what its backward pass
    keeps (see above), for a layer or a chain of them.

        kept_mb(tf.function(lambda x: model(x, training=True)), data)
    """
    for _ in range(2):  # the first call traces the forward with its gradient's side outputs
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            before = live_memory.current_bytes()
            outputs = forward(inputs)
            kept = live_memory.current_bytes() - before
        del tape, outputs
    return kept / 2**20


def _seconds(step, arguments, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        result = step(*arguments)
    result.numpy()
    return (time.perf_counter() - started) / calls


def measure(
    policy: str,
    shape: list[int],
    rounds: int,
    groups: int = 0,
    layer: str = BATCH_NORMALIZATION,
    heads: int = 0,
) -> dict:
    """Keras' and the fused layer's ms per forward + backward, timed in turn, and their peaks."""
    policy = precision.resolve(policy).policy
    compute_dtype = keras.dtype_policies.get(policy).compute_dtype
    tf.random.set_seed(0)
    images = tf.cast(tf.random.normal(shape), compute_dtype)
    upstream = tf.random.normal(shape)
    arguments = (images, upstream)
    functions = {
        "keras": _forward_backward(policy, shape, False, groups, layer, heads),
        "fused": _forward_backward(policy, shape, True, groups, layer, heads),
    }
    steps = {name: step for name, (step, _) in functions.items()}
    for step in steps.values():
        _seconds(step, arguments, WARMUP_CALLS)
    peaks = {name: _live_peak_mb(step, arguments) for name, step in steps.items()}
    kept = {name: kept_mb(forward, images) for name, (_, forward) in functions.items()}
    slowest = max(_seconds(step, arguments, 1) for step in steps.values())
    calls = max(1, math.ceil(MIN_TIMING_SECONDS / max(slowest, 1e-6)))
    times = {"keras": [], "fused": []}
    for index in range(rounds):
        for name in ("keras", "fused") if index % 2 == 0 else ("fused", "keras"):
            times[name].append(1000 * _seconds(steps[name], arguments, calls))
    ratios = [fused / keras for fused, keras in zip(times["fused"], times["keras"])]
    return {
        "policy": policy,
        "layer": study_layer_name(layer, groups, heads),
        "compute_dtype": compute_dtype,
        "shape": list(shape),
        "rounds": rounds,
        "calls_per_round": calls,
        "keras_ms": statistics.median(times["keras"]),
        "fused_ms": statistics.median(times["fused"]),
        "keras_ms_rounds": times["keras"],
        "fused_ms_rounds": times["fused"],
        "ratios": ratios,
        "value": statistics.median(ratios),
        "keras_peak_memory_mb": peaks["keras"],
        "fused_peak_memory_mb": peaks["fused"],
        "keras_kept_mb": kept["keras"],
        "fused_kept_mb": kept["fused"],
        "peak_memory_source": live_memory.source(),
    }
