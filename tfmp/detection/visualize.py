"""Drawing detections onto images and writing them as PNG files (Pillow, no display needed).

    from tfmp.detection import visualize
    visualize.draw_detections(image, boxes, classes, scores, class_names, "out.png")

`image` is HxWx3, float in [0, 1] or uint8; `boxes` are xyxy pixels of that image; `scores` may
be None (ground truth). Each box gets an outline in its class's colour and a label
"name 0.93" on a filled tag above it (inside the image when the box touches the top edge); the
most confident box is drawn last, on top.
"""

from __future__ import annotations

import colorsys
import os

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from tfmp.errors import UsageError


def class_colour(class_id: int) -> tuple[int, int, int]:
    """A bright colour per class, well apart for neighbouring ids (golden-ratio hue steps)."""
    red, green, blue = colorsys.hsv_to_rgb((class_id * 0.618034) % 1.0, 0.85, 1.0)
    return int(red * 255), int(green * 255), int(blue * 255)


def _to_uint8(image) -> np.ndarray:
    image = np.asarray(image)
    if image.ndim != 3 or image.shape[-1] not in (1, 3):
        raise UsageError(f"cannot draw on an image of shape {image.shape}; use HxWx3 or HxWx1")
    if image.dtype != np.uint8:
        image = np.clip(np.round(image.astype(np.float32) * 255.0), 0, 255).astype(np.uint8)
    return np.repeat(image, 3, axis=-1) if image.shape[-1] == 1 else image


def render(image, boxes, classes, scores=None, class_names=None, scale: int = 1) -> Image.Image:
    """The image (enlarged `scale` times, so small inputs stay legible) with the boxes drawn."""
    picture = Image.fromarray(_to_uint8(image))
    if scale != 1:
        picture = picture.resize((picture.width * scale, picture.height * scale), Image.NEAREST)
    draw = ImageDraw.Draw(picture)
    font = ImageFont.load_default()
    boxes = np.asarray(boxes, np.float32).reshape(-1, 4) * scale
    classes = np.asarray(classes).reshape(-1).astype(int)
    scores = None if scores is None else np.asarray(scores, np.float32).reshape(-1)
    line_width = max(1, round(min(picture.size) / 200))
    # Lowest score first: where tags overlap, the most confident one stays readable on top.
    order = range(len(boxes)) if scores is None else np.argsort(scores, kind="stable")
    for index in order:
        box, class_id = boxes[index], classes[index]
        colour = class_colour(class_id)
        draw.rectangle([float(v) for v in box], outline=colour, width=line_width)
        name = (
            class_names[class_id]
            if class_names is not None and 0 <= class_id < len(class_names)
            else str(class_id)
        )
        label = name if scores is None else f"{name} {scores[index]:.2f}"
        left, top, right, bottom = draw.textbbox((0, 0), label, font=font)
        tag_height = bottom - top + 2
        y = box[1] - tag_height if box[1] >= tag_height else box[1]
        draw.rectangle([box[0], y, box[0] + right - left + 3, y + tag_height], fill=colour)
        draw.text((box[0] + 2, y + 1 - top), label, fill=(0, 0, 0), font=font)
    return picture


def draw_detections(image, boxes, classes, scores, class_names, path: str, scale: int = 1) -> str:
    """Renders (see `render`) and writes a PNG to `path` (folders created); returns the path."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    render(image, boxes, classes, scores, class_names, scale).save(path, format="PNG")
    return path
