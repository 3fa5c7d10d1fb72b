"""The precision doctor names the layers that break in half precision, and its cure works.

Every expectation holds by construction (an overflow that happens for any input in the range the
data are drawn from, error bounds from the dtype's epsilon), not from one lucky run.
"""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import run_python

import tfmp
from tfmp import precision
from tfmp.errors import UsageError

F16 = "mixed_float16"
FIT_STEPS = 4


def _regression_data(features=8, rows=32, batch=8, seed=0):
    generator = np.random.default_rng(seed)
    x = generator.uniform(0.5, 1.0, (rows, features)).astype("float32")
    y = generator.uniform(-1.0, 1.0, (rows, 1)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def _overflowing_model(dtype=F16):
    """`scale_up` multiplies the sum of 8 inputs in [0.5, 1] by 3e4: every output is >= 1.2e5,
    beyond float16's 65504, whatever the batch. `scale_down` brings it back to ~1, but in float16
    it would receive inf. The rest is ordinary."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,), name="x")
    big = keras.layers.Dense(
        4, use_bias=False, kernel_initializer=keras.initializers.Constant(3e4), dtype=dtype, name="scale_up"
    )(inputs)
    small = keras.layers.Rescaling(1e-5, dtype=dtype, name="scale_down")(big)
    hidden = keras.layers.Dense(8, activation="relu", dtype=dtype, name="hidden")(small)
    outputs = keras.layers.Dense(1, dtype="float32", name="out")(hidden)
    model = keras.Model(inputs, outputs, name="overflowing")
    model.dtype_policy = dtype  # as tfmp's builders do: compile adds loss scaling for float16
    return model


def _compiled(model, initial_scale=None):
    optimizer = keras.optimizers.SGD(0.01)
    if initial_scale:
        optimizer = precision.LossScaleOptimizer(optimizer, initial_scale=initial_scale)
    model.compile(optimizer, keras.losses.MeanSquaredError())
    return model


def _applied_steps(model) -> int:
    tfmp.fit(model, _regression_data(), epochs=1, steps_per_epoch=FIT_STEPS, verbose=0)
    return int(model.optimizer.iterations.numpy())


def test_overflowing_layer_is_named_and_its_float32_copy_trains_without_skipped_steps(tmp_path):
    model = _compiled(_overflowing_model())
    report = precision.diagnose(model, _regression_data(), steps=FIT_STEPS)  # the batches fit will see
    assert report.policy == F16 and report.loss_scale == precision.DEFAULT_INITIAL_SCALE
    assert report.float32_layers == ["scale_up", "scale_down"]
    by_name = {layer.name: layer for layer in report.layers}
    assert by_name["scale_up"].activation["overflow"] == 1.0  # every output, by construction
    assert by_name["scale_up"].activation["max_abs"] >= 1.2e5
    assert "outputs overflow float16" in by_name["scale_up"].reasons[F16][0]
    assert by_name["scale_down"].relative_error["float16"] == float("inf")  # its input is inf in float16
    assert report.float32_layers_for("mixed_bfloat16") == []  # bfloat16 has float32's range
    table = precision.format_report(report)
    assert "--float32_layers=scale_up,scale_down" in table
    saved = json.loads(open(precision.save_report(report, str(tmp_path))).read())
    assert saved["float32_layers"] == {F16: ["scale_up", "scale_down"], "mixed_bfloat16": []}

    # The gradients of `hidden` (the one float16 layer left) stay below 65504 at this scale.
    scale = report.safe_loss_scale
    assert 65504 / 2 < scale * by_name["hidden"].weight_gradient["max_abs"] <= 65504

    # Plain mixed_float16, starting at that same scale: the forward pass overflows on every
    # step, so every step is skipped and the dynamic loss scale halves each time.
    model = _compiled(_overflowing_model(), initial_scale=scale)
    assert _applied_steps(model) == 0
    assert precision.current_loss_scale(model.optimizer) == scale / 2**FIT_STEPS

    fixed = _compiled(
        precision.float32_layers(_overflowing_model(), report.float32_layers), initial_scale=scale
    )
    assert {layer.name: layer.dtype_policy.name for layer in fixed.layers[1:]} == {
        "scale_up": "float32",
        "scale_down": "float32",
        "hidden": F16,
        "out": "float32",
    }
    assert precision.diagnose(fixed, _regression_data(), steps=2).verdict() == precision.HEALTHY
    assert _applied_steps(fixed) == FIT_STEPS  # no step skipped
    assert precision.current_loss_scale(fixed.optimizer) == scale


def test_healthy_model_needs_no_float32_layer():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    scaled = keras.layers.Rescaling(0.5, dtype=F16, name="rescale")(inputs)  # weightless first layer
    hidden = keras.layers.Dense(16, activation="relu", dtype=F16, name="hidden")(scaled)
    outputs = keras.layers.Dense(1, dtype="float32", name="out")(hidden)
    model = _compiled(keras.Model(inputs, outputs, name="healthy"))
    report = precision.diagnose(model, _regression_data(), steps=2)
    assert report.float32_layers == [] and report.float32_layers_for("mixed_bfloat16") == []
    assert all(layer.output_gradient["max_abs"] > 0 for layer in report.layers)
    assert report.verdict() == "no layer needs float32"
    assert f"{F16}: no layer needs float32" in precision.format_report(report)
    assert report.steps == 2 and report.examples == 16


def test_relative_error_of_a_dense_layer_is_bounded_by_epsilon():
    # y = x . W with x, W >= 0: rounding x and W and every partial sum of n terms to a dtype with
    # unit roundoff u = eps / 2 gives |y_half - y| <= ((1 + u)^(n + 3) - 1) * y (no cancellation),
    # whatever order or precision the kernel accumulates in, so the norm-wise error is bounded too.
    n = 8
    inputs = keras.Input((n,))
    outputs = keras.layers.Dense(
        6, use_bias=False, kernel_initializer=keras.initializers.RandomUniform(0.0, 1.0, seed=3), name="dense"
    )(inputs)
    model = _compiled(keras.Model(inputs, outputs))
    report = precision.diagnose(model, _regression_data(features=n), steps=3)
    for dtype, epsilon in precision.EPSILON.items():
        error = report.layers[0].relative_error[dtype]
        assert 0 < error <= (1 + epsilon / 2) ** (n + 3) - 1
        assert error < report.error_thresholds[dtype]  # a well-conditioned layer is never flagged


def _weights(model):
    return [weight.numpy().copy() for weight in model.weights]


def test_diagnose_changes_no_weight_and_handles_shared_random_and_stateful_layers():
    keras.utils.set_random_seed(2)
    inputs = keras.Input((8,))
    shared = keras.layers.Dense(8, activation="tanh", name="shared")
    hidden = shared(shared(inputs))  # one layer, two calls
    hidden = keras.layers.BatchNormalization(name="norm")(hidden)  # moving statistics
    hidden = keras.layers.Dropout(0.5, name="dropout")(hidden)  # random in training
    model = _compiled(keras.Model(inputs, keras.layers.Dense(1, name="out")(hidden)))
    before = _weights(model)
    report = precision.diagnose(model, _regression_data(), steps=2)
    for old, new in zip(before, _weights(model)):
        np.testing.assert_array_equal(old, new)
    assert int(model.optimizer.iterations.numpy()) == 0
    by_name = {layer.name: layer for layer in report.layers}
    assert by_name["shared"].calls == 2 and by_name["norm"].calls == 1
    # Dropout is compared with itself in inference mode, not across two random masks.
    assert by_name["dropout"].relative_error["float16"] < report.error_thresholds["float16"]
    assert report.verdict() == precision.HEALTHY


def test_float32_layers_copies_weights_and_refuses_patterns_that_match_nothing():
    model = _overflowing_model()
    copy = precision.float32_layers(model, ["scale_.*"])
    assert [layer.dtype_policy.name for layer in copy.layers[1:]] == ["float32", "float32", F16, "float32"]
    assert copy.dtype_policy.name == F16
    for old, new in zip(_weights(model), _weights(copy)):
        np.testing.assert_array_equal(old, new)
    assert precision.matching_layers(model, ["hid+en", "out"]) == ["hidden", "out"]
    with pytest.raises(UsageError, match=r"'scale' matches no layer .*whole name.*scale_up, scale_down"):
        precision.float32_layers(model, ["scale"])
    with pytest.raises(UsageError, match=r"'\(' is not a regular expression"):
        precision.float32_layers(model, ["("])


def test_sequential_models_are_diagnosed_and_subclassed_ones_refused():
    keras.utils.set_random_seed(0)
    sequential = _compiled(
        keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(4, name="a"), keras.layers.Dense(1, name="b")]
        )
    )
    report = precision.diagnose(sequential, _regression_data(), steps=1)
    assert [layer.name for layer in report.layers] == ["a", "b"] and report.verdict() == precision.HEALTHY

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

    subclassed = _compiled(Subclassed())
    subclassed(np.zeros((1, 8), "float32"))
    with pytest.raises(UsageError, match="subclassed Subclassed"):
        precision.diagnose(subclassed, _regression_data())


def test_diagnose_refuses_what_it_cannot_measure():
    model = _overflowing_model()
    with pytest.raises(UsageError, match="compiled"):
        precision.diagnose(model, _regression_data())
    model = _compiled(model)
    with pytest.raises(UsageError, match="steps=0"):
        precision.diagnose(model, _regression_data(), steps=0)
    with pytest.raises(UsageError, match="no batch"):
        precision.diagnose(model, _regression_data().take(0))
    with pytest.raises(UsageError, match="policy='float32'"):
        precision.diagnose(model, _regression_data(), policy="float32")


@pytest.mark.slow  # each starts TensorFlow in a new process
@pytest.mark.parametrize(
    "app, extra",
    [
        ("classify", ["--global_batch_size=16"]),
        ("mnist", ["--global_batch_size=16"]),
        ("detect", ["--global_batch_size=2"]),
    ],
)
def test_app_flag_writes_the_report_and_trains_nothing(tmp_path, app, extra):
    result = run_python(
        [
            "-m",
            f"apps.{app}",
            "--precision=mixed_float16",
            "--diagnose_precision",
            "--diagnose_steps=1",
            f"--model_dir={tmp_path}",
            *extra,
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / precision.REPORT_FILE).read_text())
    assert report["steps"] == 1 and report["policy"] == F16 and report["layers"]
    assert report["float32_layers"] == {F16: [], "mixed_bfloat16": []}  # the built-in models are healthy
    assert f"{F16}: no layer needs float32" in result.stdout
    assert sorted(path.name for path in tmp_path.iterdir()) == [precision.REPORT_FILE]  # no training


@pytest.mark.slow
def test_app_float32_layers_flag_builds_them_in_float32_and_says_so(tmp_path):
    patterns = "seed_cnn_dense,seed_cnn_conv[12]"
    result = run_python(
        [
            "-m",
            "apps.classify",
            "--precision=mixed_float16",
            f"--float32_layers={patterns}",
            "--steps=2",
            "--global_batch_size=16",
            f"--model_dir={tmp_path}",
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    card = json.loads((tmp_path / "run_card.json").read_text())
    assert (
        card["float32 layers"]
        == f"seed_cnn_conv1, seed_cnn_conv2, seed_cnn_dense (--float32_layers={patterns})"
    )
    assert f"--float32_layers={patterns}" in (tmp_path / "flags.txt").read_text()
    saved = keras.saving.load_model(tmp_path / "model.keras", compile=False)
    dtypes = {layer.name: layer.dtype_policy.name for layer in saved.layers}
    assert (
        dtypes["seed_cnn_conv1"] == dtypes["seed_cnn_dense"] == "float32" and dtypes["seed_cnn_conv3"] == F16
    )

    bad = run_python(["-m", "apps.classify", "--float32_layers=nope", f"--model_dir={tmp_path / 'bad'}"])
    assert bad.returncode == 2 and "error: float32 layer pattern 'nope' matches no layer" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "bad").exists()
