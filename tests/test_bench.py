"""apps.bench: bench.json's schema from a tiny real run, ratios from hand-made cells, the matmul
peak as the best of its sizes, peak memory, a parent that never imports TensorFlow, bad flags.

Timing is never asserted: only that every documented field is there, typed, and that every
ratio divides the cells it names.
"""

import ast
import copy
import dataclasses
import importlib.util
import json
import os
import pathlib
import signal
import statistics
import time

import pytest
from conftest import ROOT, finish, run_python, start_python, workers_of

from tfmp.bench import cell as bench_cell
from tfmp.bench import matrix as bench
from tfmp.bench import peak as bench_peak
from tfmp.bench import report as bench_report
from tfmp.bench import runner as bench_runner
from tfmp.bench import schema
from tfmp.distribute import allreduce
from tfmp.errors import UsageError

ENVIRONMENT = bench.Environment(
    classifiers=["mnist_mlp", "lenet"],
    detectors=["retinanet_tiny"],
    policies={"float32": "float32", "auto": "mixed_bfloat16", "mixed_bfloat16": "mixed_bfloat16"},
    gpus=[],
    cpu_fast_bfloat16=True,
    versions={"tensorflow": "2", "keras": "3"},
)


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    """The smallest run with every engine ratio: 2 precisions x 1, 2 replicas, tiny peaks."""
    output = tmp_path_factory.mktemp("bench")
    result = run_python(
        [
            "-m",
            "apps.bench",
            "--models=mnist_mlp",
            "--precisions=float32,mixed_bfloat16",
            "--replicas=1,2",
            "--allreduce_dtypes=float32,bfloat16",
            # Smaller than mnist_mlp's gradients: the 2-replica cells sum in several calls.
            "--allreduce_bucket_bytes=65536",
            "--noreferences",
            "--global_batch_size=16",
            "--steps_per_execution=2",
            "--warmup_executions=1",
            "--executions=1",
            "--repeats=2",
            "--min_repeat_seconds=0",
            "--peak_sizes=32,64",
            "--peak_repeats=2",
            "--peak_min_call_seconds=0.01",
            f"--output_dir={output}",
        ],
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return output, result.stdout, json.load(open(output / "bench.json"))


@pytest.mark.slow  # one process per cell
def test_bench_json_has_the_documented_schema_and_table(tiny_report):
    output, stdout, report = tiny_report
    schema.check(report)  # every documented field, typed; nothing undocumented
    assert report["schema_version"] == schema.SCHEMA_VERSION
    assert {"tensorflow", "keras"} <= set(report["versions"])
    assert (output / "bench.png").stat().st_size > 1000
    assert stdout.count("[1/") == 2  # a progress line before and after each cell
    assert "peak method: best of square matmuls 32/64 x 2 timed calls of >= 0.01 s" in stdout
    assert "live peak memory mixed_bfloat16 / float32: mnist_mlp batch 16" in stdout
    assert "\nprecision probe (matmul" in stdout and "\n  would choose: --mixed: " in stdout
    engine = [c for c in report["cells"] if c["kind"] == "engine"]
    assert len(engine) == 6  # 2 precisions x (1 replica, 2 replicas x 2 all-reduce dtypes)
    for cell in engine:
        result = cell["result"]
        assert result["examples_per_sec_min"] <= result["examples_per_sec"] <= result["examples_per_sec_max"]
        assert result["step_time_median"] <= result["step_time_p90"]
        assert result["replicas"] == cell["replicas"]
        assert result["peak_memory_source"] == "cpu" and result["peak_gpu_memory_mb"] == []
        assert result["peak_host_memory_mb"] >= result["host_memory_before_model_mb"] > 0
        # The allocator's live peak holds at least the float32 weights and Adam's two slots per
        # weight (mnist_mlp: 407,050 parameters), and is part of the process's resident memory.
        assert 3 * 4 * 407_050 / 2**20 < result["peak_memory_mb"] < result["peak_host_memory_mb"]
        assert len(cell["load_average"]) == 3


@pytest.mark.slow
def test_every_ratio_of_the_run_divides_its_named_cells(tiny_report):
    _, _, report = tiny_report

    def cell(kind, **match):
        found = [c for c in report["cells"] if c["kind"] == kind and all(c[k] == v for k, v in match.items())]
        assert len(found) == 1, match
        return found[0]["result"]

    one, two = (
        cell("engine", precision="float32", replicas=1),
        cell("engine", precision="float32", replicas=2, allreduce_dtype="float32"),
    )
    two_bfloat16 = cell("engine", precision="float32", replicas=2, allreduce_dtype="bfloat16")
    half = cell("engine", precision="mixed_bfloat16", replicas=1)
    peak = cell("peak", precision="float32")
    ratios = {
        name: {(row["precision"], row["replicas"]): row["value"] for row in report["ratios"][name]}
        for name in ("speedup_vs_float32", "flops_fraction_of_peak", "peak_memory_vs_float32")
    }
    scaling = {
        (row["precision"], row["allreduce_dtype"]): row for row in report["ratios"]["scaling_efficiency"]
    }
    # All engine cells of the model were timed in the same interleaved rounds (one repeat each
    # per round): a ratio is the median of its per-round ratios.
    assert len({c["round_group"] for c in report["cells"] if c["kind"] == "engine"} - {None}) == 1

    def per_round(cell, reference, factor=1):
        mine, theirs = cell["examples_per_sec_repeats"], reference["examples_per_sec_repeats"]
        assert len(mine) == len(theirs) == 2
        return statistics.median(a / (factor * b) for a, b in zip(mine, theirs))

    assert scaling[("float32", "float32")]["value"] == pytest.approx(per_round(two, one, 2))
    assert scaling[("float32", "bfloat16")]["value"] == pytest.approx(per_round(two_bfloat16, one, 2))
    assert len(scaling[("float32", "float32")]["rounds"]) == 2
    # A bfloat16 sum sends half a float32 one's bytes; both sums were timed on their own.
    assert two_bfloat16["gradient_bytes_per_step"] * 2 == two["gradient_bytes_per_step"] > 0
    assert one["gradient_bytes_per_step"] == 0 and one["collective_seconds_per_step"] is None
    # 64 KiB buckets: the head's small gradients, then the first layer's kernel alone (larger
    # than a bucket); a bfloat16 sum needs no more calls than float32's.
    assert two["allreduce_bucket_bytes"] == two_bfloat16["allreduce_bucket_bytes"] == 65536
    assert two["allreduce_buckets"] >= two_bfloat16["allreduce_buckets"] >= 2
    assert one["allreduce_buckets"] == 0 and one["allreduce_bucket_bytes"] is None
    for row in scaling.values():
        assert row["collective_seconds_per_step"] > 0 and row["collective_share"] > 0
    assert ratios["speedup_vs_float32"][("mixed_bfloat16", 1)] == pytest.approx(per_round(half, one))
    assert ratios["flops_fraction_of_peak"][("float32", 1)] == pytest.approx(
        one["flops_per_sec"] / peak["peak_flops"]
    )
    assert ratios["peak_memory_vs_float32"][("mixed_bfloat16", 1)] == pytest.approx(
        half["peak_memory_mb"] / one["peak_memory_mb"]
    )
    # The peak is the best of every size and repeat, and says how it was measured.
    assert [row["size"] for row in peak["sizes"]] == [32, 64]
    assert peak["peak_flops"] == max(flops for row in peak["sizes"] for flops in row["flops"])
    assert all(len(row["flops"]) == 2 for row in peak["sizes"])
    assert report["peak_method"] == peak["method"]


def test_peak_is_the_best_of_its_sizes_and_repeats():
    result = bench_peak.measure("float32", sizes=(16, 48), repeats=2, min_call_seconds=0.01)
    assert [row["size"] for row in result["sizes"]] == [16, 48]
    best = max(result["sizes"], key=lambda row: row["best_flops"])
    assert result["peak_flops"] == best["best_flops"] == max(best["flops"])
    assert result["matmul_size"] == best["size"] and result["dtype"] == "float32"
    assert "16/48 x 2 timed calls of >= 0.01 s" in result["method"]


def test_one_peak_cell_per_policy_with_the_configured_method():
    config = bench.BenchConfig(
        models=["lenet"], precisions=["float32", "auto", "mixed_bfloat16"], peak_sizes=[8, 16]
    )
    peaks = [cell for cell in bench.cells(config, ENVIRONMENT) if cell["kind"] == "peak"]
    assert peaks == [
        {"kind": "peak", "precision": policy, "sizes": [8, 16], "repeats": 3, "min_call_seconds": 0.5}
        for policy in ("float32", "mixed_bfloat16")  # auto is mixed_bfloat16 here: measured once
    ]


def _engine_result(eps, policy="float32", flops=1e9, memory=100.0, host=1000.0, before=600.0):
    return {
        "examples_per_sec": eps,
        "flops_per_sec": flops,
        "policy": policy,
        "peak_memory_mb": memory,
        "peak_memory_source": "cpu",
        "peak_host_memory_mb": host,
        "host_memory_before_model_mb": before,
    }


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
            global_batch_size=64,
        )
        base.update(values)
        return base

    cells = [
        {"kind": "peak", "precision": "float32", "result": {"peak_flops": 4e9}},
        dict(cell(), result=_engine_result(100.0)),
        dict(cell(replicas=2), result=_engine_result(180.0)),
        dict(cell(precision="auto"), result=_engine_result(150.0, memory=60.0, host=800.0)),
        dict(cell(kind="fit"), result=_engine_result(80.0)),
        dict(cell(data="synthetic", reference="input"), result=_engine_result(125.0)),
    ]
    ratios = bench_report.derive(cells)
    assert ratios["scaling_efficiency"][0]["value"] == pytest.approx(0.9)
    assert ratios["speedup_vs_float32"][0]["value"] == pytest.approx(1.5)
    assert ratios["engine_vs_keras_fit"][0]["value"] == pytest.approx(1.25)
    assert ratios["input_vs_synthetic"][0]["value"] == pytest.approx(0.8)
    assert ratios["input_vs_synthetic"][0]["paired"] is False  # two cells, two processes
    assert ratios["flops_fraction_of_peak"][0]["value"] == pytest.approx(0.25)
    assert ratios["peak_memory_vs_float32"][0]["value"] == pytest.approx(0.6)
    assert ratios["host_memory_vs_float32"][0]["value"] == pytest.approx(200 / 400)
    assert set(ratios) == set(schema.RATIOS)


