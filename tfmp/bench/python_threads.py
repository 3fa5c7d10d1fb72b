"""Python threads vs the GIL, measured in one fresh process: `{"kind": "python_threads"}` cells.

    from tfmp.bench import python_threads
    result = python_threads.measure(unit_seconds=1.0)   # in a fresh process (sets TF's pools)

The same total work, 2 units, of a pure-Python loop (`tfmp.bench.threads.python_loop`) on 1
thread, on 2 threads and on 2 processes, and of a TensorFlow function (a chain of 256x256
matmuls, intra-op pool of 1 thread) on 1 and 2 Python threads; best of REPEATS, timed in turns.
`tfmp.bench.threads.rows` turns the seconds into speedups over 1 thread.
"""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time

import tensorflow as tf

from tfmp.bench.threads import python_loop
from tfmp.distribute import strategies as distribute

REPEATS = 3  # best of


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


def measure(unit_seconds: float = 1.0) -> dict:
    """Seconds for 2 units of work: pure Python on 1/2 threads and 2 processes, a TensorFlow
    function on 1/2 Python threads (intra-op pool of 1 thread, so one call uses one core).
    Call in a fresh process: it sets TensorFlow's intra-op pool before TensorFlow starts."""
    count = _calibrate(python_loop, unit_seconds, 100_000)
    # Processes started (and warmed up) before timing: the figure is the work, not the start.
    with _LoopProcesses(2) as processes:
        processes.run(1)
        python = _best(
            {
                "one_thread": lambda: _serial(python_loop, [count, count]),
                "two_threads": lambda: _on_threads(python_loop, [count, count]),
                "two_processes": lambda: _timed(processes.run, count),
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


class _LoopProcesses:
    """Python processes that each run `python_loop(count)` per line of input and answer a line.

    Plain interpreters that import only `tfmp.bench.threads` (no TensorFlow): a multiprocessing
    pool would re-import this cell's main module, TensorFlow included, in every child, and
    forking a process that has loaded TensorFlow is unsafe."""

    SCRIPT = (
        "import sys\nfrom tfmp.bench.threads import python_loop\n"
        "for line in sys.stdin:\n    python_loop(int(line))\n    print('done', flush=True)\n"
    )

    def __init__(self, count: int):
        self.processes = [
            subprocess.Popen(
                [sys.executable, "-c", self.SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            for _ in range(count)
        ]

    def run(self, count: int) -> None:
        """python_loop(count) in every process at once; returns when all are done."""
        for process in self.processes:
            process.stdin.write(f"{count}\n")
            process.stdin.flush()
        for process in self.processes:
            if process.stdout.readline().strip() != "done":
                raise RuntimeError(f"a python_loop process failed (exit {process.wait()})")

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        for process in self.processes:
            process.stdin.close()
            process.wait()


def _timed(function, *arguments) -> float:
    started = time.perf_counter()
    function(*arguments)
    return time.perf_counter() - started


def _tensorflow_threads(unit_seconds: float) -> dict:
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
