"""RandAugment (Cubuk et al. 2020) for one float32 image in [0, 1], keyed by a stateless random key.

    image = randaugment.rand_augment(image, key, num_ops=2, magnitude=9)   # in a tf.data map

`num_ops` times, one op is drawn uniformly from `OPS` (with replacement, as the paper does) and
applied at `magnitude` on the paper's 0..10 scale; `tf.switch_case` runs only the drawn op. Every
op gets stronger as the magnitude grows and is the identity (or, for equalize and auto-contrast,
magnitude-free) at magnitude 0: timm's "increasing" variants, the ones DeiT trains with
(``rand-m9-mstd0.5-inc1``). At magnitude 10:

* rotate 30 degrees, shear 0.3, translate 0.45 of the image side (timm's ``translate_pct``),
  each with a random sign, about the image centre; uncovered pixels are 0.5 grey;
* color (saturation), contrast, brightness, sharpness: a PIL ``ImageEnhance`` factor of
  1 +- 0.9 (0.1 or 1.9, random sign);
* solarize: every pixel inverted (magnitude m inverts the 8-bit levels at or above
  256 - int(25.6 m));
* posterize: 4 bits kept (8 - 0.4 m bits: the paper's 4..8 range, stronger with m).

Identity, auto-contrast (each channel stretched to [0, 1]) and equalize (each channel's 256-bin
histogram equalised, as PIL's ``ImageOps.equalize``) ignore the magnitude. Left out: timm's
invert and solarize-add (not in the paper's list), its per-op probability 0.5 (the paper always
applies the drawn ops; identity is in the list) and its magnitude noise (``mstd``).

The image needs a static HxWxC shape, C = 1 or 3 (color is the identity on one channel). The
result has the same shape and dtype, is clipped to [0, 1] and depends only on the image and
`key` (an int32/int64 shape [2] tensor, as `tf.random.stateless_*` take): graph mode and
tf.data maps give the same image.
"""

import math
import numbers

import tensorflow as tf

from tfmp.errors import UsageError, spelt

MAX_MAGNITUDE = 10.0
FILL_VALUE = 0.5  # grey where rotate, shear or translate uncover the canvas
MAX_ROTATE_DEGREES, MAX_SHEAR, MAX_TRANSLATE = 30.0, 0.3, 0.45
MAX_ENHANCE = 0.9  # color/contrast/brightness/sharpness factor 1 +- 0.9 at magnitude 10


def check(num_ops: int, magnitude: float, *, as_flags: bool = False) -> None:
    """Raises `UsageError` (one line) unless 0 <= num_ops <= len(OPS) and 0 <= magnitude <= 10;
    `as_flags` names the values as the apps' flags (--randaugment_ops=...)."""
    if isinstance(num_ops, bool) or not isinstance(num_ops, numbers.Integral) or not 0 <= num_ops <= len(OPS):
        name = spelt("randaugment_ops", num_ops, as_flags)
        raise UsageError(f"{name} must be an integer in [0, {len(OPS)}] ops per image (0: off), e.g. 2")
    if (
        isinstance(magnitude, bool)
        or not isinstance(magnitude, numbers.Real)
        or not 0 <= magnitude <= MAX_MAGNITUDE
    ):
        name = spelt("randaugment_magnitude", magnitude, as_flags)
        raise UsageError(f"{name} must be in [0, {MAX_MAGNITUDE:g}], e.g. 9 (DeiT)")


def rand_augment(image: tf.Tensor, key: tf.Tensor, num_ops: int, magnitude: float) -> tf.Tensor:
    """`num_ops` ops drawn uniformly from `OPS`, each applied at `magnitude` (module docstring)."""
    check(num_ops, magnitude)
    image = tf.convert_to_tensor(image)
    if image.dtype != tf.float32 or image.shape.rank != 3 or not image.shape.is_fully_defined():
        raise ValueError(f"rand_augment needs a float32 HxWxC image of static shape, got {image}")
    if image.shape[2] not in (1, 3):
        raise ValueError(f"rand_augment needs 1 or 3 channels, got shape {image.shape}")
    level = float(magnitude) / MAX_MAGNITUDE
    for layer_key in tf.unstack(tf.random.experimental.stateless_split(key, max(num_ops, 1)))[:num_ops]:
        choice_key, sign_key = tf.unstack(tf.random.experimental.stateless_split(layer_key, 2))
        choice = tf.random.stateless_uniform([], choice_key, 0, len(OPS), dtype=tf.int32)
        sign = tf.where(tf.random.stateless_uniform([], sign_key) < 0.5, -1.0, 1.0)
        # Default arguments bind this layer's image: each branch is traced once, here.
        branches = [lambda op=op, image=image: op(image, level, sign) for op in _OPERATIONS.values()]
        image = tf.ensure_shape(tf.switch_case(choice, branches), image.shape)
    return tf.clip_by_value(image, 0.0, 1.0)


