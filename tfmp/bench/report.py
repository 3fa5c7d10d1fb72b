"""Turning measured bench cells into ratios, a table and a chart (no measuring here).

    ratios = derive(cells)          # also writes cell["derived"] into each cell
    print(table(cells, ratios))
    chart(cells, "bench/bench.png")

Every ratio divides two cells of the same run: speedup vs the float32 cell, scaling efficiency
vs the 1-replica (or 1-worker) cell, tfmp engine vs plain Keras fit, real input vs synthetic
tensors, achieved model FLOP/s vs the matmul peak of the same precision, mixed vs float32
peak memory (the allocator's live peak, and the process's resident memory above its base). The optional studies
add their own rows: "pipeline" (each K=2, M row of the pipeline cell: throughput relative to
the unsplit model, bubble measured and in theory), "pipeline_2d" (each layout of the 2-D cell
relative to data parallelism on the same workers) and "threads" (`tfmp.bench.threads.rows`).
`layer_profile_table(cell)` prints a `layer_profile` cell (`tfmp.bench.layer_profile`): per
layer class ms in each policy, speedup and share of the step, then the totals, the casts and
the most expensive layer calls. The memory ratios (mixed / float32 live peak and host memory)
and fused vs Keras BatchNormalization (`fused_vs_keras_norm` of the engine cells,
`fused_vs_keras_bn` of the `bn_study` cells) come from `tfmp.bench.memory_report`.
"""

from __future__ import annotations

from matplotlib.figure import Figure

from tfmp.bench import engine_vs_fit, memory_report, onednn
from tfmp.bench import threads as bench_threads
from tfmp.bench.rounds import paired_ratio, spread


def _key(cell: dict, **changes) -> tuple:
    values = dict(cell, **changes)
    return (
        values["model"],
        values["precision"],
        values.get("tf32", True),
        values["xla"],
        values["mode"],
        values["data"],
        values["replicas"],
        values["workers"],
        values.get("fused_norm", False),
        values.get("allreduce_dtype"),
        values.get("allreduce_bucket_bytes"),
    )


def _main_cells(cells: list[dict]) -> list[dict]:
    return [c for c in cells if c["kind"] == "engine" and not c.get("reference") and not c.get("study")]


def derive(cells: list[dict]) -> dict:
    peaks = {c["precision"]: c["result"]["peak_flops"] for c in cells if c["kind"] == "peak"}
    main = {_key(c): c for c in _main_cells(cells)}
    ratios = {
        "speedup_vs_float32": [],
        "scaling_efficiency": [],
        "flops_fraction_of_peak": [],
        "peak_memory_vs_float32": [],
        "host_memory_vs_float32": [],
        "engine_vs_keras_fit": [],
        "input_vs_synthetic": [],
    }

    def throughput(key):
        return main[key]["result"]["examples_per_sec"] if key in main else None

    for key, cell in main.items():
        result, derived = cell["result"], {}
        label = {**memory_report.device_label(cell), "fused_norm": cell.get("fused_norm", False)}
        if result["policy"] in peaks:
            derived["flops_fraction_of_peak"] = result["flops_per_sec"] / peaks[result["policy"]]
            ratios["flops_fraction_of_peak"].append(dict(label, value=derived["flops_fraction_of_peak"]))
        float32 = main.get(_key(cell, precision="float32", tf32=True))
        if float32 and cell["precision"] != "float32":
            derived["speedup_vs_float32"], per_round = paired_ratio(cell, float32)
            ratios["speedup_vs_float32"].append(
                dict(label, value=derived["speedup_vs_float32"], rounds=per_round)
            )
            for name, value in memory_report.mixed_vs_float32(result, float32["result"]).items():
                derived[name] = value
                ratios[name].append(dict(label, global_batch_size=cell["global_batch_size"], value=value))
        count = cell["workers"] or cell["replicas"]
        one = dict(workers=1) if cell["workers"] else dict(replicas=1)
        single = main.get(_key(cell, **one)) or main.get(
            _key(cell, **one, allreduce_dtype=None, allreduce_bucket_bytes=None)
        )
        if single and count > 1:
            derived["scaling_efficiency"], per_round = paired_ratio(cell, single, count)
            ratios["scaling_efficiency"].append(
                dict(label, **_summing(result), value=derived["scaling_efficiency"], rounds=per_round)
            )
        cell["derived"] = derived
    for cell in cells:
        if cell["kind"] == "fit" and throughput(_key(cell)):
            value, per_round = paired_ratio(main[_key(cell)], cell)
            ratios["engine_vs_keras_fit"].append(
                dict(
                    model=cell["model"],
                    precision=cell["precision"],
                    xla=cell["xla"],
                    value=value,
                    rounds=per_round,
                )
            )
        if cell.get("reference") == "input":
            # A detector's reference cell timed the real pipeline too, in turn with the same
            # compiled step (`paired_input`): its ratio is free of the drift between processes.
            paired = cell["result"].get("paired_input")
            real = main.get(_key(cell, data=_real_data(cells, cell)))
            if paired or real:
                value, per_round = (paired["value"], paired["ratios"]) if paired else paired_ratio(real, cell)
                ratios["input_vs_synthetic"].append(
                    dict(
                        model=cell["model"],
                        precision=cell["precision"],
                        xla=cell["xla"],
                        value=value,
                        paired=bool(paired),
                        rounds=per_round,
                    )
                )
    ratios["fused_vs_keras_norm"] = memory_report.fused_vs_keras_norm(main, _key)
    ratios["fused_vs_keras_bn"] = memory_report.fused_vs_keras_bn(cells)
    ratios["pipeline"] = _pipeline_rows(cells)
    ratios["pipeline_2d"] = _pipeline_2d_rows(cells)
    ratios["input_cost"] = _input_cost_rows(cells)
    ratios["threads"] = bench_threads.rows(cells)
    return ratios


