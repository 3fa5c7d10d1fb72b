"""apps.predict and tfmp.serving.predictors: training's preprocessing, top-k with class names, refusals.

One tiny seed_cnn run (16x16 shapes) and its float16 .tflite export; the app runs twice in a
fresh process (a good pair of images, and a pair with one undecodable file), and once on a
detector run (marked slow); the library tests run in-process.
"""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import run_python

from tfmp import models
from tfmp.classification import data
from tfmp.detection import shapes
from tfmp.detection.retinanet import build_detector
from tfmp.errors import UsageError
from tfmp.serving import artifacts, export, predictors

IMAGE_SIZE = 16


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run dir (model.keras + flags.txt, as train.py writes them), two PNGs and a broken one."""
    root = tmp_path_factory.mktemp("predict")
    run_dir = root / "run"
    run_dir.mkdir()
    keras.utils.set_random_seed(2)
    model = models.build("seed_cnn", (IMAGE_SIZE, IMAGE_SIZE, 3), 10)
    model.save(run_dir / "model.keras")
    (run_dir / "flags.txt").write_text(f"--model=seed_cnn\n--dataset=shapes\n--image_size={IMAGE_SIZE}\n")
    images = next(iter(data.load("shapes", "eval", 2, image_size=IMAGE_SIZE, training=False)[0]))[0]
    paths = []
    for index, image in enumerate(images):
        path = root / f"shape{index}.png"
        path.write_bytes(tf.io.encode_png(tf.image.convert_image_dtype(image, tf.uint8)).numpy())
        paths.append(str(path))
    bigger = root / "bigger.jpg"  # not the training size: predict must resize it
    bigger.write_bytes(tf.io.encode_jpeg(tf.cast(tf.fill([40, 30, 3], 200), tf.uint8)).numpy())
    broken = root / "broken.png"
    broken.write_text("not an image")
    export.export_run(str(run_dir), formats=["tflite"], precision="float16", eval_batches=1)
    return {
        "run_dir": str(run_dir),
        "model": model,
        "images": images.numpy(),
        "pngs": paths,
        "jpg": str(bigger),
        "broken": str(broken),
    }


@pytest.mark.slow  # a fresh process
def test_predict_prints_top_k_with_class_names_one_json_line_per_image(run):
    images = [*run["pngs"], run["jpg"]]
    result = run_python(["-m", "apps.predict", f"--model={run['run_dir']}", "--top_k=3", *images])
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [line["image"] for line in lines] == images
    expected = run["model"](run["images"]).numpy()  # the training-pipeline pixels (PNG is lossless to 1/255)
    for line, probabilities in zip(lines, expected):
        top = line["top_k"]
        assert len(top) == 3 and [entry["probability"] for entry in top] == sorted(
            [entry["probability"] for entry in top], reverse=True
        )
        assert top[0]["class"] == int(np.argmax(probabilities))
        assert top[0]["name"] == data.SHAPES_CLASS_NAMES[top[0]["class"]]
        assert abs(top[0]["probability"] - probabilities.max()) < 1e-2


@pytest.mark.slow  # a fresh process
def test_undecodable_image_exits_2_with_one_line_and_no_predictions(run):
    result = run_python(["-m", "apps.predict", f"--model={run['run_dir']}", run["pngs"][0], run["broken"]])
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "broken.png" in errors[0] and "Traceback" not in result.stderr
    assert result.stdout.strip() == ""


def test_read_images_is_the_training_preprocessing(run):
    pixels = predictors.read_images(run["pngs"], artifacts.Preprocessing(IMAGE_SIZE, IMAGE_SIZE, 3))
    assert pixels.dtype == np.float32 and pixels.shape == run["images"].shape
    assert np.abs(pixels - run["images"]).max() <= 1 / 255 + 1e-6  # the 8-bit PNG only
    resized = predictors.read_images([run["jpg"]], artifacts.Preprocessing(IMAGE_SIZE, IMAGE_SIZE, 3))
    assert resized.shape == (1, IMAGE_SIZE, IMAGE_SIZE, 3) and 0.0 <= resized.min() <= resized.max() <= 1.0


def test_tflite_export_predicts_like_the_run_with_its_own_metadata(run):
    tflite = os.path.join(run["run_dir"], "export", "float16", "model.tflite")
    predictor = predictors.load(tflite)
    assert predictor.format == "tflite" and predictor.class_names == data.SHAPES_CLASS_NAMES
    assert predictor.preprocessing == artifacts.Preprocessing(IMAGE_SIZE, IMAGE_SIZE, 3)
    expected = run["model"](run["images"]).numpy()
    assert np.abs(predictor.predict(run["images"]) - expected).max() < 1e-2  # float16 weights
    top = predictors.top_k(predictor.predict(run["images"][:1])[0], 2, predictor.class_names)
    assert [entry["class"] for entry in top] == list(np.argsort(-expected[0])[:2])


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda root: root / "missing", "does not exist"),
        (lambda root: root, "holds no model"),
        (
            lambda root: (root / "notes.txt").write_text("x") and root / "notes.txt",
            "neither .tflite nor .keras",
        ),
    ],
)
def test_loading_something_that_is_not_a_model_is_one_usage_error(tmp_path, make, message):
    with pytest.raises(UsageError, match=message):
        predictors.load(str(make(tmp_path)))


def test_the_parent_of_per_precision_exports_asks_which_one(run):
    with pytest.raises(UsageError, match="several precisions; pick one: .*float16"):
        predictors.load(os.path.join(run["run_dir"], "export"))


@pytest.mark.slow  # a fresh process
def test_predict_on_a_detector_run_prints_detections_and_writes_the_png(tmp_path):
    """apps.predict delegates a detector run to the detection predict mode."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    keras.utils.set_random_seed(6)
    model = build_detector("retinanet_tiny", 64, 3, dtype="mixed_bfloat16")
    head = model.get_layer("retinanet_tiny_classes_output")  # confident random scores: some boxes pass 0.3
    head.bias.assign(np.zeros(head.bias.shape))
    model.save(run_dir / "model.keras")
    (run_dir / "flags.txt").write_text("--model=retinanet_tiny\n--dataset=shapes\n--image_size=64\n")
    image = shapes.draw_scene(tf.constant([1, 2], tf.int64), 48)[0]  # not the input size: fit + pad
    (tmp_path / "scene.png").write_bytes(
        tf.io.encode_png(tf.image.convert_image_dtype(image, tf.uint8)).numpy()
    )
    result = run_python(
        [
            "-m",
            "apps.predict",
            f"--model={run_dir}",
            f"--output_dir={tmp_path / 'out'}",
            "--score_threshold=0.3",
            str(tmp_path / "scene.png"),
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1 and lines[0]["image"] == str(tmp_path / "scene.png")
    assert lines[0]["png"] == str(tmp_path / "out" / "scene.detections.png") and os.path.isfile(
        lines[0]["png"]
    )
    assert lines[0]["detections"], "a 0.5-score head must leave detections above 0.3"
    for detection in lines[0]["detections"]:
        assert detection["score"] >= 0.3 and detection["name"] == shapes.CLASS_NAMES[detection["class"]]
        assert all(0.0 <= value <= 48.0 for value in detection["box"])  # the original image's pixels
