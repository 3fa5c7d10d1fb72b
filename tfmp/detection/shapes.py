"""The built-in detection scenes: several coloured shapes per image, drawn a batch at a time.

    image, boxes, classes = draw_scene(key, size=128, max_shapes=4)          # one scene
    scenes = [scene_randomness(key_i, 128, 4) for key_i in keys]            # per example (cheap)
    images, boxes, classes = render_scenes(stacked(scenes), 128, 4)         # a batch, vectorised

`key` is a stateless-random seed pair, so the same key always draws the same scene (the
`shapes` detection dataset keys it by split and example index: deterministic, no memory, any
resolution). Each scene has a random background and 1 to `max_shapes` shapes of the classes in
`CLASS_NAMES`, each 20-50% of the image across, slightly rotated, in a colour 0.25-0.6 brighter
or darker than the background per channel (as `tfmp.classification.drawing.draw_shape`). Shapes
may overlap, but no two boxes overlap by more than `MAX_COVERED` of the smaller one, so a partly
hidden shape is still recognisable. A later shape is drawn over an earlier one. Pixels are
8-bit values (as a decoded image file's), so a cached scene equals a drawn one.

How it is cheap (a scene costs less than decoding a JPEG of its size does): the per-example
part only draws the scene's random numbers; `render_scenes` draws a whole batch with a handful
of vectorised ops. Each class is a signed distance field (in shape radii, < 0 inside) sampled
once into a `SPRITE` x `SPRITE` bank; one `ImageProjectiveTransformV3` call rotates, scales and
places every shape's field at half resolution, a bilinear resize brings it to full resolution
(a distance field interpolates almost exactly, unlike a mask), and the anti-aliased coverage is
`0.5 - distance * pixels_per_radius`, as if evaluated per pixel. The painting (compositing the
shapes over the background, the noise, 8-bit rounding) is one XLA-compiled function (`_paint`):
fused, it costs a fraction of the dozen full-image passes it is otherwise (one thread, 128 px,
batch 16: 1,230 drawn scenes/s against 760 unfused, and 830/s for a JPEG pipeline of the same
scenes; `apps.bench`'s input_cost cell measures it).

Which candidate shapes a scene keeps is decided on each candidate's analytic box (its rotated
unit square), cheaply for all candidates; the boxes returned are then exact: xyxy pixel edges of
the pixels a kept shape covers by more than half (from its own coverage, so they include the
parts another shape hides), float32 [max_shapes, 4], classes int32 [max_shapes] with -1 rows
for the shapes a scene does not have.
"""

import functools

import numpy as np
import tensorflow as tf

CLASS_NAMES = ("circle", "square", "triangle", "plus", "ring", "bar")
MAX_COVERED = 0.3  # no box may lie more than this fraction inside another box
_CANDIDATES_PER_SHAPE = 2  # rejected candidates (too much overlap) leave room for others
SPRITE, EXTENT = 128, 1.25  # distance bank: SPRITE^2 samples over [-EXTENT, EXTENT]^2 radii
_FAR = 4.0  # the distance outside the bank: well outside every shape
# Uniform pixel noise of standard deviation 0.03, grey (the same in every channel, like a
# sensor's luminance noise): a third of the random numbers of colour noise, which cost a scene
# 0.55 of its 1.3 ms in the input pipeline (one thread, 128 px); grey noise 0.24 ms.
_NOISE = 0.03 * 3**0.5


def _distance(u, v):
    """Signed distances [6, ...] of the classes at shape coordinates u, v (NumPy, float64)."""
    au, av, r = np.abs(u), np.abs(v), np.sqrt(u * u + v * v)
    box = lambda half_u, half_v: np.maximum(au - half_u, av - half_v)  # noqa: E731
    return np.stack(
        [
            r - 1.0,  # circle
            box(0.8, 0.8),  # square
            np.maximum(v - 0.7, (1.65 * au - 0.95 * (v + 0.95)) / 1.904),  # triangle
            np.minimum(box(0.28, 1.0), box(1.0, 0.28)),  # plus
            np.abs(r - 0.72) - 0.24,  # ring
            box(1.0, 0.26),  # bar (rotated by 90 degrees half of the time)
        ]
    )


