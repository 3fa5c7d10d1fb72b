"""train_and_evaluate: outputs, resume, divergence stop, refusals that leave nothing behind."""

import json
import math
import os
import shutil
import weakref

import keras
import numpy as np
import pytest
import rounding
import tensorflow as tf

from tfmp import models, precision, pruning
from tfmp.classification import data
from tfmp.classification.task import TASK, SmoothedSparseCrossentropy, compile_classifier
from tfmp.distribute import strategies as distribute
from tfmp.errors import TrainingDiverged, UsageError
from tfmp.training import checkpoint
from tfmp.training.config import TrainConfig
from tfmp.training.engine import Engine
from tfmp.training.run import train_and_evaluate


def _config(model_dir, **overrides):
    values = dict(
        model="lenet",
        dataset="digits",
        global_batch_size=32,
        steps=6,
        steps_per_epoch=3,
        log_every=2,
        model_dir=str(model_dir),
        strategy="default",
        verbose=False,
    )
    values.update(overrides)
    return TrainConfig.from_flat(**values)


def test_run_writes_every_output(tmp_path):
    summary = train_and_evaluate(
        task=TASK,
        config=_config(tmp_path, strategy="mirrored", precision="mixed_bfloat16", steps_per_execution=2),
        resolved_flags="--model=lenet\n",
    )
    assert summary["steps"] == 6 and summary["replicas"] == 2 and summary["precision"] == "mixed_bfloat16"
    saved = keras.models.load_model(tmp_path / "model.keras")
    # A dense run reports its weights' raw bytes (float32 master weights) and skips the gzip.
    assert summary["weights_bytes"] == 4 * saved.count_params() and summary["weights_gzip_bytes"] is None
    # The reported accuracy is the saved model's on the whole eval split, recomputed here at the
    # per-replica batch (kernels pick algorithms by batch size); near ties may flip in bfloat16.
    accuracy, ties = _accuracy(saved, batch=16, policy="mixed_bfloat16")
    rounding.assert_accuracy_within_ties(summary["eval_accuracy"], accuracy, data.DIGITS_EVAL_EXAMPLES, ties)
    card = json.load(open(tmp_path / "run_card.json"))
    assert card["compute dtype"] == "bfloat16" and card["variable dtype"] == "float32"
    assert card["head dtype"] == "float32" and card["per-replica batch"] == 16
    for key in (
        "loss scale",
        "strategy",
        "replicas",
        "global batch",
        "learning rate",
        "xla",
        "shard policy",
        "versions",
        "devices",
    ):
        assert key in card
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    train = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train] == [2, 3, 5, 6]  # every 2 steps, and at each epoch end
    assert {"loss", "accuracy", "learning_rate", "loss_scale", "examples_per_sec"} <= set(train[0])
    assert [r["step"] for r in records if r["split"] == "eval"] == [3, 6]
    assert os.listdir(tmp_path / "tensorboard") and (tmp_path / "flags.txt").read_text() == "--model=lenet\n"
    assert tf.train.latest_checkpoint(str(tmp_path / checkpoint.SUBDIR)).endswith("ckpt-6")
    assert saved.output.dtype == "float32"


def _accuracy(model, batch, policy):
    """(accuracy, near ties) of the model on the digits eval split, padding rows (label -1)
    left out."""
    correct = ties = total = 0
    for images, labels in data.load("digits", "eval", batch, training=False)[0]:
        valid = labels.numpy() >= 0
        probabilities = model(images, training=False).numpy()[valid]
        correct += int((probabilities.argmax(-1) == labels.numpy()[valid]).sum())
        ties += rounding.count_near_ties(probabilities, policy)
        total += int(valid.sum())
    assert total == data.DIGITS_EVAL_EXAMPLES
    return correct / total, ties


@pytest.fixture(scope="module")
def six_step_run(tmp_path_factory):
    """One finished 6-step run (checkpoints ckpt-3 and ckpt-6), which each resume test copies."""
    run_dir = tmp_path_factory.mktemp("six_steps")
    train_and_evaluate(task=TASK, config=_config(run_dir, steps=6))
    return run_dir


