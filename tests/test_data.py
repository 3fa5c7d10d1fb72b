"""Tests for tfmp.classification.data: built-in datasets, TFDS (mocked and a tiny real one), folders, sharding."""

import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from conftest import run_python, write_image_folder

from tfmp.classification import data, drawing
from tfmp.errors import UsageError

tfds.disable_progress_bar()


def _take(dataset, batches):
    """The first `batches` batches, concatenated: (images, labels) as numpy."""
    images, labels = zip(*[(x.numpy(), y.numpy()) for x, y in dataset.take(batches)])
    return np.concatenate(images), np.concatenate(labels)


def _context(pipelines, pipeline_id, replicas):
    return tf.distribute.InputContext(
        num_input_pipelines=pipelines, input_pipeline_id=pipeline_id, num_replicas_in_sync=replicas
    )


# ----------------------------------------------------------------------------- built-ins
@pytest.mark.parametrize(
    "spec, shape", [("shapes", (32, 32, 3)), ("digits", (28, 28, 1)), ("synthetic", (32, 32, 3))]
)
def test_builtin_batches(spec, shape):
    info = data.describe(spec)
    assert info.image_shape == shape and info.num_classes == 10 and info.name == spec
    dataset, policy = data.load(spec, "train", 16)
    assert policy == "OFF"
    images, labels = _take(dataset, 2)
    assert images.shape == (32, *shape) and images.dtype == np.float32
    assert labels.dtype == np.int32 and labels.min() >= 0 and labels.max() < 10
    assert 0.0 <= images.min() and images.max() <= 1.0 and images.std() > 0.05
    options = dataset.options().experimental_distribute
    assert options.auto_shard_policy == tf.data.experimental.AutoShardPolicy.OFF


def test_builtin_sizes():
    assert data.describe("shapes").train_examples == data.SHAPES_TRAIN_EXAMPLES == 12_000
    assert data.describe("shapes").eval_examples == data.SHAPES_EVAL_EXAMPLES == 2_000
    assert data.describe("digits").train_examples == data.DIGITS_TRAIN_EXAMPLES == 20_000
    assert data.describe("digits", image_size=32).image_shape == (32, 32, 1)
    assert data.describe("synthetic", image_size=64).image_shape == (64, 64, 3)


@pytest.mark.parametrize("spec", ["shapes", "digits"])
def test_builtin_deterministic_and_seeded(spec):
    first = _take(data.load(spec, "train", 8, seed=3, augment=True)[0], 2)
    again = _take(data.load(spec, "train", 8, seed=3, augment=True)[0], 2)
    other = _take(data.load(spec, "train", 8, seed=4, augment=True)[0], 2)
    np.testing.assert_array_equal(first[0], again[0])
    np.testing.assert_array_equal(first[1], again[1])
    assert not np.array_equal(first[0], other[0])


@pytest.mark.parametrize("spec", ["shapes", "digits"])
def test_builtin_splits_differ_and_hold_all_classes(spec):
    train = _take(data.load(spec, "train", 20, training=False)[0], 1)
    evaluation = _take(data.load(spec, "eval", 20, training=False)[0], 1)
    assert set(evaluation[1]) == set(range(10)) and set(train[1]) == set(range(10))
    np.testing.assert_array_equal(train[1], evaluation[1])  # same label order, other pictures
    assert not np.allclose(train[0], evaluation[0])


@pytest.mark.parametrize("size", [64, 224])
def test_shapes_any_resolution(size):
    images, _ = _take(data.load("shapes", "train", 4, image_size=size, augment=True)[0], 1)
    assert images.shape == (4, size, size, 3)


def test_eval_is_finite_and_padded_to_full_batches():
    dataset, _ = data.load("synthetic", "eval", 300, training=False)
    assert sum(1 for _ in dataset) == 7  # ceil(2000 / 300)
    dataset, _ = data.load("digits", "eval", 768, training=False)
    labels = np.concatenate([y.numpy() for _, y in dataset])
    assert labels.shape == (3 * 768,)  # 2000 examples + 304 padding rows labelled -1
    assert (labels >= 0).sum() == 2000 and (labels[2000:] == -1).all()


