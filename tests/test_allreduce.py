"""tfmp.distribute.allreduce: gradients summed in float32, bfloat16 or float16, in buckets.

Replicas are the two logical CPUs of conftest's `mirrored`; the 2-worker cells (a float16 sum
whose worker-1 gradients overflow) run in the shared launched group (tests/mwms_worker.py,
checked in tests/test_matrix.py).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmp import precision
from tfmp.distribute import allreduce
from tfmp.errors import UsageError
from tfmp.training import run_card
from tfmp.training.engine import Engine


def test_auto_sums_in_bfloat16_only_under_mixed_bfloat16():
    assert allreduce.resolve("auto", "mixed_bfloat16", False, 2).dtype == "bfloat16"
    assert allreduce.resolve("auto", "mixed_float16", True, 2).dtype == "float32"
    assert allreduce.resolve("auto", "float32", False, 2).dtype == "float32"
    assert allreduce.resolve("bfloat16", "float32", False, 1).dtype == "float32"  # one replica: no sum
    assert allreduce.resolve("float16", "mixed_float16", True, 8).dtype == "float16"


@pytest.mark.parametrize(
    "requested, policy, loss_scaling, bucket_bytes, message",
    [
        ("half", "float32", False, 0, "--allreduce_dtype value 'half'"),
        ("float16", "float32", False, 0, "without loss scaling"),
        ("float16", "mixed_bfloat16", False, 0, "without loss scaling"),
        ("float32", "float32", False, -1, "--allreduce_bucket_bytes=-1"),
    ],
)
def test_bad_choices_are_one_line_naming_the_value_and_the_fix(
    requested, policy, loss_scaling, bucket_bytes, message
):
    with pytest.raises(UsageError, match=message) as raised:
        allreduce.resolve(requested, policy, loss_scaling, 2, bucket_bytes)
    assert "\n" not in str(raised.value)


def test_buckets_go_last_layer_first_and_hold_at_most_the_bucket_size():
    gradients = [tf.zeros([10]), None, tf.zeros([30]), tf.zeros([5]), tf.zeros([100])]
    # float32: 40, 120, 20 and 400 bytes; a 150-byte bucket closes before it would overflow.
    assert allreduce.buckets(gradients, "float32", 150) == [[4], [3, 2], [0]]
    assert allreduce.buckets(gradients, "bfloat16", 150) == [[4], [3, 2, 0]]  # half the bytes
    assert allreduce.buckets(gradients, "float32", 0) == [[4, 3, 2, 0]]  # one call
    assert allreduce.gradient_bytes([tf.zeros([10, 3]), tf.zeros([5])], "bfloat16") == 70


def _per_replica_sums(strategy, plan, values):
    """Each replica's `values[replica]` summed over the replicas with `plan`, on every replica."""

    @tf.function
    def step():
        def replica():
            context = tf.distribute.get_replica_context()
            mine = tf.gather(tf.constant(values), context.replica_id_in_sync_group)
            return allreduce.all_reduce(context, [mine, None], plan)[0]

        return strategy.run(replica)

    return [tensor.numpy() for tensor in strategy.experimental_local_results(step())]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_sum_is_within_its_epsilon_of_the_float32_sum(mirrored, dtype):
    replicas = mirrored.num_replicas_in_sync
    values = np.random.default_rng(0).normal(size=(replicas, 257)).astype(np.float32)
    plan = allreduce.resolve(dtype, "mixed_float16", True, replicas, bucket_bytes=64)
    exact = values.astype(np.float64).sum(axis=0)
    # Each replica's value rounds once to `dtype` and each of the replicas - 1 additions once:
    # at most (replicas) roundings of half an ulp of the running magnitude, then float32 back.
    epsilon = float(np.finfo(np.float16).eps) if dtype == "float16" else 2.0**-7
    bound = replicas * epsilon * np.abs(values).sum(axis=0)
    for summed in _per_replica_sums(mirrored, plan, values):
        assert summed.dtype == np.float32
        assert np.all(np.abs(summed - exact) <= bound)
        assert np.any(summed != exact.astype(np.float32))  # it did round: the sum ran in `dtype`
    float32 = _per_replica_sums(mirrored, allreduce.resolve("float32", "float32", False, replicas), values)
    np.testing.assert_allclose(float32[0], exact, rtol=4 * np.finfo(np.float32).eps)


