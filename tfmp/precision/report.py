"""The precision doctor's report: per-layer numbers, the float32 verdict, a table and the JSON file.

    report = precision.diagnose(model, dataset, steps=3)
    print(precision.format_report(report))
    precision.save_report(report, "runs/my-run")        # runs/my-run/precision_report.json
    report.float32_layers                               # ["model_exp", ...] or []

`diagnose` (tfmp.precision.doctor) fills it; docs/precision-doctor.md explains every column.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

from tfmp import run_dir

REPORT_FILE = run_dir.PRECISION_REPORT_FILE
HALF_POLICIES = ("mixed_float16", "mixed_bfloat16")
HEALTHY = "no layer needs float32"


@dataclasses.dataclass
class LayerReport:
    """One top-level layer, over every call of it (a shared layer is called more than once)."""

    name: str
    kind: str  # the layer's class
    calls: int  # calls per step (shared layers: one per use)
    compute_dtype: str  # in the diagnosed model as given
    activation: dict  # magnitude summary of the layer's outputs (see doctor.Magnitudes.summary)
    output_gradient: dict | None  # of the scaled loss w.r.t. the outputs; None: no path to the loss
    weight_gradient: dict | None  # of the scaled loss w.r.t. the trainable weights; None: none
    relative_error: dict  # {"float16": x, "bfloat16": y}: ||half - float32|| / ||float32||, None: n/a
    reasons: dict  # {"mixed_float16": [why float32], "mixed_bfloat16": [...]}


@dataclasses.dataclass
class Report:
    model: str
    policy: str  # the half-precision policy the verdict is for
    steps: int
    examples: int
    loss_scale: float
    loss_scale_source: str
    error_thresholds: dict  # {"float16": ..., "bfloat16": ...}
    layers: list[LayerReport]
    computes_in_half: bool  # some layer of the diagnosed model computes in float16 or bfloat16
    # The largest power of two the loss can be scaled by with no float16 gradient overflowing
    # on these batches, once the float16 verdict is followed (None: no gradient in float16).
    safe_loss_scale: float | None = None
    notes: list[str] = dataclasses.field(default_factory=list)

    def _listed(self, layer: LayerReport, policy: str) -> bool:
        # A mixed model's float32 layers are already what the verdict asks; a float32 model is
        # being diagnosed before going mixed, so every flagged layer is listed.
        return bool(layer.reasons.get(policy)) and not (
            self.computes_in_half and layer.compute_dtype == "float32"
        )

    def float32_layers_for(self, policy: str) -> list[str]:
        """The layers to switch to float32 under `policy` (flagged, not already float32)."""
        return [layer.name for layer in self.layers if self._listed(layer, policy)]

    def already_float32(self, policy: str) -> list[str]:
        """Flagged layers that already compute in float32 in a mixed model: nothing to do."""
        return [
            layer.name
            for layer in self.layers
            if layer.reasons.get(policy) and not self._listed(layer, policy)
        ]

    @property
    def float32_layers(self) -> list[str]:
        """The layers to keep in float32 under `policy`, in graph order ([] for a healthy model)."""
        return self.float32_layers_for(self.policy)

    def verdict(self, policy: str | None = None) -> str:
        names = self.float32_layers_for(policy or self.policy)
        return f"keep in float32: {', '.join(names)}" if names else HEALTHY

    def to_dict(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "float32_layers": {policy: self.float32_layers_for(policy) for policy in HALF_POLICIES},
            "verdict": {policy: self.verdict(policy) for policy in HALF_POLICIES},
        }


def save_report(report: Report, directory: str) -> str:
    """Writes `directory/precision_report.json` (whole, via a temporary file); returns its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, REPORT_FILE)
    run_dir.write_text_atomic(path, json.dumps(report.to_dict(), indent=1, allow_nan=True) + "\n")
    return path


def _magnitude(value: float | None) -> str:
    if value is None:
        return "-"
    return "0" if value == 0 else f"{value:.2g}" if 1e-3 <= value < 1e4 else f"{value:.1e}"


def _fraction(value: float | None) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    return f"{value:.0%}" if value >= 0.01 else f"{value:.0e}"


def _error(value: float | None, threshold: float) -> str:
    if value is None:
        return "-"
    return f"{value:.1e}" + ("!" if value > threshold else "")


