"""apps.bench --onednn_study (tfmp.bench.onednn): one training step's time by oneDNN primitive
from ONEDNN_VERBOSE=1 lines, reference kernels flagged, and one line where oneDNN is off.

    .venv/bin/python -m pytest tests/test_bench_onednn.py -q -n 0
"""

import os

import pytest

from tfmp.bench import matrix, onednn, runner, schema

# Two steps' worth of oneDNN lines (timestamps in ms), one before the window and one after it.
STDOUT = """\
onednn_verbose,v1,primitive,info,template:timestamp,operation,engine,primitive,implementation,...
onednn_verbose,v1,999.0,primitive,exec,cpu,convolution,jit:avx512_core,forward_training,src:f32,,alg,mb8,50.0
[worker 0] onednn_verbose,v1,1001.0,primitive,exec,cpu,convolution,brg_conv_fwd:avx512_core,forward_training,,,,mb8,3.0
onednn_verbose,v1,1002.0,primitive,exec,cpu,convolution,ref:any,backward_weights,src:f16,,alg,mb8,400.0
onednn_verbose,v1,1003.0,primitive,exec,cpu,reorder,jit:uni,undef,src:f16,,,8x8,0.5
onednn_verbose,v1,1011.0,primitive,exec,cpu,convolution,brg_conv_fwd:avx512_core,forward_training,,,,mb8,5.0
onednn_verbose,v1,1012.0,primitive,exec,cpu,convolution,ref:any,backward_weights,src:f16,,alg,mb8,420.0
onednn_verbose,v1,1013.0,primitive,create:cache_miss,cpu,reorder,jit:uni,undef,src:f16,,,8x8,0.1
onednn_verbose,v1,1500.0,primitive,exec,cpu,convolution,jit:avx512_core,forward_training,src:f32,,alg,mb8,70.0
"""


def test_the_breakdown_counts_the_window_per_kernel_and_flags_reference_kernels():
    result = onednn.breakdown(STDOUT, steps=2, step_seconds=[0.5, 0.45, 0.46], window_ms=[1000.0, 1100.0])
    assert result["onednn"] and result["note"] == ""
    rows = {(row["kind"], row["propagation"], row["implementation"]): row for row in result["primitives"]}
    assert set(rows) == {
        ("convolution", "forward_training", "brg_conv_fwd:avx512_core"),
        ("convolution", "backward_weights", "ref:any"),
        ("reorder", "undef", "jit:uni"),
    }
    weights = rows[("convolution", "backward_weights", "ref:any")]
    assert weights["calls_per_step"] == 1 and weights["ms_per_step"] == 410.0 and weights["reference_kernel"]
    assert not rows[("reorder", "undef", "jit:uni")]["reference_kernel"]
    assert result["step_ms"] == pytest.approx(460.0) and result["onednn_ms"] == pytest.approx(414.25)
    assert result["outside_onednn_ms"] == pytest.approx(460.0 - 414.25)
    assert result["reference_kernels"] == ["ref:any"]
    for row in result["primitives"]:
        schema._fields("row", row, schema.ONEDNN_PRIMITIVE, exact=True)
    schema._fields("result", dict(result, policy="mixed_float16"), schema.ONEDNN_RESULT, exact=True)
    cells = [
        {
            "kind": "onednn_study",
            "model": "m",
            "precision": "float32",
            "global_batch_size": 8,
            "result": result,
        },
        {
            "kind": "onednn_study",
            "model": "m",
            "precision": "mixed_float16",
            "global_batch_size": 8,
            "result": result,
        },
    ]
    printed = "\n".join(onednn.lines(cells))
    assert "convolution bwd weights" in printed and "ref:any [REF]" in printed
    assert "reference kernels (oneDNN's naive ones): ref:any" in printed


def test_without_verbose_lines_the_study_says_onednn_is_off_in_one_line():
    result = onednn.breakdown("no onednn here\n", steps=3, step_seconds=[0.1], window_ms=[0.0, 1e15])
    assert not result["onednn"] and result["primitives"] == [] and result["note"] == onednn.OFF_NOTE
    cell = {"kind": "onednn_study", "model": "m", "precision": "float32", "global_batch_size": 8}
    assert onednn.lines([dict(cell, result=result)]) == ["", f"oneDNN study m: {onednn.OFF_NOTE}"]


def test_one_cell_per_model_and_precision_only_when_asked():
    config = matrix.BenchConfig(models=["a", "b"], precisions=["float32", "mixed_float16"], onednn_study=True)
    cells = onednn.cells(config)
    assert [(c["model"], c["precision"]) for c in cells] == [
        ("a", "float32"),
        ("a", "mixed_float16"),
        ("b", "float32"),
        ("b", "mixed_float16"),
    ]
    assert all(c["steps"] == 3 and c["steps_per_execution"] == 1 for c in cells)
    assert onednn.cells(matrix.BenchConfig(models=["a"], precisions=["float32"])) == []


@pytest.mark.slow  # two TensorFlow processes, about 20 s
def test_a_real_cell_reads_onednn_and_says_so_when_it_is_off(monkeypatch):
    """A tiny model's step on this host (oneDNN on by default on CPUs with AVX512-BF16 or AMX:
    primitives; on others: off), and with TF_ENABLE_ONEDNN_OPTS=0: the one-line note."""
    config = matrix.BenchConfig(
        models=["mnist_mlp"],
        precisions=["float32"],
        global_batch_size=8,
        onednn_study=True,
        onednn_study_steps=2,
    )
    (cell,) = onednn.cells(config)
    result = runner.measure(cell, 600)
    schema._fields("result", result, schema.ONEDNN_RESULT, exact=True)
    # Eigen's matmuls call oneDNN's gemm whether or not TensorFlow's oneDNN ops are on (the AVX2
    # EPYC, where they are off by default, lists only those): they do not make "onednn" true.
    own = [row for row in result["primitives"] if row["kind"] != onednn.EIGEN_GEMM]
    assert result["onednn"] == bool(own) and result["step_ms"] > 0
    if result["onednn"]:
        assert any(row["kind"] == "inner_product" or row["kind"] == "matmul" for row in result["primitives"])
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "0")
    off = runner.measure(cell, 600)  # Eigen's matmuls may still call oneDNN's gemm
    assert not off["onednn"] and off["note"].startswith(onednn.OFF_NOTE) and off["step_ms"] > 0
    assert {row["kind"] for row in off["primitives"]} <= {onednn.EIGEN_GEMM}
    assert os.environ["TF_ENABLE_ONEDNN_OPTS"] == "0"
