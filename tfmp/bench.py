"""Benchmark matrices: throughput, mixed-vs-float32 speedup, scaling, engine and input overhead.

    from tfmp import bench
    report = bench.run(bench.BenchConfig(models=["resnet20"], precisions=["float32", "auto"],
                                         output_dir="/tmp/bench"))

Every cell runs in a fresh process (`tfmp.bench_cell`; multi-worker cells through
`tfmp.launch`, one CPU core or GPU share per worker), warm-up excluded, `repeats` timed
repeats reported as median and min-max spread. Side by side in the same run: the matmul peak
per precision, the same model under plain Keras `fit` (engine overhead) and fed from synthetic
in-memory tensors (input-pipeline overhead). Ratios come only from cells measured here.
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

from tfmp import bench_report
from tfmp.bench_cell import RESULT_PREFIX
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


def validate(config: BenchConfig) -> None:
    from tfmp import models, precision

    for name in config.models + config.ratio_models:
        if name not in models.MODELS:
            raise unknown("model", name, models.MODELS)
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


def cells(config: BenchConfig) -> list[dict]:
    """The measurements to take: engine cells, references, and one matmul peak per precision."""
    base = {"data": config.data, "steps_per_execution": config.steps_per_execution,
            "mode": config.mode, "image_size": config.image_size, "cache": config.cache,
            "warmup_executions": config.warmup_executions, "executions": config.executions,
            "min_repeat_seconds": config.min_repeat_seconds, "repeats": config.repeats}
    from tfmp import precision as precisions

    # One matmul peak per concrete policy ("auto" and "mixed" resolve to one of them here).
    policies = dict.fromkeys(precisions.resolve(p).policy for p in config.precisions)
    result = [{"kind": "peak", "precision": policy} for policy in policies]
    for model in config.models:
        # Scaling and reference cells cost the most; --ratio_models limits them to some models.
        ratios = not config.ratio_models or model in config.ratio_models
        for precision in config.precisions:
            # TF32 only changes float32 math; mixed policies are measured once.
            for tf32 in (config.tf32 if precision == "float32" else [True]):
                for xla in config.xla:
                    common = dict(base, model=model, precision=precision, xla=xla, tf32=tf32)
                    for replicas in config.replicas:
                        if replicas == 1 or ratios:
                            result.append(dict(common, kind="engine", replicas=replicas, workers=0,
                                               global_batch_size=config.global_batch_size * replicas))
                    for workers in (config.workers if ratios else []):
                        result.append(dict(common, kind="engine", replicas=1, workers=workers,
                                           global_batch_size=config.global_batch_size * workers))
                    if config.references and ratios:
                        single = dict(common, replicas=1, workers=0,
                                      global_batch_size=config.global_batch_size)
                        result.append(dict(single, kind="fit"))
                        if config.data != "synthetic":
                            result.append(dict(single, kind="engine", data="synthetic", reference="input"))
    return result


def describe_cell(cell: dict) -> str:
    if cell["kind"] == "peak":
        return f"matmul peak {cell['precision']}"
    devices = f"{cell['workers']} worker(s)" if cell["workers"] else f"{cell['replicas']} replica(s)"
    kind = {"fit": " [keras fit]", "engine": ""}[cell["kind"]]
    data = " [synthetic input]" if cell.get("reference") == "input" else ""
    tf32 = "" if cell.get("tf32", True) else " tf32=off"
    return (f"{cell['model']} {cell['precision']}{tf32} {devices} xla={'on' if cell['xla'] else 'off'} "
            f"batch {cell['global_batch_size']}{kind}{data}")


def _command(cell: dict, startup_timeout: float = 120) -> list[str]:
    runner = [sys.executable, "-m", "tfmp.bench_cell", json.dumps(cell)]
    if cell.get("workers"):
        return [sys.executable, "-m", "tfmp.launch", f"--workers={cell['workers']}", "--devices_per_worker=1",
                f"--startup_timeout={startup_timeout:g}", "--", *runner]
    return runner


def measure(cell: dict, timeout: float) -> dict:
    """Runs one cell in a fresh process; returns its result (worker 0's for a group)."""
    completed = subprocess.run(_command(cell), capture_output=True, text=True, timeout=timeout,
                               env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    for line in completed.stdout.splitlines():
        line = line.split("] ", 1)[1] if line.startswith("[worker 0] ") else line
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    tail = (completed.stderr or completed.stdout).strip().splitlines()[-5:]
    raise RuntimeError(f"bench cell '{describe_cell(cell)}' failed (exit {completed.returncode}): "
                       + " | ".join(tail))


def hardware() -> dict:
    info = {"machine": platform.machine(), "cpu_cores": os.cpu_count(), "python": platform.python_version(),
            "cpu": platform.processor()}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
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
    started = time.time()
    for index, cell in enumerate(planned, 1):
        progress(f"[{index}/{len(planned)}] {describe_cell(cell)} ...")
        cell["result"] = measure(cell, config.cell_timeout)
        figure = cell["result"].get("examples_per_sec") or cell["result"]["peak_flops"] / 1e9
        unit = "examples/s" if "examples_per_sec" in cell["result"] else "GFLOP/s"
        progress(f"[{index}/{len(planned)}] {describe_cell(cell)}: {figure:,.1f} {unit} "
                 f"({time.time() - started:.0f} s so far)")
    report = {
        "config": dataclasses.asdict(config),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "hardware": dict(hardware(), gpus=[g.name for g in tf.config.list_physical_devices("GPU")],
                         cpu_fast_bfloat16=precision.detect_hardware().cpu_fast_bfloat16),
        "versions": {"tensorflow": tf.__version__, "keras": keras.__version__},
        "cells": planned,
        "seconds": round(time.time() - started, 1),
    }
    report["ratios"] = bench_report.derive(planned)
    with open(os.path.join(config.output_dir, "bench.json"), "w", encoding="utf-8") as file:
        json.dump(report, file, indent=2)
    report["chart"] = bench_report.chart(planned, os.path.join(config.output_dir, "bench.png"))
    return report