def test_a_float16_sum_that_overflows_skips_the_step_on_every_replica(mirrored):
    """Neither replica's scaled gradient overflows float16 (49,152 < 65,504); their float16 sum
    does: the loss scaler sees it on both replicas and skips the step everywhere."""
    with mirrored.scope():
        inputs = keras.Input((1,))
        outputs = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", dtype="mixed_float16")(
            inputs
        )
        model = keras.Model(inputs, keras.layers.Activation("linear", dtype="float32")(outputs))
        optimizer = precision.wrap_optimizer(keras.optimizers.SGD(0.1), "mixed_float16", "dynamic")
        model.compile(optimizer, loss="mae")
    # loss = mean|w x - y|, y below: d(scaled loss)/dw = 32,768 x / 2 replicas = 49,152 for x = 3.
    data = tf.data.Dataset.from_tensor_slices(
        (np.full([2, 1], 3.0, np.float32), np.full([2, 1], -1.0, np.float32))
    )
    for dtype, skipped in (("float16", True), ("float32", False)):
        plan = allreduce.resolve(dtype, "mixed_float16", True, 2, 0)
        engine = Engine(mirrored, model, optimizer, allreduce_plan=plan)
        before = [copy.numpy() for copy in mirrored.experimental_local_results(model.weights[0].value)]
        scale = precision.current_loss_scale(optimizer)
        engine.train(iter(mirrored.experimental_distribute_dataset(data.batch(2))), 1)
        after = [copy.numpy() for copy in mirrored.experimental_local_results(model.weights[0].value)]
        assert all(np.array_equal(a, b) for a, b in zip(before, after)) is skipped, dtype
        assert (precision.current_loss_scale(optimizer) == scale / 2) is skipped, dtype
        assert np.array_equal(after[0], after[1])  # the replicas agree either way


def _trained(strategy, plan, xla=False):
    """A tiny classifier trained 4 steps by the Engine on 2 replicas, gradients summed by `plan`."""
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, "tanh"), keras.layers.Dense(3)])
        model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    engine = Engine(strategy, model, allreduce_plan=plan, xla=xla)
    rng = np.random.default_rng(1)
    data = tf.data.Dataset.from_tensor_slices(
        (rng.normal(size=(64, 6)).astype(np.float32), rng.integers(0, 3, 64))
    ).batch(16)
    engine.train(iter(strategy.experimental_distribute_dataset(data)), 4)
    return model


def _replica_copies(strategy, variable):
    return [copy.numpy() for copy in strategy.experimental_local_results(variable.value)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_steps_summed_in_bfloat16_stay_near_float32_and_replicas_identical(mirrored, dtype):
    reference = _trained(mirrored, allreduce.resolve("float32", "float32", False, 2))
    model = _trained(mirrored, allreduce.resolve(dtype, "mixed_bfloat16", False, 2))
    for variable, expected in zip(model.weights, reference.weights):
        copies = _replica_copies(mirrored, variable)
        np.testing.assert_array_equal(copies[0], copies[1])  # replicas identical
        # 4 steps of lr 0.1 x |gradient| <= ~1, each gradient off by at most 2 x 2^-7 of itself.
        tolerance = 0.0 if dtype == "float32" else 4 * 0.1 * 2 * 2.0**-7
        np.testing.assert_allclose(copies[0], expected.numpy(), atol=tolerance + 1e-6)


@pytest.mark.parametrize("xla", [False, True])
def test_buckets_train_exactly_as_one_call(mirrored, xla):
    """16-byte buckets hold one gradient each (the kernels' 192 and 96 bytes, the biases' 32
    and 12): 4 all-reduce calls instead of one, each number summed from the same two addends,
    so the weights are bit-identical, with XLA off and on."""
    one_call = _trained(mirrored, allreduce.resolve("float32", "float32", False, 2, 0), xla)
    bucketed_plan = allreduce.resolve("float32", "float32", False, 2, 16)
    assert len(allreduce.buckets(one_call.trainable_variables, "float32", 16)) == 4
    bucketed = _trained(mirrored, bucketed_plan, xla)
    for variable, expected in zip(bucketed.weights, one_call.weights):
        copies = _replica_copies(mirrored, variable)
        np.testing.assert_array_equal(copies[0], copies[1])
        np.testing.assert_array_equal(copies[0], expected.numpy())


def test_the_run_card_names_the_calls_and_the_collective(mirrored):
    with mirrored.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dense(3)])
        model.compile(keras.optimizers.SGD(0.1), "mse")
    plan = allreduce.resolve("bfloat16", "float32", False, 2, 16)
    row = run_card.allreduce_row(Engine(mirrored, model, allreduce_plan=plan))
    # bfloat16 gradients of 16, 96, 6 and 48 bytes: each its own 16-byte bucket.
    assert row.startswith("bfloat16, buckets of 16 bytes (asked for); 0.00 MiB of gradients")
    assert row.endswith("in 4 calls, reduction to one device (logical CPUs share memory)")
    assert allreduce.implementation(tf.distribute.get_strategy()) == "none"
