"""The compatibility matrix in README.md: strategy x precision x XLA, every cell trains.

Single-process strategies run in-process on the two logical CPUs of conftest; the
multi-worker column runs in the two real worker processes of conftest's shared launched group.
Every cell also checks the README's "replicas identical".
"""

import keras
import numpy as np
import pytest
import rounding

from tfmp import models, precision
from tfmp.classification import data
from tfmp.classification.task import compile_classifier
from tfmp.distribute import strategies as distribute
from tfmp.training.engine import Engine

GLOBAL_BATCH = 16
# LeNet's smallest input (digits are drawn at any size): float16 is emulated on CPU, so its
# cells cost by the convolutions' size; the cells test strategy x precision x XLA, not the size.
IMAGE_SIZE = 16


@pytest.fixture(scope="module")
def strategies():
    return {
        name: distribute.get_strategy(name, tf_config="") for name in ("default", "one_device", "mirrored")
    }


def _replica_copies(strategy, variable):
    """Every replica's copy of a (Keras) variable: one for a single-replica strategy, one per
    device for a MirroredVariable."""
    return [copy.numpy() for copy in strategy.experimental_local_results(variable.value)]


@pytest.mark.parametrize("xla", [False, True], ids=["xla_off", "xla_on"])
@pytest.mark.parametrize("policy", precision.POLICIES)
@pytest.mark.parametrize("strategy_name", ["default", "one_device", "mirrored"])
def test_single_process_cell_trains_and_replicas_end_identical(strategies, strategy_name, policy, xla):
    strategy = strategies[strategy_name]
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = models.build("lenet", (IMAGE_SIZE, IMAGE_SIZE, 1), 10, dtype=policy)
        optimizer = precision.wrap_optimizer(keras.optimizers.SGD(0.05), policy, "auto")
    compile_classifier(model, optimizer, strategy)
    engine = Engine(strategy, model, optimizer, xla=xla)
    start = [weight.numpy() for weight in model.trainable_weights]
    train = strategy.distribute_datasets_from_function(
        lambda context: data.load(
            "digits", "train", GLOBAL_BATCH, image_size=IMAGE_SIZE, input_context=context
        )[0]
    )
    iterator = iter(train)
    # Two host calls: the first traces the step, the second reuses it with another step count.
    first = engine.train(iterator, 1)
    later = engine.train(iterator, 2)
    assert np.isfinite(first.metrics["loss"]) and first.nonfinite_steps == later.nonfinite_steps == 0
    assert int(optimizer.iterations.numpy()) == 3  # every step applied
    for weight, before in zip(model.trainable_weights, start):
        assert weight.dtype == "float32"
        assert np.isfinite(weight.numpy()).all()
        assert not np.array_equal(weight.numpy(), before), weight.path  # it trained
    # README: replicas identical in every cell. Each replica's copy of every model and optimizer
    # variable (weights, iterations, loss scale) is bitwise the same.
    for variable in model.variables + optimizer.variables:
        copies = _replica_copies(strategy, variable)
        assert len(copies) == strategy.num_replicas_in_sync, variable.path
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0], err_msg=variable.path)


@pytest.mark.slow
def test_multi_worker_cells_train_and_replicas_end_identical(launched_workers):
    """2 workers (conftest's shared launched group) x every precision x XLA off/on: every model
    and optimizer variable identical on both workers, every eval example counted once; and a
    float16 overflow on worker 1 alone skips the step on both."""
    assert launched_workers.returncode == 0, launched_workers.tail
    records = launched_workers.records
    assert [r["multi_worker"] for r in records["strategy"][0]] == [True]  # what "auto" chose
    # tfmp's heartbeat timeout, not TensorFlow's 10 s (which the strategy would have set, as 0,
    # had it configured the coordination service itself), on both workers.
    for worker in (0, 1):
        (strategy,) = records["strategy"][worker]
        assert strategy["peer_timeout_ms"] == distribute.DEFAULT_HEARTBEAT_TIMEOUT * 1000, strategy
    for worker in (0, 1):
        (overflow,) = records["overflow"][worker]
        # Worker 1's overflow skipped the step everywhere: weights unchanged, scale halved.
        assert overflow["unchanged"] and overflow["nonfinite_steps"] >= 1, overflow
        assert overflow["loss_scale"] == 2.0**14, overflow
        # Summed in float16: worker 1's overflowing gradients make the sum inf on both workers.
        (summed,) = records["overflow_float16_sum"][worker]
        assert summed["unchanged"] and summed["nonfinite_steps"] >= 1, summed
        assert summed["nonfinite_inputs"] == [] and summed["loss_scale"] == 2.0**14, summed
    chief, other = records["classify"][0], records["classify"][1]
    assert len(chief) == len(other) == 2 * len(precision.POLICIES)
    assert [r["chief"] for r in chief] == [True] * 6 and [r["chief"] for r in other] == [False] * 6
    for mine, theirs in zip(chief, other):
        assert (mine["policy"], mine["xla"]) == (theirs["policy"], theirs["xla"])
        assert mine["workers"] == 2 and mine["replicas"] == 2
        assert mine["finite"] and np.isfinite(mine["loss"])
        # Every eval example counted once across both workers: the rows counted over every
        # replica are the split's size (exact: one missing or doubled example moves the mean loss
        # by only ~7e-6 relative, measured, so the loss comparison below cannot show it), and
        # the distributed loss is the one a single worker computes over the whole split; accuracy
        # may differ only on the near ties of this barely trained model (the local pass calls the
        # model alone, the distributed one runs the engine's step or XLA: tests/rounding.py).
        assert mine["eval_examples"] == theirs["eval_examples"] == data.DIGITS_EVAL_EXAMPLES
        local_loss, local_accuracy, ties = mine["local_eval"]
        assert mine["eval_loss"] == pytest.approx(local_loss, rel=2e-5)
        rounding.assert_accuracy_within_ties(
            mine["eval_accuracy"], local_accuracy, data.DIGITS_EVAL_EXAMPLES, ties
        )
        assert mine["eval_accuracy"] == theirs["eval_accuracy"]
        # README: replicas identical. One replica per worker: the digests of every model and
        # optimizer variable (weights, iterations, loss scale) must be equal.
        assert mine["checksum"] == theirs["checksum"], mine
