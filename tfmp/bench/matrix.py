"""Benchmark matrices, planned: which cells to measure, and what one cell is (no measuring here).

    from tfmp.bench import matrix, runner
    config = matrix.BenchConfig(models=["resnet20"], precisions=["float32", "auto"], output_dir="/tmp/bench")
    report = runner.run(config)

A cell is a plain dict (the JSON a `python -m tfmp.bench.cell` process gets, see that module):
engine cells (tfmp's Engine), the same model under plain Keras `fit` (engine overhead) and fed
from synthetic in-memory tensors (input-pipeline overhead), one matmul peak per precision.
A detector in `models` (retinanet_tiny, faster_rcnn_tiny, ...) trains on the built-in detection
`shapes` data at `image_size` (a multiple of 32); it gets no Keras-fit reference (its losses
are tfmp's), only the synthetic-input one; with XLA on, Faster R-CNN compiles its
static-shaped parts (backbone, FPN, RPN and box head).
The optional studies (`pipeline_micro_batches`, `pipeline_2d_workers`, `threads_study`,
`bn_study`) are planned by `tfmp.bench.studies`, `onednn_study` by `tfmp.bench.onednn` and
`engine_vs_fit` by `tfmp.bench.engine_vs_fit`. `layer_profile` (a list of model names) plans
the cells of a run of its own (`runner.run_layer_profile`): each model's layers timed in
float32 and mixed_bfloat16 at `image_size` and `global_batch_size` against the Engine's step
(`tfmp.bench.layer_profile`).

`fused_norm` ([True], the default as in the apps, [False] or both) is a dimension of the train
cells (true: the model's BatchNormalization and GroupNormalization fused before compile,
`tfmp.bench.workloads`). `mode="memory"` plans no matrix: `tfmp.bench.memory` searches each
setting's largest batch under `memory_budget_mb` (`runner.run_memory_search`).

This module runs in the parent process, which never imports TensorFlow (`tfmp.bench.runner`
says why): what only TensorFlow knows (model names, what "auto" resolves to here) comes in as
an `Environment` that a fresh cell process reports.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import math

from tfmp import run_dir
from tfmp.bench import engine_vs_fit, onednn, studies
from tfmp.errors import UsageError, unknown

RESULT_PREFIX = "BENCH_RESULT "  # a cell process prints its result as one line: PREFIX + JSON
MODES = ("train", "inference", "memory")
DATA_KINDS = ("synthetic", "builtin")
# The layer profile's policies: the reference first, then the one whose speedup it explains.
LAYER_PROFILE_POLICIES = ("float32", "mixed_bfloat16")
# tfmp.distribute.allreduce.DTYPES, named here: that module imports TensorFlow, which this
# process must not (tests/test_bench.py checks the two agree).
ALLREDUCE_DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_BUCKET_BYTES = 25 * 2**20  # tfmp.distribute.allreduce.DEFAULT_BUCKET_BYTES (the same test)
INPUT_COST_BATCHES = 10  # timed batches per pipeline and round of an input_cost cell
# The BatchNormalization study's policies: float32, and both half types as the GPU guide has them.


@dataclasses.dataclass
class BenchConfig:
    models: list[str]
    precisions: list[str]
    replicas: list[int] = dataclasses.field(default_factory=lambda: [1])
    workers: list[int] = dataclasses.field(default_factory=list)  # local processes, 1 core each
    xla: list[bool] = dataclasses.field(default_factory=lambda: [False])
    tf32: list[bool] = dataclasses.field(default_factory=lambda: [True])  # float32 cells only
    # Cells of several replicas or workers: the dtypes their gradients are summed in.
    allreduce_dtypes: list[str] = dataclasses.field(default_factory=lambda: ["auto"])
    # ... and the bucket sizes they are summed in (0: one all-reduce call after the backward pass).
    allreduce_bucket_bytes: list[int] = dataclasses.field(default_factory=lambda: [DEFAULT_BUCKET_BYTES])
    ratio_models: list[str] = dataclasses.field(default_factory=list)  # scaling + references; [] = all
    data: str = "synthetic"  # synthetic | builtin | tfds:<name>
    global_batch_size: int = 64  # of a 1-replica cell; N-replica cells use N x (weak scaling)
    steps_per_execution: int = 10
    mode: str = "train"
    image_size: int = 32
    warmup_executions: int = 3
    executions: int = 5  # host calls per timed repeat, at least
    min_repeat_seconds: float = 1.5  # ... and at least this long
    repeats: int = 5
    references: bool = True  # plain-Keras fit cell and synthetic-input cell
    cache: bool = False
    output_dir: str = "bench"
    cell_timeout: float = 1800
    pipeline_micro_batches: list[int] = dataclasses.field(default_factory=list)  # [] = no pipeline cell
    pipeline_2d_workers: int = 0  # N > 1: one N workers x 2 stages cell (tfmp.bench.pipeline_2d)
    pipeline_2d_micro_batches: int = 4
    threads_study: bool = False
    threads_rounds: int = 2  # the thread cells run this many times in turn; each keeps its best
    study_model: str = "seed_cnn"  # the classifier of the pipeline and thread studies
    study_image_size: int = 32
    study_batch_size: int = 64
    peak_sizes: list[int] = dataclasses.field(default_factory=lambda: [1024, 2048, 4096])
    peak_repeats: int = 3  # timed calls per size; the peak is the best over sizes and repeats
    peak_min_call_seconds: float = 0.5  # a timed peak call chains matmuls for at least this long
    layer_profile: list[str] = dataclasses.field(default_factory=list)  # [] = no layer profile
    layer_profile_repeats: int = 20  # interleaved rounds: each layer's time is their median
    fused_norm: list[bool] = dataclasses.field(
        default_factory=lambda: [True]
    )  # classifiers only; the apps fuse too
    bn_study: bool = False
    bn_study_shape: list[int] = dataclasses.field(default_factory=lambda: [64, 48, 48, 64])  # NHWC
    bn_study_rounds: int = 20  # Keras' layer and the fused one timed in turn, this many times each
    bn_study_groups: int = 0  # 0: BatchNormalization; G > 0: GroupNormalization(G) (C % G == 0)
    # Which layers the study times (tfmp.bench.studies.BN_STUDY_LAYERS); all but BatchNormalization
    # on a (batch, tokens, width) input: vit_tiny's at batch 64 by default.
    bn_study_layers: list[str] = dataclasses.field(default_factory=lambda: ["BatchNormalization"])
    bn_study_sequence_shape: list[int] = dataclasses.field(default_factory=lambda: [64, 65, 192])
    bn_study_heads: int = 3  # MultiHeadAttention's heads (vit_tiny's), width / heads each
    onednn_study: bool = False  # one oneDNN per-primitive breakdown per model and precision
    onednn_study_steps: int = 3  # the steps it reads oneDNN's verbose lines of
    engine_vs_fit: bool = False  # the engine and Keras' fit in one process per model and precision
    engine_vs_fit_rounds: int = 8  # ... timed in turn, this many rounds each
    memory_budget_mb: float = 0  # mode="memory": the live-peak budget (MiB) a batch must fit
    memory_probe_batches: list[int] = dataclasses.field(default_factory=lambda: [16, 32])  # the fit's
    memory_batch_step: int = 1  # the batches tried are multiples of this


@dataclasses.dataclass(frozen=True)
class Environment:
    """What only TensorFlow knows, reported by a fresh cell process (`{"kind": "environment"}`)."""

    classifiers: list[str]  # tfmp.models.MODELS
    detectors: list[str]  # tfmp.detection.retinanet.DETECTORS and faster_rcnn.DETECTORS
    policies: dict[str, str]  # every precision choice -> the Keras policy it is on this hardware
    gpus: list[str]
    cpu_fast_bfloat16: bool
    versions: dict[str, str]  # tensorflow, keras
    keras_models: list[str] = dataclasses.field(default_factory=list)  # tfmp.bench.keras_models

    def is_detector(self, name: str) -> bool:
        return name in self.detectors


# Bench models whose builders need a package a plain install lacks: name -> (module, what to
# install). Checked by its module spec, so the parent process never imports it.
OPTIONAL_PACKAGES = {"hub_vit": ("keras_hub", "keras-hub>=0.32,<0.33")}


def validate(config: BenchConfig, environment: Environment) -> None:
    """Every check: `check` (no TensorFlow needed) and `check_names`."""
    check(config)
    check_names(config, environment)


def check(config: BenchConfig) -> None:
    """The checks that need no TensorFlow: counts, modes, study settings."""
    if not config.models or not config.precisions:
        raise UsageError("--models and --precisions need at least one value each")
    if config.mode not in MODES:
        raise unknown("mode", config.mode, MODES)
    if config.data not in DATA_KINDS and not config.data.startswith("tfds:"):
        raise unknown("bench data", config.data, DATA_KINDS + ("tfds:<name>",))
    if not config.replicas and not config.workers:
        raise UsageError("give --replicas and/or --workers (e.g. --replicas=1 --workers=1,2)")
    for flag in ("replicas", "workers"):
        for value in getattr(config, flag):
            if value < 1:
                raise UsageError(f"--{flag} value {value} must be >= 1")
    if not config.allreduce_dtypes:
        raise UsageError("--allreduce_dtypes needs at least one value, e.g. auto")
    for dtype in config.allreduce_dtypes:
        if dtype not in ALLREDUCE_DTYPES:
            raise unknown("--allreduce_dtypes value", dtype, ALLREDUCE_DTYPES)
    if not config.allreduce_bucket_bytes or min(config.allreduce_bucket_bytes) < 0:
        raise UsageError(
            f"--allreduce_bucket_bytes={config.allreduce_bucket_bytes} needs sizes >= 0 "
            f"(0: one all-reduce call), e.g. 0,{DEFAULT_BUCKET_BYTES}"
        )
    for flag in ("global_batch_size", "steps_per_execution", "executions", "repeats", "peak_repeats"):
        if getattr(config, flag) < 1:
            raise UsageError(f"--{flag}={getattr(config, flag)} must be >= 1")
    if not config.peak_sizes or min(config.peak_sizes) < 1:
        raise UsageError(f"--peak_sizes={config.peak_sizes} needs matrix sizes >= 1, e.g. 1024,2048,4096")
    if config.warmup_executions < 1:
        raise UsageError("--warmup_executions must be >= 1: the first call traces and compiles")
    if not 0 <= config.min_repeat_seconds < math.inf:  # also refuses NaN; 0: `executions` calls only
        raise UsageError(
            f"--min_repeat_seconds={config.min_repeat_seconds} must be 0 or a positive number of seconds, e.g. 1.5"
        )
    if not 0 < config.peak_min_call_seconds < math.inf:
        raise UsageError(
            f"--peak_min_call_seconds={config.peak_min_call_seconds} must be a positive number of seconds, e.g. 0.5"
        )
    run_dir.writable_dir(config.output_dir, "--output_dir")
    for flag in (
        "study_image_size",
        "study_batch_size",
        "threads_rounds",
        "layer_profile_repeats",
        "bn_study_rounds",
        "onednn_study_steps",
        "engine_vs_fit_rounds",
    ):
        if getattr(config, flag) < 1:
            raise UsageError(f"--{flag}={getattr(config, flag)} must be >= 1")
    studies.check(config)
    if not config.fused_norm:
        raise UsageError("--fused_norm needs at least one value: false, true or false,true")
    if len(config.bn_study_shape) != 4 or min(config.bn_study_shape) < 1:
        raise UsageError(
            f"--bn_study_shape={config.bn_study_shape} must be 4 sizes >= 1: batch, height, width, channels"
        )
    if config.bn_study_groups < 0 or config.bn_study_shape[-1] % max(config.bn_study_groups, 1):
        raise UsageError(f"bn_study_groups={config.bn_study_groups} must be 0 or divide the channels")


def check_names(config: BenchConfig, environment: Environment) -> None:
    """Model and precision names, and what detectors need, against this installation."""
    known = [*environment.classifiers, *environment.keras_models, *environment.detectors]
    for name in config.models + config.ratio_models + config.layer_profile:
        if name not in known:
            raise unknown("model", name, known)
        module, requirement = OPTIONAL_PACKAGES.get(name, (None, None))
        if module and importlib.util.find_spec(module) is None:
            raise UsageError(
                f"model {name!r} needs {module}, which is not installed: pip install '{requirement}'"
            )
    for name in config.layer_profile:
        if environment.is_detector(name) and (config.image_size < 32 or config.image_size % 32):
            raise UsageError(
                f"--image_size={config.image_size} for {name} in --layer_profile must be a multiple of 32"
            )
    if any(environment.is_detector(name) for name in config.models):
        if config.data not in DATA_KINDS:
            raise UsageError(
                f"--data={config.data} is not for detectors here; use synthetic or builtin (shapes)"
            )
        if config.image_size < 32 or config.image_size % 32:
            raise UsageError(
                f"--image_size={config.image_size} for a detector must be a multiple of 32, e.g. 128"
            )
    planned = config.threads_study or config.pipeline_micro_batches or config.pipeline_2d_workers
    if planned and config.study_model not in environment.classifiers:
        raise unknown("study model (a classifier)", config.study_model, environment.classifiers)
    for name in config.precisions:
        if name not in environment.policies:
            raise unknown("precision", name, environment.policies)


def layer_profile_cells(config: BenchConfig) -> list[dict]:
    """One `layer_profile` cell per model of `config.layer_profile`: its layers and its Engine
    step (fed one batch from memory, so the input pipeline stays out) in each policy; its
    normalization and attention layers fused when `fused_norm` has true (the default, as the
    apps train), Keras' own with `fused_norm=[False]`."""
    return [
        {
            "kind": "layer_profile",
            "model": model,
            "policies": list(LAYER_PROFILE_POLICIES),
            "layer_repeats": config.layer_profile_repeats,
            "image_size": config.image_size,
            "global_batch_size": config.global_batch_size,
            "data": "synthetic",
            "xla": False,
            "fused_norm": True in config.fused_norm,
            "mode": "train",
            "cache": False,
            "steps_per_execution": config.steps_per_execution,
            "warmup_executions": config.warmup_executions,
            "executions": config.executions,
            "min_repeat_seconds": config.min_repeat_seconds,
            "repeats": config.repeats,
        }
        for model in config.layer_profile
    ]


