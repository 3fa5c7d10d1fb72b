"""The scaling model (tfmp.distribute.scaling) on hand-computed numbers, and apps.scaling's input.

.venv/bin/python -m pytest -q -n0 tests/test_scaling.py
"""

import json
import math
import os
import sys

import pytest
from conftest import ROOT, run_python

from tfmp.bench import scaling_measure
from tfmp.distribute import scaling, scaling_anchors
from tfmp.errors import UsageError

# 1 GB/s, 1 us per ring step: every term below is easy to compute by hand.
SIMPLE = scaling.Link("simple", 1e9, 1e-6, None, "test")
NO_LATENCY = scaling.Link("no latency", 1e9, 0.0, None, "test")


def test_ring_allreduce_time_is_two_n_minus_one_over_n_bytes_over_bandwidth_plus_its_steps():
    # 4 devices, 1e9 bytes: each sends 2*3/4 * 1e9 bytes at 1e9 B/s = 1.5 s, in 6 steps of 1 us.
    assert scaling.ring_allreduce_seconds(1e9, 4, SIMPLE) == pytest.approx(1.5 + 6e-6, rel=1e-12)
    # 2 devices: 1 x the bytes, 2 steps; 3 calls (buckets) pay the steps' latency 3 times.
    assert scaling.ring_allreduce_seconds(2e6, 2, SIMPLE, calls=3) == pytest.approx(2e-3 + 6e-6, rel=1e-12)
    assert scaling.ring_allreduce_seconds(1e9, 1, SIMPLE) == 0.0


def test_prediction_adds_the_allreduce_to_the_step_and_divides():
    prediction = scaling.predict(0.1, int(1e8), 8, NO_LATENCY, bucket_bytes=0)
    allreduce = 2 * 7 / 8 * 1e8 / 1e9  # 0.175 s
    assert prediction.allreduce_seconds == pytest.approx(allreduce)
    assert prediction.step_seconds == pytest.approx(0.1 + allreduce)
    assert prediction.efficiency == pytest.approx(0.1 / (0.1 + allreduce))
    # One call (bucket_bytes=0) cannot overlap the backward pass.
    assert prediction.buckets == 1 and prediction.efficiency_overlapped == prediction.efficiency
    assert scaling.predict(0.1, int(1e8), 1, SIMPLE).efficiency == 1.0


def test_buckets_hide_at_most_the_backward_pass_and_never_the_last_bucket():
    compute, nbytes = 0.3, int(4e8)  # all-reduce over 2 devices: 0.4 s; backward pass: 0.2 s
    hidden = scaling.predict(compute, nbytes, 2, NO_LATENCY, bucket_bytes=int(1e8))
    assert hidden.buckets == 4
    assert hidden.step_seconds_overlapped == pytest.approx(compute + 0.4 - 2 / 3 * compute)
    # A fast link: everything but the last bucket's 0.1 GB (0.1 s) hides behind 0.2 s of backward.
    fast = scaling.Link("fast", 4e9, 0.0, None, "test")
    assert scaling.predict(compute, nbytes, 2, fast, bucket_bytes=int(1e8)).step_seconds_overlapped == (
        pytest.approx(compute + 0.025)
    )
    assert scaling.predict(compute, nbytes, 2, NO_LATENCY, int(1e8), overlap=0.0).step_seconds_overlapped == (
        pytest.approx(compute + 0.4)
    )


@pytest.mark.parametrize("overheads", [scaling.NO_OVERHEADS, scaling_anchors.dgx_a100_overheads(256)])
@pytest.mark.parametrize("link", sorted(scaling.LINKS))
def test_efficiency_falls_as_devices_are_added(link, overheads):
    nbytes = scaling.gradient_bytes(25_557_032, "float32")
    devices = (1, 2, 8, 64, 256, 4096)
    predictions = [
        scaling.predict(0.108, nbytes, n, scaling.LINKS[link], overheads=overheads) for n in devices
    ]
    for fewer, more in zip(predictions, predictions[1:]):
        assert more.efficiency < fewer.efficiency
        assert more.efficiency_overlapped <= fewer.efficiency_overlapped


