"""Procedural drawing of the built-in datasets, one example at a time in TensorFlow ops.

    image = draw_shape(key, label, size)   # (size, size, 3) float32 in [0, 1], class `label`
    image = draw_digit(key, label, 28)     # (28, 28, 1): a jittered stroke digit

`key` is a stateless-random seed pair: the same key always draws the same picture, so the
datasets in `tfmp.classification.data` are deterministic, cost no memory at any resolution and parallelise
freely inside `Dataset.map`.
"""

import tensorflow as tf

# The drawing functions are plain TensorFlow (loops over static ranges, no Python branch on a
# tensor), so tf.data's AutoGraph need not rewrite them in every process that builds a pipeline:
# with tfmp.detection.shapes marked alike, 1.5 -> 0.45 CPU-s of conversion where the digits,
# shapes and detection scenes pipelines are all built (measured).


def _grid(size):
    """Pixel-centre coordinates in [0, 1]: y as a column, x as a row (broadcast to size x size)."""
    centres = (tf.range(size, dtype=tf.float32) + 0.5) / size
    return centres[:, None], centres[None, :]


def shape_distances(u, v) -> dict:
    """Signed distance (in radii, < 0 inside) of every shape at shape coordinates u, v, by name,
    in the order of the `shapes` labels (`tfmp.classification.data.SHAPES_CLASS_NAMES`). The
    detection scenes (`tfmp.detection.shapes`) draw some of them too."""
    au, av, r = tf.abs(u), tf.abs(v), tf.sqrt(u * u + v * v)
    box = lambda half_u, half_v: tf.maximum(au - half_u, av - half_v)  # noqa: E731
    return {
        "circle": r - 1.0,  # filled
        "square": box(0.8, 0.8),
        "triangle": tf.maximum(v - 0.7, (1.65 * au - 0.95 * (v + 0.95)) / 1.904),
        "diamond": (au + av - 1.0) / 1.414,
        "plus": tf.minimum(box(0.28, 1.0), box(1.0, 0.28)),
        "ring": tf.abs(r - 0.72) - 0.24,
        "horizontal_bar": box(1.0, 0.26),
        "vertical_bar": box(0.26, 1.0),
        "ellipse": (tf.sqrt(u * u + (v / 0.55) ** 2) - 1.0) * 0.55,
        "x": tf.maximum(tf.minimum(tf.abs(u - v), tf.abs(u + v)) / 1.414 - 0.2, box(0.85, 0.85)),
    }


@tf.autograph.experimental.do_not_convert
def draw_shape(key, label, size):
    """One `shapes` image: a signed distance field per class, anti-aliased over one pixel."""
    params_key, noise_key = tf.unstack(tf.random.experimental.stateless_split(key, 2))
    p = tf.random.stateless_uniform([11], params_key)
    radius = 0.22 + 0.18 * p[0]  # fraction of the image; the shape spans ~2 * radius
    centre_y, centre_x = radius + (1 - 2 * radius) * p[1], radius + (1 - 2 * radius) * p[2]
    angle = (p[3] - 0.5) * 0.35  # +-10 degrees: keeps squares apart from diamonds
    y, x = _grid(size)
    dy, dx = y - centre_y, x - centre_x
    u = (tf.cos(angle) * dx + tf.sin(angle) * dy) / radius  # shape coordinates, ~[-1, 1]
    v = (tf.cos(angle) * dy - tf.sin(angle) * dx) / radius
    distance = tf.gather(tf.stack(list(shape_distances(u, v).values())), label)
    alpha = tf.clip_by_value(0.5 - distance * radius * size, 0.0, 1.0)[:, :, None]
    # Random colours, but each channel of the shape is 0.35-0.55 brighter than the background
    # (or darker: a coin flip), so the outline is always visible.
    dark = 0.45 * p[4:7]
    light = dark + 0.35 + 0.2 * p[7:10]
    light_shape = p[10] < 0.5
    background, foreground = tf.where(light_shape, dark, light), tf.where(light_shape, light, dark)
    image = background + alpha * (foreground - background)
    image += 0.03 * tf.random.stateless_normal([size, size, 3], noise_key)
    return tf.clip_by_value(image, 0.0, 1.0)