def _pipeline_rows(cells: list[dict]) -> list[dict]:
    """One ratio row per K=2, M row of a measured pipeline cell."""
    result = []
    for cell in cells:
        if cell["kind"] == "pipeline" and "result" in cell:
            for row in cell["result"]["rows"][1:]:
                result.append(
                    {
                        "model": cell["model"],
                        "stages": row["stages"],
                        "micro_batches": row["micro_batches"],
                        "value": row["relative"],
                        "bubble_theory": row["bubble_theory"],
                        "bubble_measured": row["bubble_measured"],
                    }
                )
    return result


def _pipeline_2d_rows(cells: list[dict]) -> list[dict]:
    """One row per layout of a measured pipeline_2d cell, relative to data parallelism."""
    return [
        {
            "model": cell["model"],
            "layout": row["layout"],
            "workers": row["workers"],
            "stages": row["stages"],
            "micro_batches": row["micro_batches"],
            "images_per_second": row["images_per_second"],
            "value": row["relative"],
            "bubble_theory": row.get("bubble_theory"),
            "bubble_measured": row.get("bubble_measured"),
            "parameters_per_device": [device["parameters"] for device in row["devices"]],
        }
        for cell in cells
        if cell["kind"] == "pipeline_2d" and "result" in cell
        for row in cell["result"]["rows"]
    ]


def _input_cost_rows(cells: list[dict]) -> list[dict]:
    """Drawn / JPEG images per second (one thread) of a measured input_cost cell, plain and
    augmented: >= 1 means a drawn scene costs the input pipeline no more than a JPEG."""
    result = []
    for cell in cells:
        if cell["kind"] == "input_cost" and "result" in cell:
            speed = cell["result"]["images_per_second"]
            for pipeline, reference in (("drawn", "jpeg"), ("drawn_augmented", "jpeg_augmented")):
                result.append(
                    {
                        "image_size": cell["image_size"],
                        "pipeline": pipeline,
                        "reference": reference,
                        "images_per_second": speed[pipeline],
                        "reference_images_per_second": speed[reference],
                        "value": speed[pipeline] / speed[reference],
                    }
                )
    return result


def _real_data(cells: list[dict], reference: dict) -> str:
    return next(c["data"] for c in _main_cells(cells) if c["model"] == reference["model"])


