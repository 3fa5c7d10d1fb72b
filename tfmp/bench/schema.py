"""The schema of `bench.json` (documented field by field in docs/bench.md), and its check.

    from tfmp.bench import schema
    schema.check(json.load(open("bench/bench.json")))    # raises SchemaError naming the field

A `--mode=memory` run's bench.json (`tfmp.bench.memory`) has MEMORY_REPORT's fields instead;
`check` tells them apart by `config.mode`.

`tfmp.bench.runner` checks every report against it before writing, so the file always has
exactly these fields. A change that renames, removes or retypes a field raises SCHEMA_VERSION.
Types: "number" (int or float), "integer", "string", "boolean", "list", "object"; a trailing
"?" allows null (e.g. a load average where the OS has none).
"""

from __future__ import annotations

# 2: peak_memory_mb is the allocator peak on CPUs too; host_memory_vs_float32.
# 3: fused_norm (cells, ratio labels), variables_mb, fused_vs_keras_norm, bn_study, --mode=memory.
# 4: interleaved rounds: round_group (engine and fit cells), examples_per_sec_repeats, and every
#    throughput ratio's rounds (its value the median of them); onednn_study cells.
SCHEMA_VERSION = 4

REPORT = {
    "schema_version": "integer",
    "date": "string",
    "seconds": "number",
    "config": "object",
    "hardware": "object",
    "versions": "object",
    "load_average": "object",
    "peak_method": "string",
    "cells": "list",
    "ratios": "object",
    "memory_note": "string",
}
HARDWARE = {
    "machine": "string",
    "cpu": "string",
    "cpu_cores": "integer",
    "python": "string",
    "gpus": "list",
    "cpu_fast_bfloat16": "boolean",
}
# Every measured cell, whatever its kind; its other keys are the settings it was planned with.
CELL = {"kind": "string", "result": "object", "load_average": "list?"}
# The settings of an engine or fit cell (kind "engine" | "fit").
ENGINE_CELL = {
    "model": "string",
    "precision": "string",
    "xla": "boolean",
    "tf32": "boolean",
    "fused_norm": "boolean",
    "replicas": "integer",
    "workers": "integer",
    "global_batch_size": "integer",
    "image_size": "integer",
    "data": "string",
    "mode": "string",
    "steps_per_execution": "integer",
    "repeats": "integer",
    "round_group": "integer?",  # the interleaved rounds it was timed in (tfmp.bench.rounds); null: alone
}
ENGINE_RESULT = {
    "policy": "string",
    "dataset": "string",
    "image_shape": "list",
    "replicas": "integer",
    "workers": "integer",
    "examples_per_sec": "number",
    "examples_per_sec_repeats": "list",  # each repeat's, in round order when timed in rounds
    "examples_per_sec_min": "number",
    "examples_per_sec_max": "number",
    "examples_per_sec_per_replica": "number",
    "step_time_median": "number",
    "step_time_p90": "number",
    "flops_per_step": "number",
    "flops_per_sec": "number",
    "peak_memory_mb": "number",
    "peak_memory_source": "string",
    "peak_host_memory_mb": "number",
    "host_memory_before_model_mb": "number",
    "peak_gpu_memory_mb": "list",
    "variables_mb": "number",
    "intra_op_threads": "integer",
    "inter_op_threads": "integer",
    "paired_input": "object?",
    "allreduce_dtype": "string?",  # the dtype gradients were summed in (null: one device, or a fit cell)
    "allreduce_bucket_bytes": "integer?",  # the bucket size asked for (0: one call; null: nothing summed)
    "allreduce_buckets": "integer",  # the all-reduce calls per step (0: nothing summed)
    "gradient_bytes_per_step": "integer",  # sent per replica per step (0: nothing summed)
    "collective_seconds_per_step": "number?",  # that sum alone, timed apart from the step
}
# `paired_input` of a detector's synthetic-input reference cell (null in every other cell).
PAIRED_INPUT = {"real_examples_per_sec": "number", "ratios": "list", "value": "number"}
PEAK_RESULT = {
    "peak_flops": "number",
    "matmul_size": "integer",
    "dtype": "string",
    "sizes": "list",
    "method": "string",
}
PEAK_SIZE = {"size": "integer", "matmuls_per_call": "integer", "flops": "list", "best_flops": "number"}
# Ratio name -> the fields of each of its rows.
_DEVICE_LABEL = {
    "model": "string",
    "precision": "string",
    "tf32": "boolean",
    "xla": "boolean",
    "replicas": "integer",
    "workers": "integer",
    "fused_norm": "boolean",
    "value": "number",
}
_REFERENCE_LABEL = {"model": "string", "precision": "string", "xla": "boolean", "value": "number"}
# A throughput ratio's per-round ratios (its value is their median); [] when not timed in rounds.
_ROUNDS = {"rounds": "list"}
RATIOS = {
    "speedup_vs_float32": dict(_DEVICE_LABEL, **_ROUNDS),
    "scaling_efficiency": dict(
        _DEVICE_LABEL,
        **_ROUNDS,
        allreduce_dtype="string",
        allreduce_buckets="integer",
        gradient_bytes_per_step="integer",
        collective_seconds_per_step="number",
        collective_share="number",
    ),
    "flops_fraction_of_peak": _DEVICE_LABEL,
    "peak_memory_vs_float32": dict(_DEVICE_LABEL, global_batch_size="integer"),
    "host_memory_vs_float32": dict(_DEVICE_LABEL, global_batch_size="integer"),
    "engine_vs_keras_fit": dict(_REFERENCE_LABEL, **_ROUNDS),
    "input_vs_synthetic": dict(_REFERENCE_LABEL, paired="boolean", **_ROUNDS),
    "fused_vs_keras_norm": {
        "model": "string",
        "precision": "string",
        "tf32": "boolean",
        "xla": "boolean",
        "replicas": "integer",
        "workers": "integer",
        "global_batch_size": "integer",
        "value": "number",
        "rounds": "list",
        "peak_memory": "number",
        "peak_memory_mb": "number",
        "keras_peak_memory_mb": "number",
    },
    "fused_vs_keras_bn": {
        "precision": "string",
        "policy": "string",
        "layer": "string",
        "shape": "list",
        "keras_ms": "number",
        "fused_ms": "number",
        "value": "number",
        "peak_memory": "number?",
        "keras_kept_mb": "number?",
        "fused_kept_mb": "number?",
    },
    "pipeline": {
        "model": "string",
        "stages": "integer",
        "micro_batches": "integer",
        "value": "number",
        "bubble_theory": "number",
        "bubble_measured": "number",
    },
    "pipeline_2d": {
        "model": "string",
        "layout": "string",  # "2-D", "data-parallel" or "1-worker pipeline"
        "workers": "integer",
        "stages": "integer",
        "micro_batches": "integer?",
        "images_per_second": "number",
        "value": "number",  # images/s / the data-parallel row's
        "bubble_theory": "number?",
        "bubble_measured": "number?",
        "parameters_per_device": "list",
    },
    "input_cost": {
        "image_size": "integer",
        "pipeline": "string",
        "reference": "string",
        "images_per_second": "number",
        "reference_images_per_second": "number",
        "value": "number",
    },
    "threads": {
        "knob": "string",
        "setting": "string",
        "value": "number",
        "reference": "number",
        "unit": "string",
        "ratio": "number",
    },
}

