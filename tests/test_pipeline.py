"""Model parallelism: a 2-stage GPipe pipeline on the 2 logical CPUs trains like the unsplit model."""

import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmp import models, precision
from tfmp.bench import pipeline as bench_pipeline
from tfmp.classification.task import compile_classifier
from tfmp.errors import UsageError
from tfmp.pipeline import plan as pipeline
from tfmp.training.engine import Engine

SHAPE = (16, 16, 1)
BATCH = 16
DEVICES = ["/CPU:0", "/CPU:1"]
# Machine epsilon (the gap above 1.0) of each half-precision compute dtype.
EPSILON = {"float16": 2.0**-10, "bfloat16": 2.0**-7}


def _data(poison=None, weights=False):
    rng = np.random.default_rng(0)
    images = rng.random((64, *SHAPE), dtype=np.float32)
    labels = rng.integers(0, 10, 64).astype(np.int32)
    if poison is not None:
        images[poison] = np.inf
    arrays = (images, labels, rng.random(64).astype(np.float32)) if weights else (images, labels)
    return tf.data.Dataset.from_tensor_slices(arrays).repeat().batch(BATCH)


def _lenet(policy="float32", split=True, micro_batches=4, xla=False, boundaries=None):
    """lenet (no BatchNorm), compiled as the apps compile it; pipelined over 2 CPUs if `split`."""
    keras.utils.set_random_seed(1)
    strategy = tf.distribute.get_strategy()
    model = models.build("lenet", SHAPE, 10, dtype=policy)
    plan = None
    if split:
        plan = pipeline.plan(model, DEVICES, micro_batches=micro_batches, boundaries=boundaries)
        pipeline.place(model, plan)
    optimizer = precision.wrap_optimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), policy, "auto", initial_scale=1024.0
    )
    compile_classifier(model, optimizer, strategy)
    hook = pipeline.gradients_fn(plan) if split else None
    return Engine(strategy, model, optimizer, xla=xla, gradients=hook), plan


def _weights(model):
    return [w.numpy().astype(np.float64) for w in model.trainable_weights]


def _max_difference(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(_weights(a), _weights(b)))


@pytest.mark.parametrize("xla", [False, True])
def test_float32_pipeline_trains_like_the_unsplit_model(xla):
    unsplit, _ = _lenet(split=False)
    piped, plan = _lenet(xla=xla)
    unsplit_result = unsplit.train(iter(_data()), 4)
    piped_result = piped.train(iter(_data()), 4)
    assert _max_difference(unsplit.model, piped.model) <= 1e-6  # measured ~1e-8
    assert piped_result.metrics["loss"] == pytest.approx(unsplit_result.metrics["loss"], rel=1e-6)
    assert piped_result.metrics["accuracy"] == unsplit_result.metrics["accuracy"]
    assert plan.describe()["bubble"] == pytest.approx(1 / 5)


def test_regularisers_and_sample_weights_count_once_per_step():
    """A Sequential MLP with L2 penalties on both stages, sample-weighted, split by parameters."""

    def build(split):
        keras.utils.set_random_seed(2)
        regularizer = keras.regularizers.L2(0.01)
        model = keras.Sequential(
            [
                keras.Input(SHAPE),
                keras.layers.Flatten(),
                keras.layers.Dense(32, activation="relu", kernel_regularizer=regularizer),
                keras.layers.Dense(10, kernel_regularizer=regularizer),
            ]
        )
        plan = pipeline.plan(model, DEVICES, micro_batches=2, balance="params")
        if split:
            pipeline.place(model, plan)
        model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        hook = pipeline.gradients_fn(plan) if split else None
        engine = Engine(tf.distribute.get_strategy(), model, gradients=hook)
        engine.train(iter(_data(weights=True)), 3)
        return model, plan

    (unsplit, _), (piped, plan) = build(False), build(True)
    assert [len(stage.model.losses) for stage in plan.stages] == [1, 1]  # a penalty in each stage
    assert _max_difference(unsplit, piped) <= 1e-6


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_pipeline_step_is_the_unsplit_step_within_half_precision_rounding(policy):
    """Micro-batches sum weight gradients in float32 where the unsplit model sums over the whole
    batch in half precision, so one step from the same weights on the same batch may differ
    only by the rounding of those sums: relative to the update, at most one epsilon of the
    compute dtype (float16 2^-10, bfloat16 2^-7). The bound is on the norm over every weight,
    where the independent roundings average: measured 0.26 eps (float16) and 0.39 eps
    (bfloat16), the same on 4 seeds. Several steps are not compared: a rounding difference
    flips a ReLU near zero and the runs then part by far more than rounding (measured 0.05% to
    2.4% of the update after 3 steps), which is why a bound from one lucky run was flaky."""
    unsplit, _ = _lenet(policy, split=False)
    piped, _ = _lenet(policy)
    start = np.concatenate([w.ravel() for w in _weights(unsplit.model)])
    for engine in (unsplit, piped):
        assert engine.train(iter(_data()), 1).nonfinite_steps == 0
    unsplit_update = np.concatenate([w.ravel() for w in _weights(unsplit.model)]) - start
    piped_update = np.concatenate([w.ravel() for w in _weights(piped.model)]) - start
    epsilon = EPSILON[keras.DTypePolicy(policy).compute_dtype]
    assert np.linalg.norm(piped_update - unsplit_update) <= epsilon * np.linalg.norm(unsplit_update)
    # ... and the pipelined model keeps training in half precision: no overflow, loss scale kept.
    assert piped.train(iter(_data()), 2).nonfinite_steps == 0