def _summing(result: dict) -> dict:
    """A scaling row's all-reduce: dtype, bytes per step, its time alone and its share of the step."""
    seconds = result.get("collective_seconds_per_step") or 0.0
    return {
        "allreduce_dtype": result.get("allreduce_dtype") or "none",
        "allreduce_buckets": result.get("allreduce_buckets", 0),
        "gradient_bytes_per_step": result.get("gradient_bytes_per_step", 0),
        "collective_seconds_per_step": seconds,
        "collective_share": seconds / result["step_time_median"] if result.get("step_time_median") else 0.0,
    }


def _devices(cell: dict) -> str:
    devices = f"{cell['workers']}w x 1 core" if cell["workers"] else f"{cell['replicas']} replica(s)"
    result = cell.get("result", {})
    summed = result.get("allreduce_dtype")
    if not summed:
        return devices
    calls = result.get("allreduce_buckets", 0)
    return f"{devices}, sum {summed} in {calls} call{'s' if calls != 1 else ''}"


def table(cells: list[dict], ratios: dict) -> str:
    """NVIDIA-style table of the engine cells, then the peaks and the reference ratios."""
    header = (
        "model",
        "devices",
        "xla",
        "precision",
        "policy",
        "norm",
        "examples/s",
        "spread",
        "per replica",
        "step ms p50/p90",
        "TFLOP/s",
        "% peak",
        "vs fp32",
        "scaling",
        "batch",
        "peak MB",
        "mem vs fp32",
    )
    rows = []
    for cell in _main_cells(cells):
        result, derived = cell["result"], cell.get("derived", {})
        rows.append(
            (
                cell["model"],
                _devices(cell),
                "on" if cell["xla"] else "off",
                cell["precision"] + ("" if cell.get("tf32", True) else " (tf32 off)"),
                result["policy"],
                "fused" if cell.get("fused_norm") else "keras",
                f"{result['examples_per_sec']:,.0f}",
                f"{result['examples_per_sec_min']:,.0f}-{result['examples_per_sec_max']:,.0f}",
                f"{result['examples_per_sec_per_replica']:,.0f}",
                f"{1000 * result['step_time_median']:.1f}/{1000 * result['step_time_p90']:.1f}",
                f"{result['flops_per_sec'] / 1e12:.3f}",
                _percent(derived.get("flops_fraction_of_peak")),
                _times(derived.get("speedup_vs_float32")),
                _percent(derived.get("scaling_efficiency")),
                str(cell["global_batch_size"]),
                f"{result['peak_memory_mb']:,.{0 if result['peak_memory_mb'] >= 100 else 1}f} "
                f"{result['peak_memory_source']}",
                _times(derived.get("peak_memory_vs_float32")),
            )
        )
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)) for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += peak_lines(cells)
    lines += memory_report.lines(ratios, _devices)
    for row in ratios["speedup_vs_float32"]:
        lines.append(
            f"{row['precision']} / float32: {row['model']} {_devices(row)} xla={'on' if row['xla'] else 'off'}"
            f"{' fused norm' if row['fused_norm'] else ''}: {row['value']:.3f}x{spread(row)}"
        )
    for row in ratios["scaling_efficiency"]:
        lines.append(
            f"scaling efficiency: {row['model']} {row['precision']} {_devices(row)}: {row['value']:.3f}{spread(row)}"
        )
    for name, title in (
        ("engine_vs_keras_fit", "tfmp engine / Keras fit"),
        ("input_vs_synthetic", "real input / synthetic tensors"),
    ):
        for ratio in ratios[name]:
            how = " (timed in turn, one process)" if ratio.get("paired") else spread(ratio)
            lines.append(
                f"{title}: {ratio['model']} {ratio['precision']} xla={'on' if ratio['xla'] else 'off'}: "
                f"{ratio['value']:.3f}{how}"
            )
    for row in ratios.get("input_cost", []):
        lines.append(
            f"input cost, one thread, {row['image_size']}px: {row['pipeline']} {row['images_per_second']:.0f} "
            f"img/s / {row['reference']} {row['reference_images_per_second']:.0f} img/s: {row['value']:.2f}"
        )
    for cell in cells:
        if cell["kind"] == "pipeline":
            lines += [
                "",
                f"pipeline: {cell['model']} {cell['result']['rows'][0]['policy']}, global batch "
                f"{cell['global_batch_size']}, K=2 stages vs the unsplit model (rel)",
                pipeline_table(cell["result"]["rows"]),
            ]
    if ratios.get("pipeline_2d"):
        lines += ["", "two-dimensional parallelism (same worker processes, timed in turn):"]
        lines += [pipeline_2d_table(ratios["pipeline_2d"])]
    if ratios.get("threads"):
        lines += [
            "",
            "compute parallelism (baseline / variant, same run):",
            bench_threads.table(ratios["threads"]),
        ]
    lines += onednn.lines(cells)
    lines += engine_vs_fit.lines(cells)
    return "\n".join(lines)