@functools.cache
def _bank() -> np.ndarray:
    """[6, SPRITE, SPRITE, 1] float32 distance fields, pixel centres over [-EXTENT, EXTENT]."""
    centres = ((np.arange(SPRITE) + 0.5) / SPRITE * 2 - 1) * EXTENT
    v, u = np.meshgrid(centres, centres, indexing="ij")
    return _distance(u, v)[..., None].astype(np.float32)


def scene_randomness(key, size: int, max_shapes: int = 4) -> dict:
    """Every random number of one scene (the per-example part of drawing it)."""
    scene_key, shapes_key, noise_key = tf.unstack(tf.random.experimental.stateless_split(key, 3))
    return {
        "scene": tf.random.stateless_uniform([8], scene_key),
        "shapes": tf.random.stateless_uniform([_CANDIDATES_PER_SHAPE * max_shapes, 9], shapes_key),
        "noise": tf.random.stateless_uniform([size, size, 1], noise_key, -_NOISE, _NOISE),
    }


def _accept(boxes, wanted):
    """Greedy choice, in drawing order, of up to `wanted` candidates whose boxes [N, C, 4] do
    not cover each other by more than MAX_COVERED; bool [N, C]."""
    top_left = tf.maximum(boxes[:, :, None, :2], boxes[:, None, :, :2])
    bottom_right = tf.minimum(boxes[:, :, None, 2:], boxes[:, None, :, 2:])
    intersection = tf.reduce_prod(tf.maximum(bottom_right - top_left, 0.0), axis=-1)
    area = (boxes[..., 2] - boxes[..., 0]) * (boxes[..., 3] - boxes[..., 1])
    conflict = intersection > MAX_COVERED * tf.minimum(area[:, :, None], area[:, None, :])
    taken = tf.zeros_like(conflict[:, :, 0])
    for index in range(boxes.shape[1]):  # unrolled: a handful of candidates
        count = tf.reduce_sum(tf.cast(taken, tf.int32), axis=1)
        take = ~tf.reduce_any(conflict[:, index] & taken, axis=1) & (count < wanted)
        taken |= tf.one_hot(index, boxes.shape[1], on_value=True, off_value=False) & take[:, None]
    return taken


