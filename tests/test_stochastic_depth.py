"""tfmp.models.stochastic_depth.StochasticDepth: per-example drops in training with the expected
sum kept, exactly the plain add (and no random op) at inference, the rate's range, a config and
.keras round trip, half-precision dtypes, and independent masks on mirrored replicas.

The model-level checks (a ViT trained under MirroredStrategy and XLA, exported) are in
tests/test_vit.py. Everything here runs in a few seconds.
"""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmp.models.stochastic_depth import StochasticDepth

RATE = 0.25
EXAMPLES = 4000
# A deviation beyond this many standard errors has probability < 6e-7 under the binomial model.
STANDARD_ERRORS = 5.0


def random_pair(examples=EXAMPLES, seed=0, shape=(3, 2)):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(examples, *shape)).astype(np.float32), rng.normal(size=(examples, *shape)).astype(
        np.float32
    )


def op_types(function, *specs) -> set[str]:
    """The op types of `function`'s traced graph, nested functions' included."""
    graph = tf.function(function).get_concrete_function(*specs).graph
    types = {op.type for op in graph.get_operations()}
    return types | {
        node.op for function in graph.as_graph_def().library.function for node in function.node_def
    }


def random_op_types(function, *specs) -> set[str]:
    """The op types of `function`'s traced graph that draw random numbers: what a deterministic
    inference graph must not hold."""
    return {kind for kind in op_types(function, *specs) if "Random" in kind}


def test_each_example_keeps_its_scaled_residual_or_only_its_shortcut():
    shortcut, residual = random_pair()
    output = StochasticDepth(RATE, seed=1)([shortcut, residual], training=True).numpy()
    kept = np.isclose(output, shortcut + residual / (1 - RATE), rtol=1e-6, atol=1e-6).all(axis=(1, 2))
    dropped = (output == shortcut).all(axis=(1, 2))
    assert (kept ^ dropped).all()  # every example is one or the other, as a whole
    standard_error = math.sqrt(RATE * (1 - RATE) / EXAMPLES)
    assert abs(dropped.mean() - RATE) < STANDARD_ERRORS * standard_error, dropped.mean()


def test_the_mean_over_examples_is_the_plain_sum():
    # The same pair in every example: the mean output is shortcut + residual * kept / (1 - rate),
    # whose standard error is |residual| * sqrt(rate / ((1 - rate) * examples)).
    shortcut = np.tile(np.float32([[1.0, -2.0]]), (EXAMPLES, 1))
    residual = np.tile(np.float32([[3.0, 0.5]]), (EXAMPLES, 1))
    output = StochasticDepth(RATE, seed=2)([shortcut, residual], training=True).numpy()
    standard_error = np.abs(residual[0]) * math.sqrt(RATE / ((1 - RATE) * EXAMPLES))
    deviation = np.abs(output.mean(axis=0) - (shortcut[0] + residual[0]))
    assert (deviation < STANDARD_ERRORS * standard_error).all(), (deviation, standard_error)


@pytest.mark.parametrize("training", [False, None])
def test_inference_is_exactly_the_plain_add_with_no_random_op(training):
    shortcut, residual = random_pair(64)
    layer = StochasticDepth(0.5, seed=3)
    np.testing.assert_array_equal(layer([shortcut, residual], training=training), shortcut + residual)
    spec = tf.TensorSpec((None, 3, 2), tf.float32)
    inference = op_types(lambda a, b: layer([a, b], training=training), spec, spec)
    assert not {kind for kind in inference if "Random" in kind or "Variable" in kind}, inference
    # The check sees the draw when there is one.
    assert random_op_types(lambda a, b: layer([a, b], training=True), spec, spec)


def test_rate_zero_is_a_plain_add_in_training_too():
    shortcut, residual = random_pair(64)
    layer = StochasticDepth(0.0)
    np.testing.assert_array_equal(layer([shortcut, residual], training=True), shortcut + residual)
    assert layer.variables == []  # no seed state: nothing is ever drawn


@pytest.mark.parametrize("rate", [1.0, -0.1, float("nan"), "0.1", True])
def test_rates_outside_zero_to_one_are_refused(rate):
    with pytest.raises(ValueError, match=r"must be in \[0, 1\)"):
        StochasticDepth(rate)


def test_same_seed_same_masks_and_each_call_draws_anew():
    shortcut, residual = np.zeros((256, 1), np.float32), np.ones((256, 1), np.float32)
    first, second = StochasticDepth(0.5, seed=7), StochasticDepth(0.5, seed=7)
    one, again = (first([shortcut, residual], training=True) for _ in range(2))
    np.testing.assert_array_equal(second([shortcut, residual], training=True), one)
    assert not np.array_equal(one, again)


def test_config_and_keras_file_round_trip(tmp_path):
    layer = StochasticDepth(0.3, seed=5, name="block_add1")
    config = keras.saving.serialize_keras_object(layer)
    assert config["registered_name"] == "tfmp>StochasticDepth"
    copy = keras.saving.deserialize_keras_object(config)
    assert (type(copy), copy.rate, copy.seed, copy.name) == (StochasticDepth, 0.3, 5, "block_add1")
    inputs = [keras.Input((4,)), keras.Input((4,))]
    model = keras.Model(inputs, layer(inputs))
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras").get_layer("block_add1")
    assert (type(loaded), loaded.rate, loaded.seed) == (StochasticDepth, 0.3, 5)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_half_precision_policies_compute_in_their_dtype(policy):
    shortcut, residual = random_pair(512)
    layer = StochasticDepth(RATE, seed=4, dtype=policy)
    compute = keras.DTypePolicy(policy).compute_dtype
    output = layer([shortcut, residual], training=True)
    assert output.dtype == compute and layer([shortcut, residual]).dtype == compute
    half_shortcut, half_residual = (tf.cast(value, compute) for value in (shortcut, residual))
    # Kept: the residual times 1 / (1 - rate) rounded to the dtype once, as Keras' dropout scales.
    scale = tf.cast(1 / (1 - RATE), compute)
    kept = (output == half_shortcut + half_residual * scale).numpy().all(axis=(1, 2))
    dropped = (output == half_shortcut).numpy().all(axis=(1, 2))
    assert (kept | dropped).all() and 0 < dropped.mean() < 1


def test_mirrored_replicas_draw_their_own_masks_from_one_shared_state(mirrored):
    with mirrored.scope():
        layer = StochasticDepth(0.5, seed=6)
    ones = mirrored.experimental_distribute_values_from_function(lambda context: tf.ones((64, 1)))
    zeros = mirrored.experimental_distribute_values_from_function(lambda context: tf.zeros((64, 1)))
    step = tf.function(lambda a, b: mirrored.run(lambda x, y: layer([x, y], training=True), args=(a, b)))
    first, second = (replica.numpy() for replica in step(zeros, ones).values)
    # Identical inputs: equal masks would mean the replicas' examples are dropped together.
    assert not np.array_equal(first, second)
    states = [copy.numpy() for copy in layer.seed_generator.state.value.values]
    np.testing.assert_array_equal(states[0], states[1])
    np.testing.assert_array_equal(states[0], [6, 1])  # one draw: the state moved once, alike