def _copy_of(run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    return copy


def test_resume_continues_at_the_saved_step(six_step_run, tmp_path):
    run_dir = _copy_of(six_step_run, tmp_path)
    summary = train_and_evaluate(task=TASK, config=_config(run_dir, steps=9))
    assert summary["steps"] == 9
    card = json.load(open(run_dir / "run_card.json"))
    assert card["steps"].endswith("from step 6")
    steps = [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl") if '"train"' in line]
    assert steps == [2, 3, 5, 6, 8, 9]  # nothing repeated, nothing skipped


def test_the_input_iterator_is_destroyed_before_the_end_barrier(tmp_path, monkeypatch):
    """Destroying a tf.data iterator can take seconds; a worker doing it after the end barrier
    outlives its exited peers' heartbeats. So the run frees its iterator before the barrier."""
    iterators, alive_at_barrier = [], []
    inputs = TASK.inputs

    def recording_inputs(*args, **kwargs):
        data_for_epoch, evaluate, shard_policies = inputs(*args, **kwargs)
        iterators.append(weakref.ref(data_for_epoch(0, 0)))
        return data_for_epoch, evaluate, shard_policies

    monkeypatch.setattr(TASK, "inputs", recording_inputs)
    monkeypatch.setattr(
        distribute, "barrier", lambda strategy: alive_at_barrier.append(iterators[0]() is not None)
    )
    train_and_evaluate(task=TASK, config=_config(tmp_path, steps=2, steps_per_epoch=2))
    assert alive_at_barrier == [False]


def test_nonfinite_float32_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    diverging = _config(tmp_path, steps=30, optimizer="sgd", learning_rate=1e30)
    with pytest.raises(TrainingDiverged, match="non-finite at step [12] .*no checkpoint was saved yet in"):
        train_and_evaluate(task=TASK, config=diverging)  # before the first checkpoint (step 3)
    train_and_evaluate(task=TASK, config=_config(tmp_path, steps=3, optimizer="sgd"))
    with pytest.raises(
        TrainingDiverged, match="non-finite at step .* float32.*the checkpoint of step 3 in .* is kept"
    ):
        train_and_evaluate(task=TASK, config=diverging)
    latest = tf.train.latest_checkpoint(str(tmp_path / checkpoint.SUBDIR))
    assert latest.endswith("ckpt-3")
    reader = tf.train.load_checkpoint(latest)
    for name, _ in tf.train.list_variables(latest):
        if "model" in name and name.endswith("VARIABLE_VALUE"):
            assert tf.reduce_all(tf.math.is_finite(tf.cast(reader.get_tensor(name), tf.float32)))


@pytest.mark.parametrize("damaged", [".index", ".data-00000-of-00001"])
def test_damaged_newest_checkpoint_falls_back_to_the_older_one(six_step_run, tmp_path, damaged, caplog):
    run_dir = _copy_of(six_step_run, tmp_path)  # keeps ckpt-3 and ckpt-6
    newest = run_dir / checkpoint.SUBDIR / f"ckpt-6{damaged}"
    newest.write_bytes(newest.read_bytes()[: len(newest.read_bytes()) // 2])  # truncated
    summary = train_and_evaluate(task=TASK, config=_config(run_dir, steps=9))
    assert summary["steps"] == 9
    card = json.load(open(run_dir / "run_card.json"))
    assert card["steps"].endswith("from step 3")  # ckpt-6 was skipped, ckpt-3 restored
    assert "skipped checkpoint" in caplog.text and "ckpt-6" in caplog.text


def test_no_readable_checkpoint_is_a_usage_error(six_step_run, tmp_path):
    run_dir = _copy_of(six_step_run, tmp_path)
    for name in os.listdir(run_dir / checkpoint.SUBDIR):
        if name.endswith(".index"):
            (run_dir / checkpoint.SUBDIR / name).write_bytes(b"garbage")
    with pytest.raises(
        UsageError, match="no checkpoint in .* can be restored.*ckpt-6.*ckpt-3.*fresh --model_dir"
    ):
        train_and_evaluate(task=TASK, config=_config(run_dir, steps=9))


def test_resume_with_another_global_batch_is_refused_naming_both(six_step_run, tmp_path):
    run_dir = _copy_of(six_step_run, tmp_path)
    with pytest.raises(
        UsageError, match="trained with global batch 32, this run uses 16.*--global_batch_size=32"
    ):
        train_and_evaluate(task=TASK, config=_config(run_dir, steps=9, global_batch_size=16))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"model": "resnet9"}, "unknown model 'resnet9'; choose one of: lenet"),
        ({"dataset": "imagenette"}, "unknown dataset 'imagenette'"),
        ({"precision": "fp8"}, "unknown precision 'fp8'; choose one of:"),
        ({"strategy": "horovod"}, "unknown strategy 'horovod'"),
        ({"optimizer": "lamb"}, "unknown optimizer 'lamb'"),
        ({"xla": "maybe"}, "unknown --xla value 'maybe'"),
        ({"strategy": "mirrored", "global_batch_size": 33}, "global batch 33 is not divisible by 2 replicas"),
        ({"precision": "mixed_bfloat16", "loss_scale": "dynamic"}, "needs --precision=mixed_float16"),
        ({"loss_scale": "huge"}, "neither auto, dynamic, none nor a number"),
        ({"global_batch_size": 0}, "global_batch_size=0 must be positive"),
        ({"lr_scaling": "cubic"}, "unknown lr scaling rule 'cubic'"),
        ({"model": "lenet", "image_size": 12, "dataset": "shapes"}, "needs images of at least 16x16"),
        ({"cpu_replicas": -1}, "--cpu_replicas=-1 must be 0"),
    ],
)
def test_user_errors_leave_nothing_behind(tmp_path, overrides, message):
    model_dir = tmp_path / "run"
    with pytest.raises(UsageError, match=message) as error:
        train_and_evaluate(task=TASK, config=_config(model_dir, **overrides))
    assert "\n" not in str(error.value)
    assert not model_dir.exists()


