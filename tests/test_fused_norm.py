"""fuse_normalization: BatchNormalization on TensorFlow's fused kernel computes Keras' numbers.

    .venv/bin/python -m pytest tests/test_fused_norm.py -q -n 0

Every check compares a fused layer or model with a fresh Keras copy holding identical weights:
outputs within 2 epsilons of the compute dtype (each side rounds once) plus float32 epsilon x the
summed terms (sums in another order), times the values' scale (tests/fused_scaffolding.py). The
2-worker cell runs in the shared launched group (tests/mwms_worker.py calls `worker_cells`).
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
    assert_replicas_identical,
    engine_step,
    launched_cell,
    layer_pair,
    print_worker_cell,
    relative_tolerance,
)

import tfmp  # noqa: E402
from tfmp.classification.task import TASK  # noqa: E402
from tfmp.errors import UsageError  # noqa: E402
from tfmp.precision import conv  # noqa: E402
from tfmp.precision.fused_norm import fuse_normalization, is_fused, unfused  # noqa: E402
from tfmp.training.config import TrainConfig  # noqa: E402
from tfmp.training.plan import make_plan  # noqa: E402
from tfmp.training.run import build_model, train_and_evaluate  # noqa: E402

POLICIES = ["float32", "mixed_float16", "mixed_bfloat16"]
SHAPE = (4, 6, 6, 8)  # NHWC
TERMS = 4 * 6 * 6  # elements per channel that each batch statistic sums
VARIANTS = {
    "defaults": {},
    "nchw-no-center": {"axis": 1, "center": False, "momentum": 0.9, "epsilon": 1e-5},
    "no-scale": {"scale": False, "momentum": 0.5},
    "frozen": {"trainable": False},
}
IMAGE, CLASSES, ROWS = (6, 6, 3), 4, 8
GLOBAL_BATCH, STEPS = 2 * ROWS, 3
STATISTIC_TERMS = GLOBAL_BATCH * IMAGE[0] * IMAGE[1]  # a whole-model batch statistic's terms


def _layer_pair(policy, config):
    """A fused BatchNormalization and a Keras copy with the same random weights (gamma and the
    moving variance in 0.5..2), and the input shape (NCHW for axis 1)."""
    shape = (SHAPE[0], SHAPE[3], *SHAPE[1:3]) if config.get("axis") == 1 else SHAPE
    positive = ("gamma", "moving_variance")
    layers = layer_pair(
        lambda: keras.layers.BatchNormalization(dtype=policy, **config),
        shape,
        lambda w, rng: rng.uniform(0.5, 2, w.shape) if w.name in positive else rng.normal(0, 1, w.shape),
    )
    return layers, shape


def _forward_backward(layer, x, upstream, training):
    """Output, input gradient and gamma/beta gradients of sum(output * upstream)."""
    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=training)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * upstream)
    grads = tape.gradient(loss, [x, *layer.trainable_weights])
    return y, [g.numpy() for g in grads]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("policy", POLICIES)
def test_layer_matches_keras(policy, variant):
    """Outputs, input and gamma/beta gradients (training=None/False/True), and the moving
    statistics after 3 training calls, in each policy and configuration."""
    config = VARIANTS[variant]
    (fused, reference), shape = _layer_pair(policy, config)
    compute = fused.compute_dtype
    rng = np.random.default_rng(1)
    batches = [rng.normal(1.0, 3.0, shape).astype(np.float32) for _ in range(3)]
    before = [w.numpy() for w in reference.non_trainable_weights]
    for x in batches:
        fused(x, training=True)
        reference(x, training=True)
    for mine, theirs in zip(fused.non_trainable_weights, reference.non_trainable_weights):
        # float32 statistics of the same half-precision inputs: float32 rounding only.
        assert_close(mine.numpy(), theirs.numpy(), "float32", TERMS, what=mine.name)
    if config.get("trainable") is False:  # frozen: Keras never updates the statistics
        for start, weight in zip(before, fused.non_trainable_weights):
            np.testing.assert_array_equal(weight.numpy(), start)

    x, upstream = batches[0], rng.normal(0, 1, shape).astype(np.float32)
    for training in (None, False, True):
        y, grads = _forward_backward(fused, x, upstream, training)
        y_ref, grads_ref = _forward_backward(reference, x, upstream, training)
        assert y.dtype == y_ref.dtype == compute
        assert_close(y, y_ref, compute, TERMS, what=f"output, training={training}")
        assert_close(grads[0], grads_ref[0], compute, TERMS, what=f"input gradient, training={training}")
        scale = _sum_scale(x, upstream, reference)
        for mine, theirs, weight in zip(grads[1:], grads_ref[1:], fused.trainable_weights):
            assert_close(
                mine, theirs, "float32", TERMS, scale=scale, what=f"{weight.name}, training={training}"
            )


def _sum_scale(x, upstream, layer):
    """gamma's and beta's gradients are float32 sums over TERMS terms, each at most |upstream| x
    |normalised input| (under the batch's or the moving statistics): the largest such sum."""
    axes, shape = tuple(axis for axis in range(4) if axis != layer.axis % 4), [1, 1, 1, 1]
    shape[layer.axis % 4] = -1
    x = np.asarray(x, np.float64)
    batch = (x - x.mean(axes, keepdims=True)) / np.sqrt(x.var(axes, keepdims=True) + layer.epsilon)
    mean, variance = (np.reshape(w.numpy(), shape) for w in (layer.moving_mean, layer.moving_variance))
    moving = (x - mean) / np.sqrt(variance + layer.epsilon)
    return np.abs(upstream).sum(axis=axes).max() * max(np.abs(batch).max(), np.abs(moving).max(), 1.0)


def tiny_conv_model(policy="float32", seed=1) -> keras.Model:
    """conv -> BN -> relu twice, global pool, a float32 Dense head (logits); seeded weights."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(IMAGE)
    x = inputs
    for index in range(2):
        x = keras.layers.Conv2D(8, 3, padding="same", use_bias=False, dtype=policy, name=f"conv{index}")(x)
        x = keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-5, dtype=policy, name=f"bn{index}")(x)
        x = keras.layers.ReLU(dtype=policy)(x)
    x = keras.layers.GlobalAveragePooling2D(dtype=policy)(x)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, dtype="float32", name="head")(x), name="tiny")


def tiny_data(steps=1):
    """`steps` global batches of GLOBAL_BATCH rows whose two halves are the same ROWS rows: each
    of 2 replicas sees what one device sees, so BatchNorm's per-replica statistics equal the
    global batch's and replicas can match one device (and each other) to rounding."""
    rng = np.random.default_rng(2)
    images = rng.normal(0.5, 1.0, (steps, ROWS, *IMAGE)).astype(np.float32)
    labels = rng.integers(0, CLASSES, (steps, ROWS)).astype(np.int32)
    twice = lambda a: np.concatenate([a, a], axis=1).reshape(-1, *a.shape[2:])  # noqa: E731
    return twice(images), twice(labels)


def _eager_training(model, steps=STEPS):
    """Per-step losses of plain SGD on the tiny data (no loss scaling: these gradients are far
    from float16's range limits)."""
    images, labels = tiny_data(steps)
    optimizer = keras.optimizers.SGD(0.1)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    losses = []
    for step in range(steps):
        rows = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        with tf.GradientTape() as tape:
            loss = loss_fn(labels[rows], model(images[rows], training=True))
        optimizer.apply(tape.gradient(loss, model.trainable_weights), model.trainable_weights)
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("policy", POLICIES)
def test_conv_model_trains_like_keras(policy):
    """STEPS SGD steps of the tiny conv model, fused vs Keras: loss curves and every final weight
    (moving statistics included) within the compute dtype's rounding; the traced step runs
    FusedBatchNormV3 and its gradient on inputs in the compute dtype."""
    fused, reference = tiny_conv_model(policy), tiny_conv_model(policy)
    start = [w.numpy() for w in fused.weights]
    reference.set_weights(start)
    # float16 convolutions are fused too (tfmp.precision.conv: their gradients from float32 copies).
    convs = ("tiny/conv0", "tiny/conv1") if policy == "mixed_float16" else ()
    assert sorted(fuse_normalization(fused).fused) == sorted(("tiny/bn0", "tiny/bn1", *convs))
    # The reference's float16 convolutions take their gradients as the fused model's do (float32
    # copies): Keras' own come from TensorFlow's float16 Conv2DBackpropFilter, itself off by up to
    # 4 float16 epsilons of the gradient on a CPU (vs float64, the AVX2 EPYC), which 3 steps
    # through 2 layers grow past BatchNorm's rounding. tests/test_fused_conv.py holds the
    # convolutions to Keras'; this test holds BatchNorm to Keras'.
    for layer in reference.layers:
        if policy == "mixed_float16" and isinstance(layer, keras.layers.Conv2D):
            layer.call = types.MethodType(conv.fused_call, layer)
    losses, reference_losses = _eager_training(fused), _eager_training(reference)
    compute = keras.mixed_precision.Policy(policy).compute_dtype
    # Per step, each BatchNorm output may round once differently on each side, and each batch
    # statistic sums GLOBAL_BATCH x 6 x 6 terms in another order.
    tolerance = dict(dtype=compute, terms=STEPS * STATISTIC_TERMS, roundings=STEPS * 2 * 2)
    np.testing.assert_allclose(losses, reference_losses, rtol=relative_tolerance(**tolerance))
    for before, mine, theirs in zip(start, fused.weights, reference.weights):
        update = theirs.numpy() - before
        assert_close(mine.numpy() - before, update, **tolerance, what=mine.path)
        assert np.abs(update).max() > 0, f"{mine.path} did not change"

    graph = tf.function(_step_graph).get_concrete_function(fused, tf.TensorSpec((2, *IMAGE))).graph
    ops = [op.type for op in graph.get_operations()]
    assert ops.count("FusedBatchNormV3") == 2 and ops.count("FusedBatchNormGradV3") == 2, ops
    inputs = [op.inputs[0].dtype.name for op in graph.get_operations() if op.type == "FusedBatchNormV3"]
    assert inputs == [compute, compute]


def _step_graph(model, images):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(images, training=True))
    return tape.gradient(loss, model.trainable_weights)


