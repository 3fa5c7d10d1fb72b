"""Tests for tfmp.input.mixing: Beta draws, Mixup and CutMix images and labels, sample weights,
label smoothing, determinism in eager, graph mode and tf.data maps, bad settings."""

import math

import numpy as np
import pytest
import tensorflow as tf

from tfmp.errors import UsageError
from tfmp.input import mixing

CLASSES = 5


def _batch(size=4, height=8, width=6):
    """Example i is filled with the value (i + 1) / 10: a pixel tells which example it came from."""
    values = (np.arange(size, dtype=np.float32) + 1) / 10
    images = tf.constant(np.broadcast_to(values[:, None, None, None], (size, height, width, 3)).copy())
    return images, tf.constant(np.arange(size) % CLASSES, tf.int32)


def _key(index):
    return tf.constant([11, index], tf.int64)


@pytest.mark.parametrize("alpha", [0.2, 1.0, 4.0])
def test_beta_samples_have_the_beta_mean_and_variance(alpha):
    """Beta(a, a): mean 1/2, variance 1/(4 (2a + 1)), excess kurtosis -6/(2a + 3); the tolerances
    are 5 standard errors of the sample mean and variance at this sample count."""
    count = 20_000
    samples = mixing.sample_beta(_key(0), alpha, [count]).numpy()
    assert samples.dtype == np.float32 and 0 <= samples.min() and samples.max() <= 1
    samples = samples.astype(np.float64)
    variance = 1 / (4 * (2 * alpha + 1))
    assert abs(samples.mean() - 0.5) < 5 * math.sqrt(variance / count)
    variance_error = math.sqrt(variance**2 * (2 - 6 / (2 * alpha + 3)) / count)
    assert abs(samples.var() - variance) < 5 * variance_error


def test_mixup_blends_images_and_labels_with_the_reversed_batch():
    images, labels = _batch()
    mixed, soft = mixing.mix_batch(images, labels, _key(1), num_classes=CLASSES, mixup_alpha=1.0)
    soft = soft.numpy()
    assert soft.shape == (4, CLASSES) and soft.dtype == np.float32
    np.testing.assert_allclose(soft.sum(axis=1), 1.0, rtol=1e-6)
    lam = soft[0, 0]  # example 0 (class 0) mixed with example 3 (class 3)
    assert 0 < lam < 1 and np.isclose(soft[0, 3], 1 - lam)
    for index, partner in enumerate((3, 2, 1, 0)):
        expected = np.zeros(CLASSES)
        expected[labels[index]] += lam
        expected[labels[partner]] += 1 - lam
        np.testing.assert_allclose(soft[index], expected, rtol=1e-6)
        np.testing.assert_allclose(mixed[index], lam * images[index] + (1 - lam) * images[partner], rtol=1e-6)


def test_cutmix_lambda_is_the_exact_unpasted_fraction():
    images, labels = _batch(height=8, width=6)
    values = images[:, 0, 0, 0].numpy()
    seen_clipped = False
    for index in range(30):
        mixed, soft = mixing.mix_batch(images, labels, _key(index), num_classes=CLASSES, cutmix_alpha=1.0)
        mixed, lam = mixed.numpy(), soft.numpy()[0, 0]
        pasted = mixed[0, :, :, 0] == values[3]  # example 0's pixels that came from example 3
        assert ((mixed[0] == values[0]) | pasted[:, :, None]).all()  # pasted, not blended
        assert lam == pytest.approx(1 - pasted.sum() / pasted.size, abs=1e-6)
        np.testing.assert_allclose(soft[0, 3], 1 - lam, atol=1e-6)
        rows, columns = np.nonzero(pasted.any(axis=1))[0], np.nonzero(pasted.any(axis=0))[0]
        if rows.size:  # one box: every pixel between the first and last pasted row and column
            assert pasted[rows[0] : rows[-1] + 1, columns[0] : columns[-1] + 1].all()
            seen_clipped |= rows[0] == 0 or rows[-1] == 7 or columns[0] == 0 or columns[-1] == 5
        for example in range(4):  # the same box in every example
            np.testing.assert_array_equal(mixed[example, :, :, 0] == values[3 - example], pasted)
    assert seen_clipped  # boxes that ran over an edge were clipped, and lam corrected


def test_switch_prob_picks_cutmix_or_mixup_per_batch():
    images, labels = _batch()
    values = images[:, 0, 0, 0].numpy()

    def kinds(switch_prob):
        found = []
        for index in range(20):
            mixed = mixing.mix_batch(
                images,
                labels,
                _key(index),
                num_classes=CLASSES,
                mixup_alpha=1.0,
                cutmix_alpha=1.0,
                switch_prob=switch_prob,
            )[0].numpy()
            pure = np.isin(mixed[0], values[[0, 3]]).all()  # every pixel one example's: CutMix
            found.append("cutmix" if pure else "mixup")
        return found

    assert set(kinds(1.0)) == {"cutmix"} and set(kinds(0.0)) == {"mixup"}
    assert set(kinds(0.5)) == {"cutmix", "mixup"}


def test_sample_weights_and_soft_labels_are_mixed_too():
    images, _ = _batch()
    soft_in = tf.constant(np.eye(CLASSES, dtype=np.float32)[[4, 3, 2, 1]])
    weights = tf.constant([1.0, 2.0, 3.0, 4.0])
    _, soft, mixed_weights = mixing.mix_batch(
        images, soft_in, _key(2), num_classes=CLASSES, mixup_alpha=1.0, sample_weight=weights
    )
    lam = soft.numpy()[0, 4]
    assert np.isclose(soft.numpy()[0, 1], 1 - lam)
    np.testing.assert_allclose(mixed_weights, lam * weights + (1 - lam) * weights[::-1], rtol=1e-6)
    _, _, unmixed = mixing.mix_batch(images, soft_in, _key(2), num_classes=CLASSES, sample_weight=weights)
    np.testing.assert_array_equal(unmixed, weights)


