"""tfmp.serving.export and apps.export: every artifact reloads in a fresh process and matches Keras.

One tiny ResNet-20 run (16x16 shapes, random weights and random BatchNorm statistics so the
folding is exercised) is exported in float32 and bfloat16 in-process and in float16 through the
app; one fresh process then loads all artifacts. Tolerances on probabilities, from each dtype's
machine epsilon over ~20 layers: float32 1e-5, float16 0.01 (~20 x 2^-11), bfloat16 0.08
(~20 x 2^-8); top-1 agreement >= 99% on 128 eval images.
"""

import importlib.util
import json
import os

import keras
import numpy as np
import pytest
from conftest import run_python

from tfmp import models
from tfmp.classification import data
from tfmp.errors import UsageError
from tfmp.serving import export

pytestmark = pytest.mark.slow  # fresh processes
IMAGE_SIZE, EVAL_IMAGES = 16, 128
TOLERANCE = {"float32": 1e-5, "float16": 0.01, "bfloat16": 0.08}

RELOAD = r"""
import json, os, sys
import numpy as np, tensorflow as tf
from tfmp.serving import predictors as inference
export_root, images = sys.argv[1], np.load(sys.argv[2])
outputs, facts = {}, {}
for precision in sorted(os.listdir(export_root)):
    for name in ("saved_model", "model.tflite", "model.keras"):
        if not os.path.exists(os.path.join(export_root, precision, name)):
            continue
        predictor = inference.load(os.path.join(export_root, precision, name))
        outputs[f"{precision}/{name}"] = predictor.predict(images)
        if name == "saved_model":
            serve = predictor.serve
            facts[f"{precision}/saved_model"] = {
                "variable_dtypes": sorted({v.dtype.name for v in predictor.loaded.variables}),
                "input_dtype": serve.structured_input_signature[1]["images"].dtype.name,
                "output_dtypes": {k: v.dtype.name for k, v in serve.structured_outputs.items()}}
        if name == "model.tflite":
            interpreter = predictor.interpreter
            facts[f"{precision}/tflite"] = {
                "interpreter": type(interpreter).__module__,
                "ops": sorted({op["op_name"] for op in interpreter._get_ops_details()}),
                "input_dtype": np.dtype(interpreter.get_input_details()[0]["dtype"]).name,
                "output_dtype": np.dtype(interpreter.get_output_details()[0]["dtype"]).name}
np.savez(sys.argv[3], **outputs)
print("FACTS " + json.dumps(facts))
"""


def _tiny_run(run_dir):
    """A run dir as train.py leaves it: model.keras plus the resolved flags."""
    keras.utils.set_random_seed(1)
    model = models.build("resnet20", (IMAGE_SIZE, IMAGE_SIZE, 3), 10, dtype="mixed_bfloat16")
    rng = np.random.default_rng(1)
    for layer in model.layers:  # trained-looking statistics: folding must carry them exactly
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.moving_mean.assign(rng.uniform(-0.2, 0.2, layer.moving_mean.shape))
            layer.moving_variance.assign(rng.uniform(0.5, 2.0, layer.moving_variance.shape))
            layer.gamma.assign(rng.uniform(0.5, 1.5, layer.gamma.shape))
            layer.beta.assign(rng.uniform(-0.2, 0.2, layer.beta.shape))
    os.makedirs(run_dir)
    model.save(os.path.join(run_dir, "model.keras"))
    with open(os.path.join(run_dir, "flags.txt"), "w") as file:
        file.write(
            f"# resolved flags\n--model=resnet20\n--dataset=shapes\n--image_size={IMAGE_SIZE}\n"
            "--precision=mixed_bfloat16\n"
        )
    return model


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    run_dir = str(root / "run")
    model = _tiny_run(run_dir)
    export.export_run(run_dir, precision="float32", eval_batches=2)
    # Every half precision converts the same float16-weight .tflite: float16's (the app) suffices.
    export.export_run(run_dir, formats=["saved_model", "keras"], precision="bfloat16", eval_batches=2)
    app = run_python(["-m", "apps.export", f"--model_dir={run_dir}", "--precision=float16"])
    assert app.returncode == 0, app.stderr[-3000:]
    stream = data.load("shapes", "eval", EVAL_IMAGES, image_size=IMAGE_SIZE, training=False)[0]
    images = next(iter(stream))[0].numpy()
    np.save(root / "images.npy", images)
    reference = export.reference_outputs(
        export.inference_copy(model, "float32", fold_batch_norms=False), images
    )
    reload = run_python(
        ["-c", RELOAD, os.path.join(run_dir, "export"), str(root / "images.npy"), str(root / "outputs.npz")]
    )
    assert reload.returncode == 0, reload.stderr[-3000:]
    facts = json.loads(next(line for line in reload.stdout.splitlines() if line.startswith("FACTS "))[6:])
    return {
        "run_dir": run_dir,
        "app_stdout": app.stdout,
        "reference": reference,
        "facts": facts,
        "outputs": dict(np.load(root / "outputs.npz")),
    }