# The precision probe (kind "precision_probe", tfmp.precision.probe), measured beside the peaks.
PRECISION_PROBE_RESULT = {
    "table": "object",  # {dtype: {workload: median seconds per call}}
    "speedups": "object",  # {half dtype: float32's time / its time}
    "lines": "list",  # the table as printed
    "choices": "object",  # {"auto" | "mixed": the run card's line for that choice here}
}
BN_STUDY_RESULT = {
    "policy": "string",
    "layer": "string",  # "BatchNormalization" or "GroupNormalization(G)"
    "compute_dtype": "string",
    "shape": "list",
    "rounds": "integer",
    "calls_per_round": "integer",
    "keras_ms": "number",
    "fused_ms": "number",
    "keras_ms_rounds": "list",
    "fused_ms_rounds": "list",
    "ratios": "list",
    "value": "number",
    "keras_peak_memory_mb": "number",
    "fused_peak_memory_mb": "number",
    "keras_kept_mb": "number",  # what the forward leaves alive for the backward pass
    "fused_kept_mb": "number",
    "peak_memory_source": "string",
}
# The oneDNN study (kind "onednn_study", tfmp.bench.onednn): one step's time by oneDNN primitive.
ONEDNN_RESULT = {
    "policy": "string",
    "onednn": "boolean",  # false: oneDNN off or absent (no verbose line), and `note` says so
    "note": "string",
    "steps": "integer",
    "step_ms": "number",
    "onednn_ms": "number",
    "outside_onednn_ms": "number",
    "primitives": "list",
    "reference_kernels": "list",
}
# tfmp's Engine and Keras' fit in one process (kind "engine_vs_fit", tfmp.bench.engine_vs_fit).
ENGINE_VS_FIT_RESULT = {
    "policy": "string",
    "rounds": "list",  # fit's seconds / the engine's, per round
    "value": "number",  # their median
    "engine_examples_per_sec": "number",
    "fit_examples_per_sec": "number",
}
ONEDNN_PRIMITIVE = {
    "kind": "string",
    "propagation": "string",
    "implementation": "string",
    "calls_per_step": "number",
    "ms_per_step": "number",
    "share": "number",
    "reference_kernel": "boolean",
}
# --mode=memory: the largest batch under a live-peak budget (tfmp.bench.memory).
MEMORY_REPORT = {
    "schema_version": "integer",
    "date": "string",
    "seconds": "number",
    "config": "object",
    "hardware": "object",
    "versions": "object",
    "load_average": "object",
    "memory_note": "string",
    "budget_mb": "number",
    "searches": "list",
    "ratios": "object",
}
SEARCH = {
    "setting": "object",
    "model": "string",
    "precision": "string",
    "policy": "string",
    "fused_norm": "boolean",
    "xla": "boolean",
    "image_size": "integer",
    "budget_mb": "number",
    "variables_mb": "number",
    "probe_batches": "list",
    "intercept_mb": "number",
    "slope_mb_per_example": "number",
    "predicted_batch": "integer",
    "largest_batch": "integer",
    "largest_batch_peak_mb": "number",
    "next_batch": "integer",
    "next_batch_peak_mb": "number?",  # null: that cell ran out of device memory
    "confirmed": "string",
    "cells": "list",
}
SEARCH_CELL = {"global_batch_size": "integer", "result": "object?", "load_average": "list?"}
_BATCH_RATIO = {
    "model": "string",
    "precision": "string",
    "xla": "boolean",
    "largest_batch": "integer",
    "value": "number",
    "per_example": "number",
}
MEMORY_RATIOS = {
    "largest_batch_vs_float32": dict(_BATCH_RATIO, fused_norm="boolean", float32_largest_batch="integer"),
    "largest_batch_fused_vs_keras_norm": dict(_BATCH_RATIO, keras_largest_batch="integer"),
}


