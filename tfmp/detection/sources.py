"""The detection datasets `tfmp.detection.data` reads: built-in scenes, COCO-format JSON, TFDS.

    source = shapes_source("shapes", "train", 128)
    source = coco_source("coco:/data/coco", "/data/coco", "train", 512, max_boxes=100)
    source = tfds_source("tfds:voc/2007", "voc/2007", "eval", 512, 100, data_dir="/data/tfds")
    source.info                # DetectionInfo: image size, classes, split sizes

Each returns a `tfmp.input.source.Source`: a cheap stream of dict items (an index, a file path
and its boxes, or a still-encoded TFDS record) plus the decoder that turns one into (float32
image, xyxy pixel boxes, int32 classes). The `shapes` source decodes in two steps instead: per
example its random numbers, per batch the drawing (`Source.decode_batch`, see
`tfmp.detection.shapes`), already square with `max_boxes` rows. COCO category ids (any
integers) become classes 0..K-1 in ascending id order, named by the categories' "name".
Crowd annotations are skipped; an image without boxes stays (a pure negative). Bad annotation
files raise `UsageError` naming the file, the entry (``annotations[3] (id 17)``), the field and
the fix: a missing or mistyped field, a NaN or negative-size box, a box entirely outside its
image (when the image gives its width and height). A box reaching partly outside is clipped to
the image; `describe` (verify=True) warns once how many were.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np
import tensorflow as tf
from absl import logging
from keras.utils import bounding_boxes

from tfmp.detection import shapes
from tfmp.errors import UsageError
from tfmp.input import decoding, image_files, tfds_reader
from tfmp.input.source import Source

COCO_SPLITS = {"train": ("train2017", "train"), "eval": ("val2017", "val")}
HOLDOUT_EVERY = 10  # a single annotation file: every 10th image is the eval split
# Train / eval splits of known TFDS detection datasets (VOC's test split is labelled; COCO's is not).
TFDS_SPLITS = {"voc": ("train+validation", "test"), "coco": ("train", "validation")}
TFDS_SHUFFLE_BUFFER = 10_000
SHAPES_TRAIN_EXAMPLES, SHAPES_EVAL_EXAMPLES = 50_000, 500
SHAPES_MAX_SHAPES = 4
_CONTENT_SEED = 7_654_321  # fixes the shapes scenes; `seed` only orders and augments them


@dataclasses.dataclass(frozen=True)
class DetectionInfo:
    name: str  # the spec as given
    image_size: int  # square model input side
    num_classes: int
    class_names: tuple[str, ...]
    train_examples: int  # 0 when unknown (a TFDS dataset whose split sizes TFDS doesn't know)
    eval_examples: int
    max_boxes: int  # ground-truth rows per image (more are truncated)
    # The image files a coco: dataset decodes (train and eval): a run that fails to decode one
    # mid-run names it (`tfmp.input.decoding.failing_file`). Empty for the other datasets.
    files: tuple[str, ...] = dataclasses.field(default=(), repr=False, compare=False)


def shapes_source(spec, split, size) -> Source:
    """The built-in `shapes` scenes of one split, keyed by (split, index)."""
    info = DetectionInfo(
        spec,
        size,
        len(shapes.CLASS_NAMES),
        shapes.CLASS_NAMES,
        SHAPES_TRAIN_EXAMPLES,
        SHAPES_EVAL_EXAMPLES,
        SHAPES_MAX_SHAPES,
    )
    split_id = ("train", "eval").index(split)
    count = (SHAPES_TRAIN_EXAMPLES, SHAPES_EVAL_EXAMPLES)[split_id]

    def randomness(item):
        key = tf.stack([tf.constant(_CONTENT_SEED + split_id, tf.int64), item["index"]])
        return shapes.scene_randomness(key, size, SHAPES_MAX_SHAPES)

    def examples(*_):
        return tf.data.Dataset.range(count).map(lambda index: {"index": index})

    return Source(
        info,
        count,
        0,
        examples,
        randomness,
        count,
        decode_batch=lambda drawn: shapes.render_scenes(drawn, size, SHAPES_MAX_SHAPES),
    )


def _coco_files(path):
    """(annotation JSON, image folder) of each split: COCO's layout, or one JSON file."""
    root = os.path.expanduser(path)
    if tf.io.gfile.exists(root) and not tf.io.gfile.isdir(root):
        return {"train": (root, os.path.dirname(root)), "eval": (root, os.path.dirname(root))}, True
    if not tf.io.gfile.isdir(root):
        raise UsageError(
            f"COCO dataset path {path!r} does not exist; pass a folder with "
            "annotations/instances_<split>.json or one annotation JSON file"
        )
    found = {}
    for split, names in COCO_SPLITS.items():
        for name in names:
            annotation = os.path.join(root, "annotations", f"instances_{name}.json")
            if tf.io.gfile.exists(annotation):
                found[split] = (annotation, os.path.join(root, name))
                break
    if "train" not in found:
        raise UsageError(
            f"COCO folder {path!r} has no annotations/instances_train2017.json "
            "(or instances_train.json); use COCO's layout or pass the JSON file"
        )
    found.setdefault("eval", None)
    return found, False