def test_float32_artifacts_equal_the_keras_model(exported):
    for name in ("saved_model", "model.tflite", "model.keras"):
        difference = np.abs(exported["outputs"][f"float32/{name}"] - exported["reference"]).max()
        assert difference <= TOLERANCE["float32"], (name, difference)


@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
def test_half_precision_artifacts_within_tolerance(exported, precision):
    reference = exported["reference"]
    for name in ("saved_model", "model.keras", "model.tflite"):
        if f"{precision}/{name}" not in exported["outputs"]:  # bfloat16: no .tflite (see fixture)
            continue
        outputs = exported["outputs"][f"{precision}/{name}"]
        # The .tflite holds float16 weights but computes in float32: float16's tolerance.
        tolerance = TOLERANCE["float16" if name == "model.tflite" else precision]
        assert np.abs(outputs - reference).max() <= tolerance, (precision, name)
        assert np.mean(outputs.argmax(-1) == reference.argmax(-1)) >= 0.99, (precision, name)


def test_half_precision_saved_models_hold_half_variables_and_float32_signatures(exported):
    facts = exported["facts"]
    assert facts["float16/saved_model"]["variable_dtypes"] == ["float16"]
    assert facts["bfloat16/saved_model"]["variable_dtypes"] == ["bfloat16"]
    assert facts["float32/saved_model"]["variable_dtypes"] == ["float32"]
    for precision in ("float32", "float16", "bfloat16"):
        saved_model = facts[f"{precision}/saved_model"]
        assert saved_model["input_dtype"] == "float32"
        assert saved_model["output_dtypes"] == {"probabilities": "float32"}


def test_tflite_has_no_flex_ops_and_runs_in_litert(exported):
    if importlib.util.find_spec("ai_edge_litert") is None:
        pytest.skip("ai-edge-litert is not installed (pip install tfmp[litert]); tf.lite ran the files")
    for precision in ("float32", "float16"):
        tflite = exported["facts"][f"{precision}/tflite"]
        assert tflite["interpreter"].startswith("ai_edge_litert"), tflite
        assert not [op for op in tflite["ops"] if op.startswith("Flex") or op == "CUSTOM"], tflite["ops"]
        assert tflite["input_dtype"] == tflite["output_dtype"] == "float32"
    sizes = {
        p: os.path.getsize(os.path.join(exported["run_dir"], "export", p, "model.tflite"))
        for p in ("float32", "float16")
    }
    assert sizes["float16"] <= 0.52 * sizes["float32"], sizes


def test_export_dir_describes_itself_and_the_table(exported):
    export_root = os.path.join(exported["run_dir"], "export")
    assert sorted(os.listdir(export_root)) == ["bfloat16", "float16", "float32"]  # no partial dirs
    report = json.load(open(os.path.join(export_root, "float16", "export.json")))
    assert report["preprocessing"]["image_shape"] == [IMAGE_SIZE, IMAGE_SIZE, 3]
    assert report["class_names"] == list(data.SHAPES_CLASS_NAMES)
    assert report["batch_norms_folded"] == 19 and report["compared_with"].endswith("eval images of shapes")
    assert [row["format"] for row in report["artifacts"]] == ["saved_model", "tflite", "keras"]
    for row in report["artifacts"]:
        assert row["size_bytes"] > 0 and row["max_abs_difference"] <= TOLERANCE["float16"]
    table = exported["app_stdout"]
    assert "max |diff| vs Keras float32" in table and "float16 weights, float32 compute" in table


