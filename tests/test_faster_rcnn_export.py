"""Faster R-CNN exports (tfmp.serving.two_stage) and predictions with them, in-process.

One untrained `faster_rcnn_tiny` (64 px, 3 classes, float32 weights) is exported in float32
(score threshold and detection count raised above the model's own) and in bfloat16, SavedModel
and `.keras` each. An untrained second stage scores every class about 1/4 (a softmax over 3
classes + background), so every image has detections above the model's 0.05.
"""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmp.detection import faster_rcnn
from tfmp.errors import UsageError
from tfmp.serving import artifacts, copies, export, predictors, two_stage

SIZE, CLASSES, NAME = 64, 3, "faster_rcnn_tiny"
# The float32 export's, above the model's 0.05 and below its 100: the untrained model's top 100
# scores per image lie in about [0.22, 0.34], so 0.28 cuts each image's list short of 50.
SCORE_THRESHOLD, MAX_DETECTIONS = 0.28, 50
EPSILON = float(np.finfo(np.float32).eps)
# A float32 graph and the eager model run the same kernels; allow a few roundings of each
# value's scale: boxes are pixels of the 64 px input, scores probabilities <= 1.
BOX_TOLERANCE, SCORE_TOLERANCE = 4 * SIZE * EPSILON, 4 * EPSILON
# bfloat16 keeps 8 bits: ~20 layers of 2^-8 relative rounding each before the RPN's outputs.
BFLOAT16_RELATIVE = 20 * 2.0**-8
DETECTION_DTYPES = {"boxes": "float32", "scores": "float32", "classes": "int32", "valid_detections": "int32"}
# The module's exports took 42 s to build on 2 busy cores (load 3-5): out of the `-m "not slow"` loop.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The model, 4 random images and the two export reports (float32: SavedModel and .keras
    asked for by name; bfloat16: the default formats)."""
    root = tmp_path_factory.mktemp("faster_rcnn_export")
    keras.utils.set_random_seed(3)
    model = faster_rcnn.build_detector(NAME, SIZE, num_classes=CLASSES)
    images = np.random.default_rng(3).uniform(size=(4, SIZE, SIZE, 3)).astype(np.float32)
    metadata = {"model": NAME, "class_names": ["circle", "square", "triangle"]}
    reports = {
        "float32": export.export(
            model,
            str(root / "export"),
            ["saved_model", "keras"],
            "float32",
            metadata=metadata,
            reference_images=images,
            options={"score_threshold": SCORE_THRESHOLD, "max_detections": MAX_DETECTIONS},
        ),
        "bfloat16": export.export(
            model, str(root / "export"), None, "bfloat16", metadata=metadata, reference_images=images
        ),
    }
    return {"root": root, "model": model, "images": images, "reports": reports}


@pytest.fixture(scope="module")
def served(exported):
    """{precision: (SavedModel as tf.saved_model.load reads it, its detections of the images)}."""
    result = {}
    for precision, report in exported["reports"].items():
        loaded = tf.saved_model.load(os.path.join(report["directory"], "saved_model"))
        found = loaded.signatures["serving_default"](images=tf.constant(exported["images"]))
        result[precision] = loaded, {key: value.numpy() for key, value in found.items()}
    return result


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_saved_model_takes_float32_images_and_returns_float32_detections_after_nms(
    exported, served, precision
):
    loaded, found = served[precision]
    ((name, spec),) = loaded.signatures["serving_default"].structured_input_signature[1].items()
    assert name == "images" and spec.dtype == tf.float32 and spec.shape.as_list() == [None, SIZE, SIZE, 3]
    assert {key: value.dtype.name for key, value in found.items()} == DETECTION_DTYPES
    most = MAX_DETECTIONS if precision == "float32" else 100
    assert found["boxes"].shape == (4, most, 4) and found["scores"].shape == (4, most)
    assert found["classes"].shape == (4, most) and found["valid_detections"].shape == (4,)
    assert (found["valid_detections"] > 0).all()
    variables = {variable.dtype.name for variable in loaded.variables}
    assert variables == {precision}  # a float32-built model: every weight half, none cast per call
    raw = loaded.signatures["raw_outputs"](images=tf.constant(exported["images"]))
    assert {value.dtype for value in raw.values()} == {tf.float32} and "rpn_scores" in raw


def test_float32_saved_model_detections_equal_the_models_own(exported, served):
    _, found = served["float32"]
    expected = faster_rcnn.detect(exported["model"], exported["images"], SCORE_THRESHOLD, MAX_DETECTIONS)
    expected = {key: value.numpy() for key, value in expected.items()}
    assert 0 < expected["valid_detections"].max() < MAX_DETECTIONS  # the threshold cut some
    np.testing.assert_array_equal(found["valid_detections"], expected["valid_detections"])
    np.testing.assert_array_equal(found["classes"], expected["classes"])
    assert np.abs(found["boxes"] - expected["boxes"]).max() <= BOX_TOLERANCE
    assert np.abs(found["scores"] - expected["scores"]).max() <= SCORE_TOLERANCE
    (below,) = [row for row in exported["reports"]["float32"]["artifacts"] if row["format"] == "keras"]
    assert below["detection_agreement"] == 1.0 and below["max_abs_difference"] <= SCORE_TOLERANCE


def test_bfloat16_keras_copy_keeps_the_box_layers_float32_and_finds_the_saved_models_detections(
    exported, served
):
    """(The float32 .keras row of the report: agreement 1.0 and 0 difference, in the test above.)"""
    directory = exported["reports"]["bfloat16"]["directory"]
    predictor = predictors.load(os.path.join(directory, "model.keras"))
    policies = {type(layer).__name__: layer.dtype_policy.name for layer in predictor.model.layers}
    for layer in ("Proposals", "SampleROIs", "ROIAlign", "Detections"):
        assert policies[layer] == "float32", layer
    assert policies["Conv2D"] == policies["Dense"] == "bfloat16"
    _, found = two_stage.detections(predictor, exported["images"])
    _, expected = served["bfloat16"]
    # The same bfloat16 graph in Keras and in the SavedModel: the same detections.
    np.testing.assert_array_equal(found["valid_detections"], expected["valid_detections"])
    np.testing.assert_array_equal(found["classes"], expected["classes"])


def test_report_table_and_export_json_describe_the_two_stage_export(exported):
    reference = exported["model"](
        predictors.model_inputs(exported["model"], exported["images"]), training=False
    )
    scale = float(np.abs(reference["rpn_scores"]).max())
    for precision, report in exported["reports"].items():
        with open(os.path.join(report["directory"], "export.json")) as file:
            stored = json.load(file)
        assert stored["kind"] == "two_stage_detector" and stored["preprocessing"]["image_shape"] == [
            64,
            64,
            3,
        ]
        assert not os.path.exists(os.path.join(report["directory"], "model.tflite"))
        section = stored["two_stage_detector"]
        assert section["image_size"] == SIZE and section["num_classes"] == CLASSES
        assert section["model_score_threshold"] == 0.05 and section["iou_threshold"] == 0.5
        table = export.format_table(report["artifacts"], report["kind"])
        assert "max |diff RPN logits|" in table and "detection agreement" in table
        for row in report["artifacts"]:
            bound = 0.0 if precision == "float32" else BFLOAT16_RELATIVE * scale
            assert row["max_abs_difference_per_output"]["rpn_scores"] <= bound + SCORE_TOLERANCE, row
            assert 0.0 < row["detection_agreement"] <= 1.0
    assert exported["reports"]["float32"]["two_stage_detector"]["score_threshold"] == SCORE_THRESHOLD
    # Default formats (None) leave TFLite out and say why; asked-for formats skip nothing.
    assert exported["reports"]["bfloat16"]["skipped_formats"] == {"tflite": two_stage.NO_TFLITE}
    assert "skipped_formats" not in exported["reports"]["float32"]


@pytest.mark.parametrize(
    "formats, options, message",
    [
        (
            ["tflite"],
            {},
            "^--formats=tflite: faster_rcnn_tiny needs CropAndResize and NMS, which are no TFLite "
            "builtins; export saved_model,keras$",
        ),
        (["saved_model", "tflite"], {}, "--formats=tflite: "),
        (["saved_model"], {"score_threshold": 0.01}, r"--score_threshold=0.01 must be in \[0.05, 1\)"),
        (["saved_model"], {"max_detections": 101}, r"--max_detections=101 must be in \[1, 100\]"),
        (["saved_model"], {"iou_threshold": 0.6}, "built into the model"),
    ],
)
def test_what_a_two_stage_export_cannot_do_is_refused_in_one_line_before_writing(
    exported, tmp_path, formats, options, message
):
    target = tmp_path / "out"
    with pytest.raises(UsageError, match=message) as refusal:
        export.export(exported["model"], str(target), formats, metadata={"model": NAME}, options=options)
    assert "\n" not in str(refusal.value) and not target.exists()


def test_run_dirs_of_faster_rcnn_are_a_two_stage_kind_and_unknown_models_still_refused(exported, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    exported["model"].save(run / "model.keras")
    (run / "flags.txt").write_text(f"--model={NAME}\n--dataset=shapes\n--image_size={SIZE}\n")
    assert artifacts.kind_of(str(run)) == "two_stage_detector"
    with pytest.raises(UsageError, match="^--formats=tflite: faster_rcnn_tiny needs CropAndResize"):
        export.export_run(str(run), ["tflite"])
    (run / "flags.txt").write_text("--model=someone_elses_net\n--dataset=shapes\n")
    with pytest.raises(UsageError, match="trained 'someone_elses_net', which apps.export cannot export yet"):
        export.export_run(str(run))
    assert sorted(os.listdir(run)) == ["flags.txt", "model.keras"]


def test_predicting_files_with_a_faster_rcnn_export_draws_its_detections(exported, tmp_path):
    """What apps.predict does with --model=EXPORT_DIR: export.json names the kind, the SavedModel
    answers with its NMS output, the boxes are drawn on the original image."""
    export_dir = exported["reports"]["float32"]["directory"]
    assert artifacts.kind_of(export_dir) == "two_stage_detector"
    image = np.random.default_rng(7).uniform(size=(48, 40, 3))  # not the input size: fit + pad
    png = tmp_path / "noise.png"
    png.write_bytes(tf.io.encode_png(tf.image.convert_image_dtype(image, tf.uint8, saturate=True)).numpy())
    settings = {"score_threshold": SCORE_THRESHOLD, "output_dir": str(tmp_path / "out")}
    (record,) = artifacts.KINDS["two_stage_detector"].predict_files(export_dir, [str(png)], settings)
    assert record["model_format"] == "saved_model" and os.path.isfile(record["png"])
    assert record["detections"] and {found["name"] for found in record["detections"]} <= {
        "circle",
        "square",
        "triangle",
    }
    for found in record["detections"]:
        assert found["score"] >= SCORE_THRESHOLD and all(0.0 <= value <= 48.0 for value in found["box"])
    with pytest.raises(UsageError, match=r"--score_threshold=0.1 must be in \[0.28, 1\)"):
        artifacts.KINDS["two_stage_detector"].predict_files(export_dir, [str(png)], {"score_threshold": 0.1})


@pytest.mark.parametrize("precision", ["float16", "mixed"])
def test_inference_copies_of_a_mixed_trained_model_keep_its_float32_layers(precision):
    """A run trained with --mixed: the layers it runs in float32 on purpose (RPN outputs, the
    second stage's last layers, proposals, ROIAlign, NMS) stay float32 in every copy."""
    keras.utils.set_random_seed(3)
    model = faster_rcnn.build_detector(NAME, SIZE, num_classes=CLASSES, dtype="mixed_bfloat16")
    copy = copies.inference_copy(model, precision, keep_float32_layers=True)
    float32_layers = {layer.name for layer in model.layers if layer.dtype_policy.name == "float32"}
    half = "float16" if precision == "float16" else copies.layer_policy("mixed")
    for layer in copy.layers:
        if not isinstance(layer, keras.layers.InputLayer):
            assert layer.dtype_policy.name == ("float32" if layer.name in float32_layers else half), (
                layer.name
            )
    found = faster_rcnn.detect(copy, np.zeros((1, SIZE, SIZE, 3), np.float32), 0.05, 100)
    assert {key: value.dtype.name for key, value in found.items()} == DETECTION_DTYPES
    assert np.isfinite(found["scores"].numpy()).all() and found["valid_detections"].numpy()[0] > 0
