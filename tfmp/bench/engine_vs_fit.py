"""tfmp's Engine against Keras' fit in one process, in alternating rounds (`--engine_vs_fit`).

    cells = engine_vs_fit.cells(config, environment)   # one per classifier and precision
    engine_vs_fit.lines(measured_cells)                 # the report's table

Why: the matrix's engine / Keras fit ratio divides two cells that run in two processes. Even
timed in interleaved rounds (`tfmp.bench.rounds`), that ratio moved 0.82-1.08 from round to
round on a 2-core VM with nothing else running (docs/performance.md). Two processes differ in
where their threads and memory land. Here one cell process holds two copies of the model, built
with the same seed and so with the same initial weights: the engine trains one and Keras'
`model.fit` trains the other. There is one `fit` call with one epoch per round, and each epoch
starts with one engine repeat of the same steps, run in `on_epoch_begin` before fit's clock
starts: engine, fit, engine, fit, ... on the same threads and allocator.

A round's ratio is fit's seconds over the engine's for the same examples. The cell's value is
the median of the per-round ratios, shown with their range: above 1 the engine is faster. On
the AVX2 EPYC those ranges were ±1-3 %, where the two-process cells' were ±15 %. Peak memory is
left to the matrix's own cells, because here the two models share one allocator.

Like `tfmp.bench.matrix`, this runs in the parent and never imports TensorFlow; the cell's
measurement is `tfmp.bench.cell`'s.
"""

from __future__ import annotations

KIND = "engine_vs_fit"


def cells(config, environment) -> list[dict]:
    """With `engine_vs_fit` on: one cell per classifier of `models` and per precision, at the
    matrix's batch, data, steps per execution and first XLA and fused-layers settings (detectors
    have no plain-Keras fit here: their losses are tfmp's)."""
    if not config.engine_vs_fit:
        return []
    return [
        {
            "kind": KIND,
            "model": model,
            "precision": precision,
            "image_size": config.image_size,
            "global_batch_size": config.global_batch_size,
            "fused_norm": config.fused_norm[0],
            "data": config.data,
            "cache": config.cache,
            "xla": config.xla[0],
            "mode": "train",
            "replicas": 1,
            "workers": 0,
            "steps_per_execution": config.steps_per_execution,
            "warmup_executions": config.warmup_executions,
            "executions": config.executions,
            "min_repeat_seconds": config.min_repeat_seconds,
            "rounds": config.engine_vs_fit_rounds,
        }
        for model in config.models
        if not environment.is_detector(model)
        for precision in config.precisions
    ]


def describe(cell: dict) -> str:
    return (
        f"engine vs Keras fit in one process: {cell['model']} {cell['precision']} batch "
        f"{cell['global_batch_size']}, {cell['rounds']} alternating rounds"
    )


def headline(result: dict) -> str:
    """The one figure a progress line shows."""
    rounds = result["rounds"]
    return (
        f"engine / fit {result['value']:.3f} ({min(rounds):.2f}-{max(rounds):.2f}): engine "
        f"{result['engine_examples_per_sec']:,.1f}, fit {result['fit_examples_per_sec']:,.1f} examples/s"
    )


def lines(cells: list[dict]) -> list[str]:
    """The study's table: one row per model and precision."""
    measured = [cell for cell in cells if cell["kind"] == KIND and "result" in cell]
    if not measured:
        return []
    result = [
        "",
        "engine vs Keras fit, two copies of the model in one process, alternating rounds "
        "(median of the per-round ratios, their range):",
        f"  {'model':<14} {'precision':<16} {'batch':>5} {'engine ex/s':>12} {'fit ex/s':>10}  engine / fit",
    ]
    for cell in measured:
        measure = cell["result"]
        rounds = measure["rounds"]
        result.append(
            f"  {cell['model']:<14} {measure['policy']:<16} {cell['global_batch_size']:>5} "
            f"{measure['engine_examples_per_sec']:>12,.1f} {measure['fit_examples_per_sec']:>10,.1f}  "
            f"{measure['value']:.3f} ({min(rounds):.2f}-{max(rounds):.2f}, {len(rounds)} rounds)"
        )
    return result
