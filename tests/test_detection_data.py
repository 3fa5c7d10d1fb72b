"""Tests for tfmp.detection.data/.sources/.shapes: built-in scenes, box-aware augmentation,
COCO-format folders the tests write, TFDS VOC (mocked), eval padding and sharding.

Tiny images (64 px) and a few examples each; the file runs in well under a minute on CPU.
"""

import functools
import json
import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from PIL import Image

from tfmp.detection import boxes, data, shapes, targets
from tfmp.errors import UsageError

tfds.disable_progress_bar()
SIZE = 64
ANCHORS = boxes.generate_anchors(SIZE, boxes.AnchorConfig(levels=(3, 4, 5)))


def _context(pipelines, pipeline_id, replicas):
    return tf.distribute.InputContext(
        num_input_pipelines=pipelines, input_pipeline_id=pipeline_id, num_replicas_in_sync=replicas
    )


# ----------------------------------------------------------------------------- built-in scenes
def test_shapes_scenes_are_deterministic_with_boxes_on_the_drawn_pixels():
    info = data.describe("shapes", image_size=SIZE)
    assert info.num_classes == len(shapes.CLASS_NAMES) == len(info.class_names)
    first, _ = data.load("shapes", "eval", 8, anchors=ANCHORS, image_size=SIZE)
    again, _ = data.load("shapes", "eval", 8, anchors=ANCHORS, image_size=SIZE)
    (images, labels, truth), (images_again, _, _) = next(iter(first)), next(iter(again))
    np.testing.assert_array_equal(images, images_again)
    assert images.dtype == tf.float32 and images.shape == (8, SIZE, SIZE, 3)
    assert labels["classes"].shape == (8, ANCHORS.shape[0]) and labels["boxes"].shape[-1] == 5
    counts = (truth["classes"].numpy() >= 0).sum(1)
    assert counts.min() >= 1 and counts.max() <= data.SHAPES_MAX_SHAPES and len(set(counts)) > 1
    valid = truth["boxes"].numpy()[truth["classes"].numpy() >= 0]
    assert valid.min() >= 0 and valid.max() <= SIZE and (valid[:, 2:] > valid[:, :2]).all()
    # Every positive anchor's class is the class of a box of its image.
    for row in range(8):
        positive = set(labels["classes"][row].numpy()[labels["classes"][row].numpy() >= 0])
        assert positive == set(
            truth["classes"][row].numpy()[
                counts[row] * [True] + [False] * (data.SHAPES_MAX_SHAPES - counts[row])
            ]
        )


def test_a_single_shape_box_bounds_exactly_the_pixels_that_differ_from_the_background():
    for index in range(6):
        image, scene_boxes, classes = shapes.draw_scene(tf.constant([5, index], tf.int64), SIZE, 1)
        image, (x0, y0, x1, y1) = image.numpy(), scene_boxes[0].numpy().astype(int)
        background = np.median(image[[0, -1]].reshape(-1, 3), axis=0)
        differs = np.abs(image - background).max(-1) > 0.2  # shape contrast >= 0.25, noise 0.03
        assert int(classes[0]) >= 0
        outside = differs.copy()
        # Covered by less than half, anti-aliased edge pixels may still differ: one pixel around.
        outside[max(y0 - 1, 0) : y1 + 1, max(x0 - 1, 0) : x1 + 1] = False
        assert not outside.any()
        assert differs[y0:y1, x0:x1].any(axis=1)[[0, -1]].all()  # top and bottom rows are ink
        assert differs[y0:y1, x0:x1].any(axis=0)[[0, -1]].all()


