"""Policy choice, loss-scale flags, and loss scaling that skips an overflow on every replica."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmp import precision
from tfmp.errors import UsageError
from tfmp.precision import loss_scaling

CPU_PLAIN = precision.Hardware((), False, cpu_fast_bfloat16=False)
CPU_BF16 = precision.Hardware((), False, cpu_fast_bfloat16=True)
VOLTA = precision.Hardware(((7, 0), (8, 0)), False, False)
PASCAL = precision.Hardware(((6, 1),), False, False)
TPU = precision.Hardware((), True, False)


@pytest.mark.parametrize(
    "hardware, expected",
    [
        (VOLTA, "mixed_float16"),
        (PASCAL, "float32"),
        (TPU, "mixed_bfloat16"),
        (CPU_BF16, "mixed_bfloat16"),
        (CPU_PLAIN, "float32"),
    ],
)
def test_auto_picks_fastest_policy(hardware, expected):
    assert precision.resolve("auto", hardware).policy == expected


@pytest.mark.parametrize(
    "hardware, expected, warns",
    [
        (VOLTA, "mixed_float16", False),
        (PASCAL, "mixed_float16", True),
        (TPU, "mixed_bfloat16", False),
        (CPU_BF16, "mixed_bfloat16", False),
        (CPU_PLAIN, "mixed_bfloat16", True),
    ],
)
def test_mixed_honours_request_and_warns_when_slow(hardware, expected, warns):
    choice = precision.resolve("mixed", hardware)
    assert choice.policy == expected
    assert bool(choice.warning) == warns


def test_explicit_policies_pass_through_and_unknown_refused():
    for policy in precision.POLICIES:
        assert precision.resolve(policy, CPU_PLAIN).policy == policy
    assert "emulated" in precision.resolve("mixed_float16", CPU_PLAIN).warning
    with pytest.raises(UsageError, match="unknown precision 'half'.*mixed_bfloat16"):
        precision.resolve("half", CPU_PLAIN)


def test_loss_scale_parsing():
    assert precision.parse_loss_scale("dynamic") == "dynamic"
    assert precision.parse_loss_scale("none") is None
    assert precision.parse_loss_scale("1024") == 1024.0
    # Above float16's 65504 is a valid scale (the scaled loss is float32; dynamic goes there too).
    assert precision.parse_loss_scale("65536") == 65536.0
    assert precision.parse_loss_scale("1e30") == 1e30
    for bad in ("big", "-1", "0", "inf"):
        with pytest.raises(UsageError, match="loss_scale"):
            precision.parse_loss_scale(bad)
    # float32 cannot hold it: every scaled loss would be inf.
    for refuse in (lambda: precision.parse_loss_scale("1e40"), lambda: _fixed(1e40)):
        largest = r"^--loss_scale=1e\+?40 is more than float32's largest value 3.4e\+38"
        with pytest.raises(UsageError, match=largest) as error:
            refuse()
        assert "\n" not in str(error.value)


def _fixed(scale):
    return precision.wrap_optimizer(keras.optimizers.SGD(0.1), "mixed_float16", scale)


def test_loss_scale_only_for_float16():
    sgd = keras.optimizers.SGD(0.1)
    assert precision.wrap_optimizer(sgd, "mixed_bfloat16", "auto") is sgd
    for policy in ("float32", "mixed_bfloat16"):
        for loss_scale in ("dynamic", 128.0):
            with pytest.raises(UsageError, match="needs --precision=mixed_float16"):
                precision.wrap_optimizer(keras.optimizers.SGD(0.1), policy, loss_scale)
    dynamic = precision.wrap_optimizer(keras.optimizers.SGD(0.1), "mixed_float16", "auto")
    assert isinstance(dynamic, precision.LossScaleOptimizer)
    fixed = precision.wrap_optimizer(keras.optimizers.SGD(0.1), "mixed_float16", 128.0)
    assert fixed.loss_scale_factor == 128.0
    assert precision.current_loss_scale(fixed) == 128.0
    assert "fixed 128" in precision.loss_scale_mode(fixed)


def test_fixed_loss_scale_unscales_gradients():
    variable = keras.Variable(np.ones(2, np.float32))
    optimizer = precision.wrap_optimizer(keras.optimizers.SGD(0.5), "mixed_float16", 64.0)
    assert float(optimizer.scale_loss(tf.constant(2.0))) == 128.0
    optimizer.apply([tf.constant([64.0, 128.0])], [variable])  # scaled grads of [1, 2]
    np.testing.assert_allclose(variable.numpy(), [0.5, 0.0])


def _two_replica_setup(strategy, growth_steps=2):
    with strategy.scope():
        variable = keras.Variable(np.ones(4, np.float32), name="weights")
        optimizer = precision.wrap_optimizer(
            keras.optimizers.SGD(0.1),
            "mixed_float16",
            "dynamic",
            initial_scale=1024.0,
            growth_steps=growth_steps,
        )
        optimizer.build([variable])
    return strategy, variable, optimizer


def _apply_step(strategy, variable, optimizer, bad_replica):
    """Gradient 1024 (= 1.0 scaled) on every replica, inf on `bad_replica` (-1: none)."""

    @tf.function
    def step():
        def replica_fn():
            replica_id = tf.distribute.get_replica_context().replica_id_in_sync_group
            gradient = tf.fill([4], 1024.0)
            gradient = tf.where(tf.equal(replica_id, bad_replica), gradient * np.inf, gradient)
            optimizer.apply([gradient], [variable])

        strategy.run(replica_fn)

    step()
    return [v.numpy() for v in variable.value.values]


@pytest.mark.parametrize("bad_replica", [0, 1])
def test_overflow_on_any_replica_skips_step_everywhere(mirrored, bad_replica):
    # Plain Keras 3.15 applies inf when only replica 1 overflows (docs/examples/lso_replica_overflow.py).
    strategy, variable, optimizer = _two_replica_setup(mirrored)
    copies = _apply_step(strategy, variable, optimizer, bad_replica)
    for copy in copies:
        np.testing.assert_array_equal(copy, np.ones(4))
    assert precision.current_loss_scale(optimizer) == 512.0
    assert int(optimizer.iterations.numpy()) == 0
    # Both replicas count the skip (each holds its own count of the all-reduced verdict).
    assert [int(count.numpy()) for count in optimizer.skipped_in_a_row.values] == [1, 1]


def test_finite_steps_apply_and_grow_scale_on_schedule(mirrored):
    strategy, variable, optimizer = _two_replica_setup(mirrored, growth_steps=2)
    copies = _apply_step(strategy, variable, optimizer, bad_replica=-1)
    # Sum over 2 replicas of unscaled gradient 1.0, times learning rate 0.1.
    for copy in copies:
        np.testing.assert_allclose(copy, np.full(4, 0.8), rtol=1e-6)
    assert precision.current_loss_scale(optimizer) == 1024.0
    _apply_step(strategy, variable, optimizer, bad_replica=-1)
    assert precision.current_loss_scale(optimizer) == 2048.0  # doubled after 2 finite steps
    _apply_step(strategy, variable, optimizer, bad_replica=1)
    _apply_step(strategy, variable, optimizer, bad_replica=0)
    assert precision.current_loss_scale(optimizer) == 512.0
    assert int(optimizer.step_counter.numpy()) == 0
    assert int(optimizer.skipped_in_a_row.numpy()) == 2  # in a row; a finite step starts again
    _apply_step(strategy, variable, optimizer, bad_replica=-1)
    assert int(optimizer.skipped_in_a_row.numpy()) == 0


def test_skip_limit_is_the_halvings_to_below_1_plus_a_margin():
    """From 2^15, 16 skips in a row reach 1/2 (the floor stops the run there); the limit adds
    SKIP_MARGIN for a scale that had grown since."""
    default = precision.wrap_optimizer(keras.optimizers.SGD(0.1), "mixed_float16", "dynamic")
    assert loss_scaling.skip_limit(default) == 16 + loss_scaling.SKIP_MARGIN == 32
    small = precision.wrap_optimizer(keras.optimizers.SGD(0.1), "mixed_float16", "dynamic", initial_scale=1.0)
    assert loss_scaling.skip_limit(small) == 1 + loss_scaling.SKIP_MARGIN


def test_float32_layers_takes_one_pattern_as_a_string():
    """`float32_layers(model, "logits")` is the pattern "logits", not six one-letter patterns."""
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3, name="hidden", dtype="mixed_float16"),
            keras.layers.Dense(2, name="logits", dtype="mixed_float16"),
        ]
    )
    assert precision.matching_layers(model, "logits") == ["logits"]
    copy = precision.float32_layers(model, "logits|hid.*")
    assert [layer.dtype_policy.name for layer in copy.layers] == ["float32", "float32"]
    with pytest.raises(UsageError, match="pattern 'logit' matches no layer"):
        precision.float32_layers(model, "logit")
