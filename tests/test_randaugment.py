"""Tests for tfmp.input.randaugment: every op's contract, its effect at magnitude 10 (the colour
ops against PIL, which timm's RandAugment runs), determinism by key, tf.data maps, bad input."""

import numpy as np
import PIL.Image
import PIL.ImageEnhance
import PIL.ImageOps
import pytest
import tensorflow as tf

from tfmp.errors import UsageError
from tfmp.input import randaugment

GEOMETRIC = ("rotate", "shear_x", "shear_y", "translate_x", "translate_y")
MAGNITUDE_FREE = ("identity", "auto_contrast", "equalize")


def _image(channels, size=16, seed=0):
    """A float32 image with all 8-bit levels in [64, 191]: room for every op to show."""
    levels = np.random.default_rng(seed).integers(64, 192, (size, size, channels))
    return tf.constant(levels / 255.0, tf.float32)


@pytest.mark.parametrize("name", randaugment.OPS)
def test_every_op_keeps_shape_dtype_and_range(name):
    for channels in (1, 3):
        for magnitude, sign in ((10, 1.0), (10, -1.0), (4.5, 1.0)):
            result = randaugment.apply(name, _image(channels), magnitude, sign)
            assert result.shape == (16, 16, channels) and result.dtype == tf.float32, (name, channels)
            assert 0.0 <= float(tf.reduce_min(result)) and float(tf.reduce_max(result)) <= 1.0