def test_scene_noise_is_grey_uncorrelated_and_differs_between_scenes():
    """The noise is a hash of the pixel and the scene's seed: it must look like sensor noise."""
    noises = []
    for index in range(2):
        image, scene_boxes, _ = shapes.draw_scene(tf.constant([9, index], tf.int64), SIZE, 1)
        image, (x0, y0, x1, y1) = image.numpy(), scene_boxes[0].numpy().astype(int)
        noise = image - np.median(image.reshape(-1, 3), axis=0)
        background = (image > 0).all(-1) & (image < 1).all(-1)  # not clipped
        background[max(y0 - 2, 0) : y1 + 2, max(x0 - 2, 0) : x1 + 2] = False  # nor the shape's edge
        # Grey: every channel moves by the same amount, up to 8-bit rounding (and the median's).
        assert np.abs(noise[..., 0] - noise[..., 1])[background].max() <= 2.5 / 255
        grey = np.where(background, noise[..., 0], np.nan)
        # Standard deviation 0.03: 8-bit rounding adds 1/255/sqrt(12) in quadrature, and the
        # estimate over thousands of pixels moves by well under 0.001.
        assert 0.028 < np.nanstd(grey) < 0.032, np.nanstd(grey)
        for neighbours in (grey[:, 1:], grey[1:, :]):  # right and below: no pattern
            pairs = np.isfinite(neighbours) & np.isfinite(grey[: neighbours.shape[0], : neighbours.shape[1]])
            assert pairs.sum() > 1000  # corr. of independent noise: within 1/sqrt(n) < 0.03 of 0
            left = grey[: neighbours.shape[0], : neighbours.shape[1]][pairs]
            assert abs(np.corrcoef(left, neighbours[pairs])[0, 1]) < 0.1
        noises.append(grey)
    both = np.isfinite(noises[0]) & np.isfinite(noises[1])
    assert abs(np.corrcoef(noises[0][both], noises[1][both])[0, 1]) < 0.1


@pytest.mark.parametrize("index", range(6))
def test_flip_and_scale_jitter_move_boxes_with_the_pixels(index):
    # An image whose only ink is the box itself: after augmenting, the ink must be the box.
    source_size = 48 + 8 * index
    box = np.array([[6, 10, 30, 40]], np.float32)
    mask = np.zeros([source_size, 40 + 4 * index, 3], np.float32)
    mask[10:40, 6:30] = 1.0
    image, moved, classes, scale = data.fit_to_square(
        tf.constant(mask), tf.constant(box), tf.constant([0]), SIZE, key=tf.constant([3, index], tf.int64)
    )
    ink = image.numpy()[..., 0] > 0.5
    if int(classes[0]) < 0:  # mostly cropped away: dropped
        assert not moved.numpy().any()
        return
    rows, columns = np.nonzero(ink.any(1))[0], np.nonzero(ink.any(0))[0]
    drawn = [columns[0], rows[0], columns[-1] + 1, rows[-1] + 1]
    np.testing.assert_allclose(moved.numpy()[0], drawn, atol=1.5)
    zoom = max(mask.shape[:2]) / float(scale) / SIZE
    assert data.SCALE_JITTER[0] - 1e-6 <= zoom <= data.SCALE_JITTER[1] + 1e-6


def test_batch_augmentation_moves_boxes_with_the_pixels():
    # Square images whose only ink is their box, augmented a batch at a time.
    boxes_in = np.array(
        [[[6, 10, 30, 40]], [[40, 2, 63, 20]], [[0, 0, 64, 64]], [[20, 30, 28, 38]]], np.float32
    )
    images = np.zeros([4, SIZE, SIZE, 3], np.float32)
    for row, (x0, y0, x1, y1) in enumerate(boxes_in[:, 0].astype(int)):
        images[row, y0:y1, x0:x1] = 1.0
    draws = tf.stack([data.augmentation_draws(tf.constant([9, index], tf.int64)) for index in range(4)])
    out, moved, classes = data.augment_batch(tf.constant(images), boxes_in, tf.zeros([4, 1], tf.int32), draws)
    for row in range(4):
        ink = out.numpy()[row, ..., 0] > 0.5
        if int(classes[row, 0]) < 0:  # mostly cropped away: dropped
            assert not moved.numpy()[row].any()
            continue
        rows, columns = np.nonzero(ink.any(1))[0], np.nonzero(ink.any(0))[0]
        drawn = [columns[0], rows[0], columns[-1] + 1, rows[-1] + 1]
        np.testing.assert_allclose(moved.numpy()[row, 0], drawn, atol=1.5)