def test_failed_export_keeps_the_previous_one_and_leaves_no_partial_dir(exported, monkeypatch):
    export_root = os.path.join(exported["run_dir"], "export")
    before = os.path.getmtime(os.path.join(export_root, "float32", "export.json"))

    def broken(*args, **kwargs):
        raise RuntimeError("converter crashed")

    monkeypatch.setattr(export, "write_tflite", broken)
    with pytest.raises(RuntimeError):
        export.export_run(
            exported["run_dir"], formats=["keras", "tflite"], precision="float32", eval_batches=1
        )
    assert sorted(os.listdir(export_root)) == ["bfloat16", "float16", "float32"]
    assert os.path.getmtime(os.path.join(export_root, "float32", "export.json")) == before


@pytest.mark.parametrize(
    "formats, precision, message",
    [
        (["saved_model", "onnx"], "float32", "unknown format 'onnx'"),
        (["tflite"], "int8", "unknown precision 'int8'"),
    ],
)
def test_unknown_format_or_precision_is_refused_before_writing(tmp_path, formats, precision, message):
    with pytest.raises(UsageError, match=message):
        export.export_run(str(tmp_path), formats, precision)
    assert os.listdir(tmp_path) == []


def test_app_refuses_a_run_dir_without_a_model_in_one_line(tmp_path):
    (tmp_path / "flags.txt").write_text("--dataset=shapes\n")
    result = run_python(["-m", "apps.export", f"--model_dir={tmp_path}", "--precision=bfloat16"])
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "holds no model.keras" in errors[0] and "Traceback" not in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["flags.txt"]


def test_pruned_model_exports_with_masks_stripped_and_zeros_kept(tmp_path):
    from tfmp import pruning

    keras.utils.set_random_seed(3)
    model = models.build("seed_cnn", (IMAGE_SIZE, IMAGE_SIZE, 3), 10)
    pruner = pruning.Pruner(model, pruning.ConstantSchedule(target_sparsity=0.5, begin_step=0, end_step=0))
    pruner.update(0)
    report = export.export(model, str(tmp_path), formats=["keras"], precision="bfloat16")
    exported_model = keras.saving.load_model(os.path.join(report["directory"], "model.keras"), compile=False)
    dense = exported_model.get_layer("seed_cnn_dense")
    assert dense.kernel.constraint is None and dense.kernel.dtype == "bfloat16"
    assert abs(float(np.mean(dense.kernel.numpy() == 0)) - 0.5) < 0.01
    assert report["artifacts"][0]["max_abs_difference"] <= TOLERANCE["bfloat16"]


# ----------------------------------------------------------------------------- detectors
DETECTOR_SIZE, DETECTOR_CLASSES = 64, 3
# float32 export vs the Keras model computed in float32: the same graph, so NMS picks the same
# rows; boxes (pixels of the 64 px input) within 1e-3, scores within 1e-5. bfloat16 moves logits
# by up to ~0.1 (8-bit mantissa), which can swap near-tied NMS winners: F1 of matched detections.
DETECTOR_BOX_TOLERANCE, DETECTOR_SCORE_TOLERANCE, DETECTOR_HALF_AGREEMENT = 1e-3, 1e-5, 0.9

DETECTOR_RELOAD = r"""
import json, sys
import numpy as np
from tfmp.serving import predictors as inference
root, images = sys.argv[1], np.load(sys.argv[2])
arrays, facts = {}, {}
for name in ("float32/saved_model", "bfloat16/saved_model", "float32/model.tflite"):
    predictor = inference.load(f"{root}/{name}")
    raw, found = predictor.detector_outputs(images)
    arrays.update({f"{name}/raw_{key}": value for key, value in raw.items()})
    arrays.update({f"{name}/{key}": value for key, value in found.items()})
    if name.endswith("saved_model"):
        serve = predictor.serve
        facts[name] = {"variables": [[v.dtype.name, list(v.shape)] for v in predictor.loaded.variables],
                       "input_dtype": serve.structured_input_signature[1]["images"].dtype.name,
                       "output_dtypes": {k: v.dtype.name for k, v in serve.structured_outputs.items()}}
    else:
        facts[name] = {"ops": sorted({op["op_name"] for op in predictor.interpreter._get_ops_details()})}
np.savez(sys.argv[3], **arrays)
print("FACTS " + json.dumps(facts))
"""