def shared_settings(config: BenchConfig) -> dict:
    """The settings every engine and fit cell of the run shares."""
    return {
        "data": config.data,
        "steps_per_execution": config.steps_per_execution,
        "mode": "train" if config.mode == "memory" else config.mode,
        "image_size": config.image_size,
        "cache": config.cache,
        "warmup_executions": config.warmup_executions,
        "executions": config.executions,
        "min_repeat_seconds": config.min_repeat_seconds,
        "repeats": config.repeats,
    }


def setting_groups(config: BenchConfig, environment: Environment, model: str):
    """Each (precision, tf32, xla, fused_norm) setting of `model`'s cells."""
    for precision in config.precisions:
        # TF32 only changes float32 math; mixed policies are measured once.
        for tf32 in config.tf32 if precision == "float32" else [True]:
            for xla in config.xla:
                for fused_norm in config.fused_norm:
                    yield dict(model=model, precision=precision, xla=xla, tf32=tf32, fused_norm=fused_norm)


def cells(config: BenchConfig, environment: Environment) -> list[dict]:
    """The measurements to take: engine cells, references, one matmul peak per precision and the
    precision probe."""
    # One matmul peak per concrete policy ("auto" and "mixed" resolve to one of them here).
    policies = dict.fromkeys(environment.policies[p] for p in config.precisions)
    result = [
        {
            "kind": "peak",
            "precision": policy,
            "sizes": list(config.peak_sizes),
            "repeats": config.peak_repeats,
            "min_call_seconds": config.peak_min_call_seconds,
        }
        for policy in policies
    ]
    # What --mixed and --precision=auto measure to choose (tfmp.precision.probe), beside the peaks.
    result.append({"kind": "precision_probe"})
    for model in config.models:
        for group in setting_groups(config, environment, model):
            result += _group_cells(config, environment, dict(shared_settings(config), **group))
    return (
        result
        + input_cost_cells(config, environment)
        + studies.cells(config)
        + onednn.cells(config)
        + engine_vs_fit.cells(config, environment)
    )


