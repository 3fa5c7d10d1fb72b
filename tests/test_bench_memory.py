"""apps.bench for issue 25 (mixed precision's memory promise): the fused_norm dimension, the plain
Keras models, the BatchNormalization study and the --mode=memory batch search. Planning, refusals
and the search's arithmetic in-process on hand-made cell results; one tiny run of each kind.

Timing is never asserted. The one measured comparison asserted is a memory figure that holds by
construction: with mixed_bfloat16, Keras' BatchNormalization keeps float32 copies of its
activations for the backward pass and the fused kernel keeps bfloat16 ones, so the fused
cell's live peak is at most the unfused one's.
"""

import copy
import json

import pytest
from conftest import run_python

from tfmp.bench import matrix as bench
from tfmp.bench import memory, schema
from tfmp.bench import report as bench_report
from tfmp.bench import studies as bench_studies
from tfmp.errors import UsageError

ENVIRONMENT = bench.Environment(
    classifiers=["resnet20", "lenet"],
    detectors=["retinanet_tiny"],
    policies={"float32": "float32", "mixed_bfloat16": "mixed_bfloat16", "auto": "mixed_bfloat16"},
    gpus=[],
    cpu_fast_bfloat16=True,
    versions={"tensorflow": "2", "keras": "3"},
    keras_models=["keras_bn_cnn", "keras_resnet"],
)


def _config(**changes):
    values = dict(models=["resnet20"], precisions=["float32", "mixed_bfloat16"], references=False)
    return bench.BenchConfig(**dict(values, **changes))


def test_fused_norm_is_a_dimension_of_classifier_and_detector_cells():
    config = _config(models=["keras_bn_cnn", "retinanet_tiny"], fused_norm=[False, True], references=True)
    bench.validate(config, ENVIRONMENT)
    engine = [c for c in bench.cells(config, ENVIRONMENT) if c["kind"] in ("engine", "fit")]
    settings = {(c["model"], c["precision"], c["fused_norm"], c["kind"]) for c in engine}
    assert settings == {
        *(
            (m, p, f, k)
            for m in ["keras_bn_cnn"]
            for p in config.precisions
            for f in (False, True)
            for k in ("engine", "fit")
        ),
        # Detectors (GroupNormalization) too; they have no Keras-fit reference.
        *(("retinanet_tiny", p, f, "engine") for p in config.precisions for f in (False, True)),
    }
    labels = [
        bench.describe_cell(c) for c in engine if c["model"] == "keras_bn_cnn" and c["kind"] == "engine"
    ]
    assert [label.endswith("[fused norm]") for label in labels] == [False, True, False, True]


def test_bn_study_plans_one_cell_per_precision():
    config = _config(bn_study=True, bn_study_shape=[2, 4, 4, 8], bn_study_rounds=3)
    studies = [c for c in bench.cells(config, ENVIRONMENT) if c["kind"] == "bn_study"]
    assert studies == [
        {"kind": "bn_study", "precision": policy, "shape": [2, 4, 4, 8], "rounds": 3}
        for policy in ("float32", "mixed_bfloat16", "mixed_float16")
    ]
    assert bench.describe_cell(studies[0]).startswith(
        "BatchNormalization alone float32: Keras' layer vs fused"
    )
    groups = _config(bn_study=True, bn_study_shape=[2, 4, 4, 8], bn_study_rounds=3, bn_study_groups=4)
    (study, *_) = [c for c in bench.cells(groups, ENVIRONMENT) if c["kind"] == "bn_study"]
    assert study == {
        "kind": "bn_study",
        "precision": "float32",
        "shape": [2, 4, 4, 8],
        "rounds": 3,
        "groups": 4,
    }
    assert bench.describe_cell(study).startswith("GroupNormalization(4) alone float32: Keras' layer vs fused")


