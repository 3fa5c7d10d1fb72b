"""The optional studies of a bench run, planned: their cells and how a cell is named.

    cells = studies.cells(config)           # config: a tfmp.bench.matrix.BenchConfig
    studies.describe(cells[0])              # "pipeline seed_cnn K=2 M=1,2,4,8 vs unsplit, batch 64"

On `study_model` (a classifier) at `study_image_size` / `study_batch_size`:
- `pipeline_micro_batches`: one `pipeline` cell (`tfmp.bench.pipeline`: K=2 stages on two
  devices for each M, against the unsplit model);
- `pipeline_2d_workers` (N > 1): one `pipeline_2d` cell launched on N workers
  (`tfmp.bench.pipeline_2d`: N workers x 2 stages with `pipeline_2d_micro_batches` beside
  N-worker data parallelism and the 1-worker pipeline; `study_batch_size` is the global batch);
- `threads_study`: the thread cells of `tfmp.bench.threads` (intra-op, inter-op and tf.data
  threads, steps per host call, Python threads vs the GIL).
`bn_study` adds a `bn_study` cell per BN_STUDY_PRECISIONS and `bn_study_layers` entry
(`tfmp.bench.bn_study`): BatchNormalization on `bn_study_shape` (`bn_study_groups` > 0:
GroupNormalization), LayerNormalization, RMSNormalization and MultiHeadAttention
(`bn_study_heads` heads) on `bn_study_sequence_shape`.

Like `tfmp.bench.matrix`, this runs in the parent process and never imports TensorFlow.
"""

from __future__ import annotations

from tfmp.bench import threads as bench_threads
from tfmp.errors import UsageError

BN_STUDY_PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
BATCH_NORMALIZATION, ATTENTION = "BatchNormalization", "MultiHeadAttention"
# Activation("gelu") and Dense(width, activation="gelu") (tfmp.precision.activation).
GELU, DENSE_GELU = "GELU", "DenseGELU"
# What --bn_study_layers takes: the first on a 4-D (batch, height, width, channels) input, the
# others on a 3-D (batch, tokens, width) one.
BN_STUDY_LAYERS = (BATCH_NORMALIZATION, "LayerNormalization", "RMSNormalization", ATTENTION, GELU, DENSE_GELU)
KINDS = ("pipeline", "pipeline_2d", "python_threads", "bn_study")


def check(config) -> None:
    """The study flags' values (the matrix checks the rest)."""
    for micro in config.pipeline_micro_batches:
        if micro < 1 or config.study_batch_size % micro:
            raise UsageError(
                f"--pipeline_micro_batches value {micro} must be >= 1 and divide "
                f"--study_batch_size={config.study_batch_size}"
            )
    workers, micro = config.pipeline_2d_workers, config.pipeline_2d_micro_batches
    if workers:
        if workers < 2:
            raise UsageError(f"--pipeline_2d_workers={workers} must be 0 (no 2-D cell) or >= 2")
        if micro < 1 or config.study_batch_size % (workers * micro):
            raise UsageError(
                f"--pipeline_2d_micro_batches={micro} must be >= 1 and divide the per-worker batch: "
                f"--study_batch_size={config.study_batch_size} over {workers} workers; use a "
                f"--study_batch_size that is a multiple of {workers * max(micro, 1)}"
            )
    _check_bn_study(config)


def _check_bn_study(config) -> None:
    if not config.bn_study_layers:
        raise UsageError(f"--bn_study_layers needs at least one of {', '.join(BN_STUDY_LAYERS)}")
    for layer in config.bn_study_layers:
        if layer not in BN_STUDY_LAYERS:
            raise UsageError(f"--bn_study_layers value {layer!r} is not one of {', '.join(BN_STUDY_LAYERS)}")
    shape = config.bn_study_sequence_shape
    if len(shape) != 3 or min(shape) < 1:
        raise UsageError(
            f"--bn_study_sequence_shape={shape} must be 3 sizes >= 1: batch, tokens, width (e.g. 64,65,192)"
        )
    if ATTENTION in config.bn_study_layers and (
        config.bn_study_heads < 1 or shape[-1] % config.bn_study_heads
    ):
        raise UsageError(
            f"--bn_study_heads={config.bn_study_heads} must be >= 1 and divide the width {shape[-1]} of "
            "--bn_study_sequence_shape"
        )


