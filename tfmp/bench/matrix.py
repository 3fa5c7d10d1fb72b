"""Benchmark matrices: throughput, mixed-vs-float32 speedup, scaling, engine and input overhead.

    from tfmp.bench import matrix as bench
    report = bench.run(bench.BenchConfig(models=["resnet20"], precisions=["float32", "auto"],
                                         output_dir="/tmp/bench"))

Every cell runs in a fresh process (`tfmp.bench.cell`; multi-worker cells through
`tfmp.launch`, one CPU core or GPU share per worker), warm-up excluded, `repeats` timed
repeats reported as median and min-max spread. Side by side in the same run: the matmul peak
per precision, the same model under plain Keras `fit` (engine overhead) and fed from synthetic
in-memory tensors (input-pipeline overhead). Ratios come only from cells measured here.
A detector in `models` (e.g. retinanet_tiny) trains on the built-in detection `shapes` data
at `image_size` (a multiple of 32); it gets no Keras-fit reference (its losses are tfmp's).
Two optional studies on `study_model` (a classifier) at `study_image_size` / `study_batch_size`:
`pipeline_micro_batches` adds one `pipeline` cell (`tfmp.bench.pipeline`: K=2 stages on two
devices for each M, against the unsplit model); `threads_study` adds the thread cells of
`tfmp.bench.threads` (intra-op, inter-op and tf.data threads, steps per host call, Python
threads vs the GIL).
Writes `bench.json`, `bench.png` and prints the table.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys
import time

from tfmp.bench import report as bench_report
from tfmp.bench.cell import RESULT_PREFIX
from tfmp.bench.cell import is_detector as _is_detector
from tfmp.errors import UsageError, unknown

MODES = ("train", "inference")
DATA_KINDS = ("synthetic", "builtin")


@dataclasses.dataclass
class BenchConfig:
    models: list[str]
    precisions: list[str]
    replicas: list[int] = dataclasses.field(default_factory=lambda: [1])
    workers: list[int] = dataclasses.field(default_factory=list)  # local processes, 1 core each
    xla: list[bool] = dataclasses.field(default_factory=lambda: [False])
    tf32: list[bool] = dataclasses.field(default_factory=lambda: [True])  # float32 cells only
    ratio_models: list[str] = dataclasses.field(default_factory=list)  # scaling + references; [] = all
    data: str = "synthetic"  # synthetic | builtin | tfds:<name>
    global_batch_size: int = 64  # of a 1-replica cell; N-replica cells use N x (weak scaling)
    steps_per_execution: int = 10
    mode: str = "train"
    image_size: int = 32
    warmup_executions: int = 3
    executions: int = 5  # host calls per timed repeat, at least
    min_repeat_seconds: float = 1.5  # ... and at least this long
    repeats: int = 5
    references: bool = True  # plain-Keras fit cell and synthetic-input cell
    cache: bool = False
    output_dir: str = "bench"
    cell_timeout: float = 1800
    pipeline_micro_batches: list[int] = dataclasses.field(default_factory=list)  # [] = no pipeline cell
    threads_study: bool = False
    threads_rounds: int = 2  # the thread cells run this many times in turn; each keeps its best
    study_model: str = "seed_cnn"  # the classifier of the pipeline and thread studies
    study_image_size: int = 32
    study_batch_size: int = 64


def validate(config: BenchConfig) -> None:
    from tfmp import models, precision

    for name in config.models + config.ratio_models:
        if name not in models.MODELS and not _is_detector(name):
            raise unknown("model", name, [*models.MODELS, *_detectors()])
    if any(_is_detector(name) for name in config.models):
        if config.data not in DATA_KINDS:
            raise UsageError(
                f"--data={config.data} is not for detectors here; use synthetic or builtin (shapes)"
            )
        if config.image_size < 32 or config.image_size % 32:
            raise UsageError(
                f"--image_size={config.image_size} for a detector must be a multiple of 32, e.g. 128"
            )
    _validate_studies(config)
    for name in config.precisions:
        if name not in precision.CHOICES:
            raise unknown("precision", name, precision.CHOICES)
    if config.mode not in MODES:
        raise unknown("mode", config.mode, MODES)
    if config.data not in DATA_KINDS and not config.data.startswith("tfds:"):
        raise unknown("bench data", config.data, DATA_KINDS + ("tfds:<name>",))
    if not config.models or not config.precisions:
        raise UsageError("--models and --precisions need at least one value each")
    if not config.replicas and not config.workers:
        raise UsageError("give --replicas and/or --workers (e.g. --replicas=1 --workers=1,2)")
    for flag in ("replicas", "workers"):
        for value in getattr(config, flag):
            if value < 1:
                raise UsageError(f"--{flag} value {value} must be >= 1")
    for flag in ("global_batch_size", "steps_per_execution", "executions", "repeats"):
        if getattr(config, flag) < 1:
            raise UsageError(f"--{flag}={getattr(config, flag)} must be >= 1")
    if config.warmup_executions < 1:
        raise UsageError("--warmup_executions must be >= 1: the first call traces and compiles")


def _detectors():
    from tfmp.detection import retinanet

    return retinanet.DETECTORS


def _validate_studies(config: BenchConfig) -> None:
    from tfmp import models

    if (config.threads_study or config.pipeline_micro_batches) and config.study_model not in models.MODELS:
        raise unknown("study model (a classifier)", config.study_model, models.MODELS)
    for flag in ("study_image_size", "study_batch_size", "threads_rounds"):
        if getattr(config, flag) < 1:
            raise UsageError(f"--{flag}={getattr(config, flag)} must be >= 1")
    for micro in config.pipeline_micro_batches:
        if micro < 1 or config.study_batch_size % micro:
            raise UsageError(
                f"--pipeline_micro_batches value {micro} must be >= 1 and divide "
                f"--study_batch_size={config.study_batch_size}"
            )


def study_cells(config: BenchConfig) -> list[dict]:
    """The pipeline cell and the thread-study cells the config asks for."""
    from tfmp.bench import threads as bench_threads

    result = []
    if config.pipeline_micro_batches:
        result.append(
            {
                "kind": "pipeline",
                "model": config.study_model,
                "image_size": config.study_image_size,
                "global_batch_size": config.study_batch_size,
                "micro_batches": list(config.pipeline_micro_batches),
                "steps": config.steps_per_execution,
                "repeats": config.repeats,
                "precision": config.precisions[0],
            }
        )
    if config.threads_study:
        timing = {
            "warmup_executions": config.warmup_executions,
            "executions": config.executions,
            "min_repeat_seconds": config.min_repeat_seconds,
            "repeats": config.repeats,
        }
        result += bench_threads.cells(
            config.study_model,
            config.study_image_size,
            config.study_batch_size,
            timing,
            config.threads_rounds,
        )
        # A unit of Python work as long as a timed repeat of the engine cells.
        result.append(bench_threads.python_cell(config.min_repeat_seconds))
    return result


def cells(config: BenchConfig) -> list[dict]:
    """The measurements to take: engine cells, references, and one matmul peak per precision."""
    base = {
        "data": config.data,
        "steps_per_execution": config.steps_per_execution,
        "mode": config.mode,
        "image_size": config.image_size,
        "cache": config.cache,
        "warmup_executions": config.warmup_executions,
        "executions": config.executions,
        "min_repeat_seconds": config.min_repeat_seconds,
        "repeats": config.repeats,
    }
    from tfmp import precision as precisions

    # One matmul peak per concrete policy ("auto" and "mixed" resolve to one of them here).
    policies = dict.fromkeys(precisions.resolve(p).policy for p in config.precisions)
    result = [{"kind": "peak", "precision": policy} for policy in policies]
    for model in config.models:
        # Scaling and reference cells cost the most; --ratio_models limits them to some models.
        ratios = not config.ratio_models or model in config.ratio_models
        for precision in config.precisions:
            # TF32 only changes float32 math; mixed policies are measured once.
            for tf32 in config.tf32 if precision == "float32" else [True]:
                for xla in config.xla:
                    common = dict(base, model=model, precision=precision, xla=xla, tf32=tf32)
                    for replicas in config.replicas:
                        if replicas == 1 or ratios:
                            result.append(
                                dict(
                                    common,
                                    kind="engine",
                                    replicas=replicas,
                                    workers=0,
                                    global_batch_size=config.global_batch_size * replicas,
                                )
                            )
                    for workers in config.workers if ratios else []:
                        result.append(
                            dict(
                                common,
                                kind="engine",
                                replicas=1,
                                workers=workers,
                                global_batch_size=config.global_batch_size * workers,
                            )
                        )
                    # Keras fit would need the detector's own losses: detectors get the input reference only.
                    if config.references and ratios and _is_detector(model):
                        if config.data != "synthetic":
                            result.append(
                                dict(
                                    common,
                                    kind="engine",
                                    replicas=1,
                                    workers=0,
                                    data="synthetic",
                                    reference="input",
                                    global_batch_size=config.global_batch_size,
                                )
                            )
                    elif config.references and ratios:
                        single = dict(
                            common, replicas=1, workers=0, global_batch_size=config.global_batch_size
                        )
                        result.append(dict(single, kind="fit"))
                        if config.data != "synthetic":
                            result.append(dict(single, kind="engine", data="synthetic", reference="input"))
    return result + study_cells(config)


def describe_cell(cell: dict) -> str:
    if cell["kind"] == "peak":
        return f"matmul peak {cell['precision']}"
    if cell["kind"] == "pipeline":
        return (
            f"pipeline {cell['model']} K=2 M={','.join(map(str, cell['micro_batches']))} vs unsplit, "
            f"batch {cell['global_batch_size']}"
        )
    if cell["kind"] == "python_threads":
        return "Python threads vs processes (GIL), TensorFlow on 2 Python threads"
    if cell.get("study") == "threads":
        return (
            f"threads round {cell['round']} {cell['knob']}: {cell['model']} intra {cell['intra_op_threads']} inter "
            f"{cell['inter_op_threads']} data {cell['data_threads']} steps/call {cell['steps_per_execution']}"
        )
    devices = f"{cell['workers']} worker(s)" if cell["workers"] else f"{cell['replicas']} replica(s)"
    kind = {"fit": " [keras fit]", "engine": ""}[cell["kind"]]
    data = " [synthetic input]" if cell.get("reference") == "input" else ""
    tf32 = "" if cell.get("tf32", True) else " tf32=off"
    return (
        f"{cell['model']} {cell['precision']}{tf32} {devices} xla={'on' if cell['xla'] else 'off'} "
        f"batch {cell['global_batch_size']}{kind}{data}"
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


def measure(cell: dict, timeout: float) -> dict:
    """Runs one cell in a fresh process; returns its result (worker 0's for a group)."""
    completed = subprocess.run(
        _command(cell),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    for line in completed.stdout.splitlines():
        line = line.split("] ", 1)[1] if line.startswith("[worker 0] ") else line
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    tail = (completed.stderr or completed.stdout).strip().splitlines()[-5:]
    raise RuntimeError(
        f"bench cell '{describe_cell(cell)}' failed (exit {completed.returncode}): " + " | ".join(tail)
    )


def _headline(result: dict) -> str:
    """The one figure a progress line shows for a cell's result."""
    if "examples_per_sec" in result:
        return f"{result['examples_per_sec']:,.1f} examples/s"
    if "peak_flops" in result:
        return f"{result['peak_flops'] / 1e9:,.1f} GFLOP/s"
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


def run(config: BenchConfig, progress=print) -> dict:
    """Measures every cell, derives the ratios, writes bench.json and bench.png."""
    validate(config)
    import keras
    import tensorflow as tf

    from tfmp import precision

    planned = cells(config)
    os.makedirs(config.output_dir, exist_ok=True)
    started, load_before = time.time(), load_average()
    for index, cell in enumerate(planned, 1):
        progress(f"[{index}/{len(planned)}] {describe_cell(cell)} ...")
        cell["result"] = measure(cell, config.cell_timeout)
        cell["load_average"] = load_average()  # the machine may be shared: how busy it was around this cell
        progress(
            f"[{index}/{len(planned)}] {describe_cell(cell)}: {_headline(cell['result'])} "
            f"({time.time() - started:.0f} s so far)"
        )
    report = {
        "config": dataclasses.asdict(config),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "hardware": dict(
            hardware(),
            gpus=[g.name for g in tf.config.list_physical_devices("GPU")],
            cpu_fast_bfloat16=precision.detect_hardware().cpu_fast_bfloat16,
        ),
        "versions": {"tensorflow": tf.__version__, "keras": keras.__version__},
        "cells": planned,
        "seconds": round(time.time() - started, 1),
        "load_average": {"before": load_before, "after": load_average()},
    }
    report["ratios"] = bench_report.derive(planned)
    with open(os.path.join(config.output_dir, "bench.json"), "w", encoding="utf-8") as file:
        json.dump(report, file, indent=2)
    report["chart"] = bench_report.chart(planned, os.path.join(config.output_dir, "bench.png"))
    return report