def _json_kind(value) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _is_id(value) -> bool:
    return isinstance(value, (int, str)) and not isinstance(value, bool)


_NUMBER_TYPES = {int, float}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bad_field(entry: dict, key: str) -> str:
    return f"a bad {key} {entry[key]!r}" if key in entry else f"no {key}"


def _entry_name(kind: str, index: int, entry: dict) -> str:
    """`annotations[3] (id 17)`: where a user finds the entry, by position and by id."""
    return f"{kind}[{index}]" + (f" (id {entry['id']!r})" if "id" in entry else "")


def _load_coco_json(annotation_file) -> tuple[list, list, list]:
    """(images, annotations, categories) of a COCO JSON: lists of JSON objects, or a UsageError."""
    where = f"COCO file {annotation_file!r}"
    try:
        with tf.io.gfile.GFile(annotation_file) as handle:
            content = json.load(handle)
    except ValueError as error:  # not JSON (or not UTF-8): json and the codec both raise ValueError
        raise UsageError(f"{where} is not JSON ({error}); fix it or export it again") from None
    except tf.errors.OpError as error:  # unreadable: permissions, a folder named like the file
        raise UsageError(f"{where} cannot be read ({error.message})") from None
    if not isinstance(content, dict):
        raise UsageError(
            f"{where} holds {_json_kind(content)}, not COCO's object of images, "
            "annotations and categories lists"
        )
    lists = []
    for key in ("images", "annotations", "categories"):
        entries = content.get(key, [] if key == "annotations" else None)
        if not isinstance(entries, list):
            what = f"has no {key!r}" if entries is None else f"has {_json_kind(entries)} as {key!r}"
            raise UsageError(f"{where} {what}; COCO JSON needs images, annotations and categories lists")
        bad = next((index for index, entry in enumerate(entries) if not isinstance(entry, dict)), None)
        if bad is not None:
            raise UsageError(f"{where}: {key}[{bad}] is {_json_kind(entries[bad])}, not a JSON object")
        lists.append(entries)
    return tuple(lists)


def _coco_categories(categories, where) -> tuple[tuple[str, ...], dict]:
    """(class names in ascending id order, {category id: class index})."""
    if not categories:
        raise UsageError(f"{where} has an empty categories list; list the object classes there")
    seen = {}
    for index, category in enumerate(categories):
        name = _unique_id("categories", "category", index, category, seen, where)
        if not isinstance(category.get("name"), str) or not category["name"]:
            raise UsageError(f"{where}: {name} has {_bad_field(category, 'name')}; give each category a name")
    try:
        ordered = sorted(categories, key=lambda category: category["id"])
    except TypeError:
        raise UsageError(f"{where} mixes number and string category ids; use integer ids") from None
    return tuple(c["name"] for c in ordered), {c["id"]: index for index, c in enumerate(ordered)}