def test_a_paired_reference_cell_gives_the_input_ratio_it_timed_in_turn():
    """A detector's reference cell times the real pipeline in turn with the synthetic one
    (`paired_input`); its ratio, not the one across two processes, is the row's value."""
    main = dict(kind="engine", model="d", precision="float32", xla=False, mode="train", data="builtin")
    main.update(replicas=1, workers=0, global_batch_size=16, result=_engine_result(70.0))
    paired = {"real_examples_per_sec": 95.0, "ratios": [0.93, 0.95, 0.97], "value": 0.95}
    reference = dict(
        main, data="synthetic", reference="input", result=dict(_engine_result(100.0), paired_input=paired)
    )
    (row,) = bench_report.derive([main, reference])["input_vs_synthetic"]
    assert row["value"] == 0.95 and row["paired"] is True


def test_schema_check_names_the_missing_or_mistyped_field():
    report = {
        "schema_version": schema.SCHEMA_VERSION,
        "date": "today",
        "seconds": 1.0,
        "config": {},
        "hardware": dict.fromkeys(schema.HARDWARE, "x")
        | {"cpu_cores": 2, "gpus": [], "cpu_fast_bfloat16": True},
        "versions": {},
        "load_average": {"before": None, "after": None},
        "peak_method": "best of",
        "memory_note": "rss",
        "cells": [],
        "ratios": {name: [] for name in schema.RATIOS},
    }
    schema.check(report)
    broken = copy.deepcopy(report)
    del broken["ratios"]["peak_memory_vs_float32"]
    with pytest.raises(schema.SchemaError, match="peak_memory_vs_float32"):
        schema.check(broken)
    broken = copy.deepcopy(report)
    broken["cells"] = [{"kind": "peak", "load_average": None, "result": {"peak_flops": "fast"}}]
    with pytest.raises(schema.SchemaError, match="result: missing"):
        schema.check(broken)