def test_half_precision_halves_the_bytes_and_the_bandwidth_time():
    for half in ("bfloat16", "float16"):
        assert 2 * scaling.gradient_bytes(86_567_656, half) == scaling.gradient_bytes(86_567_656, "float32")
    float32, bfloat16 = (scaling.gradient_bytes(1000, dtype) for dtype in ("float32", "bfloat16"))
    assert scaling.ring_allreduce_seconds(bfloat16, 8, NO_LATENCY) == pytest.approx(
        scaling.ring_allreduce_seconds(float32, 8, NO_LATENCY) / 2
    )
    with pytest.raises(UsageError, match="unknown all-reduce dtype 'int8'"):
        scaling.gradient_bytes(1000, "int8")


def test_a_link_fitted_to_ring_times_gives_back_its_bandwidth_and_latency():
    sizes = [2**16, 2**20, 2**22, 2**24]
    for devices in (2, 4):
        times = [scaling.ring_allreduce_seconds(size, devices, SIMPLE) for size in sizes]
        fitted = scaling.fit_link("fitted", devices, sizes, times)
        assert fitted.bandwidth == pytest.approx(SIMPLE.bandwidth, rel=1e-9)
        assert fitted.step_latency == pytest.approx(SIMPLE.step_latency, rel=1e-6)


def test_the_expected_maximum_of_n_standard_normals_is_exact_at_two_and_three_and_grows():
    # E[max of 2] = 1/sqrt(pi); E[max of 3] = 3/(2 sqrt(pi)) (the closed forms).
    assert scaling.expected_max_standard_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-9)
    assert scaling.expected_max_standard_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), rel=1e-9)
    assert scaling.expected_max_standard_normal(8) == pytest.approx(1.4236, abs=1e-4)  # tables
    assert scaling.expected_max_standard_normal(1) == 0.0
    counts = [1, 2, 3, 4, 8, 16, 64, 256, 1024, 4096]
    values = [scaling.expected_max_standard_normal(count) for count in counts]
    assert all(fewer < more for fewer, more in zip(values, values[1:]))
    assert values[-1] < math.sqrt(2 * math.log(4096))  # the known bound
    with pytest.raises(UsageError, match="0 devices"):
        scaling.expected_max_standard_normal(0)


def test_stragglers_add_sigma_times_the_expected_maximum_and_nothing_at_one_device():
    overheads = scaling.Overheads(step_cv=0.05)
    for devices in (2, 8):
        prediction = scaling.predict(0.1, 0, devices, NO_LATENCY, bucket_bytes=0, overheads=overheads)
        expected = 0.05 * 0.1 * scaling.expected_max_standard_normal(devices)
        assert prediction.straggler_seconds == pytest.approx(expected)
        assert prediction.step_seconds == pytest.approx(0.1 + expected)
    assert scaling.predict(0.1, 0, 1, NO_LATENCY, overheads=overheads).efficiency == 1.0


def test_synchronisation_is_paid_per_step_and_blocking_collectives_per_ring_step():
    overheads = scaling.Overheads(sync_seconds=0.002, blocking_collectives=10)
    prediction = scaling.predict(0.1, 0, 4, SIMPLE, bucket_bytes=0, overheads=overheads)
    # 10 small all-reduces, each 2(4-1) = 6 ring steps of 1 us, plus the empty gradient call's 6.
    assert prediction.sync_seconds == pytest.approx(0.002 + 60e-6)
    assert prediction.step_seconds == pytest.approx(0.1 + 0.002 + 60e-6 + 6e-6)
    assert scaling.predict(0.1, 0, 1, SIMPLE, overheads=overheads).sync_seconds == 0.0


def test_the_input_pipeline_stalls_a_step_only_when_the_shared_cores_cannot_keep_up():
    # 8 devices share 16 cores; each device's input needs 1 core-second per step.
    host = {"input_core_seconds": 1.0, "host_cores": 16, "devices_per_host": 8}
    fast = scaling.predict(1.0, 0, 8, NO_LATENCY, bucket_bytes=0, overheads=scaling.Overheads(**host))
    assert fast.input_stall_seconds == 0.0 and fast.efficiency == 1.0  # 8 x 1 / 16 = 0.5 s < 1 s
    slow = scaling.predict(0.25, 0, 8, NO_LATENCY, bucket_bytes=0, overheads=scaling.Overheads(**host))
    assert slow.step_seconds == pytest.approx(0.5) and slow.efficiency == pytest.approx(0.5)
    assert slow.input_stall_seconds == pytest.approx(0.25)


