"""The built-in detection scenes: several coloured shapes per image, drawn in TensorFlow ops.

    image, boxes, classes = draw_scene(key, size=128, max_shapes=4)

`key` is a stateless-random seed pair, so the same key always draws the same scene (the
`shapes` detection dataset keys it by split and example index: deterministic, no memory, any
resolution, parallel inside `Dataset.map`). Each scene has a random background and 1 to
`max_shapes` shapes of the classes in `CLASS_NAMES`, each 20-50% of the image across, slightly
rotated, in a colour 0.25-0.6 brighter or darker than the background per channel (as
`tfmp.classification.drawing.draw_shape`, whose distance fields these are). Shapes may overlap, but no two
boxes overlap by more than `MAX_COVERED` of the smaller one, so a partly hidden shape is still
recognisable.
A later shape is drawn over an earlier one.

Boxes are xyxy pixel edges of the pixels a shape covers by more than half (taken from its own
anti-aliased mask, so they are exact for every class and rotation, and include the parts
another shape hides), float32 [max_shapes, 4]; classes int32 [max_shapes], -1 for the rows of
shapes the scene does not have.
"""

import tensorflow as tf

CLASS_NAMES = ("circle", "square", "triangle", "plus", "ring", "bar")
MAX_COVERED = 0.3  # no box may lie more than this fraction inside another box
_CANDIDATES_PER_SHAPE = 2  # rejected candidates (too much overlap) leave room for others


def _distance(label, u, v):
    """Signed distance (in shape radii, < 0 inside) of class `label` at shape coordinates u, v."""
    au, av, r = tf.abs(u), tf.abs(v), tf.sqrt(u * u + v * v)
    box = lambda half_u, half_v: tf.maximum(au - half_u, av - half_v)
    fields = [
        r - 1.0,  # circle
        box(0.8, 0.8),  # square
        tf.maximum(v - 0.7, (1.65 * au - 0.95 * (v + 0.95)) / 1.904),  # triangle
        tf.minimum(box(0.28, 1.0), box(1.0, 0.28)),  # plus
        tf.abs(r - 0.72) - 0.24,  # ring
        box(1.0, 0.26),  # bar (rotated by 90 degrees half of the time: see draw_scene)
    ]
    return tf.gather(tf.stack(fields), label)


def _mask_box(alpha):
    """xyxy pixel-edge box of the pixels covered by more than half, and whether there are any."""
    size = tf.shape(alpha)[0]
    covered = alpha > 0.5
    rows, columns = tf.reduce_any(covered, axis=1), tf.reduce_any(covered, axis=0)
    first = lambda line: tf.argmax(tf.cast(line, tf.int32), output_type=tf.int32)
    last = lambda line: size - first(tf.reverse(line, [0]))
    box = tf.cast(tf.stack([first(columns), first(rows), last(columns), last(rows)]), tf.float32)
    return box, tf.reduce_any(rows)


def _covered(box, others):
    """Intersection of one xyxy box with each row of `others` [N, 4], over the smaller area."""
    top_left = tf.maximum(box[:2], others[:, :2])
    bottom_right = tf.minimum(box[2:], others[:, 2:])
    intersection = tf.reduce_prod(tf.maximum(bottom_right - top_left, 0.0), axis=-1)
    area = lambda b: (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])
    return intersection / tf.maximum(tf.minimum(area(box), area(others)), 1e-6)


def draw_scene(key, size: int, max_shapes: int = 4):
    """(image [size, size, 3] float32 in [0, 1], boxes [max_shapes, 4], classes [max_shapes])."""
    scene_key, shapes_key, noise_key = tf.unstack(tf.random.experimental.stateless_split(key, 3))
    scene = tf.random.stateless_uniform([8], scene_key)
    candidates = _CANDIDATES_PER_SHAPE * max_shapes
    params = tf.random.stateless_uniform([candidates, 9], shapes_key)
    wanted = 1 + tf.cast(scene[0] * max_shapes, tf.int32)
    wanted = tf.minimum(wanted, max_shapes)
    dark_background = scene[1] < 0.5
    background = 0.45 * scene[2:5] + tf.where(dark_background, 0.0, 0.4)
    image = tf.broadcast_to(background, [size, size, 3])
    centres = (tf.range(size, dtype=tf.float32) + 0.5) / size
    y, x = centres[:, None], centres[None, :]
    boxes, accepted = [], []  # per candidate so far
    labels = tf.cast(params[:, 0] * len(CLASS_NAMES), tf.int32)
    for index in range(candidates):  # unrolled: a handful of candidates, static shapes
        p = params[index]
        radius = 0.1 + 0.15 * p[1]  # the shape spans 20-50% of the image
        centre_y, centre_x = radius + (1 - 2 * radius) * p[2], radius + (1 - 2 * radius) * p[3]
        # +-10 degrees (as tfmp.classification.drawing), plus 90 degrees for half of the bars.
        angle = (p[4] - 0.5) * 0.35 + tf.where(p[8] < 0.5, 0.0, 1.5707964)
        dy, dx = y - centre_y, x - centre_x
        u = (tf.cos(angle) * dx + tf.sin(angle) * dy) / radius
        v = (tf.cos(angle) * dy - tf.sin(angle) * dx) / radius
        distance = _distance(tf.minimum(labels[index], len(CLASS_NAMES) - 1), u, v)
        alpha = tf.clip_by_value(0.5 - distance * radius * size, 0.0, 1.0)
        box, visible = _mask_box(alpha)
        take = visible
        if boxes:
            taken = tf.stack(accepted)
            overlap = tf.reduce_max(tf.where(taken, _covered(box, tf.stack(boxes)), 0.0))
            take &= (overlap <= MAX_COVERED) & (tf.reduce_sum(tf.cast(taken, tf.int32)) < wanted)
        contrast = (0.25 + 0.35 * p[5:8]) * tf.where(dark_background, 1.0, -1.0)
        colour = background + contrast
        image = tf.where(take, image + alpha[:, :, None] * (colour - image), image)
        boxes.append(box)
        accepted.append(take)
    image += 0.03 * tf.random.stateless_normal([size, size, 3], noise_key)
    boxes, accepted = tf.stack(boxes), tf.stack(accepted)
    # The accepted candidates first, in drawing order; the rest become padding rows.
    order = tf.argsort(tf.cast(~accepted, tf.int32), stable=True)[:max_shapes]
    keep = tf.gather(accepted, order)
    boxes = tf.where(keep[:, None], tf.gather(boxes, order), 0.0)
    classes = tf.where(keep, tf.gather(labels, order), -1)
    return tf.clip_by_value(image, 0.0, 1.0), boxes, classes
