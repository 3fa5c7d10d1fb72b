"""Untrusted files (issue 30): a SavedModel is a program, an image can be a decompression bomb,
an export.json can be anything.

Real files throughout: a SavedModel whose serving_default writes a file (run only when trusted),
a real 20000x20000 PNG of zeros (390 kB, conftest.write_zero_png), images in every format
`tf.io.decode_image` reads, and export.json files broken in each way a hand or a disk breaks
them. The app tests start `apps.predict` in a fresh process (marked slow).
"""

import hashlib
import json
import os
import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import finish, save_spy_saved_model, start_python, write_zero_png
from PIL import Image

from tfmp.classification import data as classification_data
from tfmp.detection import data as detection_data
from tfmp.errors import UsageError
from tfmp.input import image_files
from tfmp.serving import artifacts, export, predictors, trust

SIZE = 8  # the tiny classifier's input: 8x8x3
EPSILON = float(np.finfo(np.float32).eps)


# ----------------------------------------------------------------------------- files
def _noise(height, width, seed=0):
    return (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)


@pytest.fixture(scope="module")
def bomb(tmp_path_factory):
    """A 20000x20000 PNG of zeros (1.2 GB as RGB uint8, 4.8 GB as float32), and its size."""
    path = tmp_path_factory.mktemp("bomb") / "bomb.png"
    return str(path), write_zero_png(path, 20000, 20000)


# ----------------------------------------------------------------------------- image headers
def test_every_format_declares_the_size_the_decoder_makes(tmp_path):
    picture = Image.fromarray(_noise(37, 53))
    files = {
        "a.png": {},
        "a.jpg": {"exif": b"Exif\x00\x00" + bytes(60_000), "icc_profile": bytes(150_000)},  # segments first
        "progressive.jpg": {"progressive": True},
        "a.gif": {},
        "a.bmp": {},
        "lossy.webp": {},
        "lossless.webp": {"lossless": True},
    }
    for name, options in files.items():
        picture.save(tmp_path / name, **options)
        decoded = tf.io.decode_image((tmp_path / name).read_bytes(), channels=3, expand_animations=False)
        assert decoded.shape[:2] == (37, 53), name
        assert image_files.declared_size(str(tmp_path / name)) == (53, 37, 53 * 37), name
    Image.fromarray(np.dstack([_noise(37, 53), _noise(37, 53)[..., 0]])).save(tmp_path / "alpha.webp")
    assert image_files.declared_size(str(tmp_path / "alpha.webp")) == (53, 37, 53 * 37)  # VP8X canvas
    frames = [Image.fromarray(_noise(37, 53, seed)) for seed in range(5)]
    frames[0].save(tmp_path / "anim.gif", save_all=True, append_images=frames[1:])
    # The GIF decoder inflates every frame, whichever one it returns: 5 frames' pixels.
    assert image_files.declared_size(str(tmp_path / "anim.gif")) == (53, 37, 5 * 53 * 37)


def test_a_png_bomb_is_refused_from_its_header_with_its_sizes(bomb):
    path, size = bomb
    assert image_files.declared_size(path) == (20000, 20000, 400_000_000) and size < 400_000
    reason = image_files.oversized(path)
    assert reason == (
        f"a {size / 1e6:.1f} MB PNG of 20000x20000 = 400,000,000 pixels, "
        "more than --max_image_pixels=89,478,485"
    )
    assert image_files.oversized(path, max_pixels=0) is None  # 0: no limit
    assert image_files.oversized(path, max_pixels=400_000_000) is None


def test_a_folder_dataset_with_a_bomb_is_refused_before_anything_decodes(tmp_path):
    """The pre-run check: one line naming the file and its sizes. The bomb is cut short (no IEND),
    which used to make the check decode it in full; now its header refuses it first."""
    for name in ("circle", "square"):
        (tmp_path / name).mkdir()
        for index in range(10):
            Image.fromarray(_noise(8, 8, index)).save(tmp_path / name / f"{index}.png")
    bomb = tmp_path / "square" / "zz_bomb.png"
    size = write_zero_png(bomb, 20000, 20000, cut=12)
    spec = f"folder:{tmp_path}"
    with pytest.raises(UsageError) as refused:
        classification_data.describe(spec, image_size=8)
    assert str(refused.value) == (
        f"{spec}: {bomb} is a {size / 1e6:.1f} MB PNG of 20000x20000 = 400,000,000 pixels, more than "
        "--max_image_pixels=89,478,485; shrink or remove it, or raise --max_image_pixels (0: no limit) "
        "if you trust the file"
    )
    with pytest.raises(UsageError, match="--max_image_pixels=1,000"):
        classification_data.describe(spec, image_size=8, max_image_pixels=1000)  # every 8x8 passes
    bomb.unlink()
    assert classification_data.describe(spec, image_size=8, max_image_pixels=1000).num_classes == 2


