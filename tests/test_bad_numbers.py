"""Bad numbers: NaN or inf in the data, and float16 that overflows at every loss scale.

A NaN in the features at step k stops `tfmp.fit` with one line naming the data and step k, and
the model keeps exactly the weights it had after step k-1 (on every replica, with XLA or not, in
float32, mixed_bfloat16 and mixed_float16); float16 that overflows from finite inputs is skipped
by the loss scaler until its scale falls below 1 or `skip_limit` steps in a row, then stops with
one line; the streak resumes from a checkpoint. The apps exit 3 with one `error:` line.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import finish, start_python

import tfmp
from tfmp import precision
from tfmp.errors import NonFiniteInput, TrainingDiverged
from tfmp.precision import loss_scaling

BATCH = 8
FEATURES = 6


def _model(strategy, policy="float32", loss="sparse", initial_scale=None):
    """A two-layer classifier (or regressor) built and compiled in `strategy`'s scope."""
    keras.utils.set_random_seed(0)
    with strategy.scope():
        outputs = 3 if loss == "sparse" else 1
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(8, activation="relu", dtype=policy),
                keras.layers.Dense(outputs, dtype=policy),
            ]
        )
        optimizer = keras.optimizers.Adam(0.01)
        if initial_scale is not None:
            optimizer = precision.wrap_optimizer(optimizer, policy, "dynamic", initial_scale=initial_scale)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True) if loss == "sparse" else "mse"
        model.compile(optimizer, loss_fn, auto_scale_loss=initial_scale is None)
    return model


def _data(examples=64):
    rng = np.random.default_rng(0)
    return rng.random((examples, FEATURES), dtype=np.float32), rng.integers(0, 3, examples)


def _replica_copies(model):
    return [[copy.numpy() for copy in getattr(w.value, "values", [w.value])] for w in model.trainable_weights]


@pytest.mark.parametrize(
    "policy, xla",
    [("float32", False), ("float32", True), ("mixed_bfloat16", False), ("mixed_float16", False)],
)
def test_nan_features_stop_at_their_step_and_keep_the_weights_before(mirrored, policy, xla):
    """Step 3 of 8 (the middle of a 4-step host call) has a NaN in a row of replica 1 only."""
    images, labels = _data()
    bad_step = 3
    poisoned = images.copy()
    poisoned[(bad_step - 1) * BATCH + 5, 2] = np.nan  # rows 4..7 of a global batch: replica 1
    settings = dict(batch_size=BATCH, shuffle=False, verbose=0, steps_per_execution=4, xla=xla)
    reference = _model(mirrored, policy)
    tfmp.fit(reference, images[: (bad_step - 1) * BATCH], labels[: (bad_step - 1) * BATCH], **settings)
    model = _model(mirrored, policy)
    with pytest.raises(NonFiniteInput) as stopped:
        tfmp.fit(model, poisoned, labels, **settings)
    message = str(stopped.value)
    assert message.startswith(f"the training data's features hold NaN or inf at step {bad_step}: ")
    assert f"keeps its weights of step {bad_step - 1}" in message and "learning rate" not in message
    assert "\n" not in message
    for expected, copies in zip(_replica_copies(reference), _replica_copies(model)):
        for copy in copies:  # both replicas, bit for bit
            np.testing.assert_array_equal(copy, expected[0])


@pytest.mark.parametrize("part", ["labels", "sample weights"])
def test_nan_labels_or_sample_weights_are_named(part):
    images, _ = _data()
    targets = np.random.default_rng(1).random((64, 1), dtype=np.float32)
    weights = np.ones(64, np.float32)
    (targets if part == "labels" else weights)[BATCH + 1] = np.inf
    model = _model(tf.distribute.get_strategy(), loss="mse")
    with pytest.raises(NonFiniteInput, match=f"^the training data's {part} hold NaN or inf at step 2: "):
        tfmp.fit(model, images, targets, sample_weight=weights, batch_size=BATCH, shuffle=False, verbose=0)


def _overflowing(examples=BATCH):
    """Finite float32 inputs that float16 cannot hold (its largest is 65504): every step overflows."""
    return np.full((examples, FEATURES), 1e5, np.float32), np.zeros(examples, np.int64)