def _graph_nodes(engine, iterator):
    function = engine._train_fn.get_concrete_function(iterator, tf.constant(1, tf.int64), tf.constant(0.0))
    graph = function.graph.as_graph_def()
    return list(graph.node) + [node for library in graph.library.function for node in library.node_def]


def test_stage_variables_and_their_gradient_ops_live_on_the_stage_device():
    engine, plan = _lenet(micro_batches=2, boundaries=["lenet_conv2"])
    stage_of = {name: stage for stage in plan.stages for name in stage.layers}
    for variable in engine.model.trainable_variables:
        device = stage_of[variable.path.split("/")[0]].device
        assert variable.value.device.endswith(device[1:])
    for slot in engine.optimizer.variables:  # momentum made next to its variable
        layer = slot.path.split("/")[-1].rsplit("_", 2)[0]
        if layer in stage_of:
            assert slot.value.device.endswith(stage_of[layer].device[1:])
    iterator = iter(_data())
    engine.train(iterator, 1)
    checked = {0: 0, 1: 0}
    unplaced = ("NoOp", "Identity", "Const", "ReadVariableOp")  # the placer puts reads next to the resource
    for node in _graph_nodes(engine, iterator):
        for stage in plan.stages:
            if f"pipeline_stage_{stage.index}_" in node.name and node.op not in unplaced:
                assert node.device == f"/device:{stage.device[1:]}", (node.name, node.device)
                checked[stage.index] += node.name.startswith("gradient_tape/")
    assert checked[0] >= 4 and checked[1] >= 10  # conv/relu/pool gradients of both micro-batches


def test_checkpoints_move_between_pipelined_and_unsplit_models(tmp_path):
    piped, plan = _lenet()
    piped.train(iter(_data()), 2)
    path = tf.train.Checkpoint(model=piped.model).save(str(tmp_path / "piped"))
    unsplit, _ = _lenet(split=False)
    tf.train.Checkpoint(model=unsplit.model).restore(path).assert_existing_objects_matched()
    assert _max_difference(piped.model, unsplit.model) == 0.0
    unsplit.train(iter(_data()), 1)
    path = tf.train.Checkpoint(model=unsplit.model).save(str(tmp_path / "unsplit"))
    again, plan = _lenet()
    tf.train.Checkpoint(model=again.model).restore(path).assert_existing_objects_matched()
    assert _max_difference(again.model, unsplit.model) == 0.0
    last = plan.stages[-1].model.trainable_variables[-1]
    assert last.value.device.endswith("CPU:1")  # restoring kept the placement


@pytest.mark.parametrize("xla", [False, True])
def test_staged_forward_pass_equals_the_model(xla, tmp_path):
    """`forward_fn` (eval/predict stage by stage; XLA per stage, where a whole-model XLA forward
    fails on variables of two devices) gives the model's outputs; the placed model saves."""
    engine, plan = _lenet()
    images = next(iter(_data()))[0]
    forward = pipeline.forward_fn(plan)
    staged = tf.function(lambda x: forward(types.SimpleNamespace(xla=xla), x, False))(images)
    np.testing.assert_allclose(staged.numpy(), engine.model(images, training=False).numpy(), atol=1e-6)
    engine.model.save(tmp_path / "placed.keras")
    loaded = keras.models.load_model(tmp_path / "placed.keras")
    np.testing.assert_allclose(loaded(images).numpy(), staged.numpy(), atol=1e-6)