def test_bn_study_plans_transformer_layers_on_the_sequence_shape():
    config = _config(
        bn_study=True,
        bn_study_rounds=3,
        bn_study_layers=["LayerNormalization", "MultiHeadAttention"],
        bn_study_sequence_shape=[2, 5, 8],
        bn_study_heads=2,
    )
    bench.validate(config, ENVIRONMENT)
    studies = [c for c in bench.cells(config, ENVIRONMENT) if c["kind"] == "bn_study"]
    shared = {"kind": "bn_study", "shape": [2, 5, 8], "rounds": 3}
    assert studies == [
        *(dict(shared, precision=p, layer="LayerNormalization") for p in bench_studies.BN_STUDY_PRECISIONS),
        *(
            dict(shared, precision=p, layer="MultiHeadAttention", heads=2)
            for p in bench_studies.BN_STUDY_PRECISIONS
        ),
    ]
    assert bench.describe_cell(studies[-1]).startswith(
        "MultiHeadAttention(2 heads) alone mixed_float16: Keras' layer vs fused, fwd+bwd on 2x5x8"
    )


STUDY_SCRIPT = """
import json
from tfmp.bench import bn_study
for layer, heads in [("LayerNormalization", 0), ("RMSNormalization", 0), ("MultiHeadAttention", 2)]:
    print(json.dumps(bn_study.measure("mixed_bfloat16", [2, 16, 64], rounds=2, layer=layer, heads=heads)))
"""


@pytest.mark.slow  # a TensorFlow process: 5-20 s on 2 shared cores
def test_bn_study_times_each_transformer_layer_keras_vs_fused():
    """Tiny, one process (the BFC allocator keeps the live peak on CPUs without oneDNN, as the
    bench's cells have it): each layer's study builds, fuses (bn_study asserts it) and reports,
    and in bfloat16 each fused layer keeps less for its backward pass than Keras' (Keras keeps
    float32 copies of the normalised input, or the float32 softmax probabilities)."""
    result = run_python(["-c", STUDY_SCRIPT], env={"TF_CPU_ALLOCATOR_USE_BFC": "true"}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    found = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["layer"] for r in found] == [
        "LayerNormalization",
        "RMSNormalization",
        "MultiHeadAttention(2 heads)",
    ]
    for study in found:
        assert set(study) == set(schema.BN_STUDY_RESULT)
        assert (study["compute_dtype"], study["shape"], len(study["ratios"])) == ("bfloat16", [2, 16, 64], 2)
        assert study["keras_ms"] > 0 and study["fused_ms"] > 0
        assert 0 < study["fused_kept_mb"] < study["keras_kept_mb"], study


def test_memory_settings_are_one_device_train_cells_without_a_batch():
    config = _config(
        models=["resnet20", "retinanet_tiny"], mode="memory", memory_budget_mb=512, fused_norm=[True]
    )
    memory.check(config)
    found = memory.settings(config, ENVIRONMENT)
    assert [(s["model"], s["precision"], s["fused_norm"]) for s in found] == [
        ("resnet20", "float32", True),
        ("resnet20", "mixed_bfloat16", True),
        ("retinanet_tiny", "float32", True),
        ("retinanet_tiny", "mixed_bfloat16", True),
    ]
    for setting in found:
        assert setting["kind"] == "engine" and setting["mode"] == "train"
        assert (setting["replicas"], setting["workers"]) == (1, 0) and "global_batch_size" not in setting


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(fused_norm=[]), "--fused_norm needs at least one value"),
        (dict(bn_study_shape=[64, 48, 64]), r"--bn_study_shape=\[64, 48, 64\] must be 4 sizes >= 1"),
        (dict(bn_study_rounds=0), "--bn_study_rounds=0 must be >= 1"),
        (dict(bn_study_groups=3), "bn_study_groups=3 must be 0 or divide the channels"),
        (dict(bn_study_groups=-1), "bn_study_groups=-1 must be 0 or divide the channels"),
        (dict(models=["keras_vgg"]), "unknown model 'keras_vgg'; choose one of: .*keras_bn_cnn"),
        (dict(bn_study_layers=[]), "--bn_study_layers needs at least one of BatchNormalization, "),
        (
            dict(bn_study_layers=["LayerNorm"]),
            "--bn_study_layers value 'LayerNorm' is not one of BatchNormalization, LayerNormalization",
        ),
        (dict(bn_study_sequence_shape=[64, 192]), r"--bn_study_sequence_shape=\[64, 192\] must be 3 sizes"),
        (
            dict(bn_study_layers=["MultiHeadAttention"], bn_study_heads=5),
            "--bn_study_heads=5 must be >= 1 and divide the width 192",
        ),
    ],
)
def test_validate_refuses_bad_norm_settings(changes, message):
    with pytest.raises(UsageError, match=message):
        bench.validate(_config(**changes), ENVIRONMENT)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(), "--mode=memory needs --memory_budget_mb, a positive number of MiB"),
        (dict(memory_budget_mb=float("nan")), "--mode=memory needs --memory_budget_mb"),
        (
            dict(memory_budget_mb=64, memory_probe_batches=[16, 16]),
            "--memory_probe_batches=16,16 needs 2 or more",
        ),
        (
            dict(memory_budget_mb=64, memory_probe_batches=[0, 8]),
            "--memory_probe_batches=0,8 needs 2 or more",
        ),
        (dict(memory_budget_mb=64, memory_batch_step=0), "--memory_batch_step=0 must be >= 1"),
    ],
)
def test_memory_check_refuses_bad_settings(changes, message):
    with pytest.raises(UsageError, match=message):
        memory.check(_config(mode="memory", **changes))


