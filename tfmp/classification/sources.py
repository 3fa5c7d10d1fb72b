"""Where a classification dataset's examples come from: the built-in datasets, TFDS and image
folders, each a `tfmp.input.source.Source` (its info, an example stream and how to decode one)
that `tfmp.classification.data.load` turns into a pipeline. The specs, and what each dataset
holds: `tfmp.classification.data`'s docstring.

    source = sources.folder("folder:/data/pets", "/data/pets", "train", 64, verify=True, max_pixels=0)
"""

import dataclasses
import os

import tensorflow as tf

from tfmp.classification import drawing
from tfmp.errors import UsageError
from tfmp.input import decoding, image_files, tfds_reader
from tfmp.input import spec as specs
from tfmp.input.source import Source

SHAPES_TRAIN_EXAMPLES, SHAPES_EVAL_EXAMPLES = 12_000, 2_000
DIGITS_TRAIN_EXAMPLES, DIGITS_EVAL_EXAMPLES = 20_000, 2_000
SYNTHETIC_TRAIN_EXAMPLES, SYNTHETIC_EVAL_EXAMPLES = 12_000, 2_000
SPLITS = specs.SPLITS
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp")
TFDS_SHUFFLE_BUFFER = 10_000  # encoded records: bounded; index/path streams shuffle fully
CONTENT_SEED = 1_234_567  # fixes the built-in datasets' content; `seed` only orders it


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    name: str  # the spec as given
    image_shape: tuple[int, int, int]
    num_classes: int
    train_examples: int  # 0 when unknown (a TFDS dataset whose split sizes TFDS doesn't know)
    eval_examples: int
    class_names: tuple[str, ...] | None = None  # label index -> name, where the dataset has names
    # The image files a folder: dataset decodes (train and eval): a run that fails to decode one
    # mid-run names it (`tfmp.input.decoding.failing_file`). Empty for the other datasets.
    files: tuple[str, ...] = dataclasses.field(default=(), repr=False, compare=False)


SHAPES_CLASS_NAMES = (
    "circle",
    "square",
    "triangle",
    "diamond",
    "plus",
    "ring",
    "horizontal_bar",
    "vertical_bar",
    "ellipse",
    "x",
)  # the order of drawing.draw_shape's classes
DIGITS_CLASS_NAMES = tuple(str(digit) for digit in range(10))


# ----------------------------------------------------------------------------- built-ins
def builtin(spec, kind, split, size):
    counts = {
        "shapes": (SHAPES_TRAIN_EXAMPLES, SHAPES_EVAL_EXAMPLES),
        "digits": (DIGITS_TRAIN_EXAMPLES, DIGITS_EVAL_EXAMPLES),
        "synthetic": (SYNTHETIC_TRAIN_EXAMPLES, SYNTHETIC_EVAL_EXAMPLES),
    }[kind]
    if kind == "digits":
        shape, draw = (size or 28, size or 28, 1), drawing.draw_digit
    else:
        shape, draw = (size, size, 3), drawing.draw_shape
    names = {"shapes": SHAPES_CLASS_NAMES, "digits": DIGITS_CLASS_NAMES}.get(kind)
    info = DatasetInfo(spec, shape, 10, *counts, class_names=names)
    split_id = SPLITS.index(split)
    num_examples = counts[split_id]

    def decode(index):
        key = tf.stack([tf.constant(CONTENT_SEED + split_id, tf.int64), index])
        image = draw(key, tf.cast(index % 10, tf.int32), shape[0])
        if image.shape[:2] != shape[:2]:  # digits are drawn at 28x28
            image = tf.clip_by_value(tf.image.resize(image, shape[:2], antialias=True), 0.0, 1.0)
        return image, tf.cast(index % 10, tf.int32)  # index % 10: exactly balanced classes

    return Source(
        info,
        num_examples,
        0,
        lambda *_: tf.data.Dataset.range(num_examples),
        decode,
        num_examples,
        flip_ok=kind != "digits",
    )


