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
files raise `UsageError` naming the file, the image or annotation, and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import tensorflow as tf
from keras.utils import bounding_boxes

from tfmp.detection import shapes
from tfmp.errors import UsageError
from tfmp.input import tfds_reader
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


def _read_coco(annotation_file, image_folder):
    """Parses and validates one COCO JSON: (class names, [(path, boxes, classes)] in file order)."""
    try:
        with tf.io.gfile.GFile(annotation_file) as handle:
            content = json.load(handle)
        images, annotations = content["images"], content.get("annotations", [])
        categories = sorted(content["categories"], key=lambda category: category["id"])
    except (ValueError, KeyError, TypeError) as error:
        raise UsageError(
            f"COCO annotation file {annotation_file!r} is not COCO JSON ({error!r}); "
            "it needs images, annotations and categories lists"
        ) from None
    class_of = {category["id"]: index for index, category in enumerate(categories)}
    per_image = {image["id"]: ([], []) for image in images}
    for annotation in annotations:
        where = f"annotation {annotation.get('id')!r} of {annotation_file!r}"
        bbox = annotation.get("bbox")
        if not (
            isinstance(bbox, (list, tuple))
            and len(bbox) == 4
            and all(isinstance(v, (int, float)) for v in bbox)
        ):
            raise UsageError(f"{where} has a bad bbox {bbox!r}; use [x, y, width, height] numbers")
        if bbox[2] < 0 or bbox[3] < 0:
            raise UsageError(
                f"{where} has a negative width or height in bbox {bbox!r} (inverted "
                "box?); COCO boxes are [x, y, width, height] with width, height >= 0"
            )
        if annotation.get("image_id") not in per_image:
            raise UsageError(
                f"{where} names image_id {annotation.get('image_id')!r}, which is "
                "not in its images list; fix the image_id"
            )
        if annotation.get("category_id") not in class_of:
            raise UsageError(
                f"{where} names category_id {annotation.get('category_id')!r}, "
                "which is not in its categories list; fix the category_id"
            )
        if annotation.get("iscrowd", 0) or bbox[2] == 0 or bbox[3] == 0:
            continue  # crowd regions are not objects to learn; empty boxes have nothing to find
        boxes, classes = per_image[annotation["image_id"]]
        boxes.append([float(v) for v in bbox])
        classes.append(class_of[annotation["category_id"]])
    examples, missing = [], []
    for image in images:
        path = os.path.join(image_folder, image["file_name"])
        if not tf.io.gfile.exists(path):
            missing.append(path)
        boxes, classes = per_image[image["id"]]
        examples.append((path, boxes, classes))
    if missing:
        raise UsageError(
            f"{len(missing)} image(s) of {annotation_file!r} are missing, e.g. "
            f"{missing[0]!r}; put the images there or fix their file_name"
        )
    return tuple(category["name"] for category in categories), examples


def coco_source(spec, path, split, size, max_boxes):
    """A `coco:PATH` split (see the module docstring of `tfmp.detection.data`)."""
    files, single_file = _coco_files(path)
    class_names, train = _read_coco(*files["train"])
    if single_file:
        evaluation = [e for i, e in enumerate(train) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
        train = [e for i, e in enumerate(train) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
    elif files["eval"] is not None:
        eval_names, evaluation = _read_coco(*files["eval"])
        if eval_names != class_names:
            raise UsageError(
                f"COCO folder {path!r}: the val annotations have other categories "
                "than the train ones; use one category list for both"
            )
    else:
        evaluation = []
    chosen = train if split == "train" else evaluation
    if not chosen:
        raise UsageError(
            f"COCO dataset {path!r} has no {split} images (a single JSON holds out "
            f"every {HOLDOUT_EVERY}th image; a folder needs annotations for val)"
        )
    info = DetectionInfo(spec, size, len(class_names), class_names, len(train), len(evaluation), max_boxes)
    paths = [p for p, _, _ in chosen]
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
        raw = tf.io.decode_image(tf.io.read_file(item["path"]), channels=3, expand_animations=False)
        xyxy = bounding_boxes.convert_format(item["boxes"], source="xywh", target="xyxy")
        return tf.image.convert_image_dtype(raw, tf.float32), xyxy, item["classes"]

    return Source(info, len(chosen), len(chosen), examples, decode, max(len(chosen), 1))


def tfds_source(spec, name, split, size, max_boxes, data_dir):
    """A `tfds:NAME` split: a prepared TFDS dataset with `objects/bbox` and `objects/label`."""
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
        image = tf.image.convert_image_dtype(image_feature.decode_example(item["image"]), tf.float32)
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
