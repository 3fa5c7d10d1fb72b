"""Issue 25's ratios of a bench run: what mixed precision and the fused BatchNormalization do
to memory (and speed). No measuring here; `tfmp.bench.report` calls these.

    ratios = mixed_vs_float32(result, float32_result)     # peak_memory_vs_float32, host_memory_...
    rows = fused_vs_keras_norm(main_cells_by_key, key)    # engine cells, fused / unfused
    rows = fused_vs_keras_bn(cells)                        # the bn_study cells
    print("\\n".join(lines(ratios, devices)))

`mixed_vs_float32`: a mixed cell's live peak (`peak_memory_mb`, the allocator's) / the float32
cell's, and on CPUs the process's resident memory above its base, likewise.

`fused_vs_keras_norm`: for each main engine cell with "fused_norm": true and its unfused twin
(same model, precision, devices, XLA, data, batch), examples/s fused / unfused (`value`) and
live peak memory fused / unfused (`peak_memory`). `fused_vs_keras_bn`: each `bn_study` cell
(`tfmp.bench.bn_study`): one BatchNormalization's forward + backward, fused / Keras time (the
median of rounds timed in turn) and live peak. Below 1: the fused kernel is faster or smaller.
"""

from __future__ import annotations

from tfmp.bench.rounds import paired_ratio, spread


def mixed_vs_float32(result: dict, float32: dict) -> dict:
    """Mixed / float32 peak memory: of live tensors (`peak_memory_mb`, the allocator's), and on
    CPUs of the process's resident memory above its size before the model was built."""
    ratios = {"peak_memory_vs_float32": result["peak_memory_mb"] / float32["peak_memory_mb"]}
    if result["peak_memory_source"] == "cpu":
        above = float32["peak_host_memory_mb"] - float32["host_memory_before_model_mb"]
        if above > 0:
            mine = result["peak_host_memory_mb"] - result["host_memory_before_model_mb"]
            ratios["host_memory_vs_float32"] = mine / above
    return ratios


def device_label(cell: dict) -> dict:
    """What names an engine cell in a ratio row: model, precision, TF32, XLA and its devices."""
    return {
        "model": cell["model"],
        "precision": cell["precision"],
        "tf32": cell.get("tf32", True),
        "xla": cell["xla"],
        "replicas": cell["replicas"],
        "workers": cell["workers"],
    }


def fused_vs_keras_norm(main: dict, key) -> list[dict]:
    """Rows for the fused engine cells of `main` ({key(cell): cell}) that have an unfused twin;
    `key(cell, **changes)` is the report's cell key."""
    rows = []
    for cell in main.values():
        keras = main.get(key(cell, fused_norm=False)) if cell.get("fused_norm") else None
        if keras is None:
            continue
        fused_result, keras_result = cell["result"], keras["result"]
        value, per_round = paired_ratio(cell, keras)
        row = {
            **device_label(cell),
            "global_batch_size": cell["global_batch_size"],
            "value": value,
            "rounds": per_round,
            "peak_memory": fused_result["peak_memory_mb"] / keras_result["peak_memory_mb"],
            "peak_memory_mb": fused_result["peak_memory_mb"],
            "keras_peak_memory_mb": keras_result["peak_memory_mb"],
        }
        cell.setdefault("derived", {}).update(
            fused_vs_keras_norm=row["value"], fused_vs_keras_norm_memory=row["peak_memory"]
        )
        rows.append(row)
    return rows


def fused_vs_keras_bn(cells: list[dict]) -> list[dict]:
    """One row per measured `bn_study` cell."""
    rows = []
    for cell in cells:
        if cell["kind"] == "bn_study" and "result" in cell:
            result = cell["result"]
            keras_peak = result["keras_peak_memory_mb"]
            rows.append(
                {
                    "precision": cell["precision"],
                    "policy": result["policy"],
                    # Reports before GroupNormalization could be studied have no "layer".
                    "layer": result.get("layer", "BatchNormalization"),
                    "shape": result["shape"],
                    "keras_ms": result["keras_ms"],
                    "fused_ms": result["fused_ms"],
                    "value": result["value"],
                    "peak_memory": result["fused_peak_memory_mb"] / keras_peak if keras_peak > 0 else None,
                    # Reports from before the kept bytes were measured have none.
                    "keras_kept_mb": result.get("keras_kept_mb"),
                    "fused_kept_mb": result.get("fused_kept_mb"),
                }
            )
    return rows


def lines(ratios: dict, devices) -> list[str]:
    """One line per memory-ratio row: mixed / float32 (`devices(row)` names a row's devices),
    fused / Keras in the engine cells and in the BatchNormalization study."""
    result = _mixed_lines(ratios, devices)
    for row in ratios["fused_vs_keras_norm"]:
        result.append(
            f"fused / Keras normalization: {row['model']} {row['precision']} batch {row['global_batch_size']} "
            f"{devices(row)} xla={'on' if row['xla'] else 'off'}: examples/s {row['value']:.2f}x{spread(row)}, "
            f"live peak {row['peak_memory_mb']:,.0f} / {row['keras_peak_memory_mb']:,.0f} MiB = "
            f"{row['peak_memory']:.2f}x"
        )
    for row in ratios["fused_vs_keras_bn"]:
        memory = "" if row["peak_memory"] is None else f", live peak {row['peak_memory']:.2f}x"
        if row["keras_kept_mb"] is not None:  # None in reports from before it was measured
            memory += f", kept for backward {row['fused_kept_mb']:,.2f} / {row['keras_kept_mb']:,.2f} MiB"
        result.append(
            f"{row['layer']} alone, fwd+bwd on {'x'.join(map(str, row['shape']))} {row['policy']}: fused "
            f"{row['fused_ms']:.2f} ms / Keras {row['keras_ms']:.2f} ms = {row['value']:.2f}x (median of rounds "
            f"timed in turn){memory}"
        )
    return result


def _mixed_lines(ratios: dict, devices) -> list[str]:
    host = {_label(row): row["value"] for row in ratios["host_memory_vs_float32"]}
    lines = []
    for row in ratios["peak_memory_vs_float32"]:
        extra = (
            f" (process resident memory above its base: {host[_label(row)]:.2f}x)"
            if _label(row) in host
            else ""
        )
        lines.append(
            f"live peak memory {row['precision']} / float32: {row['model']} batch {row['global_batch_size']} "
            f"{devices(row)} xla={'on' if row['xla'] else 'off'}{' fused norm' if row['fused_norm'] else ''}: "
            f"{row['value']:.2f}x{extra}"
        )
    return lines


def _label(row: dict) -> tuple:
    return tuple(value for name, value in row.items() if name != "value")