def test_overflow_in_one_micro_batch_skips_the_step():
    engine, _ = _lenet("mixed_float16", micro_batches=4)
    before = _weights(engine.model)
    result = engine.train(iter(_data(poison=slice(12, 13))), 1)  # a row of micro-batch 4 only
    assert result.nonfinite_steps == 1
    for start, now in zip(before, _weights(engine.model)):
        np.testing.assert_array_equal(start, now)
    assert precision.current_loss_scale(engine.optimizer) == 512.0


def _one_line_refusal(call, match):
    with pytest.raises(UsageError, match=match) as error:
        call()
    assert "\n" not in str(error.value)


def test_refusals_are_one_line(mirrored):
    lenet = models.build("lenet", SHAPE, 10)
    _one_line_refusal(lambda: pipeline.plan(lenet, ["/CPU:0"]), "at least 2 devices")
    _one_line_refusal(lambda: pipeline.stage_devices(1), "at least 2 stages")
    _one_line_refusal(lambda: pipeline.stage_devices(3), "needs 3 devices, this host has 2")
    _one_line_refusal(lambda: pipeline.plan(lenet, ["/CPU:0", "/CPU:0"]), "repeat a device")
    _one_line_refusal(lambda: pipeline.plan(lenet, DEVICES, micro_batches=0), "micro_batches=0")
    tiny = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    _one_line_refusal(lambda: pipeline.plan(tiny, DEVICES + ["/CPU:2"]), "only 2 stages")
    _one_line_refusal(lambda: pipeline.plan(lenet, DEVICES, boundaries=["lenet_conv9"]), "unknown layer")
    resnet = models.build("resnet20", (8, 8, 3), 10)
    inside_block = "resnet20_stage1_block2_2_conv"  # the skip from the block's input crosses here
    _one_line_refusal(
        lambda: pipeline.plan(resnet, DEVICES, boundaries=[inside_block]),
        f"cannot start a pipeline stage at layer '{inside_block}'",
    )
    plan = pipeline.plan(resnet, DEVICES)  # balanced cuts fall between blocks
    first_of_stage_2 = plan.stages[1].layers[0]
    assert first_of_stage_2.endswith("_1_conv") or first_of_stage_2.endswith("_out"), first_of_stage_2
    plan = pipeline.plan(lenet, DEVICES, micro_batches=3)
    _one_line_refusal(lambda: plan.check_batch(16), "does not divide the per-replica batch 16")
    with mirrored.scope():
        mirrored_lenet = models.build("lenet", SHAPE, 10)
        mirrored_plan = pipeline.plan(mirrored_lenet, DEVICES)
        _one_line_refusal(lambda: pipeline.place(mirrored_lenet, mirrored_plan), "MirroredStrategy")


def test_indivisible_batch_is_refused_when_the_step_is_traced():
    """With a static batch size (tfmp's inputs drop the remainder) the trace refuses too, but
    autograph wraps the message in its "in user code" report: apps call `plan.check_batch`
    before training for the one-line refusal."""
    engine, _ = _lenet(micro_batches=3)
    batches = _data().unbatch().batch(BATCH, drop_remainder=True)
    with pytest.raises(Exception, match="micro_batches=3 does not divide the per-replica batch 16"):
        engine.train(iter(batches), 1)


def test_bench_reports_throughput_bubble_and_memory_per_device():
    rows = bench_pipeline.measure(
        "seed_cnn", image_size=8, global_batch=8, micro_batches=(2,), steps=1, repeats=1
    )
    unsplit, piped = rows
    assert unsplit["relative"] == 1.0 and unsplit["stages"] == 1 and len(unsplit["devices"]) == 1
    assert piped["bubble_theory"] == pytest.approx(1 / 3) and len(piped["stage_busy_seconds"]) == 2
    assert [device["device"][-5:] for device in piped["devices"]] == ["CPU:0", "CPU:1"]
    assert sum(d["parameters"] for d in piped["devices"]) == unsplit["devices"][0]["parameters"]
    assert "bubble" in bench_pipeline.table(rows)