def _coco_images(images, where, image_folder) -> dict:
    """{image id: (index in images, file_name, (width, height) or None when not given)}."""
    found, seen = {}, {}
    for index, image in enumerate(images):
        name = _unique_id("images", "image", index, image, seen, where)
        if not isinstance(image.get("file_name"), str) or not image["file_name"]:
            raise UsageError(
                f"{where}: {name} has {_bad_field(image, 'file_name')}; give each image "
                f"its file's path relative to {image_folder}"
            )
        width, height = image.get("width"), image.get("height")
        size = None
        if width is not None or height is not None:  # optional; given, they bound the boxes
            if not all(_is_number(v) and math.isfinite(v) and v > 0 for v in (width, height)):
                raise UsageError(
                    f"{where}: {name} has a bad size {width!r} x {height!r}; give its "
                    "width and height in pixels (or neither)"
                )
            size = (float(width), float(height))
        found[image["id"]] = (index, image["file_name"], size)
    return found


def _unique_id(kind: str, noun: str, index: int, entry: dict, seen: dict, where: str) -> str:
    """The entry's name for messages; a UsageError unless its id is an integer not in `seen`
    ({id: index}, which it joins)."""
    name = _entry_name(kind, index, entry)
    if not _is_id(entry.get("id")):
        raise UsageError(
            f"{where}: {name} has {_bad_field(entry, 'id')}; give each {noun} a unique integer id"
        )
    if entry["id"] in seen:
        raise UsageError(
            f"{where}: {name} repeats the id of {kind}[{seen[entry['id']]}]; give each {noun} its own id"
        )
    seen[entry["id"]] = index
    return name


def _box_problem(annotation, images, class_of) -> str | None:
    """What is wrong with one annotation's bbox, image_id or category_id, or None."""
    bbox = annotation.get("bbox")
    if bbox is None:
        return "has no bbox; give it [x, y, width, height] in pixels"
    # type() rather than isinstance: a bool is no coordinate (and COCO has ~1M boxes to check)
    if not (type(bbox) is list and len(bbox) == 4 and {type(v) for v in bbox} <= _NUMBER_TYPES):
        return f"has a bad bbox {bbox!r}; use [x, y, width, height] numbers"
    if not math.isfinite(sum(bbox)):  # a NaN or an infinity makes the sum one
        return f"has a bbox with NaN or infinity {bbox!r}; fix or remove it"
    if bbox[2] < 0 or bbox[3] < 0:
        return (
            f"has a negative width or height in bbox {bbox!r} (inverted box?); COCO boxes are "
            "[x, y, width, height] with width, height >= 0"
        )
    image_id, category_id = annotation.get("image_id"), annotation.get("category_id")
    if not _is_id(image_id) or image_id not in images:
        return f"names image_id {image_id!r}, which is not in its images list; fix the image_id"
    if not _is_id(category_id) or category_id not in class_of:
        return f"names category_id {category_id!r}, which is not in its categories list; fix the category_id"
    return None


def _clip_box(bbox: list[float], size) -> tuple[list[float], bool] | None:
    """(`bbox` clipped to an image of `size` (width, height), whether it reached outside), or
    None when it lies entirely outside. Such a box is refused rather than dropped: no clipping
    repairs it, it means the annotation is wrong in a way that is rarely alone (another image's
    id, normalised or swapped coordinates), and a dropped box would teach the detector that its
    object is background."""
    x, y, width, height = bbox
    if x >= 0 and y >= 0 and x + width <= size[0] and y + height <= size[1]:
        return bbox, False  # as given: (x + width) - x need not be width in floats
    x0, y0 = max(x, 0.0), max(y, 0.0)
    x1, y1 = min(x + width, size[0]), min(y + height, size[1])
    return ([x0, y0, x1 - x0, y1 - y0], True) if x1 > x0 and y1 > y0 else None