def trained_once(strategy, fused, xla=False, start=None):
    """(weights before, the model) after one Engine step of the tiny model on `strategy`, every
    input pipeline (worker) reading the same rows: each replica gets the same ROWS (tiny_data)."""

    def build():
        model = tiny_conv_model()
        if start is not None:
            model.set_weights(start)
        if fused:
            assert len(fuse_normalization(model).fused) == 2
        return model

    return engine_step(strategy, build, tiny_data(), GLOBAL_BATCH, shard=False, xla=xla)


@pytest.fixture(scope="module")
def one_device():
    """Keras' own BatchNorm, one step on one device: (weights before, weights after)."""
    before, model = trained_once(tf.distribute.OneDeviceStrategy("/cpu:0"), fused=False)
    return before, [w.numpy() for w in model.weights]


def assert_like_one_device(one_device, after, what=""):
    """Every weight (moving statistics too) moved as Keras' one-device step moved it, within
    float32 rounding of the batch statistics' and gradients' sums."""
    before, reference = one_device
    for index, (start, theirs, mine) in enumerate(zip(before, reference, after)):
        update = theirs - start
        assert np.abs(update).max() > 0, f"weight {index} did not change"
        assert_close(mine - start, update, "float32", terms=STATISTIC_TERMS, what=f"{what} weight {index}")