# Digit glyphs as polylines in a box x in [-0.5, 0.5], y in [-0.8, 0.8] (y points down).
_GLYPHS = [
    [
        (-0.25, -0.8),
        (0.25, -0.8),
        (0.5, -0.5),
        (0.5, 0.5),
        (0.25, 0.8),
        (-0.25, 0.8),
        (-0.5, 0.5),
        (-0.5, -0.5),
        (-0.25, -0.8),
    ],
    [(-0.25, -0.5), (0.1, -0.8), (0.1, 0.8)],
    [(-0.5, -0.5), (-0.2, -0.8), (0.3, -0.8), (0.5, -0.5), (0.5, -0.2), (-0.5, 0.8), (0.5, 0.8)],
    [(-0.5, -0.8), (0.5, -0.8), (0.0, -0.1), (0.5, 0.2), (0.5, 0.6), (0.3, 0.8), (-0.5, 0.8)],
    [(0.2, 0.8), (0.2, -0.8), (-0.5, 0.3), (0.5, 0.3)],
    [(0.5, -0.8), (-0.5, -0.8), (-0.5, -0.1), (0.3, -0.1), (0.5, 0.2), (0.5, 0.6), (0.3, 0.8), (-0.5, 0.8)],
    [(0.4, -0.8), (-0.5, 0.0), (-0.5, 0.8), (0.5, 0.8), (0.5, 0.0), (-0.5, 0.0)],
    [(-0.5, -0.8), (0.5, -0.8), (-0.1, 0.8)],
    [
        (-0.4, -0.8),
        (0.4, -0.8),
        (0.4, 0.0),
        (-0.4, 0.0),
        (-0.4, -0.8),
        (-0.5, 0.0),
        (-0.5, 0.8),
        (0.5, 0.8),
        (0.5, 0.0),
        (0.4, 0.0),
    ],
    [(0.5, 0.0), (-0.5, 0.0), (-0.5, -0.8), (0.5, -0.8), (0.5, 0.0), (-0.4, 0.8)],
]


def _glyph_vertices():
    """[10, max vertices, 2]; short polylines repeat their last vertex (zero-length segments)."""
    longest = max(map(len, _GLYPHS))
    return tf.constant([g + [g[-1]] * (longest - len(g)) for g in _GLYPHS], tf.float32)


@tf.autograph.experimental.do_not_convert
def draw_digit(key, label, _):
    """One 28x28x1 `digits` image: a wobbly stroke glyph under a random affine map, plus noise."""
    params_key, wobble_key, noise_key = tf.unstack(tf.random.experimental.stateless_split(key, 3))
    p = tf.random.stateless_uniform([9], params_key)
    scale = 10.5 + 3.5 * p[0]  # pixels per glyph unit: the digit is 17-22 px tall
    aspect = 0.8 + 0.4 * p[1]
    angle, shear = (p[2] - 0.5) * 0.6, (p[3] - 0.5) * 0.6
    shift_y, shift_x = (p[4] - 0.5) * 6.0, (p[5] - 0.5) * 6.0
    half_width = 0.06 + 0.08 * p[6]  # stroke thickness in glyph units
    vertices = tf.gather(_glyph_vertices(), label)
    vertices += 0.24 * (tf.random.stateless_uniform(tf.shape(vertices), wobble_key) - 0.5)
    y, x = _grid(28)
    y, x = (y * 28 - 14 - shift_y) / scale, (x * 28 - 14 - shift_x) / (scale * aspect)
    # Inverse of rotation(angle) @ shear(x += shear * y) maps pixels back into glyph space.
    cos, sin = tf.cos(angle), tf.sin(angle)
    rx, ry = cos * x + sin * y, cos * y - sin * x
    gx, gy = (rx - shear * ry)[None], ry[None]  # [1, 28, 28] against [segments, 1, 1]
    a, b = vertices[:-1, :, None, None], vertices[1:, :, None, None]
    ax, ay, ex, ey = a[:, 0], a[:, 1], b[:, 0] - a[:, 0], b[:, 1] - a[:, 1]
    t = tf.clip_by_value(((gx - ax) * ex + (gy - ay) * ey) / (ex * ex + ey * ey + 1e-6), 0.0, 1.0)
    distance = tf.reduce_min(tf.sqrt((gx - ax - t * ex) ** 2 + (gy - ay - t * ey) ** 2), axis=0)
    ink = tf.clip_by_value((half_width - distance) * scale + 0.5, 0.0, 1.0) * (0.7 + 0.3 * p[7])
    image = ink + 0.1 * tf.random.stateless_normal([28, 28], noise_key)
    return tf.clip_by_value(image, 0.0, 1.0)[:, :, None]