def _detector_run(run_dir):
    """A run dir as apps.detect leaves it; the output convs get spread-out weights so random
    scores are far from ties and boxes move off their anchors."""
    from tfmp.detection.retinanet import build_detector

    keras.utils.set_random_seed(4)
    model = build_detector("retinanet_tiny", DETECTOR_SIZE, DETECTOR_CLASSES, dtype="mixed_bfloat16")
    rng = np.random.default_rng(4)
    for kind, std in (("classes", 0.05), ("boxes", 0.02)):
        layer = model.get_layer(f"retinanet_tiny_{kind}_output")
        layer.kernel.assign(rng.normal(0.0, std, layer.kernel.shape))
        layer.bias.assign(np.zeros(layer.bias.shape))
    os.makedirs(run_dir)
    model.save(os.path.join(run_dir, "model.keras"))
    with open(os.path.join(run_dir, "flags.txt"), "w") as file:
        file.write(f"--model=retinanet_tiny\n--dataset=shapes\n--image_size={DETECTOR_SIZE}\n")
    return model


@pytest.fixture(scope="module")
def detector_exported(tmp_path_factory):
    from tfmp.serving import detector as export_detector

    root = tmp_path_factory.mktemp("detector")
    run_dir = str(root / "run")
    model = _detector_run(run_dir)
    reports = {
        "float32": export.export_run(
            run_dir, ["saved_model", "tflite"], "float32", eval_batches=1, batch_size=8
        ),
        "bfloat16": export.export_run(run_dir, ["saved_model"], "bfloat16", eval_batches=1, batch_size=8),
    }
    options = reports["float32"]["detector"]
    images = np.random.default_rng(5).uniform(size=(6, DETECTOR_SIZE, DETECTOR_SIZE, 3)).astype(np.float32)
    np.save(root / "images.npy", images)
    reference = export.inference_copy(model, "float32", fold_batch_norms=False)
    raw = {key: np.asarray(value) for key, value in reference(images).items()}
    reload = run_python(
        [
            "-c",
            DETECTOR_RELOAD,
            os.path.join(run_dir, "export"),
            str(root / "images.npy"),
            str(root / "outputs.npz"),
        ]
    )
    assert reload.returncode == 0, reload.stderr[-3000:]
    facts = json.loads(next(line for line in reload.stdout.splitlines() if line.startswith("FACTS "))[6:])
    return {
        "model": model,
        "reports": reports,
        "raw": raw,
        "expected": export_detector.decode(raw, options),
        "facts": facts,
        "outputs": dict(np.load(root / "outputs.npz")),
    }


def test_detector_saved_model_is_float32_images_in_float32_boxes_and_scores_out(detector_exported):
    for precision in ("float32", "bfloat16"):
        facts = detector_exported["facts"][f"{precision}/saved_model"]
        assert facts["input_dtype"] == "float32"
        assert facts["output_dtypes"] == {
            "boxes": "float32",
            "scores": "float32",
            "classes": "int32",
            "valid_detections": "int32",
        }
    report = detector_exported["reports"]["float32"]
    assert report["kind"] == "detector" and report["detector"]["anchor_levels"] == [3, 4, 5]
    assert report["class_names"][:3] == ["circle", "square", "triangle"]  # detection shapes' names
    assert report["compared_with"] == "8 eval images of shapes"
    table = export.format_table(report["artifacts"])
    assert "max |diff logits|" in table and "detection agreement" in table