def _fake_measure(peak_of_batch, variables=1.0, log=None):
    """measure(cell) for `memory.search`: a cell whose live peak is peak_of_batch(batch)."""

    def measure(cell):
        batch = cell["global_batch_size"]
        if log is not None:
            log.append(batch)
        peak = peak_of_batch(batch)
        result = (
            None if peak is None else {"peak_memory_mb": peak, "variables_mb": variables, "policy": "float32"}
        )
        return dict(cell, result=result, load_average=None)

    return measure


SETTING = {
    "kind": "engine",
    "model": "m",
    "precision": "float32",
    "fused_norm": False,
    "xla": False,
    "image_size": 32,
    "replicas": 1,
    "workers": 0,
}


def test_fit_and_prediction_arithmetic():
    intercept, slope = memory.fit_line([(16, 40.0), (32, 72.0), (64, 136.0)])
    assert (intercept, slope) == pytest.approx((8.0, 2.0))
    assert memory.predict(8.0, 2.0, budget=100.0, step=1) == 46  # 8 + 2 x 46 = 100
    assert memory.predict(8.0, 2.0, budget=100.0, step=8) == 40
    assert memory.predict(8.0, 2.0, budget=7.0, step=1) == 0


def test_an_affine_peak_is_confirmed_by_the_predicted_batch_and_its_next_step():
    log = []
    found = memory.search(
        SETTING, 100.0, [16, 32], 1, _fake_measure(lambda b: 8 + 2 * b, log=log), lambda _: None
    )
    assert log == [16, 32, 46, 47]  # probes, the prediction (fits), the next batch (does not)
    assert (found["largest_batch"], found["next_batch"], found["confirmed"]) == (46, 47, "prediction")
    assert found["largest_batch_peak_mb"] == 100 and found["next_batch_peak_mb"] == 102
    assert (found["intercept_mb"], found["slope_mb_per_example"]) == pytest.approx((8.0, 2.0))
    assert [cell["global_batch_size"] for cell in found["cells"]] == log


@pytest.mark.parametrize("jump_at", [30, 41, 46, 47, 60, 200])
def test_a_missed_prediction_is_bisected_to_the_true_boundary(jump_at):
    """The line says 46, but from `jump_at` on every batch needs 40 MiB more (a workspace):
    the search still ends on a batch that fits next to one that does not, measuring each once."""
    log = []
    peak = lambda b: 8 + 2 * b + (40 if b >= jump_at else 0)
    found = memory.search(SETTING, 100.0, [8, 16], 1, _fake_measure(peak, log=log), lambda _: None)
    largest = max(b for b in range(1, 500) if peak(b) <= 100)
    assert (found["largest_batch"], found["next_batch"]) == (largest, largest + 1)
    assert found["confirmed"] == ("prediction" if largest == 46 else "bisection")
    assert len(log) == len(set(log)) <= 2 + 2 + 2 * 7  # probes, prediction, doubling, bisection


def test_the_step_and_the_probes_bound_the_search():
    log = []
    peak = lambda b: 8 + 2 * b if b < 20 else 500.0
    found = memory.search(SETTING, 100.0, [8, 24], 8, _fake_measure(peak, log=log), lambda _: None)
    # The probes put the line far above 100 MiB at 16; batch 24 (a probe) is known to be over.
    assert (found["largest_batch"], found["next_batch"]) == (16, 24)
    assert len(log) == len(set(log))