def test_a_coco_dataset_with_a_bomb_is_refused_before_anything_decodes(tmp_path):
    (tmp_path / "images").mkdir()
    images = []
    for index in range(10):
        name = f"images/{index}.png"
        if index == 3:
            write_zero_png(tmp_path / name, 20000, 20000)
        else:
            Image.fromarray(_noise(16, 16, index)).save(tmp_path / name)
        images.append({"id": index + 1, "file_name": name, "width": 16, "height": 16})
    annotations = [
        {"id": index + 1, "image_id": index + 1, "category_id": 1, "bbox": [1, 1, 5, 5], "area": 25}
        for index in range(10)
    ]
    coco = {"images": images, "annotations": annotations, "categories": [{"id": 1, "name": "thing"}]}
    (tmp_path / "instances.json").write_text(json.dumps(coco))
    with pytest.raises(UsageError, match=r"images/3\.png is a .* PNG of 20000x20000 = 400,000,000 pixels"):
        detection_data.describe(f"coco:{tmp_path / 'instances.json'}", image_size=32)


def test_predict_refuses_a_bomb_before_decoding_it(bomb, tmp_path):
    path, _ = bomb
    with pytest.raises(UsageError, match=f"image '{path}' is a .* PNG of 20000x20000"):
        predictors.read_images([path], artifacts.Preprocessing(SIZE, SIZE, 3))
    with pytest.raises(UsageError, match="20000x20000"):
        detection_data.read_image(path, 64)


def test_normal_images_decode_to_the_same_pixels_as_before(tmp_path):
    """Resizing the decoded uint8 (never a full-size float32 copy) gives what converting first
    gave, to float32 rounding; in predict, the folder pipeline and detection alike."""
    for name, shape in (("photo.jpg", (60, 45)), ("wide.png", (23, 71)), ("same.png", (SIZE, SIZE))):
        Image.fromarray(_noise(*shape)).save(tmp_path / name)
        raw = tf.io.decode_image((tmp_path / name).read_bytes(), channels=3, expand_animations=False)
        before = tf.clip_by_value(
            tf.image.resize(tf.image.convert_image_dtype(raw, tf.float32), (SIZE, SIZE), antialias=True), 0, 1
        ).numpy()
        now = predictors.read_images([str(tmp_path / name)], artifacts.Preprocessing(SIZE, SIZE, 3))[0]
        assert np.abs(now - before).max() <= 2 * EPSILON, name
        square_before = detection_data.fit_to_square(
            tf.image.convert_image_dtype(raw, tf.float32), tf.zeros([0, 4]), tf.zeros([0], tf.int32), 32
        )[0]
        square_now, _, original = detection_data.read_image(str(tmp_path / name), 32)
        assert np.abs(square_now.numpy() - square_before.numpy()).max() <= 2 * EPSILON, name
        assert original.dtype == tf.uint8 and original.shape[:2] == shape


# ----------------------------------------------------------------------------- SavedModels
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """An apps.export-written SavedModel export of a tiny classifier, and a spying SavedModel."""
    root = tmp_path_factory.mktemp("saved_models")
    keras.utils.set_random_seed(0)
    images = keras.Input((SIZE, SIZE, 3))
    model = keras.Model(images, keras.layers.Dense(3, activation="softmax")(keras.layers.Flatten()(images)))
    report = export.export(
        model, str(root / "export"), formats=("saved_model",), reference_images=np.zeros((2, SIZE, SIZE, 3))
    )
    save_spy_saved_model(root / "spy", root / "spy_ran.txt", SIZE)
    Image.fromarray(_noise(SIZE, SIZE)).save(root / "a.png")
    return {
        "root": root,
        "export": report["directory"],
        "spy": str(root / "spy"),
        "marker": root / "spy_ran.txt",
        "image": str(root / "a.png"),
    }


def test_export_json_records_the_graph_digest_and_the_export_loads(models):
    saved_model = os.path.join(models["export"], "saved_model")
    with open(os.path.join(models["export"], "export.json"), encoding="utf-8") as file:
        recorded = json.load(file)[trust.RECORD_KEY]
    with open(os.path.join(saved_model, "saved_model.pb"), "rb") as file:
        assert recorded == hashlib.sha256(file.read()).hexdigest()
    for path in (models["export"], saved_model):  # the export dir, or its SavedModel dir
        assert artifacts.saved_model_dir(path) == saved_model
        assert predictors.load(path).predict(np.zeros((1, SIZE, SIZE, 3), np.float32)).shape == (1, 3)
    assert not [name for name in os.listdir(models["export"]) if name.startswith(".tmp-")]


def test_a_savedmodel_apps_export_did_not_write_is_refused_and_never_runs(models):
    with pytest.raises(UsageError) as refused:
        predictors.load(models["spy"])
    message = str(refused.value)
    assert models["spy"] in message and "--trust_saved_model" in message and "no export.json" in message
    assert not models["marker"].exists()
    predictor = predictors.load(models["spy"], trust_saved_model=True)  # it is a program indeed:
    predictor.predict(np.zeros((1, SIZE, SIZE, 3), np.float32))
    assert models["marker"].read_text() == "this ran with your permissions"
    models["marker"].unlink()