def pipeline_table(rows: list[dict]) -> str:
    """The rows of a pipeline cell (`tfmp.bench.pipeline.measure`) as a plain-text table."""
    header = f"{'K':>2} {'M':>2} {'img/s':>8} {'rel':>5} {'bubble':>6} {'meas.':>6}"
    lines = [header + "  per device: parameters / activation MiB"]
    for row in rows:
        devices = "  ".join(
            f"{d['device'][-5:]} {d['parameters']:,} / {d['activation_bytes'] / 2**20:.1f}"
            for d in row["devices"]
        )
        theory = f"{row['bubble_theory']:.2f}" if "bubble_theory" in row else "-"
        measured = f"{row['bubble_measured']:.2f}" if "bubble_measured" in row else "-"
        lines.append(
            f"{row['stages']:>2} {row['micro_batches'] or '-':>2} {row['images_per_second']:8.1f} "
            f"{row['relative']:5.2f} {theory:>6} {measured:>6}  {devices}"
        )
    return "\n".join(lines)


def pipeline_2d_table(rows: list[dict]) -> str:
    """The `pipeline_2d` ratio rows as text: layout, img/s, relative to data parallelism, the
    bubble in theory and measured, each device's parameters."""
    lines = [
        f"{'layout':<18} {'W':>2} {'K':>2} {'M':>2} {'img/s':>8} {'rel':>5} {'bubble':>6} {'meas.':>6}  parameters"
    ]
    for row in rows:
        theory = "-" if row["bubble_theory"] is None else f"{row['bubble_theory']:.2f}"
        measured = "-" if row["bubble_measured"] is None else f"{row['bubble_measured']:.2f}"
        lines.append(
            f"{row['layout']:<18} {row['workers']:>2} {row['stages']:>2} {row['micro_batches'] or '-':>2} "
            f"{row['images_per_second']:8.1f} {row['value']:5.2f} {theory:>6} {measured:>6}  "
            + " / ".join(f"{count:,}" for count in row["parameters_per_device"])
        )
    return "\n".join(lines)