def _read_coco(annotation_file, image_folder):
    """Parses and validates one COCO JSON: (class names, [(path, boxes, classes)] in file order,
    number of boxes clipped to their image)."""
    where = f"COCO file {annotation_file!r}"
    images, annotations, categories = _load_coco_json(annotation_file)
    class_names, class_of = _coco_categories(categories, where)
    by_id = _coco_images(images, where, image_folder)
    per_image = {image_id: ([], []) for image_id in by_id}
    clipped = 0
    for index, annotation in enumerate(annotations):
        problem = _box_problem(annotation, by_id, class_of)
        bbox = annotation.get("bbox")
        if problem is None and not (annotation.get("iscrowd", 0) or bbox[2] == 0 or bbox[3] == 0):
            # (crowd regions are not objects to learn; empty boxes have nothing to find)
            size = by_id[annotation["image_id"]][2]
            box = [float(v) for v in bbox]
            placed = (box, False) if size is None else _clip_box(box, size)
            if placed is None:
                problem = (
                    f"has bbox {bbox!r} entirely outside its image {annotation['image_id']!r} "
                    f"({size[0]:g} x {size[1]:g} pixels); fix its bbox or image_id"
                )
            else:
                clipped += placed[1]
                boxes, classes = per_image[annotation["image_id"]]
                boxes.append(placed[0])
                classes.append(class_of[annotation["category_id"]])
        if problem is not None:
            raise UsageError(f"{where}: {_entry_name('annotations', index, annotation)} {problem}")
    examples, missing = [], []
    for image_id, (index, file_name, _) in by_id.items():
        path = os.path.join(image_folder, file_name)
        if not tf.io.gfile.exists(path):
            missing.append((index, path))
        examples.append((path, *per_image[image_id]))
    if missing:
        raise UsageError(
            f"{where}: {len(missing)} image file(s) are missing, first {missing[0][1]!r} "
            f"(images[{missing[0][0]}]); put the images there or fix their file_name"
        )
    return class_names, examples, clipped


