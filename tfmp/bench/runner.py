"""Runs a benchmark matrix: plans the cells, measures each in a fresh process, writes the report.

    from tfmp.bench import matrix, runner
    report = runner.run(matrix.BenchConfig(models=["resnet20"], precisions=["float32", "auto"],
                                           output_dir="/tmp/bench"))

Every cell runs as `python -m tfmp.bench.cell '<json>'` (multi-worker cells through
`tfmp.launch`, one CPU core or GPU share per worker), warm-up excluded, `repeats` timed repeats
reported as median and min-max spread; ratios come only from cells measured in the same run
(`tfmp.bench.report`), and the engine and fit cells of each model are timed in interleaved
rounds, one repeat of each in turn (`tfmp.bench.rounds`), so every ratio between them is the
median of per-round ratios. Writes `bench.json`, `bench.png` and returns the report.
`run_layer_profile(config)` runs only the `layer_profile` cells (`matrix.layer_profile_cells`)
and writes `layer_profile.json`: the date, config, hardware, versions, load averages and cells.
`run_memory_search(config)` (`mode="memory"`) runs only `tfmp.bench.memory`'s searches, the
largest batch under `memory_budget_mb` per model and precision, and writes their `bench.json`.

This parent process never imports TensorFlow. A TensorFlow runtime here would hold threads,
host memory and (on a GPU host) a CUDA context on every GPU while the cells run: it would
compete with the cells for the cores and take device memory they measure. What only
TensorFlow knows (model names, what "auto" resolves to on this hardware, the GPUs, versions)
is asked of a fresh cell process first (`{"kind": "environment"}`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys
import time

from tfmp import run_dir
from tfmp.bench import engine_vs_fit, matrix, memory, onednn, rounds, schema
from tfmp.bench import report as bench_report
from tfmp.distribute.workers import dies_with_this_process

MEMORY_NOTE = (
    "peak_memory_mb: TensorFlow's allocator peak of live tensors during the timed steps "
    "(tf.config.experimental.get_memory_info 'peak' after reset_memory_stats at the end of the "
    "warm-up): the largest GPU of the cell, or the CPU allocator, which logical CPU replicas share. "
    "peak_host_memory_mb: the process's peak resident memory (getrusage ru_maxrss), which also "
    "counts the TensorFlow runtime, Python and freed pages malloc keeps; host_memory_before_model_mb "
    "is its base. Multi-worker cells report worker 0."
)


def _command(cell: dict, startup_timeout: float = 120) -> list[str]:
    runner = [sys.executable, "-m", "tfmp.bench.cell", json.dumps(cell)]
    if cell.get("workers"):
        return [
            sys.executable,
            "-m",
            "tfmp.launch",
            f"--workers={cell['workers']}",
            "--devices_per_worker=1",
            f"--startup_timeout={startup_timeout:g}",
            "--",
            *runner,
        ]
    return runner


# The live peak is TensorFlow's CPU allocator's statistic. With oneDNN on (TensorFlow's default on
# CPUs with AVX512-VNNI/BF16 or AMX) that allocator is a BFC allocator that keeps it; with oneDNN
# off (an AVX2-only CPU) the plain allocator keeps none ("Allocator stats not available for
# device 'CPU:0'") unless TensorFlow is told to use its BFC allocator for CPU memory too.
_ALLOCATOR_STATS = {"TF_CPU_ALLOCATOR_USE_BFC": os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "true")}


def _environment() -> dict:
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **_ALLOCATOR_STATS)


def measure(cell: dict, timeout: float) -> dict:
    """Runs one cell in a fresh process; returns its result (worker 0's for a group). An
    `onednn_study` cell runs with oneDNN's verbose lines on and gets its breakdown from them."""
    study = cell["kind"] == "onednn_study"
    completed = subprocess.run(
        _command(cell),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(_environment(), **(onednn.ENVIRONMENT if study else {})),
        preexec_fn=dies_with_this_process(),  # a SIGKILLed bench leaves no cell behind
    )
    result = parse_result(completed.stdout)
    if study and result is not None:
        steps = onednn.breakdown(completed.stdout, cell["steps"], result["step_seconds"], result["window_ms"])
        result = {"policy": result["policy"], **steps}
    if result is None:
        tail = (completed.stderr or completed.stdout).strip().splitlines()[-5:]
        raise RuntimeError(
            f"bench cell '{matrix.describe_cell(cell)}' failed (exit {completed.returncode}): "
            + " | ".join(tail)
        )
    return result


def parse_result(stdout: str) -> dict | None:
    """The cell's result line (worker 0's, `tfmp.launch` prefixes each worker's lines), or None."""
    for line in stdout.splitlines():
        line = line.split("] ", 1)[1] if line.startswith("[worker 0] ") else line
        if line.startswith(matrix.RESULT_PREFIX):
            return json.loads(line[len(matrix.RESULT_PREFIX) :])
    return None


def environment(timeout: float = 600) -> matrix.Environment:
    """Model names, precision policies, GPUs and versions, from a fresh cell process."""
    return matrix.Environment(**measure({"kind": "environment"}, timeout))


def _headline(result: dict) -> str:
    """The one figure a progress line shows for a cell's result."""
    if "fit_examples_per_sec" in result:  # engine vs Keras fit in one process
        return engine_vs_fit.headline(result)
    if "examples_per_sec" in result:
        headline = f"{result['examples_per_sec']:,.1f} examples/s"
        paired = result.get("paired_input")  # a detector's reference cell: the real input in turn
        if paired:
            headline += f", real input {paired['real_examples_per_sec']:,.1f} ({paired['value']:.3f})"
        return headline
    if "peak_flops" in result:
        return f"{result['peak_flops'] / 1e9:,.1f} GFLOP/s"
    if "classes" in result:  # a layer profile
        first, last = result["policies"][0], result["policies"][-1]
        totals = result["totals"]
        return (
            f"model fwd+bwd {totals[first]['model_ms']:.1f} / {totals[last]['model_ms']:.1f} ms of a step of "
            f"{totals[first]['step_ms']:.1f} / {totals[last]['step_ms']:.1f} ms ({first} / {last})"
        )
    if "fused_ms" in result:  # the BatchNormalization study
        return (
            f"Keras {result['keras_ms']:.2f} ms, fused {result['fused_ms']:.2f} ms ({result['value']:.2f}x)"
        )
    if "onednn_ms" in result:  # the oneDNN study
        if not result["onednn"]:
            return result["note"]
        flagged = (
            f", reference kernels: {', '.join(result['reference_kernels'])}"
            if result["reference_kernels"]
            else ""
        )
        return f"step {result['step_ms']:.1f} ms, oneDNN {result['onednn_ms']:.1f} ms{flagged}"
    if "choices" in result:  # the precision probe
        speeds = ", ".join(f"{dtype} {speed:.2f}x" for dtype, speed in result["speedups"].items())
        return f"{speeds} float32's speed"
    if "ratios" in result:  # an input cost
        return ", ".join(f"{name} {value:.2f}" for name, value in result["ratios"].items())
    if "rows" in result:
        return (
            "pipeline rows "
            + ", ".join(f"{row['relative']:.2f}x" for row in result["rows"][1:])
            + " of unsplit"
        )
    seconds = result["python_seconds"]
    return (
        f"pure Python 2 threads {seconds['one_thread'] / seconds['two_threads']:.2f}x, "
        f"2 processes {seconds['one_thread'] / seconds['two_processes']:.2f}x of 1 thread"
    )


def load_average() -> list[float] | None:
    """1/5/15-minute load averages: how busy the (shared) machine was around the run."""
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return None


def hardware() -> dict:
    info = {
        "machine": platform.machine(),
        "cpu_cores": os.cpu_count(),
        "python": platform.python_version(),
        "cpu": platform.processor(),
    }
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            info["cpu"] = next(
                line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")
            )
        with open("/proc/meminfo", encoding="utf-8") as meminfo:
            info["memory_gb"] = round(int(meminfo.readline().split()[1]) / 2**20, 1)
    except (OSError, StopIteration):
        pass
    return info


def _measure_all(planned: list[dict], timeout: float, progress, detectors=()) -> None:
    """Measures each planned cell, writing its result and the load average after it: the
    engine and fit cells of each model in interleaved rounds (`tfmp.bench.rounds`: each such
    cell's "round_group" names its group, null for a cell timed alone), the rest in turn."""
    started = time.time()
    groups = rounds.groups(planned, detectors)
    grouped = {id(cell): number for number, group in enumerate(groups) for cell in group}
    for cell in planned:
        if cell["kind"] in ("engine", "fit"):
            cell["round_group"] = grouped.get(id(cell))
    measured = set()
    for index, cell in enumerate(planned, 1):
        if id(cell) in measured:
            continue
        if id(cell) in grouped:
            group = groups[grouped[id(cell)]]
            progress(f"[{index}/{len(planned)}] {len(group)} {cell['model']} cells in interleaved rounds ...")
            results = rounds.measure(
                group, _command, _environment(), timeout, progress, parse_result, matrix.describe_cell
            )
            for member, result in zip(group, results):
                member["result"], member["load_average"] = result, load_average()
                measured.add(id(member))
                progress(f"  {matrix.describe_cell(member)}: {_headline(result)}")
            progress(f"  ({time.time() - started:.0f} s so far)")
            continue
        progress(f"[{index}/{len(planned)}] {matrix.describe_cell(cell)} ...")
        cell["result"] = measure(cell, timeout)
        cell["load_average"] = load_average()  # the machine may be shared: how busy it was around this cell
        progress(
            f"[{index}/{len(planned)}] {matrix.describe_cell(cell)}: {_headline(cell['result'])} "
            f"({time.time() - started:.0f} s so far)"
        )


def _report_header(config: matrix.BenchConfig, found, started: float, load_before) -> dict:
    """What every bench.json opens with: schema, config, date, hardware, versions, time, load."""
    return {
        "schema_version": schema.SCHEMA_VERSION,
        "config": dataclasses.asdict(config),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "hardware": dict(hardware(), gpus=found.gpus, cpu_fast_bfloat16=found.cpu_fast_bfloat16),
        "versions": found.versions,
        "seconds": round(time.time() - started, 1),
        "load_average": {"before": load_before, "after": load_average()},
    }


def run(config: matrix.BenchConfig, progress=print) -> dict:
    """Measures every cell, derives the ratios, writes bench.json and bench.png
    (`mode="memory"`: `run_memory_search`)."""
    if config.mode == "memory":
        return run_memory_search(config, progress)
    matrix.check(config)  # before the environment process: plain mistakes fail at once
    found = environment(config.cell_timeout)
    matrix.check_names(config, found)
    planned = matrix.cells(config, found)
    os.makedirs(config.output_dir, exist_ok=True)
    started, load_before = time.time(), load_average()
    _measure_all(planned, config.cell_timeout, progress, found.detectors)
    report = {
        **_report_header(config, found, started, load_before),
        "cells": planned,
        "peak_method": next(c["result"]["method"] for c in planned if c["kind"] == "peak"),
        "memory_note": MEMORY_NOTE,
    }
    report["ratios"] = bench_report.derive(planned)
    schema.check(report)  # the file always has exactly the documented fields (docs/bench.md)
    run_dir.write_text_atomic(os.path.join(config.output_dir, "bench.json"), json.dumps(report, indent=2))
    report["chart"] = bench_report.chart(planned, os.path.join(config.output_dir, "bench.png"))
    return report


def run_layer_profile(config: matrix.BenchConfig, progress=print) -> dict:
    """Profiles the layers of each model of `config.layer_profile` (one fresh process each),
    writes layer_profile.json into `config.output_dir` and returns the report."""
    matrix.check(config)
    found = environment(config.cell_timeout)
    matrix.check_names(config, found)
    planned = matrix.layer_profile_cells(config)
    os.makedirs(config.output_dir, exist_ok=True)
    started, load_before = time.time(), load_average()
    _measure_all(planned, config.cell_timeout, progress)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "seconds": round(time.time() - started, 1),
        "config": dataclasses.asdict(config),
        "hardware": dict(hardware(), gpus=found.gpus, cpu_fast_bfloat16=found.cpu_fast_bfloat16),
        "versions": found.versions,
        "load_average": {"before": load_before, "after": load_average()},
        "cells": planned,
    }
    run_dir.write_text_atomic(
        os.path.join(config.output_dir, "layer_profile.json"), json.dumps(report, indent=2)
    )
    return report