def layer_profile_table(cell: dict, top: int = 8) -> str:
    """A `layer_profile` cell as text: one row per layer class, the totals against the Engine
    step, the casts, and the `top` most expensive layer calls of the reference policy."""
    result = cell["result"]
    first, last = result["policies"][0], result["policies"][-1]
    totals = {policy: result["totals"][policy] for policy in (first, last)}
    header = ("class", "layers", "calls", f"ms {first}", f"ms {last}", "speedup", "share", "share")
    rows = [
        (
            entry["class"],
            str(entry["layers"]),
            str(entry["calls"]),
            f"{entry['ms'][first]:.2f}",
            f"{entry['ms'][last]:.2f}",
            _times(entry["speedup"]),
            _percent(entry["share"][first]),
            _percent(entry["share"][last]),
        )
        for entry in result["classes"]
    ]
    for label, key in (
        ("sum of layers", "layers_ms"),
        ("whole model fwd+bwd", "model_ms"),
        ("Engine train step", "step_ms"),
        ("outside the model fwd+bwd", "outside_model_ms"),
    ):
        values = [totals[policy][key] for policy in (first, last)]
        speedup = _times(values[0] / values[1]) if values[1] > 0 else ""
        shares = [_percent(totals[p][key] / totals[p]["step_ms"]) for p in (first, last)]
        rows.append((label, "", "", f"{values[0]:.2f}", f"{values[1]:.2f}", speedup, *shares))
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        f"layer profile: {cell['model']} {cell['image_size']}px, batch {cell['global_batch_size']}: each layer "
        f"call's forward + backward alone, median of {result['repeats']} interleaved rounds; share: of the "
        "Engine step, the model's fwd+bwd split in proportion to the classes' ms",
        *("  ".join(value.ljust(width) for value, width in zip(row, widths)) for row in [header, *rows]),
    ]
    lines.insert(2, "  ".join("-" * width for width in widths))
    lines.append(
        f"{result['calls']} layer calls, each timed with a tf.function call's fixed cost (an identity "
        f"function: {result['call_overhead_ms']:.3f} ms)"
    )
    mixed = totals[last]
    lines.append(
        f"Cast ops in the model's fwd+bwd graph: {first} {totals[first]['casts']}, {last} {mixed['casts']} "
        f"({mixed['bfloat16_casts']} to/from bfloat16, {mixed['bfloat16_cast_ms']:.2f} ms as one graph "
        "of tf.casts; already inside the layer rows)"
    )
    for policy in (first, last):
        repeats = ", ".join(f"{value:.1f}" for value in totals[policy]["step_ms_repeats"])
        lines.append(f"Engine step ms of each repeat, {policy}: {repeats}")
    lines.append(f"most expensive layer calls ({first} ms / {last} ms, input shapes):")
    for row in sorted(result["layers"], key=lambda row: -row["ms"][first])[:top]:
        lines.append(
            f"  {row['name']}#{row['call']} {row['class']}: {row['ms'][first]:.2f} / {row['ms'][last]:.2f} "
            f"{_times(row['speedup'])} {row['input_shapes']}"
        )
    return "\n".join(lines)


def peak_lines(cells: list[dict]) -> list[str]:
    """Each precision's matmul peak (what "% peak" divides by), every size's best, the method;
    then the precision probe's table and what --precision=auto and --mixed choose from it."""
    lines = []
    for cell in cells:
        if cell["kind"] == "peak":
            result = cell["result"]
            sizes = ", ".join(f"{row['size']}: {row['best_flops'] / 1e12:.3f}" for row in result["sizes"])
            lines.append(
                f"matmul peak {cell['precision']} ({result['dtype']}): {result['peak_flops'] / 1e12:.3f} "
                f"TFLOP/s at {result['matmul_size']}^2 (per size {sizes})"
            )
    methods = dict.fromkeys(c["result"]["method"] for c in cells if c["kind"] == "peak")
    lines += [f"peak method: {method}; % peak = model FLOP/s / this peak" for method in methods]
    for cell in cells:
        if cell["kind"] == "precision_probe" and "result" in cell:
            lines += cell["result"]["lines"]
            lines += [f"  would choose: {line}" for line in cell["result"]["choices"].values()]
    return lines


def _percent(value):
    return "" if value is None else f"{100 * value:.1f}%"


def _times(value):
    return "" if value is None else f"{value:.2f}x"


def _chart_group(cell: dict) -> str:
    return f"{_devices(cell)}{' xla' if cell['xla'] else ''}{' fused norm' if cell.get('fused_norm') else ''}"


def chart(cells: list[dict], path: str) -> str:
    """Bar chart of examples/s per precision and device count, one panel per model."""
    main = _main_cells(cells)
    model_names = list(dict.fromkeys(c["model"] for c in main))
    # A bare Figure renders to files through Agg without pyplot: no display, no global state.
    figure = Figure(figsize=(6 * max(1, len(model_names)), 4))
    axes = figure.subplots(1, max(1, len(model_names)), squeeze=False)
    for axis, model in zip(axes[0], model_names):
        mine = [c for c in main if c["model"] == model]
        groups = list(dict.fromkeys(_chart_group(c) for c in mine))
        precisions = list(dict.fromkeys(c["precision"] for c in mine))
        width = 0.8 / len(precisions)
        for offset, name in enumerate(precisions):
            values = []
            for group in groups:
                match = [c for c in mine if c["precision"] == name and _chart_group(c) == group]
                values.append(match[0]["result"]["examples_per_sec"] if match else 0)
            axis.bar([i + offset * width for i in range(len(groups))], values, width, label=name)
        axis.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], groups, fontsize=8)
        axis.set_title(model)
        axis.set_ylabel("examples/s")
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return path
