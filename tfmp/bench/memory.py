"""The largest batch that fits a memory budget, per model and precision (`--mode=memory`).

    python -m apps.bench --mode=memory --memory_budget_mb=1024 --models=resnet20,retinanet_tiny \\
        --precisions=float32,mixed_bfloat16 --image_size=96
    python -m apps.bench --flagfile=configs/bench_memory_batch_cpu.cfg

For each setting (model, precision, fused_norm, XLA: `settings`) `search` finds the largest
global batch, a multiple of `memory_batch_step`, whose training step's live peak
(`peak_memory_mb`: TensorFlow's allocator peak of live tensors, one device) is at most the
budget, each batch measured by one engine cell in a fresh process:

1. The live peak is affine in the batch for these models (weights, slots and workspaces fixed,
   activations per example), so the probe batches (`memory_probe_batches`, default 16 and 32)
   are measured and a least-squares line fitted: peak = intercept + slope x batch.
2. The predicted largest batch, floor((budget - intercept) / slope) rounded down to the step,
   is measured, and the next batch one step above it. If the first fits and the second does
   not, that is the answer ("confirmed": "prediction", 2 cells after the probes).
3. Otherwise the prediction missed (the allocator's peak is not exactly affine): the bracket is
   widened from there by doubling steps until one batch fits and one does not, then bisected
   to one step ("confirmed": "bisection"). Every batch measured once.

The budget is refused (a one-line UsageError, nothing written) when it is below the model's
weights and optimizer variables (`variables_mb` of the first cell: no batch can fit), or when
not even one step's batch fits. A cell that runs out of device memory (a GPU's
ResourceExhaustedError) counts as a batch that does not fit. `ratios` divides each mixed
setting's largest batch by the float32 one's (NVIDIA's "batch size" table), and each fused
setting's by the unfused one's. This module runs in the parent process: no TensorFlow.
"""

from __future__ import annotations

import math

from tfmp.bench import matrix
from tfmp.errors import UsageError


def check(config: matrix.BenchConfig) -> None:
    """The memory search's settings (no TensorFlow needed)."""
    if not 0 < config.memory_budget_mb < math.inf:
        raise UsageError(
            f"--mode=memory needs --memory_budget_mb, a positive number of MiB (got {config.memory_budget_mb:g}), "
            "e.g. --memory_budget_mb=1024"
        )
    probes = config.memory_probe_batches
    if len(set(probes)) < 2 or min(probes) < 1:
        raise UsageError(
            f"--memory_probe_batches={','.join(map(str, probes))} needs 2 or more different batches >= 1, "
            "e.g. 16,32 (the live peak is fitted as a line through them)"
        )
    if config.memory_batch_step < 1:
        raise UsageError(f"--memory_batch_step={config.memory_batch_step} must be >= 1")