def _measure_search_cell(cell: dict, timeout: float) -> dict:
    """One cell of a memory search: the cell with its result (None when it ran out of device
    memory: that batch does not fit) and the load average after it."""
    try:
        result = measure(cell, timeout)
    except RuntimeError as error:
        if "ResourceExhausted" not in str(error) and "OOM" not in str(error):
            raise
        result = None
    return dict(cell, result=result, load_average=load_average())


def run_memory_search(config: matrix.BenchConfig, progress=print) -> dict:
    """mode="memory": each setting's largest batch under the budget (`tfmp.bench.memory`);
    writes bench.json only when every search is done (a refused budget writes nothing)."""
    matrix.check(config)
    memory.check(config)
    found = environment(config.cell_timeout)
    matrix.check_names(config, found)
    settings = memory.settings(config, found)
    started, load_before = time.time(), load_average()
    searches = []
    for index, setting in enumerate(settings, 1):
        progress(
            f"[search {index}/{len(settings)}] {matrix.describe_cell(dict(setting, global_batch_size='N'))}"
        )
        searches.append(
            memory.search(
                setting,
                config.memory_budget_mb,
                config.memory_probe_batches,
                config.memory_batch_step,
                lambda cell: _measure_search_cell(cell, config.cell_timeout),
                progress,
            )
        )
    report = {
        **_report_header(config, found, started, load_before),
        "memory_note": MEMORY_NOTE,
        "budget_mb": config.memory_budget_mb,
        "searches": searches,
        "ratios": memory.ratios(searches),
    }
    schema.check(report)
    os.makedirs(config.output_dir, exist_ok=True)
    run_dir.write_text_atomic(os.path.join(config.output_dir, "bench.json"), json.dumps(report, indent=2))
    return report