@pytest.mark.parametrize("xla", [False, True], ids=["xla-off", "xla-on"])
def test_mirrored_replicas_identical_and_like_one_device(mirrored, one_device, xla):
    """2 in-process replicas, each with the same rows: every replica's copy of every variable
    identical, and equal to Keras' BatchNorm on one device within rounding."""
    _, model = trained_once(mirrored, fused=True, xla=xla, start=one_device[0])
    assert_replicas_identical(model)
    assert_like_one_device(one_device, [w.numpy() for w in model.weights], f"xla={xla}")


def worker_cells(strategy, out_dir):
    """The launched group's cell (tests/mwms_worker.py): one fused Engine step of the tiny model
    on this strategy, every variable to `out_dir`/fused_norm-<task>.npz and one JSON line."""
    before, model = trained_once(strategy, fused=True)
    # Keras' seeded initialisation, the same on every worker and in the one-device reference.
    assert all(np.array_equal(a, b) for a, b in zip(before, [w.numpy() for w in tiny_conv_model().weights]))
    multi_worker = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
    print_worker_cell(
        strategy, "fused_norm", out_dir, [w.numpy() for w in model.weights], multi_worker=multi_worker
    )


@pytest.mark.slow
def test_two_workers_identical_and_like_one_device(launched_workers, one_device):
    """The shared launched group's 2 workers (MultiWorkerMirroredStrategy, one replica each, the
    same rows): both end the fused step with identical variables, Keras' one-device step's."""
    records, weights = launched_cell(launched_workers, "fused_norm")
    assert all(record["multi_worker"] for record in records), records
    assert_like_one_device(one_device, weights, "worker 0")


