"""apps.bench --engine_vs_fit (tfmp.bench.engine_vs_fit): tfmp's Engine and Keras' fit on two
copies of a model in one process, timed in alternating rounds.

    .venv/bin/python -m pytest tests/test_bench_engine_vs_fit.py -q -n 0
"""

import statistics

import pytest

from tfmp.bench import engine_vs_fit, matrix, runner, schema
from tfmp.errors import UsageError

ENVIRONMENT = matrix.Environment(
    classifiers=["mnist_mlp", "seed_cnn"],
    detectors=["retinanet_tiny"],
    policies={"float32": "float32", "mixed_float16": "mixed_float16"},
    gpus=[],
    cpu_fast_bfloat16=False,
    versions={},
)


def test_one_cell_per_classifier_and_precision_only_when_asked():
    config = matrix.BenchConfig(
        models=["seed_cnn", "retinanet_tiny"],
        precisions=["float32", "mixed_float16"],
        engine_vs_fit=True,
        engine_vs_fit_rounds=5,
        xla=[True, False],
        fused_norm=[False, True],
    )
    cells = engine_vs_fit.cells(config, ENVIRONMENT)
    # The detector has no plain-Keras fit (its losses are tfmp's): no cell.
    assert [(cell["model"], cell["precision"]) for cell in cells] == [
        ("seed_cnn", "float32"),
        ("seed_cnn", "mixed_float16"),
    ]
    assert all(cell["rounds"] == 5 and cell["xla"] and not cell["fused_norm"] for cell in cells)
    assert all(cell["replicas"] == 1 and cell["mode"] == "train" for cell in cells)
    assert (
        engine_vs_fit.cells(matrix.BenchConfig(models=["seed_cnn"], precisions=["float32"]), ENVIRONMENT)
        == []
    )
    with pytest.raises(UsageError, match="--engine_vs_fit_rounds=0 must be >= 1"):
        matrix.check(matrix.BenchConfig(models=["seed_cnn"], precisions=["float32"], engine_vs_fit_rounds=0))


def test_the_report_prints_the_median_of_the_rounds_and_their_range():
    cell = {"kind": "engine_vs_fit", "model": "seed_cnn", "precision": "float32", "global_batch_size": 128}
    result = {
        "policy": "float32",
        "rounds": [0.97, 1.02, 0.99],
        "value": 0.99,
        "engine_examples_per_sec": 990.0,
        "fit_examples_per_sec": 1000.0,
    }
    schema._fields("result", result, schema.ENGINE_VS_FIT_RESULT, exact=True)
    printed = "\n".join(engine_vs_fit.lines([dict(cell, result=result)]))
    assert "seed_cnn" in printed and "0.990 (0.97-1.02, 3 rounds)" in printed
    assert engine_vs_fit.lines([cell]) == []  # not measured (failed): no table
    assert engine_vs_fit.headline(result).startswith("engine / fit 0.990 (0.97-1.02)")


@pytest.mark.slow  # one TensorFlow process, about 15 s
def test_a_real_cell_times_both_in_turn_in_one_process():
    config = matrix.BenchConfig(
        models=["mnist_mlp"],
        precisions=["float32"],
        global_batch_size=8,
        steps_per_execution=2,
        warmup_executions=1,
        executions=1,
        min_repeat_seconds=0,
        engine_vs_fit=True,
        engine_vs_fit_rounds=3,
    )
    (cell,) = engine_vs_fit.cells(config, ENVIRONMENT)
    result = runner.measure(cell, 600)
    schema._fields("result", result, schema.ENGINE_VS_FIT_RESULT, exact=True)
    assert result["policy"] == "float32" and len(result["rounds"]) == 3
    assert result["value"] == statistics.median(result["rounds"]) > 0
    assert result["engine_examples_per_sec"] > 0 and result["fit_examples_per_sec"] > 0
