"""Compute-parallelism study: what TensorFlow's thread pools, tf.data's private pool and
`steps_per_execution` buy, and what Python threads buy (the GIL), side by side in one run.

    from tfmp.bench import threads as bench_threads
    rows = bench_threads.measure("seed_cnn", image_size=32, global_batch=64)
    print(bench_threads.table(rows))

Two kinds of measurement, each in a fresh process (`tfmp.bench.cell`), because TensorFlow
fixes its thread pools when its runtime starts:

* engine cells (`cells`): one model trained through the Engine on the built-in data (not
  cached, so the input pipeline works every step). A baseline with THREADS intra-op, THREADS
  inter-op and THREADS tf.data threads and LONG_EXECUTION steps per host call; one cell per
  knob with that knob at 1; and TensorFlow's defaults. A row's ratio is baseline / variant:
  what the extra threads (or the longer host call) buy.
* one `python_threads` cell (`measure_python_threads`): the same total work, 2 units, of a
  pure-Python loop on 1 thread, on 2 threads and on 2 processes, and of a TensorFlow
  function (a chain of matmuls) on 1 and 2 Python threads. Ratios are speedups over 1 thread.

`rows(cells)` turns measured cells into rows {"knob", "setting", "value", "reference", "unit",
"ratio"}; `table(rows)` prints them.
"""

from __future__ import annotations

import math
import multiprocessing
import threading
import time

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
REPEATS = 3  # best of, for the Python measurements


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


def _python_loop(count: int) -> int:
    """Pure-Python CPU work: holds the GIL the whole time."""
    total = 0
    for index in range(count):
        total += index * index % 7
    return total


def _on_threads(function, arguments) -> float:
    """Seconds to run function(argument) for every argument, each on its own Python thread."""
    workers = [threading.Thread(target=function, args=(argument,)) for argument in arguments]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return time.perf_counter() - started


def _serial(function, arguments) -> float:
    started = time.perf_counter()
    for argument in arguments:
        function(argument)
    return time.perf_counter() - started


def _calibrate(function, unit_seconds: float, start: int) -> int:
    """A count for which function(count) takes about `unit_seconds` (at least 0.05 s)."""
    count, seconds = start, _serial(function, [start])
    while seconds < 0.02:  # too short to scale from reliably
        count *= 4
        seconds = _serial(function, [count])
    return max(1, math.ceil(count * max(unit_seconds, 0.05) / seconds))


def _best(runs: dict, repeats: int) -> dict:
    """Best seconds of each named run, timed in turns so drifting load hits every run alike."""
    best = dict.fromkeys(runs, math.inf)
    for _ in range(repeats):
        for name, run in runs.items():
            best[name] = min(best[name], run())
    return best


def measure_python_threads(unit_seconds: float = 1.0) -> dict:
    """Seconds for 2 units of work: pure Python on 1/2 threads and 2 processes, a TensorFlow
    function on 1/2 Python threads (intra-op pool of 1 thread, so one call uses one core).
    Call in a fresh process: it sets TensorFlow's intra-op pool before TensorFlow starts."""
    count = _calibrate(_python_loop, unit_seconds, 100_000)
    # Processes started (and warmed up) before timing: the figure is the work, not the spawn.
    # "spawn" because forking a process that has started TensorFlow's threads is unsafe.
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        pool.map(_python_loop, [1, 1])
        python = _best(
            {
                "one_thread": lambda: _serial(_python_loop, [count, count]),
                "two_threads": lambda: _on_threads(_python_loop, [count, count]),
                "two_processes": lambda: _timed(pool.map, _python_loop, [count, count]),
            },
            REPEATS,
        )
    tensorflow = _tensorflow_threads(unit_seconds)
    return {
        "python_loop_count": count,
        "python_seconds": python,
        "tensorflow_matmuls": tensorflow.pop("count"),
        "tensorflow_seconds": tensorflow,
        "unit_seconds": unit_seconds,
    }


def _timed(function, *arguments) -> float:
    started = time.perf_counter()
    function(*arguments)
    return time.perf_counter() - started


def _tensorflow_threads(unit_seconds: float) -> dict:
    import tensorflow as tf

    from tfmp.distribute import strategies as distribute

    distribute.set_threads(intra_op=1)  # one core per op: a second core only via a second caller
    weights = tf.random.uniform([256, 256], dtype=tf.float32) / 256

    @tf.function
    def matmuls(count):
        values = weights
        for _ in tf.range(count):
            values = tf.tanh(tf.linalg.matmul(values, weights))  # tanh keeps the chain bounded
        return tf.reduce_sum(values)

    def run(count):
        return matmuls(tf.constant(count)).numpy()

    run(1)  # trace
    count = _calibrate(run, unit_seconds, 50)
    seconds = _best(
        {
            "one_thread": lambda: _serial(run, [count, count]),
            "two_threads": lambda: _on_threads(run, [count, count]),
        },
        REPEATS,
    )
    return dict(seconds, count=count)


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


def measure(
    model_name: str = "seed_cnn",
    image_size: int = 32,
    global_batch: int = 64,
    unit_seconds: float = 1.0,
    base: dict | None = None,
    rounds: int = 2,
    progress=print,
) -> list[dict]:
    """Runs the whole study (one fresh process per cell, via `tfmp.bench`) and returns rows."""
    from tfmp.bench import matrix as bench

    timing = {"warmup_executions": 3, "executions": 5, "min_repeat_seconds": 1.5, "repeats": 5}
    planned = cells(model_name, image_size, global_batch, dict(timing, **(base or {})), rounds)
    planned.append(python_cell(unit_seconds))
    for cell in planned:
        progress(f"{bench.describe_cell(cell)} ...")
        cell["result"] = bench.measure(cell, timeout=1800)
    return rows(planned)


def table(rows_: list[dict]) -> str:
    """The rows as plain text: setting, the two figures, the ratio."""
    lines = []
    for row in rows_:
        lines.append(
            f"{row['setting']}: {row['value']:,.1f} vs {row['reference']:,.1f} {row['unit']} "
            f"= {row['ratio']:.2f}x"
        )
    return "\n".join(lines)
