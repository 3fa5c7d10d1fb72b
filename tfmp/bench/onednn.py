"""Where one training step's time goes, by oneDNN primitive: `apps.bench --onednn_study`.

    cells = onednn.cells(config)              # one per model and precision of the run
    result = onednn.breakdown(stdout, steps, step_seconds, window_ms)   # from ONEDNN_VERBOSE=1 lines
    print("\\n".join(onednn.lines(cells)))   # float32 and half precision side by side

TensorFlow's x86 wheels compute convolutions, matmuls, batch norms, pooling and element-wise
ops through oneDNN where it is on (by default on CPUs with AVX512-VNNI, AVX512-BF16 or AMX;
`TF_ENABLE_ONEDNN_OPTS=0` turns it off). With `ONEDNN_VERBOSE=1` oneDNN prints one line per
primitive it executes: `onednn_verbose,v1,primitive,exec,cpu,<kind>,<implementation>,
<propagation>,<memory descriptors>,<attributes>,<algorithm>,<shapes>,<ms>`. The implementation
names the kernel: `brg_conv_fwd:avx512_core_amx`, `jit:avx512_core`, `brg_matmul:...`, or
`ref:any`, oneDNN's naive reference kernel (100-1000x slower: a float16 convolution's filter
gradient on CPUs without AMX-FP16, `tfmp.precision.conv`), which the table flags.

An `onednn_study` cell (`tfmp.bench.cell`) trains the model as an engine cell does, one step per
host call: untimed warm-up steps, then `steps` steps, each timed, and it reports their wall-clock
window. Its process runs with `ONEDNN_VERBOSE=1` and `ONEDNN_VERBOSE_TIMESTAMP=1` (each line
then carries its start in ms since the epoch, so stdout's buffering cannot misplace a line); the
parent (`tfmp.bench.runner`, which never imports TensorFlow) reads the lines inside the window:
per (kind, propagation, implementation) the calls and milliseconds per step, their share of the
step, and the step's time outside oneDNN (the step's wall time minus oneDNN's: Eigen kernels,
casts, the optimizer, the executor; two primitives that ran at once on the two cores count
twice, so it can be below zero). The printing costs a little per primitive (one line each), so
the step is slower than an engine cell's. Where no line but Eigen's calls of oneDNN's gemm
(`gemm_api`, which Eigen's matrix products make even with oneDNN's ops off) appears, oneDNN's
TensorFlow ops are off or absent: the result says so in one line (`onednn` false, `note`) and
the run goes on.
"""

from __future__ import annotations

import collections
import statistics

ENVIRONMENT = {"ONEDNN_VERBOSE": "1", "ONEDNN_VERBOSE_TIMESTAMP": "1"}  # the study cell's process
VERBOSE_PREFIX = "onednn_verbose,"
OFF_NOTE = (
    "oneDNN's TensorFlow ops are off or absent here (TF_ENABLE_ONEDNN_OPTS=0, or a CPU TensorFlow "
    "leaves them off on): no per-primitive breakdown"
)
# With oneDNN's ops off, Eigen's matrix products still call oneDNN's BLAS-like gemm (`gemm_api`).
EIGEN_GEMM = "gemm_api"


def cells(config) -> list[dict]:
    """One `onednn_study` cell per model and precision of the run (float32 and half precision
    side by side), at the run's image size and batch, fused as the engine cells' first setting."""
    if not config.onednn_study:
        return []
    return [
        {
            "kind": "onednn_study",
            "model": model,
            "precision": precision,
            "image_size": config.image_size,
            "global_batch_size": config.global_batch_size,
            "fused_norm": config.fused_norm[0],
            "data": "synthetic",
            "xla": False,
            "mode": "train",
            "cache": False,
            "replicas": 1,
            "workers": 0,
            "steps_per_execution": 1,
            "warmup_executions": max(2, config.warmup_executions),
            "steps": config.onednn_study_steps,
        }
        for model in config.models
        for precision in config.precisions
    ]


def describe(cell: dict) -> str:
    return (
        f"oneDNN primitives of {cell['model']} {cell['precision']} batch {cell['global_batch_size']}: "
        f"{cell['steps']} steps with ONEDNN_VERBOSE=1"
    )