def test_more_one_core_workers_than_cores_stretch_the_compute_by_the_busiest_core():
    overheads = scaling.Overheads(compute_cores=1, host_cores=2, devices_per_host=64)
    stretched = {
        n: scaling.predict(0.2, 0, n, NO_LATENCY, bucket_bytes=0, overheads=overheads).contention_seconds
        for n in (1, 2, 3, 4, 5)
    }
    # Pinned round-robin: 3 or 4 workers put 2 on a core, 5 put 3.
    assert stretched == pytest.approx({1: 0.0, 2: 0.0, 3: 0.2, 4: 0.2, 5: 0.4})
    # A busy host whose other sessions leave this one a quarter of its 2 cores (Linux autogroup
    # scheduling shares it per session): 1 worker already runs at half speed, k workers at 1/(2k).
    shared = scaling.Overheads(compute_cores=1, host_cores=2, devices_per_host=64, host_share=0.25)
    efficiencies = [
        scaling.predict(0.2, 0, n, NO_LATENCY, bucket_bytes=0, overheads=shared).efficiency
        for n in (1, 2, 3, 4)
    ]
    assert efficiencies == pytest.approx([1.0, 1 / 2, 1 / 3, 1 / 4])
    gpu = scaling.Overheads(compute_cores=0, host_cores=128, devices_per_host=8)
    assert scaling.predict(0.2, 0, 8, NO_LATENCY, overheads=gpu).contention_seconds == 0.0


@pytest.mark.parametrize("name", sorted(scaling_anchors.ANCHORS))
def test_every_anchor_is_predicted_within_tolerance_or_its_residual_is_known(name):
    """The residuals as docs/distributed.md quotes them: a change to a term shows up here."""
    anchor = scaling_anchors.ANCHORS[name]
    prediction = anchor.predict()
    residual = prediction.efficiency_overlapped - anchor.published_efficiency
    known = {"resnet50_a100_amp": 0.040, "resnet50_a100_tf32": 0.008}
    assert residual == pytest.approx(known[name], abs=0.0015)
    assert abs(residual) <= scaling_anchors.ANCHOR_TOLERANCE or name in MISSED_ANCHORS
    # Every term is there and from its source, not zero by omission.
    assert prediction.sync_seconds > 0 and prediction.straggler_seconds > 0
    assert anchor.overheads.input_core_seconds > 0 and "DeepLearningExamples" in anchor.source


MISSED_ANCHORS = {"resnet50_a100_amp"}  # printed with its residual (apps.scaling marks it *)


def test_anchor_efficiencies_are_the_published_throughput_ratios():
    amp, tf32 = scaling_anchors.ANCHORS["resnet50_a100_amp"], scaling_anchors.ANCHORS["resnet50_a100_tf32"]
    assert amp.published_efficiency == pytest.approx(7.32 / 8, abs=0.001)  # the README's 7.32x
    assert tf32.published_efficiency == pytest.approx(7.70 / 8, abs=0.001)  # and 7.70x


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"sync_seconds": -1.0}, "sync_seconds -1.0 must be a finite number"),
        ({"step_cv": math.nan}, "step_cv nan must be a finite number"),
        ({"host_cores": -2}, "host_cores -2 must be 0"),
        ({"devices_per_host": 0}, "devices_per_host 0 at least 1"),
        ({"host_share": 0.0}, "host_share 0.0 must be a fraction of the host"),
    ],
)
def test_impossible_overheads_are_refused(changes, message):
    with pytest.raises(UsageError, match=message):
        scaling.check_overheads(scaling.Overheads(**changes))


@pytest.mark.parametrize(
    "arguments, message",
    [
        ((0.0, 10, 8, SIMPLE), "step time 0.0 s must be a positive"),
        ((-1.0, 10, 8, SIMPLE), "step time -1.0 s must be a positive"),
        ((math.nan, 10, 8, SIMPLE), "step time nan s must be a positive"),
        ((0.1, 10, 0, SIMPLE), "0 devices: give at least 1"),
        ((0.1, 10, 8, scaling.Link("dead", 0.0, 0.0, None, "")), "bandwidth 0.0 bytes/s must be positive"),
    ],
)
def test_predict_refuses_values_no_prediction_comes_from(arguments, message):
    with pytest.raises(UsageError, match=message):
        scaling.predict(*arguments)