def test_ground_truth_elements_and_cache_for_on_device_matching():
    train, _ = data.load("shapes", "train", 4, image_size=SIZE, augment=True, seed=2)
    images, truth = next(iter(train))
    assert images.shape == (4, SIZE, SIZE, 3) and set(truth) == {"boxes", "classes", "box_valid"}
    assert truth["boxes"].shape == (4, data.SHAPES_MAX_SHAPES, 4) and truth["box_valid"].dtype == tf.bool
    np.testing.assert_array_equal(truth["box_valid"], truth["classes"].numpy() >= 0)
    # The pipeline's per-anchor labels are the on-device matcher's on the same ground truth.
    with_anchors, _ = data.load("shapes", "train", 4, anchors=ANCHORS, image_size=SIZE, augment=True, seed=2)
    images_again, labels = next(iter(with_anchors))
    np.testing.assert_array_equal(images_again, images)
    expected = targets.loss_labels(
        targets.match_anchors(ANCHORS, truth["boxes"], truth["classes"], truth["box_valid"])
    )
    np.testing.assert_array_equal(labels["classes"], expected["classes"])
    # Drawn scenes are 8-bit, so the cache holds exactly what drawing makes.
    plain = next(iter(data.load("shapes", "eval", 8, image_size=SIZE)[0]))
    cached = next(iter(data.load("shapes", "eval", 8, image_size=SIZE, cache=True)[0]))
    tf.nest.map_structure(np.testing.assert_array_equal, plain, cached)
    # A scene drawn alone equals the same scene drawn in a batch.
    image, scene_boxes, _ = shapes.draw_scene(tf.constant([3, 1], tf.int64), SIZE)
    batch = [shapes.scene_randomness(tf.constant([3, index], tf.int64), SIZE) for index in range(3)]
    drawn = shapes.render_scenes(tf.nest.map_structure(lambda *v: tf.stack(v), *batch), SIZE)
    np.testing.assert_array_equal(drawn[0][1], image)
    np.testing.assert_array_equal(drawn[1][1], scene_boxes)


def test_augmented_training_stream_resumes_and_shards_late():
    full, policy = data.load("shapes", "train", 4, anchors=ANCHORS, image_size=SIZE, augment=True)
    assert policy == "OFF"
    images = np.concatenate([x.numpy() for x, _ in full.take(2)])
    resumed, _ = data.load(
        "shapes", "train", 4, anchors=ANCHORS, image_size=SIZE, augment=True, skip_examples=4
    )
    np.testing.assert_array_equal(next(iter(resumed))[0], images[4:])
    halves = [
        next(
            iter(
                data.load(
                    "shapes",
                    "train",
                    4,
                    anchors=ANCHORS,
                    image_size=SIZE,
                    augment=True,
                    input_context=_context(2, i, 2),
                )[0]
            )
        )[0].numpy()
        for i in range(2)
    ]
    np.testing.assert_array_equal(halves[0], images[0:4:2])  # pipeline 0 takes every 2nd example
    np.testing.assert_array_equal(halves[1], images[1:4:2])


def test_eval_split_is_padded_so_every_image_counts_once_on_two_pipelines():
    ids = []
    for pipeline in range(2):
        dataset, policy = data.load(
            "shapes", "eval", 64, anchors=ANCHORS, image_size=SIZE, input_context=_context(2, pipeline, 2)
        )
        assert policy == "DATA"
        batches = list(dataset)
        assert len(batches) == 8  # 250 images per pipeline -> 8 batches of 32
        for _, labels, truth in batches:
            padding = ~truth["valid"].numpy()
            assert (labels["classes"].numpy()[padding] == boxes.IGNORE).all()
            ids += truth["image_id"].numpy()[~padding].tolist()
    assert sorted(ids) == list(range(data.SHAPES_EVAL_EXAMPLES))