def settings(config: matrix.BenchConfig, environment: matrix.Environment) -> list[dict]:
    """One engine-cell setting per search (one device, no batch yet)."""
    return [
        dict(matrix.shared_settings(config), **group, kind="engine", replicas=1, workers=0)
        for model in config.models
        for group in matrix.setting_groups(config, environment, model)
    ]


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of live peak MiB over batch size."""
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    return mean_y - slope * mean_x, slope


def predict(intercept: float, slope: float, budget: float, step: int) -> int:
    """The largest multiple of `step` the line puts at or under the budget (may be 0)."""
    return max(0, math.floor((budget - intercept) / slope / step)) * step


class _Batches:
    """Measures each batch once, in order; `fits(batch)` against the budget."""

    def __init__(self, setting: dict, budget: float, measure, progress):
        self.setting, self.budget, self.measure, self.progress = setting, budget, measure, progress
        self.cells: dict[int, dict] = {}

    def peak(self, batch: int) -> float | None:
        if batch not in self.cells:
            cell = self.measure(dict(self.setting, global_batch_size=batch))
            self.cells[batch] = cell
            peak = self.peak(batch)
            verdict = "out of device memory" if peak is None else f"live peak {peak:,.1f} MiB"
            fits = "fits" if self.fits(batch) else "over"
            self.progress(f"  {matrix.describe_cell(cell)}: {verdict} ({fits} {self.budget:g} MiB)")
        result = self.cells[batch]["result"]
        return None if result is None else result["peak_memory_mb"]

    def fits(self, batch: int) -> bool:
        peak = self.peak(batch)
        return peak is not None and peak <= self.budget


def _refuse_below_variables(setting: dict, budget: float, variables: float) -> None:
    if budget <= variables:
        raise UsageError(
            f"--memory_budget_mb={budget:g} is below {setting['model']}'s weights and optimizer variables, "
            f"{variables:,.1f} MiB in {setting['precision']}: no batch fits; give a budget above {variables:,.0f}"
        )


def _bracket(batches: _Batches, start: int, step: int) -> tuple[int, int]:
    """(a batch that fits, a larger one that does not): from `start`, gaps doubling away from it,
    stopping at a batch already measured on the other side (a probe, say)."""
    measured = [batch for batch in batches.cells if batch % step == 0]
    if batches.fits(start):
        over = [batch for batch in measured if batch > start and not batches.fits(batch)]
        low, gap = start, step
        while not (over and low + gap >= min(over)) and batches.fits(low + gap):
            low, gap = low + gap, 2 * gap
        return low, min([low + gap, *over])
    fitting = [batch for batch in measured if batch < start and batches.fits(batch)]
    high, gap = start, step
    while (
        high - gap >= step and not (fitting and high - gap <= max(fitting)) and not batches.fits(high - gap)
    ):
        high, gap = high - gap, 2 * gap
    low = max([step, high - gap, *(batch for batch in fitting if batch < high)])
    if not batches.fits(low):
        setting, peak = batches.setting, batches.peak(low)
        needs = "runs out of device memory" if peak is None else f"needs {peak:,.1f} MiB of live tensors"
        raise UsageError(
            f"--memory_budget_mb={batches.budget:g}: no batch of {setting['model']} {setting['precision']} fits "
            f"(batch {low} {needs}); give a larger budget"
        )
    return low, high


def _bisect(batches: _Batches, low: int, high: int, step: int) -> tuple[int, int]:
    while high - low > step:
        middle = low + (high - low) // step // 2 * step
        low, high = (middle, high) if batches.fits(middle) else (low, middle)
    return low, high


def search(setting: dict, budget: float, probes: list[int], step: int, measure, progress=print) -> dict:
    """The largest batch of `setting` whose live peak fits `budget` MiB. `measure(cell)` runs
    one cell and returns it with "result" (None: out of device memory) and "load_average"."""
    batches = _Batches(setting, budget, measure, progress)
    probes = sorted(set(probes))
    batches.peak(probes[0])
    variables = batches.cells[probes[0]]["result"]["variables_mb"]
    _refuse_below_variables(setting, budget, variables)
    points = [(batch, batches.peak(batch)) for batch in probes]
    if any(peak is None for _, peak in points):
        raise UsageError(
            f"--memory_probe_batches={','.join(map(str, probes))}: a probe of {setting['model']} ran out of "
            "device memory; give smaller probe batches"
        )
    intercept, slope = fit_line(points)
    if slope <= 0:
        raise UsageError(
            f"the live peak of {setting['model']} did not grow with the batch over --memory_probe_batches="
            f"{','.join(map(str, probes))} ({', '.join(f'{p:,.1f}' for _, p in points)} MiB); give larger ones"
        )
    predicted = predict(intercept, slope, budget, step)
    low, high = _bisect(batches, *_bracket(batches, max(step, predicted), step), step)
    first = batches.cells[probes[0]]["result"]
    return {
        "setting": {key: value for key, value in setting.items() if key != "kind"},
        "model": setting["model"],
        "precision": setting["precision"],
        "policy": first["policy"],
        "fused_norm": setting["fused_norm"],
        "xla": setting["xla"],
        "image_size": setting["image_size"],
        "budget_mb": budget,
        "variables_mb": variables,
        "probe_batches": probes,
        "intercept_mb": intercept,
        "slope_mb_per_example": slope,
        "predicted_batch": predicted,
        "largest_batch": low,
        "largest_batch_peak_mb": batches.peak(low),
        "next_batch": high,
        "next_batch_peak_mb": batches.peak(high),
        # The prediction fitted and its next step did not: no other cell was needed.
        "confirmed": "prediction" if low == predicted else "bisection",
        "cells": [
            {"global_batch_size": batch, "result": cell["result"], "load_average": cell.get("load_average")}
            for batch, cell in batches.cells.items()
        ],
    }


def ratios(searches: list[dict]) -> dict:
    """Largest batch of each mixed setting / the float32 one's, and of each fused setting / the
    unfused one's; beside each, the same ratio of the fitted MiB per example."""
    found = {(s["model"], s["precision"], s["fused_norm"], s["xla"]): s for s in searches}
    result = {"largest_batch_vs_float32": [], "largest_batch_fused_vs_keras_norm": []}
    for (model, precision, fused_norm, xla), search in found.items():
        label = {"model": model, "precision": precision, "xla": xla, "largest_batch": search["largest_batch"]}
        float32 = found.get((model, "float32", fused_norm, xla))
        if float32 and precision != "float32":
            result["largest_batch_vs_float32"].append(
                dict(label, fused_norm=fused_norm, **_versus(search, float32, "float32_largest_batch"))
            )
        keras = found.get((model, precision, False, xla))
        if keras and fused_norm:
            result["largest_batch_fused_vs_keras_norm"].append(
                dict(label, **_versus(search, keras, "keras_largest_batch"))
            )
    return result