def test_a_cell_out_of_device_memory_does_not_fit():
    peak = lambda b: 8 + 2 * b if b <= 40 else None
    found = memory.search(SETTING, 100.0, [16, 32], 1, _fake_measure(peak), lambda _: None)
    assert (found["largest_batch"], found["next_batch"], found["next_batch_peak_mb"]) == (40, 41, None)


@pytest.mark.parametrize(
    "budget, peak, probes, message",
    [
        (
            0.5,
            lambda b: 8 + 2 * b,
            [16, 32],
            r"--memory_budget_mb=0.5 is below m's weights and optimizer variables, 1.0 MiB",
        ),
        (
            9.0,
            lambda b: 8 + 2 * b,
            [16, 32],
            r"--memory_budget_mb=9: no batch of m float32 fits \(batch 1 needs 10.0 MiB",
        ),
        (100.0, lambda b: 50.0, [16, 32], "did not grow with the batch over --memory_probe_batches=16,32"),
        (100.0, lambda b: None if b > 16 else 1.0 + b, [16, 32], "a probe of m ran out of device memory"),
    ],
)
def test_budgets_no_batch_fits_are_refused_in_one_line(budget, peak, probes, message):
    with pytest.raises(UsageError, match=message):
        memory.search(SETTING, budget, probes, 1, _fake_measure(peak), lambda _: None)


def _memory_report(searches):
    return {
        "schema_version": schema.SCHEMA_VERSION,
        "date": "today",
        "seconds": 1.0,
        "config": {"mode": "memory"},
        "hardware": dict.fromkeys(schema.HARDWARE, "x")
        | {"cpu_cores": 2, "gpus": [], "cpu_fast_bfloat16": True},
        "versions": {},
        "load_average": {"before": None, "after": None},
        "memory_note": "live",
        "budget_mb": 100.0,
        "searches": searches,
        "ratios": memory.ratios(searches),
    }


def test_batch_ratios_schema_and_table_from_hand_made_searches():
    def search(precision, fused_norm, slope):
        setting = dict(SETTING, precision=precision, fused_norm=fused_norm)
        found = memory.search(
            setting, 100.0, [8, 16], 1, _fake_measure(lambda b: 4 + slope * b), lambda _: None
        )
        for cell in found["cells"]:  # the fake results stand in for whole engine results
            cell["result"] = None
        return dict(found, policy=precision)

    searches = [search("float32", False, 2.0), search("mixed_bfloat16", False, 1.6)]
    searches += [search("float32", True, 1.6), search("mixed_bfloat16", True, 1.0)]
    report = _memory_report(searches)
    schema.check(report)
    batches = {(s["precision"], s["fused_norm"]): s["largest_batch"] for s in searches}
    assert batches == {
        ("float32", False): 48,
        ("mixed_bfloat16", False): 60,
        ("float32", True): 60,
        ("mixed_bfloat16", True): 96,
    }
    vs_float32 = {row["fused_norm"]: row for row in report["ratios"]["largest_batch_vs_float32"]}
    assert vs_float32[False]["value"] == pytest.approx(60 / 48) and vs_float32[True][
        "value"
    ] == pytest.approx(96 / 60)
    assert vs_float32[True]["per_example"] == pytest.approx(1.0 / 1.6)
    fused = {row["precision"]: row["value"] for row in report["ratios"]["largest_batch_fused_vs_keras_norm"]}
    assert fused == pytest.approx({"float32": 60 / 48, "mixed_bfloat16": 96 / 60})
    text = memory.table(report)
    assert "largest batch mixed_bfloat16 / float32: m fused norm xla=off: 96 / 60 = 1.60x" in text
    broken = copy.deepcopy(report)
    del broken["searches"][0]["largest_batch"]
    with pytest.raises(schema.SchemaError, match=r"searches\[0\]: missing \['largest_batch'\]"):
        schema.check(broken)


def _engine(precision, fused_norm, eps, peak):
    return {
        "kind": "engine",
        "model": "keras_bn_cnn",
        "precision": precision,
        "xla": False,
        "mode": "train",
        "data": "synthetic",
        "replicas": 1,
        "workers": 0,
        "global_batch_size": 64,
        "fused_norm": fused_norm,
        "result": {
            "examples_per_sec": eps,
            "examples_per_sec_min": eps,
            "examples_per_sec_max": eps,
            "examples_per_sec_per_replica": eps,
            "step_time_median": 64 / eps,
            "step_time_p90": 64 / eps,
            "flops_per_sec": 1e9,
            "policy": precision,
            "peak_memory_mb": peak,
            "peak_memory_source": "cpu",
            "peak_host_memory_mb": 1000.0,
            "host_memory_before_model_mb": 600.0,
        },
    }