def _coverage(labels, radius, centre_y, centre_x, cos, sin, size):
    """Anti-aliased coverage [K, size, size] of K shapes (see the module docstring)."""
    grid = -(-size // 2)  # the distance is sampled at half resolution, then resized
    pixels_per_radius = radius * size
    k = SPRITE / (2 * EXTENT)  # bank pixels per radius
    # Output pixel (i, j) of the grid is unit point ((j + .5) / grid, (i + .5) / grid); its
    # shape coordinates u, v (rotated, in radii) map to bank pixel u * k + EXTENT * k - .5.
    step, start = k / (radius * grid), k * (0.5 / grid)
    offset = EXTENT * k - 0.5
    transforms = tf.stack(
        [
            step * cos,
            step * sin,
            (cos * (start - k * centre_x) + sin * (start - k * centre_y)) / radius + offset,
            -step * sin,
            step * cos,
            (cos * (start - k * centre_y) - sin * (start - k * centre_x)) / radius + offset,
            tf.zeros_like(radius),
            tf.zeros_like(radius),
        ],
        axis=1,
    )
    distance = tf.raw_ops.ImageProjectiveTransformV3(
        images=tf.gather(tf.constant(_bank()), labels),
        transforms=transforms,
        output_shape=[grid, grid],
        fill_value=_FAR,
        interpolation="BILINEAR",
        fill_mode="CONSTANT",
    )
    distance = tf.image.resize(distance, [size, size])[..., 0]
    return tf.clip_by_value(0.5 - distance * pixels_per_radius[:, None, None], 0.0, 1.0)


def _mask_boxes(alpha):
    """xyxy pixel-edge boxes [K, 4] of the pixels covered by more than half, and whether any."""
    size = alpha.shape[-1]
    covered = alpha > 0.5
    rows, columns = tf.reduce_any(covered, axis=2), tf.reduce_any(covered, axis=1)
    first = lambda line: tf.argmax(tf.cast(line, tf.int32), axis=1, output_type=tf.int32)  # noqa: E731
    last = lambda line: size - first(tf.reverse(line, [1]))  # noqa: E731
    box = tf.stack([first(columns), first(rows), last(columns), last(rows)], axis=1)
    return tf.cast(box, tf.float32), tf.reduce_any(rows, axis=1)


@tf.function(jit_compile=True)
def _paint(alpha, keep, palette, noise):
    """8-bit images [N, S, S, 3] from coverages [N, K, S, S] (kept shapes), the background and
    shape colours [N, 1 + K, 3] and noise [N, S, S, 1]: one XLA cluster of elementwise work."""
    alpha = alpha * keep[:, :, None, None]
    # Drawing shape after shape (image += alpha * (colour - image)) in closed form: each colour
    # weighs its coverage times the transparency of every later shape, the background what is left.
    image, transparency = 0.0, 1.0
    for slot in reversed(range(alpha.shape[1])):
        image += (alpha[:, slot] * transparency)[..., None] * palette[:, None, None, 1 + slot]
        transparency *= 1.0 - alpha[:, slot]
    image += transparency[..., None] * palette[:, None, None, 0]
    return tf.clip_by_value(tf.round((image + noise) * 255.0), 0.0, 255.0) / 255.0


def render_scenes(randomness: dict, size: int, max_shapes: int = 4):
    """(images [N, size, size, 3] float32 in [0, 1], boxes [N, max_shapes, 4], classes
    [N, max_shapes]) of a batch of `scene_randomness` dicts (stacked)."""
    scene, params = randomness["scene"], randomness["shapes"]
    batch = tf.shape(scene)[0]
    wanted = tf.minimum(1 + tf.cast(scene[:, 0] * max_shapes, tf.int32), max_shapes)
    dark = scene[:, 1:2] < 0.5
    background = 0.45 * scene[:, 2:5] + tf.where(dark, 0.0, 0.4)  # [N, 3]
    labels = tf.minimum(tf.cast(params[..., 0] * len(CLASS_NAMES), tf.int32), len(CLASS_NAMES) - 1)
    radius = 0.1 + 0.15 * params[..., 1]  # the shape spans 20-50% of the image
    centre_y = radius + (1 - 2 * radius) * params[..., 2]
    centre_x = radius + (1 - 2 * radius) * params[..., 3]
    # +-10 degrees (as tfmp.classification.drawing), plus 90 degrees for half of the bars.
    angle = (params[..., 4] - 0.5) * 0.35 + tf.where(params[..., 8] < 0.5, 0.0, 1.5707964)
    cos, sin = tf.cos(angle), tf.sin(angle)
    spread = radius * (tf.abs(cos) + tf.abs(sin))  # half side of the rotated unit square
    analytic = tf.stack([centre_x - spread, centre_y - spread, centre_x + spread, centre_y + spread], -1)
    accepted = _accept(analytic * size, wanted)
    # The accepted candidates first, in drawing order: max_shapes slots, the rest padding.
    order = tf.argsort(tf.cast(~accepted, tf.int32), axis=1, stable=True)[:, :max_shapes]
    pick = lambda values: tf.reshape(tf.gather(values, order, batch_dims=1), [-1])  # noqa: E731
    keep = tf.gather(accepted, order, batch_dims=1)
    alpha = _coverage(*map(pick, (labels, radius, centre_y, centre_x, cos, sin)), size)
    boxes, visible = _mask_boxes(alpha)
    keep &= tf.reshape(visible, [batch, max_shapes])
    contrast = (0.25 + 0.35 * tf.gather(params[..., 5:8], order, batch_dims=1)) * tf.where(dark, 1.0, -1.0)[
        :, None
    ]
    palette = tf.concat([background[:, None], background[:, None] + contrast], axis=1)  # [N, 1 + K, 3]
    image = _paint(
        tf.reshape(alpha, [batch, max_shapes, size, size]),
        tf.cast(keep, tf.float32),
        palette,
        randomness["noise"],
    )
    boxes = tf.where(keep[..., None], tf.reshape(boxes, [batch, max_shapes, 4]), 0.0)
    classes = tf.where(keep, tf.gather(labels, order, batch_dims=1), -1)
    return image, boxes, classes


def draw_scene(key, size: int, max_shapes: int = 4):
    """(image [size, size, 3] float32 in [0, 1], boxes [max_shapes, 4], classes [max_shapes])."""
    randomness = tf.nest.map_structure(lambda value: value[None], scene_randomness(key, size, max_shapes))
    return tuple(value[0] for value in render_scenes(randomness, size, max_shapes))