def test_float16_overflow_is_skipped_until_the_scale_falls_below_1(mirrored):
    model = _model(mirrored, "mixed_float16", initial_scale=2.0**15)
    before = _replica_copies(model)
    images, labels = _overflowing(40 * BATCH)
    with pytest.raises(TrainingDiverged) as stopped:
        tfmp.fit(model, images, labels, batch_size=BATCH, shuffle=False, verbose=0, steps_per_execution=8)
    assert not isinstance(stopped.value, NonFiniteInput)
    # 2^15 halves to 1 in 15 skips; the 16th (an overflow at scale 1) takes it below 1.
    assert str(stopped.value).startswith(
        "float16 loss scaling skipped 16 step(s) in a row up to step 16 for non-finite gradients from "
        "finite inputs (loss scale fell below 1, its floor: now 0.5)"
    )
    for now, start in zip(_replica_copies(model), before):  # every step skipped, on both replicas
        for copy, first in zip(now, start):
            np.testing.assert_array_equal(copy, first)


def test_float16_overflow_stops_after_the_skip_limit_in_a_row():
    """A scale that had grown to 2^60 stays above 1 after 32 skips: the limit stops the run."""
    model = _model(tf.distribute.get_strategy(), "mixed_float16", initial_scale=2.0**15)
    images, labels = _data(BATCH)
    tfmp.fit(model, images, labels, batch_size=BATCH, verbose=0)  # builds the optimizer
    model.optimizer.dynamic_scale.assign(2.0**60)
    limit = loss_scaling.skip_limit(model.optimizer)
    images, labels = _overflowing(40 * BATCH)
    with pytest.raises(TrainingDiverged) as stopped:
        tfmp.fit(model, images, labels, batch_size=BATCH, shuffle=False, verbose=0, steps_per_execution=8)
    assert str(stopped.value).startswith(
        f"float16 loss scaling skipped {limit} step(s) in a row up to step {limit} for non-finite "
        f"gradients from finite inputs ({limit} in a row is the limit; loss scale now {2.0 ** (60 - limit):g})"
    )


def test_the_skip_streak_resumes_from_a_checkpoint(tmp_path):
    """10 skips, checkpoint, resume: the resumed run stops at step 16 with 16 in a row, as an
    uninterrupted one does (the scale and the streak are both in the checkpoint)."""
    images, labels = _overflowing(20 * BATCH)
    settings = dict(batch_size=BATCH, shuffle=False, verbose=0, steps_per_epoch=5, model_dir=str(tmp_path))
    strategy = tf.distribute.get_strategy()
    tfmp.fit(_model(strategy, "mixed_float16", initial_scale=2.0**15), images, labels, epochs=2, **settings)
    resumed = _model(strategy, "mixed_float16", initial_scale=2.0**15)
    with pytest.raises(
        TrainingDiverged, match=r"^float16 loss scaling skipped 16 step\(s\) in a row up to step 16 "
    ):
        tfmp.fit(resumed, images, labels, epochs=4, **settings)
    assert precision.current_loss_scale(resumed.optimizer) == 0.5


NAN_IN_SYNTHETIC = """
import numpy as np, tensorflow as tf
from tfmp.classification import data
from apps import cli, classify
synthetic = data._synthetic
def with_a_nan(*args, **kwargs):
    first_pixel = tf.one_hot([[0]], 16 * 16 * 3)[0]  # the test's one way in: a NaN in one pixel
    nan = lambda images: images + tf.reshape(tf.where(first_pixel > 0, np.nan, 0.0), (1, 16, 16, 3))
    return synthetic(*args, **kwargs).map(lambda images, labels: (nan(images), labels))
data._synthetic = with_a_nan
cli.run(classify.main)
"""


@pytest.mark.slow
def test_apps_stop_on_bad_numbers_with_one_line_and_exit_3(tmp_path):
    """A NaN pixel in the data, and a float16 model that overflows at every scale."""
    common = ["--dataset=synthetic", "--image_size=16", "--global_batch_size=8", "--steps=40"]
    nan_input = start_python(["-c", NAN_IN_SYNTHETIC, *common, f"--model_dir={tmp_path / 'nan'}"])
    overflow = start_python(
        ["-m", "apps.classify", *common, "--precision=mixed_float16", "--learning_rate=1e30"]
        + [f"--model_dir={tmp_path / 'overflow'}"]
    )
    expected = {
        nan_input: "error: the training data's features hold NaN or inf at step 1: ",
        overflow: "error: float16 loss scaling skipped 16 step(s) in a row up to step 17 ",
    }
    for process, first_words in expected.items():
        result = finish(process)
        assert result.returncode == 3, result.stderr[-3000:]
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(first_words), result.stderr[-3000:]
        assert "Traceback" not in result.stderr
