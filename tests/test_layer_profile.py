"""apps.bench --layer_profile: its cells planned (pure Python), and one layer profile of
retinanet_tiny (64 px, batch 2, 1 round) run in this process, as the cell process runs it.

Timing is never asserted: only that every layer with weights has a row, both policies were
timed, and the shares and speedups the table prints are well formed.
"""

import json
import math

import pytest

from tfmp.bench import cell as bench_cell
from tfmp.bench import layer_profile, workloads
from tfmp.bench import matrix as bench
from tfmp.bench import report as bench_report
from tfmp.detection import data as detection_data
from tfmp.detection import retinanet
from tfmp.errors import UsageError

DETECTORS = ["retinanet_tiny", "faster_rcnn_tiny"]
ENVIRONMENT = bench.Environment(
    classifiers=["seed_cnn"],
    detectors=DETECTORS,
    policies={"float32": "float32", "auto": "mixed_bfloat16", "mixed_bfloat16": "mixed_bfloat16"},
    gpus=[],
    cpu_fast_bfloat16=True,
    versions={"tensorflow": "2", "keras": "3"},
)


def _config(**changes):
    values = dict(models=["seed_cnn"], precisions=["float32"], layer_profile=DETECTORS, image_size=64)
    values.update(changes)
    return bench.BenchConfig(**values)


def test_layer_profile_plans_one_cell_per_model_outside_the_matrix():
    config = _config(global_batch_size=2)
    bench.validate(config, ENVIRONMENT)
    planned = bench.layer_profile_cells(config)
    assert [cell["model"] for cell in planned] == DETECTORS
    for cell in planned:
        assert cell["kind"] == "layer_profile" and cell["policies"] == ["float32", "mixed_bfloat16"]
        assert (cell["image_size"], cell["global_batch_size"], cell["layer_repeats"]) == (64, 2, 20)
        # The step the layers are compared with: one batch from memory, no XLA, the bench's timing.
        assert cell["data"] == "synthetic" and not cell["xla"] and cell["mode"] == "train"
        assert cell["steps_per_execution"] == config.steps_per_execution
        assert bench.describe_cell(cell) == (
            f"layer profile {cell['model']} float32 vs mixed_bfloat16, 64px, batch 2"
        )
    assert all(cell["kind"] != "layer_profile" for cell in bench.cells(config, ENVIRONMENT))


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(layer_profile=["retinanet_huge"]), "unknown model 'retinanet_huge'"),
        (
            dict(image_size=100),
            "--image_size=100 for retinanet_tiny in --layer_profile must be a multiple of 32",
        ),
        (dict(layer_profile_repeats=0), "--layer_profile_repeats=0 must be >= 1"),
    ],
)
def test_bad_layer_profile_settings_are_one_line_errors(changes, message):
    with pytest.raises(UsageError, match=message) as error:
        bench.validate(_config(**changes), ENVIRONMENT)
    assert "\n" not in str(error.value)


@pytest.mark.slow  # builds, replays and traces the detector's ~90 layer calls in two policies
def test_retinanet_tiny_profile_has_every_layer_both_policies_and_the_step():
    timing = dict(steps_per_execution=1, warmup_executions=1, executions=1, repeats=1, min_repeat_seconds=0)
    config = _config(layer_profile=["retinanet_tiny"], global_batch_size=2, layer_profile_repeats=1, **timing)
    (cell,) = bench.layer_profile_cells(config)
    result = layer_profile.measure(
        cell, workloads.retinanet_setup, bench_cell._time_engine, bench_cell._executions_per_repeat
    )
    json.dumps(result)  # the cell prints it as JSON
    num_classes = detection_data.describe("shapes", image_size=64).num_classes
    model = retinanet.build_detector("retinanet_tiny", 64, num_classes)
    weighted = {layer.name for layer in model.layers if layer.weights}
    assert {row["name"] for row in result["layers"] if row["parameters"]} == weighted
    # A head conv is shared by P3-P5: one row per level, each at its level's shape.
    head = [row for row in result["layers"] if row["name"] == "retinanet_tiny_classes_conv1"]
    assert [row["call"] for row in head] == [0, 1, 2]
    assert sorted(row["input_shapes"] for row in head) == [[[2, 2, 2, 64]], [[2, 4, 4, 64]], [[2, 8, 8, 64]]]
    policies = result["policies"]
    assert policies == ["float32", "mixed_bfloat16"]
    classes = {entry["class"]: entry for entry in result["classes"]}
    assert {"Conv2D", "GroupNormalization", "Activation", "Reshape", "Concatenate"} <= set(classes)
    for entry in result["classes"]:
        assert all(entry["ms"][policy] > 0 for policy in policies), entry
        assert math.isfinite(entry["speedup"]) and entry["speedup"] > 0, entry
    for policy in policies:
        totals = result["totals"][policy]
        # The shares split the model's fwd+bwd over the classes; whether that stays below the
        # step (it must, but both are noisy timings: 1.03 in a real run) is not asserted.
        shares = [entry["share"][policy] for entry in result["classes"]]
        assert all(share > 0 for share in shares)
        assert sum(shares) == pytest.approx(totals["model_ms"] / totals["step_ms"])
        assert totals["step_ms"] > 0 and totals["model_ms"] > 0
        assert totals["outside_model_ms"] == pytest.approx(totals["step_ms"] - totals["model_ms"])
    mixed, float32 = result["totals"]["mixed_bfloat16"], result["totals"]["float32"]
    assert mixed["casts"] > float32["casts"] and mixed["bfloat16_casts"] > 0 and mixed["bfloat16_cast_ms"] > 0
    assert float32["bfloat16_casts"] == 0
    text = bench_report.layer_profile_table(dict(cell, result=result))
    assert "GroupNormalization" in text and "Engine train step" in text and "outside the model" in text