# ----------------------------------------------------------------------------- TFDS
def tfds(spec, name, split, size, data_dir, verify):
    tfds = tfds_reader.module()
    info = tfds_reader.builder(name, data_dir).info
    image_key, label_key = info.supervised_keys if info.supervised_keys else ("image", "label")
    features = info.features
    if not (
        image_key in features.keys()
        and isinstance(features[image_key], tfds.features.Image)
        and label_key in features.keys()
        and isinstance(features[label_key], tfds.features.ClassLabel)
    ):
        raise UsageError(f"tfds dataset {name!r} is not image classification (no image/label)")
    native_shape = features[image_key].shape
    if size is None and None in native_shape[:2]:
        raise UsageError(f"tfds dataset {name!r} has images of varying size; pass image_size")
    height, width = (size, size) if size else native_shape[:2]
    splits = info.splits  # empty when the dataset isn't prepared in data_dir (or TFDS is mocked)
    names = ("train", next((s for s in ("test", "validation") if s in splits), "test"))
    if splits and names[1] not in splits:  # train only (e.g. tf_flowers): hold out its last 10%
        names = ("train[:90%]", "train[90%:]")
    if splits and "train" not in splits:
        raise UsageError(f"tfds dataset {name!r} has no train split (it has {', '.join(splits)})")
    if verify:  # the reader's own open: an unprepared dataset fails here, not after the run starts
        tfds_reader.check_readable(name, names, data_dir)
    split_infos = [splits[s] if splits else None for s in names]
    counts = [s.num_examples if s else 0 for s in split_infos]
    tfds_split = names[SPLITS.index(split)]
    image_feature = features[image_key]

    def examples(file_shard_context, shuffle_seed):
        # Images stay encoded (SkipDecoding) until after shuffle/skip; see `tfmp.classification.data` (pipeline order).
        decoders = {image_key: tfds.decode.SkipDecoding()}
        return tfds_reader.read(
            name, tfds_split, data_dir, file_shard_context, shuffle_seed, decoders, as_supervised=True
        )

    def decode(encoded, label):
        image = image_files.unit_float(image_feature.decode_example(encoded), (size, size) if size else None)
        return image, tf.cast(label, tf.int32)

    channels = native_shape[2] or 3
    info = DatasetInfo(
        spec,
        (height, width, channels),
        features[label_key].num_classes,
        *counts,
        class_names=tuple(features[label_key].names),
    )
    num_examples = counts[SPLITS.index(split)]
    num_files = split_infos[SPLITS.index(split)].num_shards if splits else 0
    buffer = min(num_examples or TFDS_SHUFFLE_BUFFER, TFDS_SHUFFLE_BUFFER)
    return Source(info, num_examples, num_files, examples, decode, buffer)


# ----------------------------------------------------------------------------- folders
def folder_files(path):
    """(class folder names, train [(file, label)], eval [(file, label)]) of a `folder:` dataset;
    local names as `os.listdir` gives them (surrogate-escaped where not UTF-8)."""
    root = os.path.expanduser(path)
    if not decoding.isdir(root):
        raise UsageError(f"dataset folder {path!r} does not exist (or is not a folder)")
    eval_dir = next((d for d in ("val", "validation", "test") if decoding.isdir(os.path.join(root, d))), None)
    split_dirs = decoding.isdir(os.path.join(root, "train")) and eval_dir
    class_root = os.path.join(root, "train") if split_dirs else root
    classes = sorted(d for d in decoding.listdir(class_root) if decoding.isdir(os.path.join(class_root, d)))

    def files(directory, holdout):  # holdout: None = all files, True/False = eval/train part
        found = []
        for label, name in enumerate(classes):
            folder = os.path.join(directory, name)
            names = sorted(decoding.listdir(folder)) if decoding.isdir(folder) else []
            names = [n for n in names if n.lower().endswith(IMAGE_EXTENSIONS)]
            found += [
                (os.path.join(folder, n), label)
                for i, n in enumerate(names)
                if holdout is None or (i % 10 == 9) == holdout
            ]
        return found

    if split_dirs:
        return classes, files(class_root, None), files(os.path.join(root, eval_dir), None)
    return classes, files(root, False), files(root, True)


def folder(spec, path, split, size, verify, max_pixels):
    classes, train, evaluation = folder_files(path)
    if not train:
        raise UsageError(
            f"dataset folder {path!r} has no images in class sub-folders "
            f"(expected {path}/<class>/*.png|jpg|bmp|gif|webp)"
        )
    info = DatasetInfo(
        spec,
        (size, size, 3),
        len(classes),
        len(train),
        len(evaluation),
        class_names=tuple(decoding.shown(name) for name in classes),
        files=tuple(file for file, _ in train + evaluation),
    )
    if not evaluation and (verify or split == "eval"):
        raise UsageError(
            f"dataset folder {path!r} has no eval images; give each class 10 or more images "
            f"(every 10th is held out) or put the eval images in {path}/val/<class>/ beside train/"
        )
    if verify:  # a bad file found now, before the run writes anything, not as a traceback mid-run
        image_files.check([file for file, _ in train + evaluation], spec, max_pixels=max_pixels)
    chosen = train if split == "train" else evaluation
    paths, labels = [decoding.tf_path(p) for p, _ in chosen], [label for _, label in chosen]

    def decode(file_path, label):
        raw = decoding.decode(tf.io.read_file(file_path), channels=3)
        return image_files.unit_float(raw, (size, size)), tf.cast(label, tf.int32)  # uint8 resized

    def examples(file_shard_context, _):  # one file per example: sharding files = sharding data
        dataset = tf.data.Dataset.from_tensor_slices((paths, labels))
        if file_shard_context is None:
            return dataset
        return dataset.shard(file_shard_context.num_input_pipelines, file_shard_context.input_pipeline_id)

    return Source(info, len(chosen), len(chosen), examples, decode, max(len(chosen), 1))