def _group_cells(config: BenchConfig, environment: Environment, common: dict) -> list[dict]:
    """One setting's engine cells (replicas, workers) and its reference cells."""
    model = common["model"]
    # Scaling and reference cells cost the most; --ratio_models limits them to some models.
    ratios = not config.ratio_models or model in config.ratio_models
    # N replicas or workers get N x the batch (weak scaling).
    devices = [(replicas, 0) for replicas in config.replicas if replicas == 1 or ratios]
    devices += [(1, workers) for workers in config.workers] if ratios else []
    batch = config.global_batch_size
    result = [
        dict(
            common,
            kind="engine",
            replicas=replicas,
            workers=workers,
            global_batch_size=batch * (workers or replicas),
            # One device sums nothing: None. Several: one cell per dtype and bucket size.
            allreduce_dtype=dtype,
            allreduce_bucket_bytes=bucket_bytes,
        )
        for replicas, workers in devices
        for dtype, bucket_bytes in (
            itertools.product(config.allreduce_dtypes, config.allreduce_bucket_bytes)
            if max(replicas, workers) > 1
            else [(None, None)]
        )
    ]
    if not (config.references and ratios):
        return result
    single = dict(common, replicas=1, workers=0, global_batch_size=config.global_batch_size)
    # Keras fit would need the detector's own losses: detectors get the input reference only.
    if not environment.is_detector(model):
        result.append(dict(single, kind="fit"))
    if config.data != "synthetic":
        result.append(dict(single, kind="engine", data="synthetic", reference="input"))
    return result