def test_worker_zero_result_line_is_found():
    line = bench.RESULT_PREFIX + json.dumps({"examples_per_sec": 5.0})
    assert bench_runner.parse_result(f"noise\n[worker 1] {line[:-3]}\n[worker 0] {line}\n") == {
        "examples_per_sec": 5.0
    }
    assert bench_runner.parse_result("Traceback ...") is None


def test_parent_side_never_imports_tensorflow():
    code = (
        "import sys, apps.bench, tfmp.bench.runner; "
        "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))"
    )
    result = run_python(["-c", code], timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr[-2000:]


def test_no_bench_module_imports_one_that_imports_it_back():
    """Import graph of tfmp.bench from the source: no cycles, and no import inside a function
    except apps.bench's (which says why)."""
    folder = pathlib.Path(ROOT, "tfmp", "bench")
    graph = {}
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        graph[path.stem] = {
            alias.name if node.module == "tfmp.bench" else node.module.rsplit(".", 1)[1]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tfmp.bench")
            for alias in node.names
        }
        for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            nested = [n for n in ast.walk(function) if isinstance(n, (ast.Import, ast.ImportFrom))]
            assert not nested, f"tfmp/bench/{path.name}: import inside {function.name}"

    def reachable(start):
        seen, stack = set(), [start]
        while stack:
            for module in graph.get(stack.pop(), ()):
                if module not in seen:
                    seen.add(module)
                    stack.append(module)
        return seen

    assert [name for name in graph if name in reachable(name)] == []


@pytest.mark.parametrize(
    "args, message",
    [
        (["--replicas=one"], "--replicas=one must be whole numbers"),  # the app's flag parsing
        (["--xla=maybe"], "--xla value 'maybe' must be off or on"),
        (["--peak_sizes=0"], "--peak_sizes=[0] needs matrix sizes >= 1"),  # the matrix's checks
    ],
)
def test_bad_matrix_flags_are_one_line_errors(tmp_path, args, message):
    result = run_python(["-m", "apps.bench", *args, f"--output_dir={tmp_path / 'out'}"], timeout=120)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr[-1000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # asks a fresh TensorFlow process for the model names first
def test_unknown_model_is_a_one_line_error_after_the_environment_cell(tmp_path):
    result = run_python(["-m", "apps.bench", "--models=resnet9", f"--output_dir={tmp_path / 'out'}"])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-1000:]
    assert "unknown model 'resnet9'; choose one of:" in errors[0] and "retinanet_tiny" in errors[0]
    assert not (tmp_path / "out").exists()


def _first_cell(process, timeout=60):
    """The pid of the first cell process `process` (apps.bench) started, once it runs the cell's
    program (a child caught between fork and exec is still the bench's own code)."""
    deadline = time.time() + timeout
    while time.time() < deadline and process.poll() is None:
        for child in workers_of(process):
            try:
                with open(f"/proc/{child}/cmdline", "rb") as cmdline:
                    if b"tfmp.bench.cell" in cmdline.read():
                        return child
            except FileNotFoundError:
                pass
        time.sleep(0.05)
    pytest.fail(f"apps.bench started no cell process (exit {process.poll()})")


def _gone(pid, timeout=30) -> bool:
    """Whether process `pid` ended within `timeout` seconds (a zombie counts as ended)."""
    deadline = time.time() + timeout
    while True:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        if time.time() >= deadline:
            return False
        time.sleep(0.05)


@pytest.mark.slow  # two bench parents, each killed while its first cell process starts TensorFlow
def test_a_stopped_or_killed_bench_leaves_no_cell_process_running(tmp_path):
    """SIGTERM: one `interrupted:` line, exit 143, its cell stopped, nothing written; SIGKILL
    (no handler can run): the kernel ends the cell with it (PR_SET_PDEATHSIG). The cell is
    frozen (SIGSTOP) first, so it cannot end by finishing its own work: only a kill ends it."""
    for stop in (signal.SIGTERM, signal.SIGKILL):
        output = tmp_path / stop.name
        bench_process = start_python(["-m", "apps.bench", "--models=mnist_mlp", f"--output_dir={output}"])
        cell = _first_cell(bench_process)
        os.kill(cell, signal.SIGSTOP)
        os.kill(bench_process.pid, stop)
        result = finish(bench_process, timeout=60)
        try:
            assert _gone(cell), f"the cell {cell} outlived apps.bench after {stop.name}"
        finally:
            if not _gone(cell, timeout=0):
                os.kill(cell, signal.SIGKILL)
        assert not (output / "bench.json").exists()
        if stop == signal.SIGTERM:
            assert result.returncode == 143 and "Traceback" not in result.stderr, result.stderr[-2000:]
            assert (
                result.stderr.strip()
                .splitlines()[-1]
                .startswith("interrupted: SIGTERM stopped the bench and its running cells")
            ), result.stderr[-2000:]


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(replicas=[], workers=[]), "--replicas and/or --workers"),
        (dict(workers=[0]), "--workers value 0 must be >= 1"),
        (dict(allreduce_dtypes=["half"]), "unknown --allreduce_dtypes value 'half'"),
        (dict(allreduce_bucket_bytes=[0, -1]), r"--allreduce_bucket_bytes=\[0, -1\] needs sizes >= 0"),
        (dict(mode="serve"), "unknown mode 'serve'"),
        (dict(data="imagenet"), "unknown bench data 'imagenet'"),
        (dict(peak_repeats=0), "--peak_repeats=0 must be >= 1"),
        (dict(precisions=["fp8"]), "unknown precision 'fp8'"),
        (dict(models=["resnet9"]), "unknown model 'resnet9'"),
    ],
)
def test_validate_refuses_bad_matrices(changes, message):
    config = bench.BenchConfig(**dict(dict(models=["lenet"], precisions=["float32"]), **changes))
    with pytest.raises(UsageError, match=message):
        bench.validate(config, ENVIRONMENT)