def test_unknown_dataset_and_bad_sizes_are_usage_errors():
    for bad in ("circles", "coco", "folder:x"):
        with pytest.raises(UsageError, match="unknown detection dataset"):
            data.describe(bad)
    with pytest.raises(UsageError, match="image_size"):
        data.describe("shapes", image_size=8)
    with pytest.raises(UsageError, match="global_batch_size"):
        data.load("shapes", "train", 0, anchors=ANCHORS, image_size=SIZE)


# ----------------------------------------------------------------------------- COCO format
def _write_coco(root, split, sizes, annotations, categories=((5, "cat"), (9, "dog"))):
    os.makedirs(os.path.join(root, split), exist_ok=True)
    os.makedirs(os.path.join(root, "annotations"), exist_ok=True)
    images = []
    for image_id, (height, width) in enumerate(sizes, start=1):
        name = f"{image_id:03d}.png"
        pixels = np.full([height, width, 3], 40, np.uint8)
        Image.fromarray(pixels).save(os.path.join(root, split, name))
        images.append({"id": image_id, "file_name": name, "height": height, "width": width})
    content = {
        "images": images,
        "categories": [{"id": i, "name": n} for i, n in categories],
        "annotations": [
            {
                "id": i,
                "image_id": image_id,
                "category_id": category,
                "bbox": bbox,
                "iscrowd": crowd,
                "area": 0,
            }
            for i, (image_id, category, bbox, crowd) in enumerate(annotations)
        ],
    }
    path = os.path.join(root, "annotations", f"instances_{split}.json")
    with open(path, "w") as handle:
        json.dump(content, handle)
    return path


def test_coco_folder_maps_categories_scales_boxes_and_skips_crowds(tmp_path):
    root = str(tmp_path)
    _write_coco(
        root,
        "train2017",
        [(32, 64), (64, 64)],
        [(1, 9, [8, 4, 16, 8], 0), (2, 5, [0, 0, 32, 32], 0), (2, 5, [1, 1, 5, 5], 1)],
    )
    _write_coco(root, "val2017", [(128, 64)], [(1, 9, [10, 20, 30, 40], 0)])
    info = data.describe(f"coco:{root}", image_size=SIZE)
    assert info.class_names == ("cat", "dog") and (info.train_examples, info.eval_examples) == (2, 1)
    evaluation, _ = data.load(f"coco:{root}", "eval", 2, anchors=ANCHORS, image_size=SIZE)
    ((images, labels, truth),) = list(evaluation)
    assert truth["valid"].numpy().tolist() == [True, False]
    assert truth["classes"][0, :2].numpy().tolist() == [1, -1]  # dog (id 9) is class 1
    np.testing.assert_allclose(truth["boxes"][0, 0], [5, 10, 20, 30])  # 128x64 -> 64x32
    assert float(truth["scale"][0]) == 2.0 and images[0, :, 32:].numpy().max() == 0.0
    assert (labels["classes"].numpy()[0] == 1).any()
    train, _ = data.load(f"coco:{root}", "train", 2, anchors=ANCHORS, image_size=SIZE, augment=True)
    for images, labels in train.take(2):
        assert images.shape == (2, SIZE, SIZE, 3) and (labels["classes"].numpy() >= 0).any()


