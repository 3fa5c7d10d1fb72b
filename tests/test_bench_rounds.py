"""Interleaved rounds (tfmp.bench.rounds): which cells are timed together, the handshake that
times one repeat of each in turn, round after round, and ratios as the median of per-round
ratios. Stand-in cell processes (plain Python, no TensorFlow): about 2 s.

    .venv/bin/python -m pytest tests/test_bench_rounds.py -q -n 0
"""

import json
import sys
import time

import pytest

from tfmp.bench import report as bench_report
from tfmp.bench import rounds

# A stand-in cell: warms up, then for each of its repeats waits for its turn, records when it
# ran, and prints a result whose examples_per_sec_repeats are its round numbers x its "speed".
STAND_IN = """
import json, sys, time
from tfmp.bench import rounds
cell = json.loads(sys.argv[1])
if cell.get("fail"):
    sys.exit(3)
time.sleep(0.05)
rounds.ready(cell)
ran = []
for index in range(cell["repeats"]):
    rounds.wait(cell, index)
    ran.append(time.time())
    time.sleep(0.02)
    rounds.done(cell, index)
print("BENCH_RESULT " + json.dumps({"ran": ran, "speed": cell["speed"]}), flush=True)
"""


def _command(cell):
    return [sys.executable, "-c", STAND_IN, json.dumps(cell)]


def _parse(text):
    for line in text.splitlines():
        if line.startswith("BENCH_RESULT "):
            return json.loads(line[len("BENCH_RESULT ") :])
    return None


def _measure(group, timeout=60):
    return rounds.measure(
        group, _command, None, timeout, lambda line: None, _parse, lambda cell: cell["name"]
    )


def test_each_round_times_every_cell_once_in_turn_each_taking_every_position():
    """Round r runs the cells one at a time starting at cell r mod n: A B C / B C A / C A B / A B C."""
    group = [{"name": name, "repeats": 4, "speed": 1} for name in "ABC"]
    results = _measure(group)
    events = sorted(
        (ran, name)
        for cell, result in zip(group, results)
        for ran, name in ((t, cell["name"]) for t in result["ran"])
    )
    assert "".join(name for _, name in events) == "ABC" + "BCA" + "CAB" + "ABC"
    # One at a time: each round of a cell ends before the next cell's starts.
    starts = [ran for ran, _ in events]
    assert all(later - earlier >= 0.02 for earlier, later in zip(starts, starts[1:]))


def test_a_cell_that_dies_before_its_rounds_is_named():
    group = [{"name": "A", "repeats": 2, "speed": 1}, {"name": "B", "repeats": 2, "speed": 1, "fail": True}]
    with pytest.raises(RuntimeError, match="^B: exited 3 before 1.ready"):
        _measure(group)


def test_groups_are_the_engine_and_fit_cells_of_one_model():
    """Every engine and fit cell of a model in one group; a detector's synthetic-input reference
    (it times the real pipeline in turn itself), the thread study's cells, other kinds and a lone
    cell are timed alone."""
    cells = [
        {"kind": "peak", "precision": "float32"},
        {"kind": "engine", "model": "a", "precision": "float32"},
        {"kind": "engine", "model": "a", "precision": "mixed_bfloat16"},
        {"kind": "fit", "model": "a", "precision": "float32"},
        {"kind": "engine", "model": "a", "reference": "input", "precision": "float32"},
        {"kind": "engine", "model": "d", "precision": "float32"},
        {"kind": "engine", "model": "d", "reference": "input", "precision": "float32"},
        {"kind": "engine", "model": "a", "study": "threads", "precision": "float32"},
    ]
    (group,) = rounds.groups(cells, detectors={"d"})
    assert group == cells[1:5]


def _cell(kind="engine", precision="float32", repeats=(100.0, 50.0, 100.0), group=0, **extra):
    values = dict(kind=kind, model="m", precision=precision, xla=False, mode="train", data="builtin")
    values.update(replicas=1, workers=0, global_batch_size=8, round_group=group, **extra)
    result = {
        "examples_per_sec": sorted(repeats)[len(repeats) // 2],
        "examples_per_sec_repeats": list(repeats),
        "flops_per_sec": 1.0,
        "policy": precision,
        "peak_memory_mb": 10.0,
        "peak_memory_source": "cpu",
        "peak_host_memory_mb": 100.0,
        "host_memory_before_model_mb": 50.0,
    }
    return dict(values, result=result)


def test_a_ratio_is_the_median_of_its_per_round_ratios():
    """The second round was slow for both cells (a neighbour's load): per round the mixed cell is
    2x float32 every time, while the ratio of the two medians would say 1.0."""
    float32 = _cell(repeats=(100.0, 50.0, 100.0))
    mixed = _cell(precision="mixed_bfloat16", repeats=(200.0, 100.0, 100.0))
    fit = _cell(kind="fit", repeats=(50.0, 25.0, 200.0))
    ratios = bench_report.derive([float32, mixed, fit])
    (speedup,) = ratios["speedup_vs_float32"]
    assert speedup["rounds"] == [2.0, 2.0, 1.0] and speedup["value"] == 2.0
    (engine,) = ratios["engine_vs_keras_fit"]
    assert engine["rounds"] == [2.0, 2.0, 0.5] and engine["value"] == 2.0
    assert rounds.spread(speedup) == " (median of 3 rounds in turn: 1.00-2.00)"
    # Cells of different groups (or an old report without rounds) divide their medians.
    apart = bench_report.derive(
        [float32, _cell(precision="mixed_bfloat16", repeats=(200.0, 100.0, 100.0), group=1)]
    )
    assert apart["speedup_vs_float32"][0] == dict(apart["speedup_vs_float32"][0], value=1.0, rounds=[])


def test_handshake_files_are_written_by_the_chief_only(tmp_path, monkeypatch):
    cell = {"rounds_dir": str(tmp_path), "round_id": 0}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"task": {"type": "worker", "index": 1}}))
    rounds.ready(cell)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("TF_CONFIG", json.dumps({"task": {"type": "worker", "index": 0}}))
    rounds.ready(cell)
    assert [path.name for path in tmp_path.iterdir()] == ["0.ready"]
    started = time.time()
    (tmp_path / "0.go0").touch()
    rounds.wait(cell, 0)
    assert time.time() - started < 1