_COLUMNS = (
    # header, width, value(layer, report)
    ("layer", 0, lambda layer, _: layer.name),  # width: the longest name
    ("kind", 18, lambda layer, _: layer.kind[:18]),
    ("now", 8, lambda layer, _: layer.compute_dtype),
    ("max|y|", 7, lambda layer, _: _magnitude(layer.activation["max_abs"])),
    ("y>f16", 6, lambda layer, _: _fraction(layer.activation["overflow"])),
    ("y<norm", 6, lambda layer, _: _fraction(layer.activation["below_normal"])),
    ("max|dy|", 7, lambda layer, _: _magnitude((layer.output_gradient or {}).get("max_abs"))),
    ("dy>f16", 6, lambda layer, _: _fraction((layer.output_gradient or {}).get("overflow"))),
    ("dy<norm", 7, lambda layer, _: _fraction((layer.output_gradient or {}).get("below_normal"))),
    ("dy<sub", 6, lambda layer, _: _fraction((layer.output_gradient or {}).get("below_subnormal"))),
    ("max|dW|", 7, lambda layer, _: _magnitude((layer.weight_gradient or {}).get("max_abs"))),
    ("dW>f16", 6, lambda layer, _: _fraction((layer.weight_gradient or {}).get("overflow"))),
    ("dW<sub", 6, lambda layer, _: _fraction((layer.weight_gradient or {}).get("below_subnormal"))),
    ("err f16", 8, lambda layer, r: _error(layer.relative_error["float16"], r.error_thresholds["float16"])),
    (
        "err bf16",
        8,
        lambda layer, r: _error(layer.relative_error["bfloat16"], r.error_thresholds["bfloat16"]),
    ),
    (
        "float32?",
        8,
        lambda layer, r: (
            ("KEEP" if r._listed(layer, r.policy) else "is f32") if layer.reasons.get(r.policy) else ""
        ),
    ),
)


LEGEND = (
    "y: layer outputs; dy: gradients of the loss w.r.t. them; dW: w.r.t. the layer's weights (max: unscaled).",
    ">f16: share of the nonzero values above 65504 (inf in float16); <norm / <sub: below 6.1e-5 (subnormal)",
    "  / below 6.0e-8 (lost: 0 in float16); dy and dW shares are of the values times the loss scale.",
    "err: ||half - float32|| / ||float32|| of the layer alone on the same float32 inputs cast down;",
)


def format_report(report: Report) -> str:
    """The report as a fixed-width table, then the verdict per policy and the command acting on it."""
    thresholds = report.error_thresholds
    widths = [
        width or max([len(header)] + [len(layer.name) for layer in report.layers])
        for header, width, _ in _COLUMNS
    ]
    row = lambda cells: "  ".join(f"{cell:<{width}}" for cell, width in zip(cells, widths)).rstrip()  # noqa: E731
    safe = report.safe_loss_scale
    safe = "any" if safe is None else f"2^{math.log2(safe):g} = {safe:.0f}" if safe >= 1 else f"{safe:g}"
    lines = [
        f"precision doctor: model {report.model}, {report.steps} step(s), {report.examples} examples",
        f"loss scale {report.loss_scale:g} ({report.loss_scale_source}); largest with no float16 gradient "
        f"overflow on these batches, verdict followed: {safe}",
        *LEGEND,
        f"  '!' above {thresholds['float16']:.1e} (float16) / {thresholds['bfloat16']:.1e} (bfloat16).",
        f"float32?: KEEP = switch to float32 for {report.policy}; is f32 = needs float32 and has it.",
        "",
        row(header for header, _, _ in _COLUMNS),
    ]
    lines.extend(row(str(value(layer, report)) for _, _, value in _COLUMNS) for layer in report.layers)
    lines.append("")
    for policy in HALF_POLICIES:
        names = report.float32_layers_for(policy)
        lines.append(f"{policy}: {report.verdict(policy)}")
        lines.extend(
            f"  {layer.name}: {'; '.join(layer.reasons[policy])}"
            for layer in report.layers
            if layer.reasons.get(policy)
        )
        if names:
            lines.append(
                f"  act on it: --precision={policy} --float32_layers={','.join(names)}  "
                f"(library: precision.float32_layers(model, {names!r}))"
            )
    lines.extend(f"note: {note}" for note in report.notes)
    return "\n".join(lines)