def test_fused_vs_keras_norm_pairs_cells_that_differ_only_in_fusing():
    cells = [
        _engine("float32", False, 100.0, 900.0),
        _engine("float32", True, 110.0, 720.0),
        _engine("mixed_bfloat16", False, 120.0, 750.0),
        _engine("mixed_bfloat16", True, 150.0, 450.0),
        {
            "kind": "bn_study",
            "precision": "mixed_bfloat16",
            "result": {
                "policy": "mixed_bfloat16",
                "shape": [64, 48, 48, 64],
                "keras_ms": 80.0,
                "fused_ms": 20.0,
                "value": 0.26,
                "keras_peak_memory_mb": 300.0,
                "fused_peak_memory_mb": 200.0,
                "keras_kept_mb": 120.0,
                "fused_kept_mb": 60.0,
            },
        },
    ]
    ratios = bench_report.derive(cells)
    fused = {row["precision"]: row for row in ratios["fused_vs_keras_norm"]}
    assert fused["float32"]["value"] == pytest.approx(1.1) and fused["float32"][
        "peak_memory"
    ] == pytest.approx(0.8)
    assert fused["mixed_bfloat16"]["value"] == pytest.approx(1.25) and fused["mixed_bfloat16"][
        "peak_memory"
    ] == pytest.approx(0.6)
    # Mixed vs float32 compares fused with fused and Keras with Keras.
    memory_rows = {row["fused_norm"]: row["value"] for row in ratios["peak_memory_vs_float32"]}
    assert memory_rows == pytest.approx({False: 750 / 900, True: 450 / 720})
    (bn,) = ratios["fused_vs_keras_bn"]
    assert (bn["value"], bn["peak_memory"]) == pytest.approx((0.26, 200 / 300))
    assert bn["layer"] == "BatchNormalization"  # a result without "layer": an older report
    text = bench_report.table(cells, ratios)
    assert (
        "fused / Keras normalization: keras_bn_cnn mixed_bfloat16 batch 64 1 replica(s) xla=off: examples/s 1.25x"
        in text
    )
    assert (
        "BatchNormalization alone, fwd+bwd on 64x48x48x64 mixed_bfloat16: fused 20.00 ms / Keras 80.00 ms = 0.26x"
        " (median of rounds timed in turn), live peak 0.67x, kept for backward 60.00 / 120.00 MiB" in text
    )
    assert set(ratios) == set(schema.RATIOS)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--fused_norm=yes"], "--fused_norm value 'yes' must be false or true"),
        (["--mode=memory"], "--mode=memory needs --memory_budget_mb"),
        (["--bn_study_shape=64,48"], "--bn_study_shape=[64, 48] must be 4 sizes"),
    ],
)
def test_bad_flags_are_one_line_errors_before_anything_runs(tmp_path, args, message):
    result = run_python(["-m", "apps.bench", *args, f"--output_dir={tmp_path / 'out'}"], timeout=120)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1 and message in errors[0], result.stderr[-1000:]
    assert not (tmp_path / "out").exists()


TINY_TIMING = [
    "--steps_per_execution=1",
    "--warmup_executions=1",
    "--executions=1",
    "--repeats=1",
    "--min_repeat_seconds=0",
]