def test_an_export_whose_graph_was_replaced_is_refused(models, tmp_path):
    forged = tmp_path / "float32"
    shutil.copytree(models["export"], forged)
    shutil.copy(os.path.join(models["spy"], "saved_model.pb"), forged / "saved_model" / "saved_model.pb")
    with pytest.raises(UsageError, match="holds a saved_model.pb that is not the one apps.export wrote"):
        predictors.load(str(forged))
    metadata = json.loads((forged / "export.json").read_text())
    del metadata[trust.RECORD_KEY]  # an export from before the digest was recorded
    (forged / "export.json").write_text(json.dumps(metadata))
    with pytest.raises(UsageError, match="without the graph digest .* export the run again"):
        predictors.load(str(forged))
    assert not models["marker"].exists()


def test_keras_files_load_in_safe_mode(tmp_path):
    """A Lambda layer's bytecode is refused (Keras' safe mode), not run."""
    marker = tmp_path / "lambda_ran.txt"

    def spy(images):
        marker.write_text("ran")
        return images

    model = keras.Sequential([keras.Input((SIZE, SIZE, 3)), keras.layers.Lambda(spy), keras.layers.Flatten()])
    model.save(tmp_path / "lambda.keras")
    marker.unlink(missing_ok=True)
    with pytest.raises(UsageError, match="cannot load Keras model .*lambda.keras"):
        predictors.load(str(tmp_path / "lambda.keras"))
    assert not marker.exists()


# ----------------------------------------------------------------------------- export.json
GOOD_DETECTOR = {
    "score_threshold": 0.05,
    "iou_threshold": 0.5,
    "max_detections": 100,
    "image_size": 64,
    "num_classes": 3,
    "anchor_levels": [3, 4, 5],
}
BROKEN_EXPORT_JSON = [
    (b'{"kind": "classifier", ', "is not readable JSON (Expecting property name"),
    (b"\xff\xfe not utf-8", "is not readable JSON ("),
    (b"[1, 2]", "holds a JSON list, not the object apps.export writes"),
    (b'{"kind": "segmenter"}', "names kind 'segmenter', which apps.predict does not know (classifier,"),
    (b'{"kind": 7}', "names kind 7"),
    (b'{"class_names": "cat"}', 'class_names must be a list of strings, not "cat"'),
    (b'{"kind": "detector"}', "has no 'detector' section"),
    (
        json.dumps({"kind": "detector", "detector": dict(GOOD_DETECTOR, image_size="64")}).encode(),
        'detector.image_size must be a count, not "64"',
    ),
    (
        json.dumps({"kind": "detector", "detector": dict(GOOD_DETECTOR, anchor_levels=None)}).encode(),
        "detector.anchor_levels must be a list of counts, not null",
    ),
    (b"[" * 100_000 + b"]" * 100_000, "is not readable JSON ("),
]


@pytest.mark.parametrize("content, message", BROKEN_EXPORT_JSON, ids=range(len(BROKEN_EXPORT_JSON)))
def test_a_malformed_export_json_is_one_usage_error_naming_the_file(tmp_path, content, message):
    (tmp_path / "export.json").write_bytes(content)
    (tmp_path / "model.keras").write_bytes(b"never read")
    for call in (artifacts.kind_of, predictors.load):
        with pytest.raises(UsageError) as refused:
            call(str(tmp_path))
        text = str(refused.value)
        assert text.startswith(str(tmp_path / "export.json")) and message in text and "\n" not in text
        assert text.endswith("export the run again with apps.export")


# ----------------------------------------------------------------------------- apps.predict
@pytest.mark.slow  # fresh processes (three side by side: ~6 s)
def test_apps_predict_runs_an_export_with_one_note_and_refuses_the_rest_in_one_line(models, bomb):
    commands = [
        [f"--model={models['export']}", models["image"]],
        [f"--model={models['spy']}", models["image"]],
        [f"--model={models['export']}", bomb[0]],
    ]
    ran, untrusted, too_large = [finish(start_python(["-m", "apps.predict", *args])) for args in commands]
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert [line for line in ran.stderr.splitlines() if line.strip()] == [
        f"note: running SavedModel {models['export']}/saved_model, a program with your permissions: "
        "its graph is the one apps.export recorded in export.json"
    ]
    assert json.loads(ran.stdout.splitlines()[-1])["image"] == models["image"]
    for refused, wanted in (
        (untrusted, [models["spy"], "--trust_saved_model"]),
        (too_large, [bomb[0], "20000x20000 = 400,000,000 pixels"]),
    ):
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), refused.stderr
        assert all(text in lines[0] for text in wanted) and refused.stdout == ""
    assert not models["marker"].exists()