class SchemaError(ValueError):
    """A report that does not match the schema: a bug in the bench, never a user error."""


def _is(value, kind: str) -> bool:
    if kind.endswith("?"):
        return value is None or _is(value, kind[:-1])
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    types = {"string": str, "boolean": bool, "list": list, "object": dict}
    return isinstance(value, types[kind])


def _fields(where: str, record: dict, fields: dict, exact: bool = False) -> None:
    missing = [name for name in fields if name not in record]
    extra = sorted(set(record) - set(fields)) if exact else []
    if missing or extra:
        raise SchemaError(f"{where}: missing {missing}, unexpected {extra}")
    for name, kind in fields.items():
        if not _is(record[name], kind):
            raise SchemaError(f"{where}.{name} = {record[name]!r} is not {kind}")


def _ratio_rows(ratios: dict, names: dict) -> None:
    _fields("report.ratios", ratios, dict.fromkeys(names, "list"), exact=True)
    for name, fields in names.items():
        for index, row in enumerate(ratios[name]):
            _fields(f"report.ratios.{name}[{index}]", row, fields, exact=True)


def _check_memory(report: dict) -> None:
    """A --mode=memory report: the searches, their cells and the batch ratios."""
    _fields("report", report, MEMORY_REPORT, exact=True)
    for index, search in enumerate(report["searches"]):
        where = f"report.searches[{index}]"
        _fields(where, search, SEARCH, exact=True)
        for number, cell in enumerate(search["cells"]):
            _fields(f"{where}.cells[{number}]", cell, SEARCH_CELL, exact=True)
            if cell["result"] is not None:
                _fields(f"{where}.cells[{number}].result", cell["result"], ENGINE_RESULT, exact=True)
    _ratio_rows(report["ratios"], MEMORY_RATIOS)


def check(report: dict) -> None:
    """Raises SchemaError at the first field that is missing, extra (where exact) or mistyped."""
    if report.get("schema_version") != SCHEMA_VERSION:
        raise SchemaError(f"report.schema_version {report.get('schema_version')} is not {SCHEMA_VERSION}")
    _fields("report.hardware", report.get("hardware", {}), HARDWARE)
    if report.get("config", {}).get("mode") == "memory":
        return _check_memory(report)
    _fields("report", report, REPORT, exact=True)
    for index, cell in enumerate(report["cells"]):
        where = f"report.cells[{index}]"
        _fields(where, cell, CELL)
        if cell["kind"] in ("engine", "fit"):
            _fields(where, cell, ENGINE_CELL)
            _fields(f"{where}.result", cell["result"], ENGINE_RESULT, exact=True)
            if cell["result"]["paired_input"] is not None:
                _fields(
                    f"{where}.result.paired_input", cell["result"]["paired_input"], PAIRED_INPUT, exact=True
                )
        elif cell["kind"] == "peak":
            _fields(f"{where}.result", cell["result"], PEAK_RESULT, exact=True)
            for size in cell["result"]["sizes"]:
                _fields(f"{where}.result.sizes[]", size, PEAK_SIZE, exact=True)
        elif cell["kind"] == "precision_probe":
            _fields(f"{where}.result", cell["result"], PRECISION_PROBE_RESULT, exact=True)
        elif cell["kind"] == "bn_study":
            _fields(f"{where}.result", cell["result"], BN_STUDY_RESULT, exact=True)
        elif cell["kind"] == "onednn_study":
            _fields(f"{where}.result", cell["result"], ONEDNN_RESULT, exact=True)
            for row in cell["result"]["primitives"]:
                _fields(f"{where}.result.primitives[]", row, ONEDNN_PRIMITIVE, exact=True)
        elif cell["kind"] == "engine_vs_fit":
            _fields(f"{where}.result", cell["result"], ENGINE_VS_FIT_RESULT, exact=True)
    _ratio_rows(report["ratios"], RATIOS)
