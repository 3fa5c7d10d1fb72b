"""Compute-parallelism study: what TensorFlow's thread pools, tf.data's private pool and
`steps_per_execution` buy, and what Python threads buy (the GIL), side by side in one run.

    python -m apps.bench --threads_study --study_model=seed_cnn     # see configs/bench_parallelism_cpu.cfg
    planned = bench_threads.cells("seed_cnn", 32, 64, timing) + [bench_threads.python_cell(1.0)]
    print(bench_threads.table(bench_threads.rows(measured_cells)))

This module plans the cells and reads their results (parent side, no TensorFlow). Two kinds
of measurement, each in a fresh process (`tfmp.bench.cell`), because TensorFlow fixes its
thread pools when its runtime starts:

* engine cells (`cells`): one model trained through the Engine on the built-in data (not
  cached, so the input pipeline works every step). A baseline with THREADS intra-op, THREADS
  inter-op and THREADS tf.data threads and LONG_EXECUTION steps per host call; one cell per
  knob with that knob at 1; and TensorFlow's defaults. A row's ratio is baseline / variant:
  what the extra threads (or the longer host call) buy.
* one `python_threads` cell (`tfmp.bench.python_threads.measure`): the same total work, 2 units, of a
  pure-Python loop on 1 thread, on 2 threads and on 2 processes, and of a TensorFlow
  function (a chain of matmuls) on 1 and 2 Python threads. Ratios are speedups over 1 thread.

`rows(cells)` turns measured cells into rows {"knob", "setting", "value", "reference", "unit",
"ratio"}; `table(rows)` prints them.
"""

from __future__ import annotations

THREADS = 2  # "more than one" on the 2-core CI machine; the ratios are 2 vs 1
LONG_EXECUTION = 10  # steps per host call of the baseline (vs 1)
# (knob, the cell's settings that differ from the baseline, what the ratio compares)
VARIANTS = (
    ("intra_op_threads", {"intra_op_threads": 1}, f"{THREADS} vs 1 intra-op threads"),
    ("inter_op_threads", {"inter_op_threads": 1}, f"{THREADS} vs 1 inter-op threads"),
    ("data_threads", {"data_threads": 1}, f"{THREADS} vs 1 tf.data private-pool threads"),
    ("steps_per_execution", {"steps_per_execution": 1}, f"{LONG_EXECUTION} vs 1 steps per host call"),
    (
        "tensorflow_defaults",
        {"intra_op_threads": 0, "inter_op_threads": 0, "data_threads": 0},
        f"{THREADS}/{THREADS}/{THREADS} threads vs TensorFlow's defaults",
    ),
)


def cells(model: str, image_size: int, global_batch: int, base: dict, rounds: int = 1) -> list[dict]:
    """The engine cells of the study (`base`: the bench's timing keys), baseline first in
    each of `rounds` rounds."""
    baseline = dict(
        base,
        kind="engine",
        study="threads",
        knob="baseline",
        model=model,
        precision="float32",
        xla=False,
        tf32=True,
        fused_norm=False,
        replicas=1,
        workers=0,
        data="builtin",
        cache=False,
        mode="train",
        image_size=image_size,
        global_batch_size=global_batch,
        intra_op_threads=THREADS,
        inter_op_threads=THREADS,
        data_threads=THREADS,
        steps_per_execution=LONG_EXECUTION,
    )
    one_round = [baseline] + [dict(baseline, knob=knob, **changes) for knob, changes, _ in VARIANTS]
    return [dict(cell, round=index) for index in range(1, rounds + 1) for cell in one_round]


def python_cell(unit_seconds: float) -> dict:
    return {"kind": "python_threads", "study": "threads", "unit_seconds": unit_seconds}


def python_loop(count: int) -> int:
    """Pure-Python CPU work: holds the GIL the whole time. It lives here, in a module without
    TensorFlow, because the worker processes of `tfmp.bench.python_threads` import it."""
    total = 0
    for index in range(count):
        total += index * index % 7
    return total


def rows(cells_: list[dict]) -> list[dict]:
    """Ratio rows from measured study cells (cells without a result are skipped)."""
    measured = {}
    for cell in cells_:  # each setting's best round
        if cell.get("study") == "threads" and cell["kind"] == "engine" and "result" in cell:
            best = measured.get(cell["knob"])
            if best is None or cell["result"]["examples_per_sec"] > best["examples_per_sec"]:
                measured[cell["knob"]] = cell["result"]
    result = []
    baseline = measured.get("baseline")
    for knob, _, setting in VARIANTS:
        if baseline and knob in measured:
            value, reference = baseline["examples_per_sec"], measured[knob]["examples_per_sec"]
            result.append(
                {
                    "knob": knob,
                    "setting": setting,
                    "value": value,
                    "reference": reference,
                    "unit": "examples/s",
                    "ratio": value / reference,
                }
            )
    python = next((c["result"] for c in cells_ if c["kind"] == "python_threads" and "result" in c), None)
    if python:
        for group, label, names in (
            ("python_seconds", "pure-Python loop", ("two_threads", "two_processes")),
            ("tensorflow_seconds", "TensorFlow function (GIL released)", ("two_threads",)),
        ):
            seconds = python[group]
            for name in names:
                how = name.replace("two_", "2 ")
                result.append(
                    {
                        "knob": f"{group.split('_')[0]}_{name}",
                        "setting": f"{label}: {how} vs 1 thread",
                        "value": 2 / seconds[name],
                        "reference": 2 / seconds["one_thread"],
                        "unit": "work units/s",
                        "ratio": seconds["one_thread"] / seconds[name],
                    }
                )
    return result


def table(rows_: list[dict]) -> str:
    """The rows as plain text: setting, the two figures, the ratio."""
    lines = []
    for row in rows_:
        lines.append(
            f"{row['setting']}: {row['value']:,.1f} vs {row['reference']:,.1f} {row['unit']} "
            f"= {row['ratio']:.2f}x"
        )
    return "\n".join(lines)