def _cell(workers, examples_per_sec, precision="float32", model="seed_cnn", **result):
    """An engine cell as apps.bench writes it (only the fields the model reads, and a few more)."""
    return {
        "kind": "engine",
        "model": model,
        "precision": precision,
        "xla": False,
        "tf32": True,
        "fused_norm": True,
        "replicas": 1,
        "workers": workers,
        "global_batch_size": 128 * max(1, workers),
        "image_size": 32,
        "data": "builtin",
        "steps_per_execution": 10,
        "result": dict(result, policy=precision, image_shape=[32, 32, 3], examples_per_sec=examples_per_sec),
    }


def _report(tmp_path, cells):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"schema_version": 3, "hardware": {"cpu_cores": 2}, "cells": cells}))
    return str(path)


def test_a_bench_report_gives_the_one_worker_step_and_the_measured_scaling(tmp_path):
    path = _report(
        tmp_path,
        [
            _cell(0, 2500.0),
            _cell(1, 1600.0, step_time_median=0.08, step_time_p90=0.08 * (1 + 1.2816 * 0.02)),
            _cell(2, 2880.0),
            _cell(1, 3200.0, "auto"),
            _cell(2, 5000.0, "auto"),
        ],
    )
    cell = scaling_measure.read_bench_report(path, precision="float32")
    assert (cell.model, cell.global_batch_size, cell.image_shape) == ("seed_cnn", 128, [32, 32, 3])
    assert cell.step_seconds == pytest.approx(128 / 1600)
    assert [(m.workers, m.efficiency) for m in cell.measured] == [(2, pytest.approx(2880 / (2 * 1600)))]
    # The stragglers' variation from the 1-worker cell's host calls; the cores from the report.
    assert (cell.step_cv, cell.host_cores) == (pytest.approx(0.02), 2)
    (auto,) = scaling_measure.read_bench_report(path, precision="auto").measured
    assert (auto.efficiency, auto.allreduce_dtype, auto.gradient_bytes) == (
        pytest.approx(5000 / 6400),
        None,
        None,
    )
    with pytest.raises(UsageError, match="2 1-worker cells match.*seed_cnn auto, seed_cnn float32"):
        scaling_measure.read_bench_report(path)


@pytest.mark.parametrize(
    "text, message",
    [
        (None, "No such file or directory"),
        ("{not json", "is not an apps.bench report"),
        ('{"cells": [{"kind": "engine"}]}', "is not an apps.bench report"),
        ('{"cells": []}', "none \\(run apps.bench --workers=1,2\\)"),
    ],
)
def test_a_bad_bench_report_is_one_usage_error(tmp_path, text, message):
    path = tmp_path / "bench.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(UsageError, match=message):
        scaling_measure.read_bench_report(str(path))


def test_importing_the_model_does_not_import_tensorflow():
    code = "import sys, tfmp.distribute.scaling; assert 'tensorflow' not in sys.modules"
    assert run_python(["-c", code], timeout=60).returncode == 0


# apps.scaling's bad input: one `error:` line, exit 2 (FIXTURES: a report written by the test).
APP_CASES = [
    (["--links=token_ring"], "unknown link 'token_ring'; choose one of: 100gbe, 400gbe, localhost"),
    (["--devices=8,0"], "--devices=8,0: every count must be at least 1"),
    (["--devices=eight"], "--devices=eight must be whole numbers"),
    (["--step_seconds=-0.1"], "step time -0.1 s must be a positive number of seconds"),
    (["--allreduce_dtype=int8"], "unknown all-reduce dtype 'int8'"),
    (["--model=resnet9"], "unknown model 'resnet9'"),
    (["--model=seed_cnn"], "no published step time for 'seed_cnn'; give --step_seconds"),
    (["--overlap=1.5"], "overlap 1.5 must be a fraction of the backward pass"),
    (["--links=custom"], "--links=custom needs --link_bandwidth"),
    (["--from_bench=FIXTURES/missing.json"], "--from_bench=FIXTURES/missing.json: No such file"),
    (["--from_bench=FIXTURES/bench.json", "--model=resnet50"], "0 1-worker cells match --model=resnet50"),
]