@pytest.mark.slow
def test_mixed_float16_matches_float32_accuracy(tmp_path):
    """Loss scaling works: float16 training reaches float32's accuracy.

    14x14 digits, batch 32: float16 is emulated on a CPU (1.2 s per step of this MLP at 28x28,
    batch 128), and 300 small steps already reach ~0.91. The two runs round differently, so
    their eval accuracies are two draws on 2000 examples: the margin is 4 standard errors of
    their difference, sqrt(2 p (1 - p) / 2000) with p = 0.9.
    """
    accuracy = {}
    for policy in ("float32", "mixed_float16"):
        summary = train_and_evaluate(
            task=TASK,
            config=_config(
                tmp_path / policy,
                model="mnist_mlp",
                precision=policy,
                image_size=14,
                steps=300,
                steps_per_epoch=300,
                steps_per_execution=50,
                log_every=300,
            ),
        )
        accuracy[policy] = summary["eval_accuracy"]
    assert accuracy["float32"] > 0.85  # it learned (chance is 0.1)
    margin = 4 * math.sqrt(2 * 0.9 * 0.1 / data.DIGITS_EVAL_EXAMPLES)
    assert abs(accuracy["float32"] - accuracy["mixed_float16"]) < margin, accuracy


def _kernel_zeros(model):
    return {
        layer.name: float(np.mean(layer.kernel.numpy() == 0))
        for layer in model.layers
        if hasattr(layer, "kernel")
    }


def test_pruned_run_under_mixed_float16_on_two_replicas_keeps_zeros_and_resumes(tmp_path):
    """Target sparsity on schedule, zeros that momentum cannot revive, the same masks on both
    replicas, the head left dense, and masks restored on resume."""
    pruned = dict(
        strategy="mirrored",
        precision="mixed_float16",
        optimizer="sgd",
        learning_rate=0.05,
        prune_sparsity=0.75,
        prune_begin_step=0,
        prune_end_step=4,
        prune_every=2,
        steps_per_epoch=4,
        log_every=4,
        # float16 is emulated on CPU: LeNet's smallest input, and no eval pass (not tested here).
        image_size=16,
        evaluate=False,
    )
    first = train_and_evaluate(task=TASK, config=_config(tmp_path, steps=4, **pruned))
    assert first["sparsity"] == pytest.approx(0.75, abs=0.01)
    summary = train_and_evaluate(task=TASK, config=_config(tmp_path, steps=8, **pruned))  # resumes at step 4
    assert summary["steps"] == 8 and summary["sparsity"] == pytest.approx(0.75, abs=0.01)
    # What pruning shrinks: the gzip of weights three quarters zeros, well under their raw bytes.
    assert summary["weights_gzip_bytes"] < 0.6 * summary["weights_bytes"], summary
    saved = keras.models.load_model(tmp_path / "model.keras")  # stripped: plain Keras, no masks
    zeros = _kernel_zeros(saved)
    assert zeros.pop("lenet_logits") < 0.01  # the float32 head stays dense
    for name, fraction in zeros.items():
        assert fraction == pytest.approx(0.75, abs=0.01), name
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if '"train"' in line]
    assert records[-1]["sparsity"] == pytest.approx(0.75, abs=0.01)
    assert any(key.startswith("sparsity/lenet_") for key in records[-1])