def test_detector_half_precision_copies_hold_half_variables_except_the_float32_head(detector_exported):
    variables = detector_exported["facts"]["bfloat16/saved_model"]["variables"]
    float32 = [shape for dtype, shape in variables if dtype == "float32"]
    assert {dtype for dtype, _ in variables} == {"bfloat16", "float32"}
    # Only the two output convs (kernel + bias), which the mixed model runs in float32 on purpose.
    assert sorted(shape[-1] for shape in float32) == sorted(
        [9 * 4, 9 * 4, 9 * DETECTOR_CLASSES, 9 * DETECTOR_CLASSES]
    )
    copy = export.inference_copy(detector_exported["model"], "float16", keep_float32_layers=True)
    dtypes = {variable.path: variable.dtype for variable in copy.weights}
    assert sum(dtype == "float16" for dtype in dtypes.values()) == len(dtypes) - 4
    assert all(dtype == "float32" for path, dtype in dtypes.items() if "_output/" in path)
    assert any(
        isinstance(layer, keras.layers.GroupNormalization) and layer.dtype_policy.name == "float16"
        for layer in copy.layers
    )


def test_detector_float32_saved_model_reloads_with_the_keras_detections(detector_exported):
    outputs, expected = detector_exported["outputs"], detector_exported["expected"]
    name = "float32/saved_model"
    assert expected["valid_detections"].sum() > 0
    np.testing.assert_array_equal(outputs[f"{name}/valid_detections"], expected["valid_detections"])
    np.testing.assert_array_equal(outputs[f"{name}/classes"], expected["classes"])
    assert np.abs(outputs[f"{name}/boxes"] - expected["boxes"]).max() <= DETECTOR_BOX_TOLERANCE
    assert np.abs(outputs[f"{name}/scores"] - expected["scores"]).max() <= DETECTOR_SCORE_TOLERANCE
    for key in ("classes", "boxes"):  # the raw_outputs signature
        assert np.abs(outputs[f"{name}/raw_{key}"] - detector_exported["raw"][key]).max() <= 1e-5


def test_detector_bfloat16_saved_model_and_raw_tflite_find_the_same_objects(detector_exported):
    from tfmp.serving import detector as export_detector

    outputs, expected = detector_exported["outputs"], detector_exported["expected"]
    for name, least in (("bfloat16/saved_model", DETECTOR_HALF_AGREEMENT), ("float32/model.tflite", 0.99)):
        found = {key: outputs[f"{name}/{key}"] for key in ("boxes", "scores", "classes", "valid_detections")}
        assert export_detector.agreement(expected, found) >= least, name
    for row in detector_exported["reports"]["bfloat16"]["artifacts"]:
        assert row["detection_agreement"] >= DETECTOR_HALF_AGREEMENT
    # NMS is no TFLite builtin: the .tflite returns raw logits and deltas, built-in ops only.
    ops = detector_exported["facts"]["float32/model.tflite"]["ops"]
    assert not [op for op in ops if op.startswith("Flex") or op == "CUSTOM"], ops
    assert (
        np.abs(outputs["float32/model.tflite/raw_classes"] - detector_exported["raw"]["classes"]).max()
        <= 1e-4
    )


def test_inference_bench_times_every_artifact_and_reports_the_goal_ratios(tmp_path):
    from tfmp.bench import inference as bench_inference

    config = bench_inference.InferenceBenchConfig(
        models=["mnist_mlp"],
        precisions=["bfloat16"],
        formats=["saved_model", "tflite"],
        batch_size=8,
        repeats=2,
        min_repeat_seconds=0.05,
        output_dir=str(tmp_path),
    )
    report = bench_inference.run(config, progress=lambda line: None)
    rows = {(row["format"], row["precision"]) for row in report["rows"]}
    assert rows == {
        ("keras (training model)", "float32"),
        ("saved_model", "float32"),
        ("tflite", "float32"),
        ("saved_model", "bfloat16"),
        ("tflite", "float16 weights"),
    }
    for row in report["rows"]:
        assert row["latency_ms_p50"] <= row["latency_ms_p99"] and row["images_per_sec"] > 0
    ratios = {ratio["ratio"]: ratio["value"] for ratio in report["ratios"]}
    assert ratios["tflite float16-weight / float32 size"] <= 0.52
    assert "saved_model bfloat16 / float32 throughput" in ratios
    assert "| mnist_mlp | saved_model | bfloat16 |" in bench_inference.table(report)
    assert os.listdir(tmp_path) == ["inference_bench.json"]