def test_label_smoothing_before_mixing():
    images, labels = _batch()
    _, smooth = mixing.mix_batch(images, labels, _key(3), num_classes=CLASSES, label_smoothing=0.1)
    expected = np.full((4, CLASSES), 0.1 / CLASSES, np.float32)
    expected[np.arange(4), labels.numpy()] += 0.9
    np.testing.assert_allclose(smooth, expected, rtol=1e-6)
    _, mixed = mixing.mix_batch(
        images, labels, _key(3), num_classes=CLASSES, label_smoothing=0.1, mixup_alpha=1.0
    )
    lam = (mixed.numpy()[0, 0] - 0.02) / 0.9  # class 0: lam (0.9 + 0.02) + (1 - lam) 0.02
    np.testing.assert_allclose(mixed, lam * expected + (1 - lam) * expected[::-1], rtol=1e-5)
    np.testing.assert_allclose(mixed.numpy().sum(axis=1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("dtype", [tf.uint8, tf.float16, tf.bfloat16])
def test_images_keep_their_dtype(dtype):
    images, labels = _batch()
    images = tf.cast(images * 200, dtype)
    for settings in ({"mixup_alpha": 1.0}, {"cutmix_alpha": 1.0}):
        mixed, _ = mixing.mix_batch(images, labels, _key(4), num_classes=CLASSES, **settings)
        assert mixed.dtype == dtype and mixed.shape == images.shape


def test_deterministic_by_key_and_the_same_in_graph_mode_and_tf_data_maps():
    images, labels = _batch()
    settings = {"num_classes": CLASSES, "mixup_alpha": 0.8, "cutmix_alpha": 1.0}
    eager = [mixing.mix_batch(images, labels, _key(index), **settings) for index in range(6)]
    again = mixing.mix_batch(images, labels, _key(0), **settings)
    np.testing.assert_array_equal(eager[0][0], again[0])
    np.testing.assert_array_equal(eager[0][1], again[1])
    assert len({result[1].numpy().tobytes() for result in eager}) == 6  # every key its own lambda
    keys = tf.stack([_key(index) for index in range(6)])
    examples = tf.data.Dataset.from_tensor_slices((images, labels))
    for batched in (examples.batch(4), examples.batch(4, drop_remainder=True)):  # unknown, static size
        pairs = tf.data.Dataset.zip(tf.data.Dataset.from_tensor_slices(keys), batched.repeat())
        mapped = pairs.map(lambda key, batch: mixing.mix_batch(*batch, key, **settings))
        assert mapped.element_spec[1].shape.as_list() == [batched.element_spec[0].shape[0], CLASSES]
        for (mixed, soft), (expected_images, expected_soft) in zip(mapped, eager):
            np.testing.assert_allclose(mixed, expected_images, atol=1e-6)
            np.testing.assert_allclose(soft, expected_soft, atol=1e-6)


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: mixing.check(-0.5, 0.0),
            "mixup_alpha -0.5 must be a finite number >= 0 (0 turns it off; DeiT: mixup 0.8, cutmix 1.0)",
        ),
        (lambda: mixing.check(0.0, float("nan")), "cutmix_alpha nan must be a finite number >= 0"),
        (lambda: mixing.check(float("inf"), 1.0), "mixup_alpha inf must be a finite number >= 0"),
        (lambda: mixing.check("1", 1.0), "mixup_alpha '1' must be a finite number >= 0"),
        (lambda: mixing.check(1.0, 1.0, switch_prob=1.5), "mixing switch_prob 1.5 must be in [0, 1]"),
        (lambda: mixing.check(1.0, 1.0, label_smoothing=1.0), "label_smoothing 1.0 must be in [0, 1)"),
        (lambda: mixing.Mixing(cutmix_alpha=-1), "cutmix_alpha -1 must be a finite number >= 0"),
        (lambda: mixing.Mixing(num_classes=0), "mixing num_classes 0 must be a positive integer"),
        (
            lambda: mixing.Mixing.of({"mixup": 0.8}),
            "unknown mixing setting(s) mixup; choose from: mixup_alpha",
        ),
        (lambda: mixing.Mixing.of([0.8]), "mixing must be a dict or tfmp.input.mixing.Mixing, got [0.8]"),
        (
            lambda: mixing.mix_batch(*_batch(), _key(0), num_classes=CLASSES, mixup_alpha=-1),
            "mixup_alpha -1 must be a finite number >= 0",
        ),
    ],
)
def test_bad_settings_are_one_line_usage_errors(call, message):
    with pytest.raises(UsageError) as error:
        call()
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_settings_from_a_dict_and_wrong_label_shapes():
    settings = mixing.Mixing.of({"mixup_alpha": 0.8, "cutmix_alpha": 1.0, "label_smoothing": 0.1})
    assert settings == mixing.Mixing(0.8, 1.0, 0.5, 0.1) and mixing.Mixing.of(settings) is settings
    images, _ = _batch()
    for labels in (tf.zeros([4, CLASSES + 1]), tf.zeros([4], tf.float32), tf.zeros([4, 1, 1], tf.int32)):
        with pytest.raises(ValueError, match="int class ids"):
            mixing.mix_batch(images, labels, _key(0), num_classes=CLASSES, mixup_alpha=1.0)