def _versus(search: dict, reference: dict, name: str) -> dict:
    return {
        name: reference["largest_batch"],
        "value": search["largest_batch"] / reference["largest_batch"],
        "per_example": search["slope_mb_per_example"] / reference["slope_mb_per_example"],
    }


def table(report: dict) -> str:
    """The searches as a plain-text table, then the ratios."""
    header = (
        "model",
        "precision",
        "norm",
        "weights+slots MiB",
        "fit: MiB + MiB/example",
        "predicted",
        "largest batch (live MiB)",
        "next (live MiB)",
        "confirmed by",
        "cells",
    )
    rows = [
        (
            s["model"],
            s["precision"] + ("" if s["precision"] == s["policy"] else f" ({s['policy']})"),
            "fused" if s["fused_norm"] else "keras",
            f"{s['variables_mb']:,.1f}",
            f"{s['intercept_mb']:,.1f} + {s['slope_mb_per_example']:,.2f}",
            str(s["predicted_batch"]),
            f"{s['largest_batch']} ({s['largest_batch_peak_mb']:,.1f})",
            f"{s['next_batch']} ({_mib(s['next_batch_peak_mb'])})",
            s["confirmed"],
            str(len(s["cells"])),
        )
        for s in report["searches"]
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        f"largest global batch whose training step's live peak fits {report['budget_mb']:g} MiB "
        "(one device; TensorFlow's allocator peak of live tensors)",
        *("  ".join(value.ljust(width) for value, width in zip(row, widths)) for row in [header, *rows]),
    ]
    lines.insert(2, "  ".join("-" * width for width in widths))
    for name, title, reference in (
        ("largest_batch_vs_float32", "largest batch {precision} / float32", "float32_largest_batch"),
        (
            "largest_batch_fused_vs_keras_norm",
            "largest batch fused / Keras norm, {precision}",
            "keras_largest_batch",
        ),
    ):
        for row in report["ratios"][name]:
            bn = " fused norm" if row.get("fused_norm") else ""
            lines.append(
                f"{title.format(**row)}: {row['model']}{bn} xla={'on' if row['xla'] else 'off'}: "
                f"{row['largest_batch']} / {row[reference]} = {row['value']:.2f}x "
                f"(MiB per example {row['per_example']:.2f}x)"
            )
    return "\n".join(lines)


def _mib(value) -> str:
    return "out of memory" if value is None else f"{value:,.1f}"