@pytest.mark.slow  # one process per cell
def test_tiny_fused_norm_keras_model_and_bn_study_run(tmp_path):
    result = run_python(
        [
            "-m",
            "apps.bench",
            "--models=keras_bn_cnn",
            "--precisions=float32,mixed_bfloat16",
            "--fused_norm=false,true",
            "--noreferences",
            "--global_batch_size=8",
            *TINY_TIMING,
            "--peak_sizes=32",
            "--peak_repeats=1",
            "--peak_min_call_seconds=0.01",
            "--bn_study",
            "--bn_study_shape=4,8,8,16",
            "--bn_study_rounds=2",
            f"--output_dir={tmp_path}",
        ],
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.load(open(tmp_path / "bench.json"))
    schema.check(report)
    engine = {
        (c["precision"], c["fused_norm"]): c["result"] for c in report["cells"] if c["kind"] == "engine"
    }
    assert set(engine) == {(p, f) for p in ("float32", "mixed_bfloat16") for f in (False, True)}
    for found in engine.values():
        assert found["image_shape"] == [32, 32, 3] and 0 < found["variables_mb"] < found["peak_memory_mb"]
    # The two cells' live peaks are reported, not compared: at batch 8 fusing saves about one
    # activation per BatchNormalization (~1 MiB), while on a CPU without oneDNN Eigen's
    # convolution workspaces move this tiny model's peak by more than that from process to
    # process (fused 55.3 vs Keras' 52.1 MiB in the full suite of 2026-12-08; 55-86 MiB over
    # batches, below). What fusing keeps for the backward pass is deterministic: the studies' check.
    fused = {row["precision"]: row for row in report["ratios"]["fused_vs_keras_norm"]}
    assert set(fused) == {"float32", "mixed_bfloat16"}
    for precision, row in fused.items():
        peaks = engine[(precision, True)]["peak_memory_mb"], engine[(precision, False)]["peak_memory_mb"]
        assert (row["peak_memory_mb"], row["keras_peak_memory_mb"]) == peaks
        assert row["peak_memory"] == pytest.approx(peaks[0] / peaks[1])
    studies = [c for c in report["cells"] if c["kind"] == "bn_study"]
    assert [c["result"]["policy"] for c in studies] == ["float32", "mixed_bfloat16", "mixed_float16"]
    assert [c["result"]["compute_dtype"] for c in studies] == ["float32", "bfloat16", "float16"]
    assert all(len(c["result"]["ratios"]) == 2 for c in studies)
    # In half precision Keras' BatchNormalization keeps a float32 copy of its input for the
    # backward pass; the fused kernel keeps the half-precision input.
    for study in studies[1:]:
        assert 0 < study["result"]["fused_kept_mb"] < study["result"]["keras_kept_mb"], study["result"]
    assert len(report["ratios"]["fused_vs_keras_bn"]) == 3
    assert "fused / Keras normalization: keras_bn_cnn mixed_bfloat16 batch 8" in result.stdout
    assert "BatchNormalization alone, fwd+bwd on 4x8x8x16 mixed_float16" in result.stdout


# The search's mechanics are under test, on figures that grow with the batch: oneDNN's kernels
# (TensorFlow's default on CPUs with AVX512-VNNI/BF16) allocate nothing per call beyond the
# tensors; with oneDNN off (an AVX2-only CPU) Eigen's convolution workspaces make the live peak
# of this tiny model 55-86 MiB and not monotone in the batch (docs/bench.md).
ONEDNN = {"TF_ENABLE_ONEDNN_OPTS": "1"}


@pytest.mark.slow  # one process per measured batch
def test_tiny_memory_search_run_and_its_refusal(tmp_path):
    args = ["-m", "apps.bench", "--mode=memory", "--models=keras_bn_cnn", "--precisions=float32"]
    args += ["--memory_probe_batches=4,8", "--memory_batch_step=4", *TINY_TIMING]
    refused = run_python(
        [*args, "--memory_budget_mb=0.1", f"--output_dir={tmp_path / 'refused'}"], timeout=600
    )
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.returncode == 2 and len(errors) == 1, refused.stderr[-2000:]
    assert "--memory_budget_mb=0.1 is below keras_bn_cnn's weights and optimizer variables" in errors[0]
    assert not (tmp_path / "refused").exists()

    result = run_python([*args, "--memory_budget_mb=12", f"--output_dir={tmp_path}"], timeout=900, env=ONEDNN)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.load(open(tmp_path / "bench.json"))
    schema.check(report)
    (found,) = report["searches"]
    assert found["largest_batch"] % 4 == 0 and found["next_batch"] == found["largest_batch"] + 4
    assert found["largest_batch_peak_mb"] <= 12 < found["next_batch_peak_mb"]
    assert found["slope_mb_per_example"] > 0 and 0 < found["variables_mb"] < found["largest_batch_peak_mb"]
    peaks = {cell["global_batch_size"]: cell["result"]["peak_memory_mb"] for cell in found["cells"]}
    assert peaks[found["largest_batch"]] == found["largest_batch_peak_mb"] and {4, 8} <= set(peaks)
    assert "largest global batch whose training step's live peak fits 12 MiB" in result.stdout