@pytest.mark.parametrize("pipelines, replicas", [(1, 2), (2, 2), (2, 4)])
def test_distributed_eval_gives_every_replica_the_same_full_batches(pipelines, replicas):
    """Uneven shards must not leave a replica (or a worker) without its last batch."""
    per_pipeline = []
    for pipeline_id in range(pipelines):
        context = tf.distribute.InputContext(pipelines, pipeline_id, replicas)
        batches = [
            y.numpy() for _, y in data.load("digits", "eval", 600, input_context=context, training=False)[0]
        ]
        assert {len(b) for b in batches} == {600 // replicas}
        assert len(batches) % (replicas // pipelines) == 0  # whole steps for the local replicas
        per_pipeline.append(batches)
    assert len({len(batches) for batches in per_pipeline}) == 1
    valid = np.concatenate([np.concatenate(batches) for batches in per_pipeline])
    assert (valid >= 0).sum() == 2000


def test_digits_learnable_quickly():
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(keras.optimizers.Adam(1e-3), loss, metrics=["accuracy"])
    model.fit(data.load("digits", "train", 64)[0], steps_per_epoch=60, verbose=0)
    _, accuracy = model.evaluate(data.load("digits", "eval", 256, training=False)[0].take(1), verbose=0)
    assert accuracy > 0.5  # chance is 0.1


def test_shape_distances_are_named_in_label_order():
    """draw_shape picks a label's shape by position; the detection scenes pick theirs by name."""
    fields = drawing.shape_distances(tf.constant([0.0, 2.0]), tf.constant([0.0, 0.0]))
    assert tuple(fields) == data.SHAPES_CLASS_NAMES
    for name in ("circle", "square", "plus", "ellipse", "x"):  # centred shapes: inside at 0, outside at 2
        assert fields[name][0] < 0 < fields[name][1], name


@pytest.mark.slow
def test_shapes_learnable():
    """A small CNN learns the built-in shapes well above chance (0.1) in 120 steps. At 16x16
    (a fifth of 32x32's time) seeds 0, 1 and 2 reach 0.71, 0.65 and 0.85; at 32x32 0.90-0.95."""
    import keras

    keras.utils.set_random_seed(0)
    layers = [keras.Input((16, 16, 3))]
    for filters in (32, 64, 128):
        layers += [
            keras.layers.Conv2D(filters, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
        ]
    layers += [keras.layers.Flatten(), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)]
    model = keras.Sequential(layers)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(keras.optimizers.Adam(1e-3), loss, metrics=["accuracy"])
    model.fit(data.load("shapes", "train", 64, image_size=16)[0], steps_per_epoch=120, verbose=0)
    eval_batch = data.load("shapes", "eval", 500, image_size=16, training=False)[0].take(1)
    _, accuracy = model.evaluate(eval_batch, verbose=0)
    assert accuracy > 0.4


# ----------------------------------------------------------------------------- pipeline contract
@pytest.mark.parametrize("augment", [False, True])
def test_skip_examples_continues_the_same_stream(augment):
    full = _take(data.load("shapes", "train", 8, image_size=16, augment=augment, seed=5)[0], 4)
    skipped = _take(
        data.load("shapes", "train", 8, image_size=16, augment=augment, seed=5, skip_examples=11)[0], 2
    )
    np.testing.assert_array_equal(skipped[0], full[0][11:27])
    np.testing.assert_array_equal(skipped[1], full[1][11:27])


def test_two_replicas_one_pipeline_split_each_global_batch():
    whole = _take(data.load("digits", "train", 8, seed=2)[0], 2)
    dataset, policy = data.load("digits", "train", 8, seed=2, input_context=_context(1, 0, 2))
    halves = _take(dataset, 4)  # replica 0, replica 1, replica 0, replica 1
    assert policy == "OFF" and next(iter(dataset))[0].shape[0] == 4
    np.testing.assert_array_equal(halves[0], whole[0])
    np.testing.assert_array_equal(halves[1], whole[1])


def test_two_pipelines_shard_the_data_disjointly():
    unsharded = _take(data.load("digits", "eval", 1000, training=False)[0], 2)
    parts = []
    for pipeline_id in (0, 1):
        dataset, policy = data.load(
            "digits", "eval", 1000, training=False, input_context=_context(2, pipeline_id, 2)
        )
        assert policy == "DATA"  # generated per index: the index range is sharded
        parts.append({image.tobytes() for image in _take(dataset, 10)[0]})
    assert len(parts[0]) == len(parts[1]) == 1000 and not parts[0] & parts[1]
    assert parts[0] | parts[1] == {image.tobytes() for image in unsharded[0]}


def test_batch_not_divisible_by_replicas():
    with pytest.raises(UsageError, match="divisible"):
        data.load("shapes", "train", 7, input_context=_context(1, 0, 2))


@pytest.mark.parametrize(
    "call",
    [
        lambda: data.describe("shapes", image_size=4),
        lambda: data.describe("shapes", image_size=4096),
        lambda: data.describe("shapes", image_size="32"),
        lambda: data.load("shapes", "training", 8),
        lambda: data.load("shapes", "train", 0),
        lambda: data.load("shapes", "train", 8, skip_examples=-1),
    ],
)
def test_bad_arguments(call):
    with pytest.raises(UsageError):
        call()


@pytest.mark.parametrize("spec", ["mnist", "shape", "tfds:", "folder:", "shapes:64", ""])
def test_unknown_spec_lists_choices(spec):
    with pytest.raises(UsageError, match="choose one of: digits, folder:<path>, shapes, synthetic"):
        data.describe(spec)


# ----------------------------------------------------------------------------- TFDS
@pytest.mark.parametrize("name, shape", [("mnist", (28, 28, 1)), ("cifar10", (32, 32, 3))])
def test_tfds_mocked(name, shape):
    with tfds.testing.mock_data(num_examples=10):
        info = data.describe(f"tfds:{name}")
        assert info.image_shape == shape and info.num_classes == 10
        images, labels = _take(data.load(f"tfds:{name}", "train", 4)[0], 3)  # repeats past 10
        assert images.shape == (12, *shape) and images.dtype == np.float32
        assert labels.dtype == np.int32 and 0 <= images.min() and images.max() <= 1
        resized = data.load(f"tfds:{name}", "eval", 4, image_size=16, training=False)[0]
        assert [x.shape[:3] for x, _ in resized] == [(4, 16, 16)] * 3  # 10 + 2 padding rows
        assert [int((y >= 0).numpy().sum()) for _, y in resized] == [4, 4, 2]
        assert next(iter(resized))[0].shape[3] == shape[2]
        assert data.describe(f"tfds:{name}", image_size=16).image_shape == (16, 16, shape[2])
        # The mock knows no split files, so two pipelines shard the example stream.
        assert data.load(f"tfds:{name}", "train", 4, input_context=_context(2, 0, 2))[1] == "DATA"


def test_tfds_unknown_name_and_wrong_kind():
    with pytest.raises(UsageError, match="unknown tfds dataset 'mnistt'.*mnist"):
        data.describe("tfds:mnistt")
    with pytest.raises(UsageError, match="not image classification"):
        data.describe("tfds:glue")
    with pytest.raises(UsageError, match="varying size; pass image_size"):
        data.describe("tfds:tf_flowers")
    with pytest.raises(UsageError, match="bad tfds dataset 'mnist:9.9.9'.*3.0.1"):
        data.describe("tfds:mnist:9.9.9")


def test_tfds_not_prepared_is_refused_when_described(tmp_path):
    """describe (the run's plan, before its model dir exists) opens the records load would."""
    for call in (
        lambda: data.describe("tfds:mnist", data_dir=str(tmp_path)),
        lambda: data.load("tfds:mnist", "train", 4, data_dir=str(tmp_path)),
    ):
        with pytest.raises(UsageError, match=f"'mnist' is not prepared in data_dir '{tmp_path}'"):
            call()
    assert data.describe("tfds:mnist", data_dir=str(tmp_path), verify=False).num_classes == 10
    assert os.listdir(tmp_path) == []


class TfmpTestTinyImages(tfds.core.GeneratorBasedBuilder):
    """A real (not mocked) TFDS dataset, prepared offline in a temporary data_dir."""

    VERSION = tfds.core.Version("1.0.0")
    SPLITS = {"train": (0, 24), "test": (100, 6)}

    def _info(self):
        features = tfds.features.FeaturesDict(
            {"image": tfds.features.Image(shape=(8, 8, 3)), "label": tfds.features.ClassLabel(num_classes=3)}
        )
        return tfds.core.DatasetInfo(builder=self, features=features, supervised_keys=("image", "label"))

    def _split_generators(self, dl_manager):
        return {split: self._generate_examples(*span) for split, span in self.SPLITS.items()}

    def _generate_examples(self, start, count):
        for index in range(start, start + count):  # pixel value = example id
            yield index, {"image": np.full((8, 8, 3), index, np.uint8), "label": index % 3}


class TfmpTestTinyTrainOnly(TfmpTestTinyImages):
    SPLITS = {"train": (0, 20)}


@pytest.fixture(scope="module")
def tiny_tfds_dir(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("tfds"))
    for builder in (TfmpTestTinyImages, TfmpTestTinyTrainOnly):
        builder(data_dir=data_dir).download_and_prepare(
            download_config=tfds.download.DownloadConfig(num_shards=2)
        )
    return data_dir


def _ids(dataset):
    return sorted(int(round(value * 255)) for value in _take(dataset, 100)[0][:, 0, 0, 0])


def test_tfds_prepared_dataset_shards_by_file(tiny_tfds_dir):
    info = data.describe("tfds:tfmp_test_tiny_images", data_dir=tiny_tfds_dir)
    assert (info.image_shape, info.num_classes, info.train_examples, info.eval_examples) == (
        (8, 8, 3),
        3,
        24,
        6,
    )
    parts = []
    for pipeline_id in (0, 1):
        context = _context(2, pipeline_id, 2)
        dataset, policy = data.load(
            "tfds:tfmp_test_tiny_images", "train", 4, data_dir=tiny_tfds_dir, input_context=context
        )
        assert policy == "FILE"  # 2 files, 2 pipelines: tfds.ReadConfig(input_context=...)
        images = _take(dataset, 6)[0]  # the first pass over this pipeline's 12 examples
        parts.append(sorted(int(round(value * 255)) for value in images[:, 0, 0, 0]))
    assert not set(parts[0]) & set(parts[1]) and sorted(parts[0] + parts[1]) == list(range(24))
    evaluation = data.load("tfds:tfmp_test_tiny_images", "eval", 4, training=False, data_dir=tiny_tfds_dir)[0]
    images, labels = _take(evaluation, 100)
    assert sorted(int(round(v * 255)) for v in images[labels >= 0][:, 0, 0, 0]) == list(range(100, 106))


def test_tfds_prepared_dataset_training_stream(tiny_tfds_dir):
    load = lambda **kwargs: data.load(
        "tfds:tfmp_test_tiny_images", "train", 4, data_dir=tiny_tfds_dir, seed=7, **kwargs
    )[0]
    full, again = _take(load(), 12), _take(load(), 12)
    np.testing.assert_array_equal(full[0], again[0])
    ids = [int(round(v * 255)) for v in full[0][:, 0, 0, 0]]
    assert sorted(ids[:24]) == list(range(24)) and sorted(ids[24:]) == list(range(24))
    np.testing.assert_array_equal(_take(load(skip_examples=5), 2)[0], full[0][5:13])


def test_tfds_train_only_dataset_holds_out_a_slice(tiny_tfds_dir):
    info = data.describe("tfds:tfmp_test_tiny_train_only", data_dir=tiny_tfds_dir)
    assert (info.train_examples, info.eval_examples) == (18, 2)
    load = lambda split: data.load(
        "tfds:tfmp_test_tiny_train_only", split, 2, training=False, data_dir=tiny_tfds_dir
    )[0]
    held_out, train = _ids(load("eval")), _ids(load("train"))  # "train[90%:]", "train[:90%]"
    assert len(held_out) == 2 and sorted(held_out + train) == list(range(20))


# ----------------------------------------------------------------------------- folders
@pytest.fixture
def image_folder(tmp_path):
    write_image_folder(tmp_path / "pics", 20)
    return tmp_path / "pics"


def test_folder_load_and_hold_out(image_folder):
    spec = f"folder:{image_folder}"
    info = data.describe(spec, image_size=12)
    assert (info.image_shape, info.num_classes, info.train_examples, info.eval_examples) == (
        (12, 12, 3),
        3,
        54,
        6,
    )  # every 10th file per class is held out
    assert data.describe(spec).image_shape == (64, 64, 3)  # the default size for folders
    images, labels = _take(data.load(spec, "eval", 4, image_size=12, training=False)[0], 10)
    images, labels = images[labels >= 0], labels[labels >= 0]  # drop the padding to 2 full batches
    assert images.shape == (6, 12, 12, 3) and list(labels) == [0, 0, 1, 1, 2, 2]
    np.testing.assert_array_equal(images[:, 6, 6].argmax(axis=1), labels)  # cat red, dog green...
    images, labels = _take(data.load(spec, "train", 8, image_size=12, augment=True)[0], 10)
    assert images.shape == (80, 12, 12, 3)
    np.testing.assert_array_equal(images[:, 6, 6].argmax(axis=1), labels)


def test_folder_sharding_skip_and_cache(image_folder):
    spec = f"folder:{image_folder}"
    parts = []
    for pipeline_id in (0, 1):
        dataset, policy = data.load(
            spec, "train", 2, image_size=8, seed=1, input_context=_context(2, pipeline_id, 2)
        )
        assert policy == "FILE"
        parts.append({image.tobytes() for image in _take(dataset, 27)[0]})  # one epoch: 27 each
    assert len(parts[0]) == len(parts[1]) == 27 and not parts[0] & parts[1]
    full = _take(data.load(spec, "train", 6, image_size=8, seed=1)[0], 20)  # > 2 epochs
    cached = _take(data.load(spec, "train", 6, image_size=8, seed=1, cache=True)[0], 20)
    skipped = _take(data.load(spec, "train", 6, image_size=8, seed=1, skip_examples=50)[0], 5)
    np.testing.assert_array_equal(cached[0], full[0])
    np.testing.assert_array_equal(skipped[0], full[0][50:80])
    assert len({image.tobytes() for image in full[0][:54]}) == 54  # an epoch is a permutation


def test_folder_with_train_and_val_subfolders(tmp_path):
    write_image_folder(tmp_path / "set" / "train", 3)
    write_image_folder(tmp_path / "set" / "val", 2, start=50)
    info = data.describe(f"folder:{tmp_path / 'set'}", image_size=8)
    assert (info.num_classes, info.train_examples, info.eval_examples) == (3, 9, 6)


def test_folder_errors(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        data.describe(f"folder:{tmp_path / 'missing'}")
    (tmp_path / "empty" / "cat").mkdir(parents=True)
    with pytest.raises(UsageError, match=f"{tmp_path / 'empty'}.*no images"):
        data.describe(f"folder:{tmp_path / 'empty'}")
    write_image_folder(tmp_path / "few", 3)  # fewer than 10 per class: nothing held out
    with pytest.raises(UsageError, match="has no eval images; give each class 10 or more images"):
        data.describe(f"folder:{tmp_path / 'few'}")  # a run's plan: before anything is written
    assert data.describe(f"folder:{tmp_path / 'few'}", verify=False).eval_examples == 0
    with pytest.raises(UsageError, match="no eval images"):
        data.load(f"folder:{tmp_path / 'few'}", "eval", 2, training=False)


def _encoded(kind: str) -> bytes:
    pixels = np.full((16, 16, 3), 90, np.uint8)
    return (tf.io.encode_jpeg if kind == "jpeg" else tf.io.encode_png)(pixels).numpy()


BAD_FILES = {  # name: (contents, why the refusal says it is bad)
    "empty.png": (lambda: b"", "empty file"),
    "page.jpg": (lambda: b"<html>404</html>", "starts with b'<html>404</h': not a JPEG, PNG, GIF, BMP, WebP"),
    "cut.jpg": (lambda: _encoded("jpeg")[:200], "truncated or corrupt JPEG: no end-of-image marker"),
    "cut.png": (lambda: _encoded("png")[:40], "truncated or corrupt PNG: no IEND chunk at the end"),
}


@pytest.mark.parametrize("name", BAD_FILES)
def test_folder_with_a_bad_image_file_is_refused_naming_it(image_folder, name):
    contents, why = BAD_FILES[name]
    bad = image_folder / "dog" / name
    bad.write_bytes(contents())
    spec = f"folder:{image_folder}"
    with pytest.raises(UsageError) as error:
        data.describe(spec)
    message = str(error.value)
    assert message.startswith(f"{spec}: 1 file(s) are not readable images, first {bad} ({why}")
    assert message.endswith("; remove or repair them") and "\n" not in message
    assert data.describe(spec, verify=False).train_examples == 55  # names and sizes only


def test_folder_sniff_counts_bad_files_and_passes_whole_ones(image_folder):
    whole = _encoded("jpeg")
    (image_folder / "cat" / "motion.jpg").write_bytes(whole + b"\x00\x00\x00\x18ftypmp42" + bytes(99))
    (image_folder / "cat" / "padded.jpg").write_bytes(whole + bytes(16))  # zeros after the end marker
    assert data.describe(f"folder:{image_folder}").train_examples == 56  # 54 + both: they decode
    (image_folder / "emu" / "a.jpg").write_bytes(b"")
    (image_folder / "dog" / "b.jpg").write_bytes(b"")
    with pytest.raises(
        UsageError, match=f"2 file\\(s\\) are not readable images, first {image_folder}/dog/b.jpg"
    ):
        data.describe(f"folder:{image_folder}")


@pytest.mark.slow
def test_classify_refuses_a_corrupt_folder_before_writing_anything(tmp_path):
    write_image_folder(tmp_path / "pics", 10)
    bad = tmp_path / "pics" / "emu" / "cut.jpg"
    bad.write_bytes(_encoded("jpeg")[:200])
    run = tmp_path / "run"
    result = run_python(
        ["-m", "apps.classify", f"--dataset=folder:{tmp_path / 'pics'}", "--steps=1", f"--model_dir={run}"]
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(errors) == 1 and f"first {bad} (truncated or corrupt JPEG" in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout and "JPEG library" not in result.stderr
    assert not run.exists()


@pytest.mark.parametrize("spec", ["digits", "shapes"])
def test_two_workers_see_exactly_a_single_process_global_batch(spec):
    """Late sharding: worker batches of step k together are the single-process batch k."""
    single_images, _ = _take(data.load(spec, "train", 8, seed=3)[0], 3)
    workers = []
    for pipeline_id in (0, 1):
        dataset, policy = data.load(spec, "train", 8, seed=3, input_context=_context(2, pipeline_id, 2))
        assert policy == "DATA"
        workers.append(_take(dataset, 3)[0])
    for step in range(3):
        expected = single_images[step * 8 : (step + 1) * 8]
        together = np.concatenate([w[step * 4 : (step + 1) * 4] for w in workers])
        np.testing.assert_allclose(
            np.sort(together.reshape(8, -1).sum(1)), np.sort(expected.reshape(8, -1).sum(1)), rtol=1e-5
        )
    resumed, _ = data.load(spec, "train", 8, seed=3, input_context=_context(2, 1, 2), skip_examples=4)
    np.testing.assert_array_equal(_take(resumed, 1)[0], workers[1][4:8])


# ----------------------------------------------------------------------------- RandAugment, mixing
MIXING = {"mixup_alpha": 0.8, "cutmix_alpha": 1.0, "label_smoothing": 0.1}


def test_mixing_gives_soft_labels_and_resumes_at_a_whole_batch():
    load = lambda **kwargs: data.load("shapes", "train", 8, image_size=16, seed=5, augment=True, **kwargs)[0]
    images, labels = _take(load(mixing=MIXING), 4)
    assert images.shape == (32, 16, 16, 3) and labels.shape == (32, 10) and labels.dtype == np.float32
    np.testing.assert_allclose(labels.sum(axis=1), 1.0, rtol=1e-5)
    assert labels.min() >= 0.01 - 1e-6 and len({row.max().round(5) for row in labels}) > 1  # smoothed, mixed
    # A second run, resumed after 2 batches: the same examples, lambdas and boxes.
    resumed = _take(load(mixing=MIXING, skip_examples=16), 2)
    np.testing.assert_array_equal(resumed[0], images[16:])
    np.testing.assert_array_equal(resumed[1], labels[16:])
    plain_images, plain_labels = _take(load(), 4)
    assert not np.array_equal(images, plain_images)
    # Mixing off (both alphas 0): the same examples, their labels one-hot.
    unmixed_images, one_hot = _take(load(mixing=data.Mixing()), 4)
    np.testing.assert_array_equal(unmixed_images, plain_images)
    np.testing.assert_array_equal(one_hot, np.eye(10, dtype=np.float32)[plain_labels])
    evaluation = data.load(
        "shapes", "eval", 8, image_size=16, training=False, mixing=MIXING, randaugment=(2, 9)
    )
    _, eval_labels = _take(evaluation[0], 1)  # eval: never mixed or augmented
    assert eval_labels.dtype == np.int32 and eval_labels.shape == (8,)


def test_randaugment_through_a_folder(image_folder):
    load = lambda **kwargs: data.load(
        f"folder:{image_folder}", "train", 6, image_size=12, seed=2, augment=True, **kwargs
    )[0]
    images, labels = _take(load(randaugment=(2, 9)), 3)
    plain_images, plain_labels = _take(load(), 3)
    assert images.shape == (18, 12, 12, 3) and images.dtype == np.float32
    assert 0.0 <= images.min() and images.max() <= 1.0 and not np.array_equal(images, plain_images)
    np.testing.assert_array_equal(labels, plain_labels)  # the same examples, augmented more
    # A second run, resumed after 5 examples: augmented as the first.
    np.testing.assert_array_equal(_take(load(randaugment=(2, 9), skip_examples=5), 2)[0], images[5:17])
    np.testing.assert_array_equal(_take(load(randaugment=(0, 9)), 3)[0], plain_images)  # flips, crops kept


def test_randaugment_and_mixing_through_tfds_mock():
    with tfds.testing.mock_data(num_examples=10):
        load = lambda **kwargs: data.load("tfds:mnist", "train", 4, seed=1, **kwargs)[0]
        images, labels = _take(load(randaugment=(2, 9), mixing={"cutmix_alpha": 1.0}), 2)
        plain_images, _ = _take(load(), 2)
    assert images.shape == (8, 28, 28, 1) and labels.shape == (8, 10)
    assert 0.0 <= images.min() and images.max() <= 1.0 and not np.array_equal(images, plain_images)
    np.testing.assert_allclose(labels.sum(axis=1), 1.0, rtol=1e-5)


@pytest.mark.parametrize(
    "spec, kwargs, message",
    [
        ("shapes", {"randaugment": (2, 12)}, "randaugment_magnitude 12 must be in [0, 10]"),
        ("shapes", {"randaugment": 9}, "randaugment 9 must be (num_ops, magnitude), e.g. (2, 9)"),
        ("shapes", {"mixing": {"mixup": 0.8}}, "unknown mixing setting(s) mixup; choose from: mixup_alpha"),
        ("shapes", {"mixing": {"num_classes": 5}}, "mixing num_classes 5 is not the dataset's 10 classes"),
        ("synthetic", {"mixing": MIXING}, "randaugment and mixing do not apply to the synthetic dataset"),
        (
            "synthetic",
            {"randaugment": (2, 9)},
            "randaugment and mixing do not apply to the synthetic dataset",
        ),
    ],
)
def test_bad_augmentation_settings(spec, kwargs, message):
    with pytest.raises(UsageError) as error:
        data.load(spec, "train", 8, **kwargs)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_synthetic_eval_ignores_mixing():
    _, labels = next(iter(data.load("synthetic", "eval", 8, training=False, mixing=MIXING)[0]))
    assert labels.shape == (8,) and labels.dtype == tf.int32