@pytest.mark.parametrize("name", sorted(set(randaugment.OPS) - set(MAGNITUDE_FREE)))
def test_magnitude_zero_is_the_identity(name):
    for channels in (1, 3):
        image = _image(channels)
        np.testing.assert_allclose(randaugment.apply(name, image, 0, -1.0), image, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("name", sorted(set(randaugment.OPS) - {"identity"}))
def test_every_op_changes_the_image_at_magnitude_10(name):
    for channels in (1, 3) if name != "color" else (3,):  # color of one channel: the identity
        image = _image(channels, size=32)  # equalize needs more than 255 pixels a channel
        assert np.abs(randaugment.apply(name, image, 10) - image).max() > 0.05, (name, channels)


def _pil(image):
    return PIL.Image.fromarray(np.round(image.numpy() * 255).astype(np.uint8))


PIL_OPS = {  # op at magnitude 10, sign -1 -> what PIL does (timm's "increasing" ops, 0.1 factor)
    "auto_contrast": PIL.ImageOps.autocontrast,
    "equalize": PIL.ImageOps.equalize,
    "solarize": lambda image: PIL.ImageOps.solarize(image, 0),
    "posterize": lambda image: PIL.ImageOps.posterize(image, 4),
    "color": lambda image: PIL.ImageEnhance.Color(image).enhance(0.1),
    "contrast": lambda image: PIL.ImageEnhance.Contrast(image).enhance(0.1),
    "brightness": lambda image: PIL.ImageEnhance.Brightness(image).enhance(0.1),
    "sharpness": lambda image: PIL.ImageEnhance.Sharpness(image).enhance(0.1),
}


@pytest.mark.parametrize("name", PIL_OPS)
def test_colour_ops_match_pil(name):
    """Within two 8-bit levels: PIL rounds its grey and blends on 8-bit pixels, tfmp in float."""
    wide = tf.constant(np.random.default_rng(1).integers(0, 256, (32, 32, 3)) / 255.0, tf.float32)
    expected = np.asarray(PIL_OPS[name](_pil(wide)), np.float32) / 255.0
    np.testing.assert_allclose(randaugment.apply(name, wide, 10, -1.0), expected, atol=2.01 / 255)
    sharpened = PIL.ImageEnhance.Sharpness(_pil(wide)).enhance(1.9)  # the + sign, extrapolating
    np.testing.assert_allclose(
        randaugment.apply("sharpness", wide, 10, 1.0), np.asarray(sharpened) / 255.0, atol=2.01 / 255
    )


def test_equalize_spreads_two_levels_to_black_and_white():
    image = tf.constant(np.where(np.arange(32 * 32).reshape(32, 32, 1) % 2, 192, 64) / 255.0, tf.float32)
    assert sorted(np.unique(randaugment.apply("equalize", image, 0).numpy())) == [0.0, 1.0]


def test_geometric_ops_at_magnitude_10():
    image = tf.ones([20, 20, 1])
    shifted = randaugment.apply("translate_x", image, 10, 1.0).numpy()[..., 0]  # 0.45 * 20 = 9 pixels
    np.testing.assert_allclose(shifted[:, :11], 1.0)
    np.testing.assert_allclose(shifted[:, 11:], randaugment.FILL_VALUE)  # uncovered: grey
    shifted = randaugment.apply("translate_y", image, 10, -1.0).numpy()[..., 0]
    np.testing.assert_allclose(shifted[:9], randaugment.FILL_VALUE)
    np.testing.assert_allclose(shifted[9:], 1.0)
    rotated = randaugment.apply("rotate", image, 10, 1.0).numpy()[..., 0]  # 30 degrees: corners out
    assert rotated[0, 0] == rotated[-1, -1] == randaugment.FILL_VALUE and rotated[10, 10] == 1.0
    sheared = randaugment.apply("shear_x", image, 10, 1.0).numpy()[..., 0]  # about the centre:
    assert sheared[0, 0] == sheared[-1, -1] == randaugment.FILL_VALUE  # the corners move out,
    assert (sheared[9:11, 1:-1] == 1.0).all()  # the middle rows barely move (0.15 pixels)


def test_rand_augment_is_deterministic_by_key_and_same_in_a_tf_data_map():
    image = _image(3)
    keys = [tf.constant([7, index], tf.int64) for index in range(6)]
    eager = [randaugment.rand_augment(image, key, 2, 9).numpy() for key in keys]
    again = [randaugment.rand_augment(image, key, 2, 9).numpy() for key in keys]
    mapped = tf.data.Dataset.from_tensor_slices(tf.stack(keys)).map(
        lambda key: randaugment.rand_augment(image, key, 2, 9), num_parallel_calls=2, deterministic=True
    )
    for first, second, third in zip(eager, again, mapped):
        np.testing.assert_array_equal(first, second)
        np.testing.assert_allclose(first, third, atol=1e-6)  # graph vs eager kernels
    assert len({result.tobytes() for result in eager}) == len(keys)  # every key its own draw
    np.testing.assert_array_equal(randaugment.rand_augment(image, keys[0], 0, 9), image)


def test_one_op_a_key_draws_from_the_whole_list():
    """56 keys, one op each: the results come from (nearly) every op of the list."""
    image = _image(3)
    keys = tf.stack([tf.constant([3, index], tf.int64) for index in range(56)])
    results = tf.data.Dataset.from_tensor_slices(keys).map(
        lambda key: randaugment.rand_augment(image, key, 1, 10)
    )
    outcomes = {np.round(result.numpy(), 4).tobytes() for result in results}  # sign-free ops: one each
    assert len(outcomes) >= 12  # of 14 ops, 9 with two signs; 56 uniform draws miss few


@pytest.mark.parametrize(
    "num_ops, magnitude, message",
    [
        (2, 12, "randaugment_magnitude 12 must be in [0, 10]"),
        (2, -0.5, "randaugment_magnitude -0.5 must be in [0, 10]"),
        (2, float("nan"), "randaugment_magnitude nan must be in [0, 10]"),
        (2, "9", "randaugment_magnitude '9' must be in [0, 10]"),
        (-1, 9, "randaugment_ops -1 must be an integer in [0, 14]"),
        (15, 9, "randaugment_ops 15 must be an integer in [0, 14]"),
        (1.5, 9, "randaugment_ops 1.5 must be an integer in [0, 14]"),
        (True, 9, "randaugment_ops True must be an integer in [0, 14]"),
    ],
)
def test_check_refuses_bad_settings_in_one_line(num_ops, magnitude, message):
    with pytest.raises(UsageError) as error:
        randaugment.check(num_ops, magnitude)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
    with pytest.raises(UsageError):
        randaugment.rand_augment(_image(3), tf.constant([1, 2]), num_ops, magnitude)


def test_bad_images_and_op_names():
    for image in (tf.zeros([8, 8, 2]), tf.zeros([8, 8], tf.float32), tf.zeros([8, 8, 3], tf.uint8)):
        with pytest.raises(ValueError, match="rand_augment needs"):
            randaugment.rand_augment(image, tf.constant([1, 2]), 1, 5)
    with pytest.raises(UsageError, match="unknown randaugment op 'invert'; choose one of: identity"):
        randaugment.apply("invert", _image(3), 5)
    assert len(randaugment.OPS) == 14 and len(set(randaugment.OPS)) == 14