def test_saved_fused_model_loads_in_plain_keras(tmp_path):
    """A fused, trained model saved to .keras: the same config.json as before fusing, and a
    fresh process that imports only keras and numpy predicts what the fused model predicts."""
    from conftest import run_python

    model = tiny_conv_model()
    model.save(tmp_path / "unfused.keras")
    config = model.get_config()
    fuse_normalization(model)
    assert model.get_config() == config
    assert [type(model.get_layer(f"bn{i}")) for i in (0, 1)] == [keras.layers.BatchNormalization] * 2
    _eager_training(model)
    images, _ = tiny_data()
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
    assert loaded["tfmp"] == [] and "BatchNormalization" in loaded["classes"]
    # Inference through 2 BatchNorms, 2 convs (at most 72 terms) and the head, in float32.
    assert_close(np.load(paths[2]), predictions, "float32", terms=2 * 72, what="predictions")


class _Block(keras.layers.Layer):
    """A custom layer holding a BatchNormalization as an attribute (not a keras.Model)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = keras.layers.BatchNormalization(name="inner_bn")

    def call(self, inputs, training=None):
        return self.norm(inputs, training=training)


def test_nested_layers_fused_and_the_rest_listed_with_reasons(monkeypatch):
    """Layers inside nested models and custom layers are found (a shared one once); a BN on a
    2-D input, a synchronized one and one on axis 2 are left alone, each with its reason."""
    shared = keras.layers.BatchNormalization(name="shared_bn")
    stack = keras.Sequential([keras.Input((6, 6, 4)), _Block(name="block"), shared], name="stack")
    inputs = keras.Input((6, 6, 3))
    x = keras.layers.Conv2D(4, 3, padding="same")(inputs)
    x = shared(stack(x))
    x = keras.layers.BatchNormalization(synchronized=True, name="sync_bn")(x)
    x = keras.layers.BatchNormalization(axis=2, name="width_bn")(x)
    x = keras.layers.BatchNormalization(name="flat_bn")(keras.layers.GlobalAveragePooling2D()(x))
    model = keras.Model(inputs, x, name="model")
    result = fuse_normalization(model)
    assert result.fused == ("model/stack/block/inner_bn", "model/stack/shared_bn")
    assert result.left_alone == (
        ("model/sync_bn", "synchronized=True (cross-replica statistics)"),
        ("model/width_bn", "axis 2 (the kernel normalises axis 1 or 3 of a 4-D input)"),
        ("model/flat_bn", "2-D input"),
    )
    assert fuse_normalization(model) == result  # fusing twice changes nothing
    assert not any(is_fused(model.get_layer(name)) for name in ("sync_bn", "width_bn", "flat_bn"))
    unbuilt = fuse_normalization(keras.Sequential([keras.layers.BatchNormalization(name="bn")], name="seq"))
    assert unbuilt.left_alone == (("seq/bn", "not built: call or build the model first"),)
    # MIOpen refuses epsilon < 1e-5: on a ROCm build the tiny model's epsilon=1e-5 layers stay
    # Keras' (CPU, oneDNN, XLA and cuDNN >= 7.5 take any epsilon: the other tests use 1e-5).
    monkeypatch.setattr(tf.test, "is_built_with_rocm", lambda: True)
    rocm, reason = fuse_normalization(tiny_conv_model()), "epsilon 1e-05 below ROCm's fused minimum 1.001e-05"
    assert rocm.fused == () and rocm.left_alone[0] == ("tiny/bn0", reason)


def test_a_non_model_is_refused_in_one_line():
    for argument in ("resnet", keras.layers.BatchNormalization()):
        with pytest.raises(UsageError, match="^fuse_normalization takes a keras.Model, got [^\n]*$") as error:
            fuse_normalization(argument)
    assert "got BatchNormalization <BatchNormalization" in str(error.value)
    with pytest.raises(UsageError, match="^fuse_normalization takes a keras.Model, got str 'resnet'; "):
        fuse_normalization("resnet")


def test_a_masked_call_runs_keras_own_computation():
    """Masked statistics have no fused kernel: the fused layer gives Keras' masked numbers."""
    (fused, reference), shape = _layer_pair("float32", {})
    rng = np.random.default_rng(3)
    x, mask = rng.normal(0, 1, shape).astype(np.float32), rng.random(shape[:3]) > 0.3
    np.testing.assert_array_equal(fused(x, training=True, mask=mask), reference(x, training=True, mask=mask))