def test_a_bench_model_without_its_package_is_a_one_line_refusal(monkeypatch):
    """hub_vit without keras-hub installed: refused before any cell runs, naming what to install."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "keras_hub" else real_find_spec(name, *args),
    )
    environment = dataclasses.replace(ENVIRONMENT, keras_models=["hub_vit"])
    config = bench.BenchConfig(models=["hub_vit"], precisions=["float32"])
    with pytest.raises(UsageError, match=r"model 'hub_vit' needs keras_hub, .*pip install 'keras-hub>=0.32"):
        bench.validate(config, environment)


def test_precision_probe_cell_prints_beside_the_peaks():
    """The probe --mixed and --precision=auto choose by, measured in a cell of its own (about a
    second): its table and both choices follow the matmul peaks. Which precision is faster is
    this host's business: only the form is checked."""
    probe_cell = {"kind": "precision_probe"}
    assert probe_cell in bench.cells(bench.BenchConfig(models=["lenet"], precisions=["float32"]), ENVIRONMENT)
    probe_cell["result"] = bench_cell.precision_probe()
    schema._fields("probe.result", probe_cell["result"], schema.PRECISION_PROBE_RESULT, exact=True)
    assert bench_runner._headline(probe_cell["result"]).startswith("bfloat16 ")
    lines = bench_report.peak_lines([probe_cell])
    assert lines[0].startswith("precision probe (matmul 256x512") and lines[-3].startswith("  vs float32")
    assert lines[-2].startswith("  would choose: auto: ")
    assert lines[-1].startswith("  would choose: --mixed: ")


def test_the_bench_names_the_all_reduce_dtypes_tfmp_has():
    """matrix.py spells them out (its process must not import TensorFlow): they must agree."""
    assert bench.ALLREDUCE_DTYPES == allreduce.DTYPES
    assert bench.DEFAULT_BUCKET_BYTES == allreduce.DEFAULT_BUCKET_BYTES


def test_multi_device_cells_are_one_per_all_reduce_dtype_and_bucket_size():
    config = bench.BenchConfig(
        models=["lenet"],
        precisions=["float32"],
        replicas=[1, 2],
        workers=[2],
        allreduce_dtypes=["float32", "bfloat16"],
        allreduce_bucket_bytes=[0, 4096],
        references=False,
    )
    engine = [c for c in bench.cells(config, ENVIRONMENT) if c["kind"] == "engine"]
    summed = {
        (c["replicas"], c["workers"], c["allreduce_dtype"], c["allreduce_bucket_bytes"]) for c in engine
    }
    assert summed == {(1, 0, None, None)} | {
        (replicas, workers, dtype, size)
        for replicas, workers in ((2, 0), (1, 2))
        for dtype in ("float32", "bfloat16")
        for size in (0, 4096)
    }
    assert len(engine) == 9