def test_single_coco_json_holds_out_every_tenth_image(tmp_path):
    written = _write_coco(
        str(tmp_path), "images", [(32, 32)] * 20, [(i, 5, [2, 2, 20, 20], 0) for i in range(1, 21)]
    )
    with open(written) as handle:  # a labelling tool's export: file_names relative to the JSON
        content = json.load(handle)
    for image in content["images"]:
        image["file_name"] = "images/" + image["file_name"]
    path = os.path.join(tmp_path, "export.json")
    with open(path, "w") as handle:
        json.dump(content, handle)
    info = data.describe(f"coco:{path}", image_size=SIZE)
    assert (info.train_examples, info.eval_examples) == (18, 2)
    evaluation, _ = data.load(f"coco:{path}", "eval", 2, anchors=ANCHORS, image_size=SIZE)
    assert next(iter(evaluation))[2]["valid"].numpy().all()


def _edit_coco(path, edit):
    """Rewrites the COCO JSON at `path` as `edit(content)` leaves it, or as it returns it."""
    with open(path) as handle:
        content = json.load(handle)
    edited = edit(content)
    content = content if edited is None else edited
    with open(path, "w") as handle:
        json.dump(content, handle)


def _set(entries, index, key, value=None):
    """entries[index][key] = value; without a value the key is removed."""
    entries[index].pop(key) if value is None else entries[index].__setitem__(key, value)


# (edit of a valid train JSON: 2 images 32x32, annotation 0 on image 1; what the error says)
SCHEMA_ERRORS = {
    "not an object": (
        lambda c: [],
        "holds an array, not COCO's object of images, annotations and categories",
    ),
    "images not a list": (lambda c: c.update(images={"id": 1}), "has an object as 'images'; COCO JSON needs"),
    "no categories": (lambda c: c.__delitem__("categories"), "has no 'categories'; COCO JSON needs"),
    "image not an object": (lambda c: c["images"].append(7), "images[2] is a number, not a JSON object"),
    "image without file_name": (
        lambda c: _set(c["images"], 1, "file_name"),
        "images[1] (id 2) has no file_name; give each image its file's path relative to",
    ),
    "image without id": (lambda c: _set(c["images"], 0, "id"), "images[0] has no id; give each image"),
    "repeated image id": (
        lambda c: _set(c["images"], 1, "id", 1),
        "images[1] (id 1) repeats the id of images[0]",
    ),
    "bad image size": (
        lambda c: _set(c["images"], 0, "width", -3),
        "images[0] (id 1) has a bad size -3 x 32",
    ),
    "category without name": (
        lambda c: _set(c["categories"], 1, "name"),
        "categories[1] (id 9) has no name; give each category a name",
    ),
    "annotation without bbox": (
        lambda c: _set(c["annotations"], 0, "bbox"),
        "annotations[0] (id 0) has no bbox; give it [x, y, width, height] in pixels",
    ),
    "short bbox": (
        lambda c: _set(c["annotations"], 0, "bbox", [1, 1, 4]),
        "annotations[0] (id 0) has a bad bbox",
    ),
    "text in bbox": (
        lambda c: _set(c["annotations"], 0, "bbox", [1, "a", 4, 4]),
        "has a bad bbox [1, 'a', 4, 4]",
    ),
    "NaN bbox": (
        lambda c: _set(c["annotations"], 0, "bbox", [1, float("nan"), 4, 4]),
        "annotations[0] (id 0) has a bbox with NaN or infinity [1, nan, 4, 4]",
    ),
    "negative size": (
        lambda c: _set(c["annotations"], 0, "bbox", [1, 1, -4, 5]),
        "annotations[0] (id 0) has a negative width or height in bbox [1, 1, -4, 5]",
    ),
    "box outside its image": (
        lambda c: _set(c["annotations"], 0, "bbox", [40, 1, 4, 4]),
        "annotations[0] (id 0) has bbox [40, 1, 4, 4] entirely outside its image 1 (32 x 32 pixels)",
    ),
    "unknown image_id": (
        lambda c: _set(c["annotations"], 0, "image_id", 9),
        "names image_id 9, which is not in",
    ),
}