def _coco_splits(path):
    """(class names, train examples, eval examples, boxes clipped) of a `coco:PATH` dataset."""
    files, single_file = _coco_files(path)
    class_names, train, clipped = _read_coco(*files["train"])
    if single_file:
        evaluation = [e for i, e in enumerate(train) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
        train = [e for i, e in enumerate(train) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
    elif files["eval"] is not None:
        eval_names, evaluation, clipped_eval = _read_coco(*files["eval"])
        clipped += clipped_eval
        if eval_names != class_names:
            raise UsageError(
                f"COCO folder {path!r}: the val annotations have other categories "
                "than the train ones; use one category list for both"
            )
    else:
        evaluation = []
    return class_names, train, evaluation, clipped


def coco_source(spec, path, split, size, max_boxes, verify=False, max_pixels=image_files.MAX_IMAGE_PIXELS):
    """A `coco:PATH` split (see the module docstring of `tfmp.detection.data`); `verify` also
    requires eval images and sniffs every image file of both splits (`tfmp.input.image_files`),
    refusing one whose header declares more than `max_pixels` pixels (0: no limit)."""
    class_names, train, evaluation, clipped = _coco_splits(path)
    for name, examples in (("train", train), ("eval", evaluation)):
        if not examples and (verify or name == split):
            raise UsageError(
                f"COCO dataset {path!r} has no {name} images (a single JSON holds out every "
                f"{HOLDOUT_EVERY}th image: give it {HOLDOUT_EVERY} or more; a folder needs "
                "annotations/instances_val2017.json or instances_val.json)"
            )
    if verify:
        image_files.check(
            [example[0] for example in train + evaluation],
            spec,
            fix="remove or repair them, or their entries in the annotation JSON",
            max_pixels=max_pixels,
        )
        if clipped:  # once per run (`verify` is its describe step's), and only when it starts
            total = sum(len(example[1]) for example in train + evaluation)
            logging.warning(
                "coco:%s: clipped %d of %d boxes that reach outside their image", path, clipped, total
            )
    chosen = train if split == "train" else evaluation
    files = tuple(example[0] for example in train + evaluation)
    info = DetectionInfo(
        spec, size, len(class_names), class_names, len(train), len(evaluation), max_boxes, files=files
    )
    paths = [decoding.tf_path(p) for p, _, _ in chosen]
    lengths = [len(cs) for _, _, cs in chosen]
    boxes = tf.RaggedTensor.from_row_lengths(
        np.array([b for _, bs, _ in chosen for b in bs], np.float32).reshape(-1, 4), lengths
    )
    classes = tf.RaggedTensor.from_row_lengths(
        np.array([c for _, _, cs in chosen for c in cs], np.int32), lengths
    )

    def examples(file_shard_context, _):  # one file per example: sharding files = sharding data
        dataset = tf.data.Dataset.from_tensor_slices({"path": paths, "boxes": boxes, "classes": classes})
        if file_shard_context is None:
            return dataset
        return dataset.shard(file_shard_context.num_input_pipelines, file_shard_context.input_pipeline_id)

    def decode(item):
        raw = decoding.decode(tf.io.read_file(item["path"]), channels=3)
        xyxy = bounding_boxes.convert_format(item["boxes"], source="xywh", target="xyxy")
        return raw, xyxy, item["classes"]  # uint8: fit_to_square resizes it before it becomes float32

    return Source(info, len(chosen), len(chosen), examples, decode, max(len(chosen), 1))


def tfds_source(spec, name, split, size, max_boxes, data_dir, verify=False):
    """A `tfds:NAME` split: a prepared TFDS dataset with `objects/bbox` and `objects/label`;
    `verify` also opens both splits' records (an unprepared dataset is refused now)."""
    tfds = tfds_reader.module()
    builder = tfds_reader.builder(name, data_dir, example="voc/2007 or coco/2017")
    features = builder.info.features
    objects = features["objects"] if "objects" in features.keys() else None
    if not (
        "image" in features.keys()
        and objects is not None
        and {"bbox", "label"} <= set(objects.feature.keys())
        and isinstance(objects.feature["label"], tfds.features.ClassLabel)
    ):
        raise UsageError(
            f"tfds dataset {name!r} is not object detection (it needs image, "
            "objects/bbox and objects/label features)"
        )
    family = name.split("/")[0].split(":")[0]
    splits = builder.info.splits  # empty when not prepared in data_dir (or TFDS is mocked)
    names = TFDS_SPLITS.get(family) or ("train", "test" if "test" in splits else "validation")
    tfds_split = names[("train", "eval").index(split)]

    def count(split_name):
        try:
            return sum(splits[part].num_examples for part in split_name.split("+")) if splits else 0
        except KeyError:
            raise UsageError(
                f"tfds dataset {name!r} has no split {split_name!r} (it has {', '.join(splits)})"
            ) from None

    counts = [count(split_name) for split_name in names]
    if verify:
        tfds_reader.check_readable(name, names, data_dir)
    label_feature = objects.feature["label"]
    info = DetectionInfo(
        spec, size, label_feature.num_classes, tuple(label_feature.names), *counts, max_boxes
    )
    num_files = sum(splits[part].num_shards for part in tfds_split.split("+")) if splits else 0
    image_feature = features["image"]
    crowd = "is_crowd" in objects.feature.keys()

    def examples(file_shard_context, shuffle_seed):
        # Images stay encoded until after shuffle/skip: resuming decodes nothing.
        decoders = {"image": tfds.decode.SkipDecoding()}
        return tfds_reader.read(name, tfds_split, data_dir, file_shard_context, shuffle_seed, decoders)

    def decode(item):
        image = image_feature.decode_example(item["image"])  # uint8: fit_to_square resizes it first
        shape = tf.cast(tf.shape(image), tf.float32)
        xyxy = bounding_boxes.convert_format(
            item["objects"]["bbox"], source="rel_yxyx", target="xyxy", height=shape[0], width=shape[1]
        )
        classes = tf.cast(item["objects"]["label"], tf.int32)
        if crowd:
            classes = tf.where(item["objects"]["is_crowd"], -1, classes)
        return image, xyxy, classes

    num_examples = counts[("train", "eval").index(split)]
    buffer = min(num_examples or TFDS_SHUFFLE_BUFFER, TFDS_SHUFFLE_BUFFER)
    return Source(info, num_examples, num_files, examples, decode, buffer)