# ----------------------------------------------------------------------------- colour ops
def _identity(image, level, sign):
    return image


def _auto_contrast(image, level, sign):
    low = tf.reduce_min(image, axis=[0, 1], keepdims=True)
    high = tf.reduce_max(image, axis=[0, 1], keepdims=True)
    span = high - low
    # A flat channel stays as it is (PIL does the same), instead of dividing by zero.
    return tf.where(span > 0, (image - low) / tf.where(span > 0, span, 1.0), image)


def _equalize(image, level, sign):
    """PIL's ImageOps.equalize on the 8-bit levels of each channel, vectorised over channels."""
    height, width, channels = image.shape
    levels = tf.cast(tf.round(tf.clip_by_value(image, 0.0, 1.0) * 255.0), tf.int32)
    per_channel = tf.transpose(tf.reshape(levels, [height * width, channels]))  # [C, H*W]
    histogram = tf.math.bincount(per_channel, minlength=256, maxlength=256, axis=-1)  # [C, 256]
    # PIL's step: the pixels not in the channel's brightest occupied level, over 255 levels.
    brightest = tf.gather(histogram, tf.reduce_max(per_channel, axis=1), batch_dims=1)
    step = (tf.reduce_sum(histogram, axis=1) - brightest) // 255
    before = tf.cumsum(histogram, axis=1, exclusive=True)
    safe_step = tf.maximum(step, 1)[:, None]
    table = tf.minimum((before + safe_step // 2) // safe_step, 255)  # [C, 256] level -> new level
    equalised = tf.gather(table, per_channel, batch_dims=1)
    equalised = tf.reshape(tf.transpose(tf.cast(equalised, tf.float32) / 255.0), image.shape)
    return tf.where(tf.reshape(step, [1, 1, channels]) > 0, equalised, image)  # step 0: unchanged


def _solarize(image, level, sign):
    # timm's increasing threshold on the 8-bit levels: 256 (nothing inverted) down to 0 (all).
    threshold = 256 - int(level * 256)
    return tf.where(tf.round(image * 255.0) >= threshold, 1.0 - image, image)


def _posterize(image, level, sign):
    dropped_bits = int(level * 4)
    if dropped_bits == 0:
        return image
    bucket = float(2**dropped_bits)
    levels = tf.round(tf.clip_by_value(image, 0.0, 1.0) * 255.0)
    return tf.floor(levels / bucket) * bucket / 255.0


def _grey(image):
    return tf.image.rgb_to_grayscale(image) if image.shape[2] == 3 else image


def _blend(degenerate, image, factor):
    """PIL's ImageEnhance: degenerate + factor (image - degenerate), clipped to [0, 1]."""
    return tf.clip_by_value(degenerate + factor * (image - degenerate), 0.0, 1.0)


def _factor(level, sign):
    return 1.0 + sign * MAX_ENHANCE * level


def _color(image, level, sign):
    return _blend(tf.broadcast_to(_grey(image), image.shape), image, _factor(level, sign))


def _contrast(image, level, sign):
    return _blend(tf.reduce_mean(_grey(image)), image, _factor(level, sign))


def _brightness(image, level, sign):
    return _blend(tf.zeros_like(image), image, _factor(level, sign))


def _sharpness(image, level, sign):
    """Blend with PIL's SMOOTH filter (3x3, centre 5, others 1, over 13); border pixels kept."""
    height, width, channels = image.shape
    if height < 3 or width < 3:
        return image
    kernel = tf.constant([[1.0, 1.0, 1.0], [1.0, 5.0, 1.0], [1.0, 1.0, 1.0]]) / 13.0
    kernel = tf.tile(kernel[:, :, None, None], [1, 1, channels, 1])
    smooth = tf.nn.depthwise_conv2d(image[None], kernel, [1, 1, 1, 1], "VALID")[0]
    smooth = tf.pad(smooth, [[1, 1], [1, 1], [0, 0]])
    interior = tf.pad(tf.ones([height - 2, width - 2, 1], tf.bool), [[1, 1], [1, 1], [0, 0]])
    return _blend(tf.where(interior, smooth, image), image, _factor(level, sign))


# ----------------------------------------------------------------------------- geometric ops
def _transform(image, row_x, row_y):
    """Samples output pixel (x, y) at input (row_x . (x, y, 1), row_y . (x, y, 1)), bilinearly."""
    height, width, _ = image.shape
    zero = tf.constant(0.0)
    transform = tf.stack([*row_x, *row_y, zero, zero])[None]
    return tf.raw_ops.ImageProjectiveTransformV3(
        images=image[None],
        transforms=transform,
        output_shape=tf.constant([height, width], tf.int32),
        fill_value=tf.constant(FILL_VALUE),
        interpolation="BILINEAR",
        fill_mode="CONSTANT",
    )[0]


def _centre(image):
    height, width, _ = image.shape
    return (width - 1) / 2.0, (height - 1) / 2.0


def _rotate(image, level, sign):
    radians = sign * (MAX_ROTATE_DEGREES * level * math.pi / 180.0)
    cos, sin = tf.cos(radians), tf.sin(radians)
    centre_x, centre_y = _centre(image)
    # Input = R(angle) (output - centre) + centre: the picture turns about its centre.
    row_x = (cos, -sin, centre_x - cos * centre_x + sin * centre_y)
    row_y = (sin, cos, centre_y - sin * centre_x - cos * centre_y)
    return _transform(image, row_x, row_y)


def _shear_x(image, level, sign):
    shear = sign * (MAX_SHEAR * level)
    _, centre_y = _centre(image)
    return _transform(image, (1.0, shear, -shear * centre_y), (0.0, 1.0, 0.0))


def _shear_y(image, level, sign):
    shear = sign * (MAX_SHEAR * level)
    centre_x, _ = _centre(image)
    return _transform(image, (1.0, 0.0, 0.0), (shear, 1.0, -shear * centre_x))


def _translate_x(image, level, sign):
    shift = sign * (MAX_TRANSLATE * level * image.shape[1])
    return _transform(image, (1.0, 0.0, shift), (0.0, 1.0, 0.0))


def _translate_y(image, level, sign):
    shift = sign * (MAX_TRANSLATE * level * image.shape[0])
    return _transform(image, (1.0, 0.0, 0.0), (0.0, 1.0, shift))


_OPERATIONS = {
    "identity": _identity,
    "auto_contrast": _auto_contrast,
    "equalize": _equalize,
    "rotate": _rotate,
    "solarize": _solarize,
    "color": _color,
    "posterize": _posterize,
    "contrast": _contrast,
    "brightness": _brightness,
    "sharpness": _sharpness,
    "shear_x": _shear_x,
    "shear_y": _shear_y,
    "translate_x": _translate_x,
    "translate_y": _translate_y,
}
OPS: tuple[str, ...] = tuple(_OPERATIONS)


def apply(name: str, image: tf.Tensor, magnitude: float, sign: float = 1.0) -> tf.Tensor:
    """One op of `OPS` by name at `magnitude` (sign +1 or -1 for the signed ops): for tests and
    for looking at what each op does. Same image contract as `rand_augment`."""
    check(0, magnitude)
    if name not in _OPERATIONS:
        raise UsageError(f"unknown randaugment op {name!r}; choose one of: {', '.join(OPS)}")
    image = tf.convert_to_tensor(image, tf.float32)
    result = _OPERATIONS[name](image, float(magnitude) / MAX_MAGNITUDE, tf.constant(float(sign)))
    return tf.clip_by_value(result, 0.0, 1.0)