@pytest.mark.parametrize("case", SCHEMA_ERRORS)
def test_coco_schema_errors_are_one_line_naming_file_entry_and_field(tmp_path, case):
    path = _write_coco(str(tmp_path), "train2017", [(32, 32)] * 2, [(1, 5, [1, 1, 4, 4], 0)])
    edit, message = SCHEMA_ERRORS[case]
    _edit_coco(path, edit)
    with pytest.raises(UsageError) as error:
        data.describe(f"coco:{tmp_path}")
    assert str(error.value).startswith(f"COCO file {path!r}") and message in str(error.value)
    assert "\n" not in str(error.value)


def test_coco_boxes_reaching_outside_their_image_are_clipped_with_one_warning(tmp_path, caplog):
    root = str(tmp_path)
    # A 32 (high) x 64 (wide) image: one box reaches past the right edge, one above the top.
    boxes = [(1, 5, [60, 4, 10, 8], 0), (1, 5, [2, -3, 6, 6], 0), (1, 5, [8, 8, 8, 8], 0)]
    _write_coco(root, "train2017", [(32, 64)], boxes)
    _write_coco(root, "val2017", [(32, 32)], [(1, 9, [2, 2, 8, 8], 0)])
    with caplog.at_level("WARNING"):
        data.describe(f"coco:{root}", image_size=SIZE)
    assert [r.getMessage() for r in caplog.records if "clipped" in r.getMessage()] == [
        f"coco:{root}: clipped 2 of 4 boxes that reach outside their image"
    ]
    item = next(iter(data.source(f"coco:{root}", "train", SIZE).examples(None, None)))
    np.testing.assert_allclose(item["boxes"].numpy(), [[60, 4, 4, 8], [2, 0, 6, 3], [8, 8, 8, 8]])


def test_coco_missing_image_files_and_paths_are_usage_errors(tmp_path):
    path = _write_coco(str(tmp_path), "train2017", [(32, 32), (32, 32)], [(1, 5, [1, 1, 4, 4], 0)])
    os.remove(os.path.join(tmp_path, "train2017", "002.png"))
    with pytest.raises(UsageError) as error:
        data.describe(f"coco:{tmp_path}")
    missing = os.path.join(tmp_path, "train2017", "002.png")
    assert str(error.value) == (
        f"COCO file {path!r}: 1 image file(s) are missing, first {missing!r} (images[1]); "
        "put the images there or fix their file_name"
    )
    with pytest.raises(UsageError, match="does not exist"):
        data.describe(f"coco:{tmp_path}/nowhere")
    with pytest.raises(UsageError, match="instances_train2017.json"):
        data.describe(f"coco:{tmp_path}/train2017")


def test_coco_bad_image_file_or_no_eval_images_is_refused_when_described(tmp_path):
    root = str(tmp_path)
    _write_coco(root, "train2017", [(32, 32)] * 2, [(1, 5, [1, 1, 4, 4], 0)])
    with pytest.raises(UsageError, match=f"COCO dataset {root!r} has no eval images"):
        data.describe(f"coco:{root}")  # no val annotations: refused before a run writes anything
    assert data.describe(f"coco:{root}", verify=False).eval_examples == 0
    _write_coco(root, "val2017", [(32, 32)], [(1, 9, [2, 2, 8, 8], 0)])
    assert data.describe(f"coco:{root}").eval_examples == 1
    bad = os.path.join(root, "val2017", "001.png")
    with open(bad, "wb") as handle:
        handle.write(b"version https://git-lfs.github.com/spec/v1\n")  # an LFS pointer, not the image
    with pytest.raises(UsageError) as error:
        data.describe(f"coco:{root}")
    assert str(error.value) == (
        f"coco:{root}: 1 file(s) are not readable images, first {bad} (starts with b'version http': "
        "not a JPEG, PNG, GIF, BMP, WebP or JPEG XL image); remove or repair them, or their entries "
        "in the annotation JSON"
    )