def test_pruning_keeps_replicas_identical_after_momentum_steps(mirrored):
    keras.utils.set_random_seed(0)
    with mirrored.scope():
        # LeNet's smallest input: float16 is emulated on CPU and costs by the convolutions' size.
        model = models.build("lenet", (16, 16, 1), 10, dtype="mixed_float16")
        optimizer = precision.wrap_optimizer(keras.optimizers.SGD(0.05, momentum=0.9), "mixed_float16")
    compile_classifier(model, optimizer, mirrored)
    with mirrored.scope():
        pruner = pruning.Pruner(model, pruning.ConstantSchedule(0.6, begin_step=0, end_step=0, every=1))
    engine = Engine(mirrored, model, optimizer)
    pruner.update(0)
    train = mirrored.distribute_datasets_from_function(
        lambda context: data.load("digits", "train", 32, image_size=16, input_context=context)[0]
    )
    engine.train(iter(train), 3)  # momentum steps after the last mask update (velocity on zeros)
    for layer, mask in zip(pruner.layers, pruner.masks):
        masks = [m.numpy() for m in mask.value.values]
        np.testing.assert_array_equal(masks[0], masks[1])
        for kernel in layer.kernel.value.values:
            assert np.all(kernel.numpy()[masks[0] == 0] == 0), layer.name


def test_pipelined_run_reports_its_stages_and_trains(tmp_path):
    summary = train_and_evaluate(
        task=TASK, config=_config(tmp_path, strategy="auto", pipeline_stages=2, micro_batches=4)
    )
    assert summary["steps"] == 6 and summary["replicas"] == 1
    card = json.load(open(tmp_path / "run_card.json"))
    assert card["pipeline"].startswith("2 stages x 4 micro-batches") and "bubble" in card["pipeline"]
    assert card["stage 0"].endswith("FLOPs/example)") and "CPU:1" in card["stage 1"]
    # Saved as one model: every layer of both stages, lenet's own parameters, in one file.
    saved = keras.models.load_model(tmp_path / "model.keras")
    unsplit = models.build("lenet", (28, 28, 1), 10)
    assert [layer.name for layer in saved.layers] == [layer.name for layer in unsplit.layers]
    assert [w.shape for w in saved.weights] == [w.shape for w in unsplit.weights]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"strategy": "mirrored", "pipeline_stages": 2}, "replicas cannot also use them"),
        (
            {"pipeline_stages": 2, "micro_batches": 5},
            "--micro_batches=5 does not divide the per-replica batch 32",
        ),
        ({"pipeline_stages": 3}, "3 devices"),  # in-process the CPU is already split in 2
    ],
)
def test_impossible_pipelines_are_refused_before_anything_is_written(tmp_path, overrides, message):
    with pytest.raises(UsageError, match=message) as error:
        train_and_evaluate(task=TASK, config=_config(tmp_path / "run", **{"strategy": "auto", **overrides}))
    assert "\n" not in str(error.value) and not (tmp_path / "run").exists()


def test_label_smoothing_is_keras_categorical_smoothing_on_one_hot_ids_and_saves():
    """--label_smoothing's loss equals Keras' CategoricalCrossentropy(label_smoothing) on the
    one-hot labels, weights included, and a model compiled with it saves and loads."""
    rng = np.random.default_rng(0)
    probabilities = rng.dirichlet(np.ones(5), size=8).astype(np.float32)
    labels = rng.integers(0, 5, 8)
    weights = rng.uniform(size=8).astype(np.float32)
    ours = SmoothedSparseCrossentropy(0.1)(labels, probabilities, sample_weight=weights)
    keras_loss = keras.losses.CategoricalCrossentropy(label_smoothing=0.1)
    expected = keras_loss(np.eye(5, dtype=np.float32)[labels], probabilities, sample_weight=weights)
    np.testing.assert_allclose(float(ours), float(expected), rtol=4 * np.finfo(np.float32).eps)
    assert (
        SmoothedSparseCrossentropy.from_config(SmoothedSparseCrossentropy(0.1).get_config()).label_smoothing
        == 0.1
    )