def input_cost_cells(config: BenchConfig, environment: Environment) -> list[dict]:
    """With detectors on the built-in data and references on: one `input_cost` cell, what one
    image costs the input pipeline, drawn `shapes` vs a JPEG decode (`tfmp.bench.input_cost`)."""
    detectors = [name for name in config.models if environment.is_detector(name)]
    if not (detectors and config.references and config.data == "builtin"):
        return []
    return [
        {
            "kind": "input_cost",
            "image_size": config.image_size,
            "global_batch_size": config.global_batch_size,
            "batches": INPUT_COST_BATCHES,
            "repeats": config.repeats,
        }
    ]


def describe_cell(cell: dict) -> str:
    if cell["kind"] in studies.KINDS or cell.get("study") == "threads":
        return studies.describe(cell)
    if cell["kind"] == "precision_probe":
        return "precision probe: matmul and convolution, float32 / bfloat16 / float16"
    if cell["kind"] == "onednn_study":
        return onednn.describe(cell)
    if cell["kind"] == engine_vs_fit.KIND:
        return engine_vs_fit.describe(cell)
    if cell["kind"] == "peak":
        return f"matmul peak {cell['precision']} (sizes {'/'.join(map(str, cell['sizes']))})"
    if cell["kind"] == "input_cost":
        return (
            f"input cost per image, one thread: shapes drawn vs JPEG decoded, {cell['image_size']}px, "
            f"batch {cell['global_batch_size']}"
        )
    if cell["kind"] == "layer_profile":
        return (
            f"layer profile {cell['model']} {' vs '.join(cell['policies'])}, {cell['image_size']}px, "
            f"batch {cell['global_batch_size']}"
        )
    devices = f"{cell['workers']} worker(s)" if cell["workers"] else f"{cell['replicas']} replica(s)"
    kind = {"fit": " [keras fit]", "engine": ""}[cell["kind"]]
    data = " [synthetic input]" if cell.get("reference") == "input" else ""
    tf32 = "" if cell.get("tf32", True) else " tf32=off"
    fused = " [fused norm]" if cell.get("fused_norm") else ""
    return (
        f"{cell['model']} {cell['precision']}{tf32} {devices} xla={'on' if cell['xla'] else 'off'} "
        f"batch {cell['global_batch_size']}{kind}{data}{fused}"
    )