def _executions(stdout: str, window_ms: list[float]):
    """(kind, propagation, implementation, ms) of each primitive oneDNN executed in the window:
    `onednn_verbose,v1,<timestamp>,primitive,exec,cpu,<kind>,<implementation>,<propagation>,...,<ms>`."""
    begin, end = window_ms
    for line in stdout.splitlines():
        line = line.split("] ", 1)[1] if line.startswith("[worker ") else line
        fields = line.split(",")
        if not line.startswith(VERBOSE_PREFIX) or len(fields) < 10 or fields[3:5] != ["primitive", "exec"]:
            continue
        try:
            started, milliseconds = float(fields[2]), float(fields[-1])
        except ValueError:
            continue
        if begin <= started <= end:
            yield fields[6], fields[8], fields[7], milliseconds


def breakdown(stdout: str, steps: int, step_seconds: list[float], window_ms: list[float]) -> dict:
    """The per-primitive table of the `steps` timed steps (in `window_ms`) in a cell's stdout."""
    step_ms = 1000 * statistics.median(step_seconds)
    totals = collections.defaultdict(lambda: [0, 0.0])
    for kind, propagation, implementation, milliseconds in _executions(stdout, window_ms):
        key = (kind, propagation, implementation)
        totals[key][0] += 1
        totals[key][1] += milliseconds
    primitives = [
        {
            "kind": kind,
            "propagation": propagation,
            "implementation": implementation,
            "calls_per_step": calls / steps,
            "ms_per_step": milliseconds / steps,
            "share": milliseconds / steps / step_ms if step_ms > 0 else 0.0,
            "reference_kernel": implementation.startswith("ref"),
        }
        for (kind, propagation, implementation), (calls, milliseconds) in totals.items()
    ]
    primitives.sort(key=lambda row: -row["ms_per_step"])
    onednn_ms = sum(row["ms_per_step"] for row in primitives)
    on = any(row["kind"] != EIGEN_GEMM for row in primitives)
    gemm = f" (Eigen's matmuls called oneDNN's gemm: {onednn_ms:.2f} ms per step)" if primitives else ""
    return {
        "onednn": on,
        "note": "" if on else OFF_NOTE + gemm,
        "steps": steps,
        "step_ms": step_ms,
        "onednn_ms": onednn_ms,
        "outside_onednn_ms": step_ms - onednn_ms,
        "primitives": primitives,
        "reference_kernels": sorted({row["implementation"] for row in primitives if row["reference_kernel"]}),
    }


def _by_kind(result: dict) -> dict[str, tuple[float, set]]:
    kinds = collections.defaultdict(lambda: [0.0, set()])
    for row in result["primitives"]:
        propagation = {"forward_training": "fwd", "forward_inference": "fwd (inference)", "undef": ""}.get(
            row["propagation"], row["propagation"].replace("backward_", "bwd ")
        )
        label = f"{row['kind']} {propagation}".strip()
        kinds[label][0] += row["ms_per_step"]
        kinds[label][1].add(row["implementation"] + (" [REF]" if row["reference_kernel"] else ""))
    return kinds


def lines(cells: list[dict]) -> list[str]:
    """Each model's oneDNN study: ms per step by primitive kind, one column per precision (the
    first precision, float32 where asked, is the reference), implementations named, `ref:`
    kernels flagged [REF]; then the time outside oneDNN."""
    studied = [cell for cell in cells if cell["kind"] == "onednn_study" and "result" in cell]
    result = []
    for model in dict.fromkeys(cell["model"] for cell in studied):
        mine = [cell for cell in studied if cell["model"] == model]
        off = [cell for cell in mine if not cell["result"]["onednn"]]
        if off:
            result += ["", f"oneDNN study {model}: {off[0]['result']['note']}"]
            continue
        names = [cell["precision"] for cell in mine]
        kinds = [_by_kind(cell["result"]) for cell in mine]
        labels = sorted(set().union(*kinds), key=lambda label: -max(k.get(label, (0.0,))[0] for k in kinds))
        result += [
            "",
            f"oneDNN study {model} batch {mine[0]['global_batch_size']}: ms per step ({' / '.join(names)})",
        ]
        for label in labels:
            values = " / ".join(f"{k[label][0]:7.2f}" if label in k else "      -" for k in kinds)
            implementations = "; ".join(sorted(set().union(*(k[label][1] for k in kinds if label in k))))
            result.append(f"  {label:<28} {values}   {implementations}")
        for name, key in (
            ("oneDNN total", "onednn_ms"),
            ("outside oneDNN", "outside_onednn_ms"),
            ("step", "step_ms"),
        ):
            values = " / ".join(f"{cell['result'][key]:7.2f}" for cell in mine)
            result.append(f"  {name:<28} {values}")
        flagged = sorted({kernel for cell in mine for kernel in cell["result"]["reference_kernels"]})
        if flagged:
            result.append(f"  reference kernels (oneDNN's naive ones): {', '.join(flagged)}")
    return result
