"""apps.bench end to end in a tiny matrix, its JSON, ratios from its own cells, bad flags."""

import json
import os

import pytest
from conftest import run_python

from tfmp.bench import matrix as bench
from tfmp.bench import report as bench_report
from tfmp.errors import UsageError

pytestmark = pytest.mark.slow  # one process per cell


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    output = tmp_path_factory.mktemp("bench")
    result = run_python(
        [
            "-m",
            "apps.bench",
            "--models=mnist_mlp",
            "--precisions=float32,mixed_bfloat16",
            "--replicas=1,2",
            "--workers=1,2",
            "--data=builtin",
            "--global_batch_size=32",
            "--steps_per_execution=2",
            "--warmup_executions=1",
            "--executions=2",
            "--repeats=2",
            "--min_repeat_seconds=0",
            f"--output_dir={output}",
        ],
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return output, result.stdout, json.load(open(output / "bench.json"))


def test_bench_writes_table_json_and_chart(tiny_report):
    output, stdout, report = tiny_report
    assert "examples/s" in stdout and "tfmp engine / Keras fit" in stdout
    assert "real input / synthetic tensors" in stdout and "matmul peak float32" in stdout
    assert stdout.count("[1/") == 2  # a progress line before and after each cell
    assert os.path.getsize(output / "bench.png") > 1000
    for key in ("config", "date", "hardware", "versions", "cells", "ratios", "seconds"):
        assert key in report
    assert {"cpu", "cpu_cores", "gpus", "cpu_fast_bfloat16"} <= set(report["hardware"])
    assert {"tensorflow", "keras"} <= set(report["versions"])


def test_every_engine_cell_has_every_documented_figure(tiny_report):
    _, _, report = tiny_report
    engine = [c for c in report["cells"] if c["kind"] == "engine" and not c.get("reference")]
    assert len(engine) == 2 * 4  # 2 precisions x (1, 2 replicas + 1, 2 workers)
    for cell in engine:
        result = cell["result"]
        for key in (
            "examples_per_sec",
            "examples_per_sec_min",
            "examples_per_sec_max",
            "examples_per_sec_per_replica",
            "step_time_median",
            "step_time_p90",
            "flops_per_step",
            "flops_per_sec",
            "peak_host_memory_mb",
            "policy",
        ):
            assert result[key] is not None, key
        assert result["examples_per_sec_min"] <= result["examples_per_sec"] <= result["examples_per_sec_max"]
        assert result["step_time_median"] <= result["step_time_p90"]
        assert result["replicas"] == max(cell["replicas"], cell["workers"])
        assert "flops_fraction_of_peak" in cell["derived"]
        if cell["workers"] == 2 or cell["replicas"] == 2:
            assert "scaling_efficiency" in cell["derived"]
        if cell["precision"] != "float32":
            assert "speedup_vs_float32" in cell["derived"]


def test_ratios_are_computed_from_the_measured_cells(tiny_report):
    _, _, report = tiny_report
    cells = report["cells"]

    def find(**match):
        found = [c for c in cells if all(c.get(k) == v for k, v in match.items())]
        assert len(found) == 1, match
        return found[0]["result"]

    one = find(kind="engine", precision="float32", replicas=1, workers=0, data="builtin")
    two = find(kind="engine", precision="float32", replicas=2, workers=0)
    fit = find(kind="fit", precision="float32")
    synthetic = find(kind="engine", precision="float32", reference="input")
    bf16 = find(kind="engine", precision="mixed_bfloat16", replicas=1, workers=0, data="builtin")
    peak = find(kind="peak", precision="float32")
    ratios = report["ratios"]

    def ratio(name, **match):
        return next(r["value"] for r in ratios[name] if all(r[k] == v for k, v in match.items()))

    eps = "examples_per_sec"
    assert ratio("engine_vs_keras_fit", precision="float32") == pytest.approx(one[eps] / fit[eps])
    assert ratio("input_vs_synthetic", precision="float32") == pytest.approx(one[eps] / synthetic[eps])
    assert ratio("speedup_vs_float32", precision="mixed_bfloat16", replicas=1, workers=0) == pytest.approx(
        bf16[eps] / one[eps]
    )
    assert ratio("scaling_efficiency", precision="float32", replicas=2) == pytest.approx(
        two[eps] / (2 * one[eps])
    )
    assert ratio("flops_fraction_of_peak", precision="float32", replicas=1, workers=0) == pytest.approx(
        one["flops_per_sec"] / peak["peak_flops"]
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--models=resnet9"], "unknown model 'resnet9'"),
        (["--precisions=fp8"], "unknown precision 'fp8'"),
        (["--replicas=one"], "--replicas=one must be whole numbers"),
        (["--workers=0"], "--workers value 0 must be >= 1"),
        (["--xla=maybe"], "--xla value 'maybe' must be off or on"),
        (["--mode=serve"], "unknown mode 'serve'"),
        (["--data=imagenet"], "unknown bench data 'imagenet'"),
    ],
)
def test_bad_matrix_flags_are_one_line_errors(tmp_path, args, message):
    result = run_python(["-m", "apps.bench", *args, f"--output_dir={tmp_path / 'out'}"], timeout=120)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr[-1000:]
    assert not (tmp_path / "out").exists()


def test_validate_refuses_empty_matrix():
    with pytest.raises(UsageError, match="--replicas and/or --workers"):
        bench.check(bench.BenchConfig(models=["lenet"], precisions=["float32"], replicas=[], workers=[]))


def test_derive_on_hand_made_cells():
    def cell(**values):
        base = dict(
            kind="engine",
            model="m",
            precision="float32",
            xla=False,
            mode="train",
            data="builtin",
            replicas=1,
            workers=0,
        )
        base.update(values)
        return base

    def result(eps, policy="float32", flops=1e9):
        return {"examples_per_sec": eps, "flops_per_sec": flops, "policy": policy}

    cells = [
        {"kind": "peak", "precision": "float32", "result": {"peak_flops": 4e9}},
        dict(cell(), result=result(100.0)),
        dict(cell(replicas=2), result=result(180.0)),
        dict(cell(precision="auto"), result=result(150.0, policy="float32")),
        dict(cell(kind="fit"), result=result(80.0)),
        dict(cell(data="synthetic", reference="input"), result=result(125.0)),
    ]
    ratios = bench_report.derive(cells)
    assert ratios["scaling_efficiency"][0]["value"] == pytest.approx(0.9)
    assert ratios["speedup_vs_float32"][0]["value"] == pytest.approx(1.5)
    assert ratios["engine_vs_keras_fit"][0]["value"] == pytest.approx(1.25)
    assert ratios["input_vs_synthetic"][0]["value"] == pytest.approx(0.8)
    assert ratios["flops_fraction_of_peak"][0]["value"] == pytest.approx(0.25)