def study_layer_name(layer: str, groups: int = 0, heads: int = 0) -> str:
    """A `bn_study` result's "layer": "BatchNormalization", "GroupNormalization(32)",
    "LayerNormalization", "RMSNormalization", "MultiHeadAttention(3 heads)", "GELU" or
    "Dense(gelu)"."""
    if layer == BATCH_NORMALIZATION and groups:
        return f"GroupNormalization({groups})"
    if layer == DENSE_GELU:
        return "Dense(gelu)"
    return f"{ATTENTION}({heads} heads)" if layer == ATTENTION else layer


def bn_study_cells(config) -> list[dict]:
    """One `bn_study` cell per layer of `bn_study_layers` and policy of BN_STUDY_PRECISIONS."""
    result = []
    for layer in config.bn_study_layers:
        if layer == BATCH_NORMALIZATION:  # cells without "layer", as before other layers could be studied
            extra = {"groups": config.bn_study_groups} if config.bn_study_groups else {}
            shape = config.bn_study_shape
        else:
            extra = {"layer": layer, **({"heads": config.bn_study_heads} if layer == ATTENTION else {})}
            shape = config.bn_study_sequence_shape
        result += [
            {
                "kind": "bn_study",
                "precision": policy,
                "shape": list(shape),
                "rounds": config.bn_study_rounds,
                **extra,
            }
            for policy in BN_STUDY_PRECISIONS
        ]
    return result


def cells(config) -> list[dict]:
    """The pipeline, 2-D, thread-study and bn_study cells the config asks for."""
    result = []
    if config.pipeline_micro_batches:
        result.append(
            {
                "kind": "pipeline",
                "model": config.study_model,
                "image_size": config.study_image_size,
                "global_batch_size": config.study_batch_size,
                "micro_batches": list(config.pipeline_micro_batches),
                "steps": config.steps_per_execution,
                "repeats": config.repeats,
                "precision": config.precisions[0],
            }
        )
    if config.pipeline_2d_workers:
        result.append(
            {
                "kind": "pipeline_2d",
                "model": config.study_model,
                "image_size": config.study_image_size,
                "global_batch_size": config.study_batch_size,
                "workers": config.pipeline_2d_workers,
                "micro_batches": config.pipeline_2d_micro_batches,
                "steps": config.steps_per_execution,
                "repeats": config.repeats,
                "precision": config.precisions[0],
            }
        )
    if config.threads_study:
        timing = {
            "warmup_executions": config.warmup_executions,
            "executions": config.executions,
            "min_repeat_seconds": config.min_repeat_seconds,
            "repeats": config.repeats,
        }
        result += bench_threads.cells(
            config.study_model,
            config.study_image_size,
            config.study_batch_size,
            timing,
            config.threads_rounds,
        )
        # A unit of Python work as long as a timed repeat of the engine cells.
        result.append(bench_threads.python_cell(config.min_repeat_seconds))
    if config.bn_study:
        result += bn_study_cells(config)
    return result


def describe(cell: dict) -> str:
    """One line naming a study cell (a kind of KINDS, or a thread-study engine cell)."""
    if cell["kind"] == "pipeline":
        return (
            f"pipeline {cell['model']} K=2 M={','.join(map(str, cell['micro_batches']))} vs unsplit, "
            f"batch {cell['global_batch_size']}"
        )
    if cell["kind"] == "pipeline_2d":
        return (
            f"2-D {cell['model']} {cell['workers']} workers x 2 stages M={cell['micro_batches']} vs "
            f"data-parallel and the 1-worker pipeline, global batch {cell['global_batch_size']}"
        )
    if cell["kind"] == "python_threads":
        return "Python threads vs processes (GIL), TensorFlow on 2 Python threads"
    if cell["kind"] == "bn_study":
        layer = study_layer_name(
            cell.get("layer", BATCH_NORMALIZATION), cell.get("groups", 0), cell.get("heads", 0)
        )
        return (
            f"{layer} alone {cell['precision']}: Keras' layer vs fused, fwd+bwd on "
            f"{'x'.join(map(str, cell['shape']))}, {cell['rounds']} rounds in turn"
        )
    return (
        f"threads round {cell['round']} {cell['knob']}: {cell['model']} intra {cell['intra_op_threads']} inter "
        f"{cell['inter_op_threads']} data {cell['data_threads']} steps/call {cell['steps_per_execution']}"
    )