@pytest.mark.parametrize("fused", [True, False], ids=["fused_norm", "nofused_norm"])
def test_runs_fuse_their_builders_batch_norms_unless_told_not_to(tmp_path, fused):
    """tfmp's runs fuse every BatchNormalization of the built model (resnet20: 19) by default,
    say so in the run card, and `--nofused_norm` leaves Keras' layer in place to compare."""
    config = TrainConfig.from_flat(
        model="resnet20",
        dataset="synthetic",
        image_size=8,
        global_batch_size=8,
        steps=1,
        steps_per_epoch=1,
        precision="mixed_bfloat16",
        fused_norm=fused,
        strategy="default",
        model_dir=str(tmp_path),
        verbose=False,
    )
    plan = make_plan(config, TASK)
    model = build_model(config, plan, TASK)
    norms = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    assert len(norms) == 19 and all(is_fused(layer) == fused for layer in norms)
    assert unfused(model) == (() if fused else tuple(f"{model.name}/{layer.name}" for layer in norms))
    train_and_evaluate(config, TASK)
    card = json.load(open(tmp_path / "run_card.json"))["normalization"]
    assert card == ("19 on the fused kernel" if fused else "19 on Keras' layer (--nofused_norm)")


def test_fit_tells_once_what_fusing_would_change(tmp_path, caplog):
    model = tiny_conv_model()
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    images = np.zeros((GLOBAL_BATCH, *IMAGE), np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((images, np.zeros(GLOBAL_BATCH, np.int32))).batch(ROWS)
    for _ in range(2):
        tfmp.fit(model, dataset, epochs=1, model_dir=str(tmp_path / "run"), verbose=0)
    hints = [record.getMessage() for record in caplog.records if "fuse_normalization" in record.getMessage()]
    assert len(hints) == 1 and hints[0].startswith(
        "tfmp: 2 normalization, attention, GELU or float16 convolution layer(s) run Keras' layer;"
    )
    card = json.load(open(tmp_path / "run" / "run_card.json"))["normalization"]
    assert card.startswith("2 layer(s) on Keras' layer; tfmp.fuse_normalization(model) before fit")
    fuse_normalization(model)
    tfmp.fit(model, dataset, epochs=1, model_dir=str(tmp_path / "fused"), verbose=0)
    assert "normalization" not in json.load(open(tmp_path / "fused" / "run_card.json"))
