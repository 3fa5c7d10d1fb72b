"""Interleaved rounds: the cells a ratio divides, timed in turn, repeat by repeat.

    groups = rounds.groups(planned)                 # [[cell, cell, ...], ...]: one per model
    results = rounds.measure(group, command, env, timeout, progress)   # the parent (no TensorFlow)
    # in a cell process (tfmp.bench.cell): after its warm-up
    rounds.ready(cell); for r in range(cell["repeats"]): rounds.wait(cell, r); ...; rounds.done(cell, r)

Why: every ratio the bench prints divides two cells (mixed / float32, tfmp's engine / Keras fit,
fused / Keras' layers, N devices / one, real / synthetic input). Measured one after the other,
minutes apart, a shared 2-core VM's load moves such a ratio by up to ±30% (docs/performance.md:
the same pair gave engine / fit 0.88-1.08 in fresh processes). Here every engine and fit cell of
one model runs in its own process as before (device splits, thread pools, compiled graphs and
peak memory stay apart), but all of them are alive at once: each is started, traced and warmed
up alone, then waits; the parent times one repeat of each in turn, round after round (round r
starts at cell r mod n, so each cell takes every position: A, B, A, B / B, A, ...), and each
cell's result keeps its repeats in round order (`examples_per_sec_repeats`). A ratio is then the
median of its per-round ratios, with their spread (`tfmp.bench.report`): what the machine did
during a round falls on both cells alike. The cost is memory: every cell of the group is
resident at once (about 1 GB per TensorFlow process on a CPU).

The handshake is files in a private folder (`rounds_dir`): a multi-worker cell's processes all
wait for the same round file and time the round together; the chief writes `ready` after its
warm-up and `done` after each round.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time

from tfmp.distribute.workers import dies_with_this_process

POLL_SECONDS = 0.01  # a waiting cell polls its round file: ~no CPU, ~10 ms late at most


def groups(cells: list[dict], detectors=()) -> list[list[dict]]:
    """The engine and fit cells timed in interleaved rounds, one group per model (the cells every
    ratio of that model divides); cells timed otherwise (a detector's synthetic-input reference,
    which times the real pipeline in turn itself: `tfmp.bench.cell.is_paired`; the thread
    study's) are left out, and so are groups of one cell."""
    by_model: dict[str, list[dict]] = {}
    for cell in cells:
        paired = cell.get("reference") == "input" and cell.get("model") in detectors
        if cell["kind"] in ("engine", "fit") and not cell.get("study") and not paired:
            by_model.setdefault(cell["model"], []).append(cell)
    return [group for group in by_model.values() if len(group) > 1]


def paired_ratio(cell: dict, reference: dict, factor: float = 1.0) -> tuple[float, list[float]]:
    """(value, per-round ratios) of `cell`'s examples/s over `factor` x `reference`'s: the median
    of the per-round ratios when the two were timed in the same interleaved rounds
    (`measure`), else the ratio of their medians and no rounds."""
    mine, theirs = cell["result"], reference["result"]
    group = cell.get("round_group")
    repeats, reference_repeats = mine.get("examples_per_sec_repeats"), theirs.get("examples_per_sec_repeats")
    if group is not None and group == reference.get("round_group") and len(repeats) == len(reference_repeats):
        per_round = [a / (factor * b) for a, b in zip(repeats, reference_repeats)]
        return statistics.median(per_round), per_round
    return mine["examples_per_sec"] / (factor * theirs["examples_per_sec"]), []


def spread(row: dict) -> str:
    """How a ratio row was timed, as printed after its value: the range of its per-round ratios
    and their count, or that its two cells were timed apart."""
    per_round = row.get("rounds") or []
    if not per_round:
        return " (two cells timed apart)"
    return f" (median of {len(per_round)} rounds in turn: {min(per_round):.2f}-{max(per_round):.2f})"


# ----------------------------------------------------------------------------- in a cell
def _path(cell: dict, name: str) -> str:
    return os.path.join(cell["rounds_dir"], f"{cell['round_id']}.{name}")


def is_chief() -> bool:
    """Worker 0 of a launched group (or a process without TF_CONFIG) writes the handshake files."""
    task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
    return task.get("index", 0) == 0


def _signal(cell: dict, name: str) -> None:
    if is_chief():
        with open(_path(cell, name) + ".tmp", "w", encoding="utf-8") as file:
            file.write(str(time.time()))
        os.replace(_path(cell, name) + ".tmp", _path(cell, name))


def ready(cell: dict) -> None:
    """After the warm-up: the cell waits for its rounds."""
    _signal(cell, "ready")


def wait(cell: dict, index: int) -> None:
    """Until the parent starts this cell's round `index`."""
    while not os.path.exists(_path(cell, f"go{index}")):
        time.sleep(POLL_SECONDS)


def done(cell: dict, index: int) -> None:
    _signal(cell, f"done{index}")


# ----------------------------------------------------------------------------- in the parent
def _await(path: str, process: subprocess.Popen, what: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while not os.path.exists(path):
        if process.poll() is not None:
            raise RuntimeError(f"{what}: exited {process.returncode} before {os.path.basename(path)}")
        if time.time() > deadline:
            raise RuntimeError(f"{what}: no {os.path.basename(path)} after {timeout:g} s")
        time.sleep(POLL_SECONDS)


def measure(group: list[dict], command, env: dict, timeout: float, progress, parse, describe) -> list[dict]:
    """Starts every cell of `group` (`command(cell)` -> argv; each warmed up alone, in turn),
    times `repeats` rounds of one repeat per cell in turn, and returns each cell's result
    (`parse(stdout)`), in the group's order."""
    repeats = group[0]["repeats"]
    with tempfile.TemporaryDirectory(prefix="tfmp-rounds-") as folder:
        processes, outputs = [], []
        try:
            for index, cell in enumerate(group):
                spec = dict(cell, rounds_dir=folder, round_id=index)
                out = open(os.path.join(folder, f"{index}.out"), "w+", encoding="utf-8")  # noqa: SIM115
                outputs.append(out)
                processes.append(
                    subprocess.Popen(
                        command(spec),
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=env,
                        preexec_fn=dies_with_this_process(),  # a SIGKILLed bench leaves no cell behind
                    )
                )
                progress(f"  warming up {describe(cell)} ...")
                _await(os.path.join(folder, f"{index}.ready"), processes[-1], describe(cell), timeout)
            for number in range(repeats):
                order = [(number + offset) % len(group) for offset in range(len(group))]
                for index in order:
                    open(os.path.join(folder, f"{index}.go{number}"), "w").close()
                    _await(
                        os.path.join(folder, f"{index}.done{number}"),
                        processes[index],
                        describe(group[index]),
                        timeout,
                    )
                progress(f"  round {number + 1}/{repeats} timed ({len(group)} cells in turn)")
            results = []
            for index, process in enumerate(processes):
                process.wait(timeout)
                outputs[index].seek(0)
                text = outputs[index].read()
                result = parse(text)
                if result is None:
                    tail = " | ".join(text.strip().splitlines()[-5:])
                    raise RuntimeError(
                        f"bench cell '{describe(group[index])}' failed (exit {process.returncode}): {tail}"
                    )
                results.append(result)
            return results
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
            for out in outputs:
                out.close()