@pytest.fixture(scope="module")
def app_runs(tmp_path_factory):
    """Every case in one runner process (tests/bad_input_runner.py: one import, a fork each), and
    one good --from_bench run among them."""
    base = tmp_path_factory.mktemp("scaling_app")
    fixtures, tree, logs = base / "fixtures", base / "tree", base / "logs"
    for folder in (fixtures, tree, logs):
        folder.mkdir()
    (fixtures / "bench.json").write_text(
        json.dumps(
            {
                "schema_version": 4,
                "cells": [
                    _cell(1, 1600.0, allreduce_dtype=None, gradient_bytes_per_step=0),
                    _cell(
                        2,
                        2880.0,
                        allreduce_dtype="bfloat16",
                        gradient_bytes_per_step=713_620,
                        collective_seconds_per_step=0.0042,
                    ),
                ],
            }
        )
    )
    good = [
        "--from_bench=FIXTURES/bench.json",
        "--devices=2,8",
        "--links=100gbe",
        "--allreduce_dtype=float32",
    ]
    cases = [{"args": [arg.replace("FIXTURES", str(fixtures)) for arg in args]} for args, _ in APP_CASES]
    cases.append({"args": [arg.replace("FIXTURES", str(fixtures)) for arg in good]})
    cases.append({"args": ["--devices=8", "--links=nvlink", "--allreduce_dtype=float32"]})
    spec = {"app": "scaling", "tree": str(tree), "logs": str(logs), "cases": cases}
    (base / "cases.json").write_text(json.dumps(spec))
    runner = os.path.join(ROOT, "tests", "bad_input_runner.py")
    finished = run_python([runner, str(base / "cases.json"), str(base / "results.json")], timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return json.loads((base / "results.json").read_text()), str(fixtures)


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(APP_CASES)), ids=[" ".join(args) for args, _ in APP_CASES])
def test_app_refuses_bad_input_with_one_line(app_runs, case):
    results, fixtures = app_runs
    result, message = results[case], APP_CASES[case][1].replace("FIXTURES", fixtures)
    assert result["returncode"] == 2, result["stderr"][-3000:]
    lines = result["stderr"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result["stderr"]
    assert not result["written"]


@pytest.mark.slow
def test_app_predicts_from_a_bench_report_beside_its_measurement(app_runs):
    result = app_runs[0][len(APP_CASES)]
    assert result["returncode"] == 0, result["stderr"][-3000:]
    out = result["stdout"]
    assert "seed_cnn:" in out and "1 worker, 1,600 ex/s" in out
    assert "compute (1 device): 80.0 ms per step" in out
    assert (
        "measured in that report: 2 workers / (2 x 1 worker) = 0.900, bfloat16 all-reduce of 713,620 "
        "bytes: 4.20 ms per step"
    ) in out
    rows = [line.split() for line in out.splitlines() if line.startswith("seed_cnn  float32")]
    assert [row[-7] for row in rows] == ["2", "8"], out  # the devices column
    # The measured 2-worker scaling beside the prediction (one core per worker, this report's 2
    # cores, no step variation in the fixture) and its residual.
    prediction = scaling.predict(
        0.08,
        713_620,
        2,
        scaling.LINKS["100gbe"],
        overheads=scaling.Overheads(compute_cores=1, host_cores=0, devices_per_host=8),
    )
    residual = prediction.efficiency_overlapped - 0.9
    assert (
        f"predicted (100 Gb/s network, with overheads) {prediction.efficiency_overlapped:.3f}, "
        f"residual {residual:+.3f}"
    ) in out, out


@pytest.mark.slow
def test_app_prints_every_anchor_with_its_published_and_predicted_efficiency_and_residual(app_runs):
    result = app_runs[0][len(APP_CASES) + 1]
    assert result["returncode"] == 0, result["stderr"][-3000:]
    out = result["stdout"]
    assert "overheads: sync_seconds=0.0025," in out  # the DGX A100 run's terms, for resnet50
    header = next(line for line in out.splitlines() if line.startswith("anchor "))
    assert header.split()[:5] == ["anchor", "devices", "published", "predicted", "residual"], header
    for anchor in scaling_anchors.ANCHORS.values():
        prediction = anchor.predict()
        residual = scaling_anchors.residual(anchor)
        row = next(line for line in out.splitlines() if line.startswith(anchor.name + "  "))
        published, predicted, printed = row[len(anchor.name) :].split()[1:4]
        assert (published, predicted) == (
            f"{anchor.published_efficiency:.3f}",
            f"{prediction.efficiency_overlapped:.3f}",
        )
        assert printed == f"{residual:+.3f}", row


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-n0"]))
