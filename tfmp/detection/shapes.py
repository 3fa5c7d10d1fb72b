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
part only draws the scene's few random numbers; `render_scenes` draws a whole batch in one
XLA-compiled function (`_paint`) of elementwise work, which XLA fuses and vectorises.
Each class is a signed distance function (in shape radii, < 0 inside) evaluated at every
pixel's rotated, scaled shape coordinates, and the anti-aliased coverage is
`0.5 - distance * pixels_per_radius`. The pixel noise is an integer hash of the pixel's index
and the scene's noise seed (no random numbers drawn per pixel). Compositing the shapes over the
background, the noise and the 8-bit rounding fuse into the same loop (one thread, 128 px,
batch 16: about 0.3 ms per scene for the randomness and the drawing; `apps.bench`'s input_cost
cell compares it with a JPEG pipeline of the same scenes).

Which candidate shapes a scene keeps is decided on each candidate's analytic box (its rotated
unit square), cheaply for all candidates; the boxes returned are then exact: xyxy pixel edges of
the pixels a kept shape covers by more than half (from its own coverage, so they include the
parts another shape hides), float32 [max_shapes, 4], classes int32 [max_shapes] with -1 rows
for the shapes a scene does not have.
"""

import tensorflow as tf

from tfmp.classification import drawing

CLASS_NAMES = ("circle", "square", "triangle", "plus", "ring", "bar")
# How each class is drawn: its shape in tfmp.classification.drawing (a bar lies or, turned by
# 90 degrees, stands).
_DRAWN_AS = ("circle", "square", "triangle", "plus", "ring", "horizontal_bar")
MAX_COVERED = 0.3  # no box may lie more than this fraction inside another box
_CANDIDATES_PER_SHAPE = 2  # rejected candidates (too much overlap) leave room for others
# Uniform pixel noise of standard deviation 0.03, grey (the same in every channel, like a
# sensor's luminance noise).
_NOISE = 0.03 * 3**0.5


def _distance(labels, u, v):
    """Signed distances of the shapes of classes `labels` at shape coordinates u, v (in radii)."""
    fields = drawing.shape_distances(u, v)
    # All six are computed and one is selected per shape: no branch, so XLA vectorises the loop
    # (and drops the classifier-only shapes as dead code).
    distance = fields[_DRAWN_AS[0]]
    for label, name in enumerate(_DRAWN_AS[1:], start=1):
        distance = tf.where(labels == label, fields[name], distance)
    return distance


def _hash(values):
    """A well-mixed uint32 of each uint32 (Wellons' "lowbias32" integer hash)."""
    for shift, multiplier in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        values = tf.bitwise.bitwise_xor(values, tf.bitwise.right_shift(values, shift))
        values *= tf.constant(multiplier, tf.uint32)
    return tf.bitwise.bitwise_xor(values, tf.bitwise.right_shift(values, 16))


@tf.autograph.experimental.do_not_convert  # plain TensorFlow: as tfmp.classification.drawing
def scene_randomness(key, size: int, max_shapes: int = 4) -> dict:
    """Every random number of one scene (the per-example part of drawing it)."""
    scene_key, shapes_key, noise_key = tf.unstack(tf.random.experimental.stateless_split(key, 3))
    return {
        "scene": tf.random.stateless_uniform([8], scene_key),
        "shapes": tf.random.stateless_uniform([_CANDIDATES_PER_SHAPE * max_shapes, 9], shapes_key),
        "noise_seed": tf.random.stateless_uniform([], noise_key, None, None, tf.uint32),
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


@tf.function(jit_compile=True, autograph=False)
def _paint(labels, radius, centre_y, centre_x, cos, sin, keep, palette, noise_seed, size: int):
    """The 8-bit images [N, size, size, 3] and, per shape, which rows and columns [N, K, size]
    it covers by more than half, from the shapes' [N, K] classes, radii, centres, rotations and
    `keep` (the ones a scene draws), the background and shape colours `palette` [N, 1 + K, 3]
    and the scenes' noise seeds [N]: one XLA loop of elementwise work."""
    pixel = lambda values: values[:, :, None, None]  # noqa: E731
    centres = (tf.range(size, dtype=tf.float32) + 0.5) / size
    x, y = centres[None, None, None, :] - pixel(centre_x), centres[None, None, :, None] - pixel(centre_y)
    u = (pixel(cos) * x + pixel(sin) * y) / pixel(radius)
    v = (pixel(cos) * y - pixel(sin) * x) / pixel(radius)
    distance = _distance(pixel(labels), u, v)
    alpha = tf.clip_by_value(0.5 - distance * pixel(radius * size), 0.0, 1.0)
    covered = alpha > 0.5
    rows, columns = tf.reduce_any(covered, axis=3), tf.reduce_any(covered, axis=2)
    alpha *= pixel(tf.cast(keep & tf.reduce_any(rows, axis=2), alpha.dtype))
    # Drawing shape after shape (image += alpha * (colour - image)) in closed form: each colour
    # weighs its coverage times the transparency of every later shape, the background what is left.
    image, transparency = 0.0, 1.0
    for slot in reversed(range(alpha.shape[1])):
        image += (alpha[:, slot] * transparency)[..., None] * palette[:, None, None, 1 + slot]
        transparency *= 1.0 - alpha[:, slot]
    image += transparency[..., None] * palette[:, None, None, 0]
    index = tf.cast(tf.reshape(tf.range(size * size), [1, size, size]), tf.uint32)
    bits = _hash(tf.bitwise.bitwise_xor(index, _hash(noise_seed)[:, None, None]))
    uniform = tf.cast(tf.bitwise.right_shift(bits, 8), tf.float32) * 2.0**-24  # [0, 1), 24 bits
    noise = (2.0 * uniform - 1.0)[..., None] * _NOISE
    return tf.clip_by_value(tf.round((image + noise) * 255.0), 0.0, 255.0) / 255.0, rows, columns


def _extents(rows, columns):
    """xyxy pixel-edge boxes [..., 4] from the covered rows and columns [..., S], and whether any."""
    size = rows.shape[-1]
    first = lambda line: tf.argmax(tf.cast(line, tf.int32), axis=-1, output_type=tf.int32)  # noqa: E731
    last = lambda line: size - first(tf.reverse(line, [-1]))  # noqa: E731
    box = tf.stack([first(columns), first(rows), last(columns), last(rows)], axis=-1)
    return tf.cast(box, tf.float32), tf.reduce_any(rows, axis=-1)


@tf.autograph.experimental.do_not_convert  # plain TensorFlow: as tfmp.classification.drawing
def render_scenes(randomness: dict, size: int, max_shapes: int = 4):
    """(images [N, size, size, 3] float32 in [0, 1], boxes [N, max_shapes, 4], classes
    [N, max_shapes]) of a batch of `scene_randomness` dicts (stacked)."""
    scene, params = randomness["scene"], randomness["shapes"]
    wanted = tf.minimum(1 + tf.cast(scene[:, 0] * max_shapes, tf.int32), max_shapes)
    dark = scene[:, 1:2] < 0.5
    background = 0.45 * scene[:, 2:5] + tf.where(dark, 0.0, 0.4)  # [N, 3]
    labels = tf.minimum(tf.cast(params[..., 0] * len(CLASS_NAMES), tf.int32), len(CLASS_NAMES) - 1)
    radius = 0.1 + 0.15 * params[..., 1]  # the shape spans 20-50% of the image
    centre_y = radius + (1 - 2 * radius) * params[..., 2]
    centre_x = radius + (1 - 2 * radius) * params[..., 3]
    # +-10 degrees (as tfmp.classification.drawing), plus 90 degrees for half of the shapes (only
    # bars and triangles look different for it: bars stand or lie, triangles point up or sideways).
    angle = (params[..., 4] - 0.5) * 0.35 + tf.where(params[..., 8] < 0.5, 0.0, 1.5707964)
    cos, sin = tf.cos(angle), tf.sin(angle)
    spread = radius * (tf.abs(cos) + tf.abs(sin))  # half side of the rotated unit square
    analytic = tf.stack([centre_x - spread, centre_y - spread, centre_x + spread, centre_y + spread], -1)
    accepted = _accept(analytic * size, wanted)
    # The accepted candidates first, in drawing order: max_shapes slots, the rest padding.
    order = tf.argsort(tf.cast(~accepted, tf.int32), axis=1, stable=True)[:, :max_shapes]
    pick = lambda values: tf.gather(values, order, batch_dims=1)  # noqa: E731
    keep = pick(accepted)
    contrast = (0.25 + 0.35 * pick(params[..., 5:8])) * tf.where(dark, 1.0, -1.0)[:, None]
    palette = tf.concat([background[:, None], background[:, None] + contrast], axis=1)  # [N, 1 + K, 3]
    image, rows, columns = _paint(
        *map(pick, (labels, radius, centre_y, centre_x, cos, sin)),
        keep,
        palette,
        randomness["noise_seed"],
        size,
    )
    boxes, visible = _extents(rows, columns)
    keep &= visible
    boxes = tf.where(keep[..., None], boxes, 0.0)
    classes = tf.where(keep, pick(labels), -1)
    return image, boxes, classes


def draw_scene(key, size: int, max_shapes: int = 4):
    """(image [size, size, 3] float32 in [0, 1], boxes [max_shapes, 4], classes [max_shapes])."""
    randomness = tf.nest.map_structure(lambda value: value[None], scene_randomness(key, size, max_shapes))
    return tuple(value[0] for value in render_scenes(randomness, size, max_shapes))