# ----------------------------------------------------------------------------- TFDS (mocked)
def _fake_voc(self, split, decoders=None, **_):
    """VOC-shaped examples with consistent object counts (tfds' random mock draws each object
    field with its own length, which its own Sequence encoder then rejects)."""
    features = self.info.features
    specs = tf.nest.map_structure(
        lambda spec: tf.TensorSpec(spec.shape, spec.dtype), features.get_serialized_info()
    )

    def examples():
        for index in range(5 if split == "test" else 7):
            count = index % 3 + 1
            yield features.encode_example(
                {
                    "image": np.full([40 + index, 80, 3], 90, np.uint8),
                    "image/filename": f"{index}",
                    "labels": [index % 20] * count,
                    "labels_no_difficult": [index % 20] * count,
                    "objects": {
                        "bbox": [tfds.features.BBox(0.1, 0.2, 0.6, 0.7)] * count,
                        "label": [index % 20] * count,
                        "is_difficult": [False] * count,
                        "is_truncated": [False] * count,
                        "pose": [0] * count,
                    },
                }
            )

    dataset = tf.data.Dataset.from_generator(examples, output_signature=specs)
    return dataset.map(functools.partial(features.decode_example, decoders=decoders))


def test_tfds_voc_decodes_relative_yxyx_boxes_offline():
    with tfds.testing.mock_data(as_dataset_fn=_fake_voc):
        info = data.describe("tfds:voc/2007", image_size=SIZE)
        assert info.num_classes == 20 and info.class_names[0] == "aeroplane"
        evaluation, _ = data.load("tfds:voc/2007", "eval", 4, anchors=ANCHORS, image_size=SIZE)
        batches = list(evaluation)
        train, _ = data.load("tfds:voc/2007", "train", 4, anchors=ANCHORS, image_size=SIZE, augment=True)
        train_images, _ = next(iter(train))
    assert len(batches) == 2 and train_images.shape == (4, SIZE, SIZE, 3)
    truth = batches[0][2]
    assert truth["valid"].numpy().all() and truth["classes"][1, :3].numpy().tolist() == [1, 1, -1]
    # bbox (ymin .1, xmin .2, ymax .6, xmax .7) of an 80-wide, 40-high image scaled by 64/80
    np.testing.assert_allclose(truth["boxes"][0, 0], [12.8, 3.2, 44.8, 19.2], atol=1e-4)
    assert sorted(np.concatenate([b[2]["image_id"].numpy() for b in batches]).tolist()) == [
        -1,
        -1,
        -1,
        0,
        1,
        2,
        3,
        4,
    ]


def test_tfds_dataset_that_is_not_detection_or_not_prepared_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="not object detection"):
        data.describe("tfds:mnist")
    with pytest.raises(UsageError, match="unknown tfds dataset"):
        data.describe("tfds:no_such_dataset_here")
    with pytest.raises(UsageError, match="'voc/2007' is not prepared in data_dir"):
        data.describe("tfds:voc/2007", data_dir=str(tmp_path))  # before a run writes anything


def test_read_image_for_prediction(tmp_path):
    path = str(tmp_path / "wide.png")
    Image.fromarray(np.full([50, 100, 3], 255, np.uint8)).save(path)
    image, scale, original = data.read_image(path, SIZE)
    assert image.shape == (SIZE, SIZE, 3) and original.shape == (50, 100, 3)
    assert scale == pytest.approx(100 / SIZE) and float(image[SIZE - 1, 0, 0]) == 0.0
    with pytest.raises(UsageError, match="does not exist"):
        data.read_image(str(tmp_path / "missing.jpg"), SIZE)
    (tmp_path / "bad.png").write_bytes(b"not an image")
    with pytest.raises(UsageError, match="cannot decode"):
        data.read_image(str(tmp_path / "bad.png"), SIZE)
