"""Data parallelism past one host, on paper: the ring all-reduce time, the step time and the
scaling efficiency predicted from a measured single-device step, the gradient bytes and a link.

    from tfmp.distribute import scaling
    nbytes = scaling.gradient_bytes(25_557_032, "bfloat16")            # ResNet-50, half precision
    prediction = scaling.predict(0.108, nbytes, devices=64, link=scaling.LINKS["400gbe"])
    prediction.efficiency, prediction.efficiency_overlapped

    python -m apps.scaling                                   # the table (docs/distributed.md)
    python -m apps.scaling --from_bench=bench-cpu-quick/bench.json --links=localhost

The model (weak scaling: every device keeps its batch, so its compute time stays the same):

- ring all-reduce of B bytes over N devices: every device sends and receives 2(N-1)/N x B
  bytes (a reduce-scatter, then an all-gather) in 2(N-1) steps, so
  t = 2(N-1)/N x B / bandwidth + 2(N-1) x step latency. `bandwidth` is what one device sends
  (and receives at once) over the ring's slowest hop: the quantity NCCL's all_reduce_perf calls
  bus bandwidth (busbw = algbw x 2(N-1)/N, nccl-tests doc/PERFORMANCE.md).
- step time without overlap: compute + t (one all-reduce after the whole backward pass, as
  Keras does).
- step time with buckets: the gradients all-reduced in buckets of `bucket_bytes` while the
  backward pass still computes the earlier layers. The backward pass is `backward_share` of
  the compute (2/3: it does about twice the forward pass's FLOPs), and a fraction `overlap` of
  it can hide communication; what does not fit, and at least the last bucket's all-reduce
  (the first layers' gradients, ready only when the backward pass ends), is added.
- scaling efficiency = single-device step / predicted step.

What it leaves out, so a prediction is an upper bound: stragglers and the wait for the slowest
device, the input pipeline, the optimizer update, contention of compute and communication for
memory bandwidth (or, on a CPU, for the cores), and links below their peak.

Pure Python: importing it does not import TensorFlow.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time

from tfmp.errors import UsageError, unknown

BYTES_PER_ELEMENT = {"float32": 4, "bfloat16": 2, "float16": 2}
BACKWARD_SHARE = 2 / 3  # backward ~ 2x the forward FLOPs: 2/3 of a training step's compute
DEFAULT_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's bucket_cap_mb; tfmp.distribute.allreduce's default


@dataclasses.dataclass(frozen=True)
class Link:
    """One kind of link: what each device sends per second over the ring's slowest hop, and the
    latency each ring step adds."""

    name: str
    bandwidth: float  # bytes/s per device and direction (NCCL's bus bandwidth)
    step_latency: float  # seconds per ring step
    reach: int | None  # most devices such links join in one shipped system; None: any number
    source: str  # where the numbers come from


# Bandwidths are peaks from the datasheets (per direction); NCCL reaches less (its own tuning
# model caps A100's NVLink bus bandwidth at 235 GB/s). Step latencies are NCCL's ring / Simple
# protocol figures (src/graph/tuning.cc, hwLat: NVLink 3.4 us, network 9.6 us per step).
LINKS = {
    "nvlink": Link(
        "A100 NVLink 3",
        300e9,
        3.4e-6,
        8,
        "NVIDIA A100 datasheet: NVLink 600 GB/s (both directions), 8 GPUs per HGX A100 board",
    ),
    "nvlink4": Link(
        "H100 NVLink 4",
        450e9,
        3.4e-6,
        256,
        "NVIDIA H100 datasheet: NVLink 900 GB/s (both directions); NVLink Switch System: up to 256 GPUs",
    ),
    "100gbe": Link(
        "100 Gb/s network",
        12.5e9,
        9.6e-6,
        None,
        "100 Gb/s per host; a ring crosses each host's link once per direction",
    ),
    "400gbe": Link(
        "400 Gb/s network",
        50e9,
        9.6e-6,
        None,
        "400 Gb/s per host; a ring crosses each host's link once per direction",
    ),
    "localhost": Link(
        "localhost gRPC",
        0.53e9,
        780e-6,
        None,
        "measured 2026-12-04 on the 2-core EPYC (AVX2) VM: 2 workers of `python -m tfmp.launch --workers=2 "
        "-- python -m apps.scaling --measure_link`, MultiWorkerMirroredStrategy's ring over gRPC on loopback",
    ),
}


@dataclasses.dataclass(frozen=True)
class Published:
    """A published single-GPU training throughput: the compute time of one step."""

    device: str
    precision: str
    batch_per_device: int
    examples_per_sec: float
    source: str

    @property
    def step_seconds(self) -> float:
        return self.batch_per_device / self.examples_per_sec


PUBLISHED = {
    "resnet50": Published(
        "A100 40GB",
        "mixed precision + XLA",
        256,
        2375.0,
        "NVIDIA DeepLearningExamples, TensorFlow/Classification/ConvNets/resnet50v1.5/README.md, "
        "'Training performance: NVIDIA DGX A100 (8x A100 40GB)', 1 GPU (8 GPUs: 17,400 img/s, 7.32x)",
    ),
    "vit_b16": Published(
        "A100",
        "mixed precision",
        128,
        3583.0 / 8,
        "PaddlePaddle PLSC ViT-B_16_224 pretraining benchmark, 3,583 img/s on 8 A100 (1 node), / 8; "
        "batch 128 per GPU as configs/vit_b16_imagenet_8gpu.cfg",
    ),
}


@dataclasses.dataclass(frozen=True)
class Prediction:
    devices: int
    link: str
    gradient_bytes: int
    compute_seconds: float
    allreduce_seconds: float  # one call
    step_seconds: float  # compute + one all-reduce after the backward pass
    efficiency: float
    buckets: int
    step_seconds_overlapped: float  # buckets all-reduced while the backward pass runs
    efficiency_overlapped: float


def gradient_bytes(parameters: int, dtype: str) -> int:
    """The bytes one replica all-reduces per step: every trainable parameter in `dtype`."""
    if dtype not in BYTES_PER_ELEMENT:
        raise unknown("all-reduce dtype", dtype, BYTES_PER_ELEMENT)
    return parameters * BYTES_PER_ELEMENT[dtype]


def ring_allreduce_seconds(nbytes: float, devices: int, link: Link, calls: int = 1) -> float:
    """2(N-1)/N x bytes / bandwidth, plus 2(N-1) ring steps' latency per call; 0 for one device."""
    if devices == 1:
        return 0.0
    steps = 2 * (devices - 1)
    return steps / devices * nbytes / link.bandwidth + calls * steps * link.step_latency


def predict(
    compute_seconds: float,
    nbytes: int,
    devices: int,
    link: Link,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    overlap: float = 1.0,
    backward_share: float = BACKWARD_SHARE,
) -> Prediction:
    """The step time and scaling efficiency of `devices` data-parallel replicas (weak scaling)."""
    check(compute_seconds, devices, link, bucket_bytes, overlap)
    allreduce = ring_allreduce_seconds(nbytes, devices, link)
    step = compute_seconds + allreduce
    buckets = max(1, math.ceil(nbytes / bucket_bytes)) if bucket_bytes else 1
    bucketed = ring_allreduce_seconds(nbytes, devices, link, calls=buckets)
    # Buckets fill from the last layer back, so the last one holds the first layers: the remainder.
    last_bucket = ring_allreduce_seconds(nbytes - (buckets - 1) * bucket_bytes, devices, link)
    hidden = overlap * backward_share * compute_seconds if buckets > 1 else 0.0
    exposed = max(bucketed - hidden, last_bucket) if buckets > 1 else bucketed
    overlapped = compute_seconds + exposed
    return Prediction(
        devices=devices,
        link=link.name,
        gradient_bytes=nbytes,
        compute_seconds=compute_seconds,
        allreduce_seconds=allreduce,
        step_seconds=step,
        efficiency=compute_seconds / step,
        buckets=buckets,
        step_seconds_overlapped=overlapped,
        efficiency_overlapped=compute_seconds / overlapped,
    )


def check(compute_seconds: float, devices: int, link: Link, bucket_bytes: int, overlap: float) -> None:
    """UsageError for a value no prediction can be made from, naming it and the fix."""
    if not compute_seconds > 0 or math.isinf(compute_seconds):
        raise UsageError(f"step time {compute_seconds} s must be a positive number of seconds, e.g. 0.1")
    if devices < 1:
        raise UsageError(f"{devices} devices: give at least 1, e.g. --devices=8,64,256")
    if not link.bandwidth > 0 or math.isinf(link.bandwidth) or link.step_latency < 0:
        raise UsageError(
            f"link {link.name!r}: bandwidth {link.bandwidth} bytes/s must be positive and latency "
            f"{link.step_latency} s at least 0"
        )
    if bucket_bytes < 0:
        raise UsageError(f"bucket size {bucket_bytes} bytes: give 0 (one call) or a positive size")
    if not 0 <= overlap <= 1:
        raise UsageError(f"overlap {overlap} must be a fraction of the backward pass, from 0 to 1")


def link(name: str) -> Link:
    """A named link of LINKS; UsageError naming the choices."""
    if name not in LINKS:
        raise unknown("link", name, LINKS)
    return LINKS[name]


def fit_link(name: str, devices: int, sizes: list[int], seconds: list[float]) -> Link:
    """The link whose ring time fits measured all-reduce times of `sizes` bytes over `devices`
    replicas best (least squares of t = a + b x bytes): bandwidth 2(N-1)/N / b, step latency
    a / 2(N-1)."""
    if devices < 2 or len(sizes) < 2 or len(set(sizes)) < 2 or len(sizes) != len(seconds):
        raise UsageError("fitting a link needs 2 or more devices and times of 2 or more different sizes")
    mean_size, mean_time = sum(sizes) / len(sizes), sum(seconds) / len(seconds)
    slope = sum((s - mean_size) * (t - mean_time) for s, t in zip(sizes, seconds)) / sum(
        (s - mean_size) ** 2 for s in sizes
    )
    intercept = max(0.0, mean_time - slope * mean_size)
    if not slope > 0:
        raise UsageError(f"all-reduce times {seconds} do not grow with the sizes {sizes}: measure again")
    steps = 2 * (devices - 1)
    return Link(name, steps / devices / slope, intercept / steps, None, f"fitted to {len(sizes)} sizes")


def measure_allreduce(strategy, calls: list[list[int]], repeats: int = 5) -> list[float]:
    """Median seconds of each all-reduce call (SUM over every replica of `strategy`): a call is a
    list of float32 tensor sizes in elements, summed in one `all_reduce` as a model's gradients
    are. Each is timed `repeats` times after one untimed call. Every worker of a multi-worker
    strategy runs it at once (`python -m tfmp.launch --workers=2 -- python -m apps.scaling
    --measure_link`)."""
    # TensorFlow only here, so that importing this module (the model, its table) stays cheap.
    import tensorflow as tf

    medians = []
    for sizes in calls:
        with strategy.scope():
            tensors = [tf.Variable(tf.ones([size], tf.float32), trainable=False) for size in sizes]

        @tf.function
        def reduce_once(tensors=tensors):
            def replica_fn():
                values = [tf.identity(tensor) for tensor in tensors]
                return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, values)

            summed = strategy.run(replica_fn)
            # One number back to the host, not the tensors: the time is the collective's.
            return strategy.experimental_local_results(summed[0])[0][0]

        reduce_once().numpy()
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            reduce_once().numpy()
            times.append(time.perf_counter() - started)
        medians.append(statistics.median(times))
    return medians


@dataclasses.dataclass(frozen=True)
class BenchCell:
    """What one bench report says about a model's 1-worker step and its 2-worker scaling."""

    model: str
    precision: str
    policy: str
    data: str
    image_size: int
    image_shape: list
    global_batch_size: int
    examples_per_sec: float
    step_seconds: float  # global batch / examples/s of the 1-worker cell
    measured: list  # one Measured per N-worker cell of the same settings


@dataclasses.dataclass(frozen=True)
class Measured:
    """An N-worker cell of a bench report, beside which a prediction is printed."""

    workers: int
    efficiency: float  # its examples/s / (N x the 1-worker cell's)
    allreduce_dtype: str | None  # None: a report from before the bench recorded it
    gradient_bytes: int | None  # sent per replica per step
    collective_seconds: float | None  # that all-reduce alone, per step


_SETTINGS = ("model", "precision", "xla", "tf32", "fused_norm", "data", "image_size", "steps_per_execution")


def read_bench_report(path: str, model: str | None = None, precision: str | None = None) -> BenchCell:
    """The 1-worker engine cell of `model` in `precision` (either may be left out when the report
    has only one) of an `apps.bench` report, with the scaling efficiency of its N-worker cells
    of the same settings; UsageError for a file that is missing, not a report, or ambiguous."""
    try:
        with open(path, encoding="utf-8") as file:
            cells = [cell for cell in json.load(file)["cells"] if cell["kind"] == "engine"]
        single = [
            cell
            for cell in cells
            if cell["workers"] == 1
            and model in (None, cell["model"])
            and precision in (None, cell["precision"])
        ]
        found = sorted({(cell["model"], cell["precision"]) for cell in single})
        if len(found) == 1:
            return _bench_cell(single[0], cells)
        choices = sorted({f"{cell['model']} {cell['precision']}" for cell in cells if cell["workers"] == 1})
    except OSError as error:
        raise UsageError(f"--from_bench={path}: {error.strerror}; give an apps.bench bench.json") from None
    except (ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError):
        raise UsageError(f"--from_bench={path} is not an apps.bench report (bench.json)") from None
    raise UsageError(
        f"--from_bench={path}: {len(found)} 1-worker cells match --model={model} --bench_precision="
        f"{precision}; its 1-worker cells: {', '.join(choices) or 'none (run apps.bench --workers=1,2)'}"
    )


def _bench_cell(cell: dict, cells: list[dict]) -> BenchCell:
    result = cell["result"]
    settings = [cell.get(name) for name in _SETTINGS]
    measured = [
        Measured(
            workers=other["workers"],
            efficiency=other["result"]["examples_per_sec"] / (other["workers"] * result["examples_per_sec"]),
            allreduce_dtype=other["result"].get("allreduce_dtype"),
            gradient_bytes=other["result"].get("gradient_bytes_per_step"),
            collective_seconds=other["result"].get("collective_seconds_per_step"),
        )
        for other in cells
        if other["workers"] > 1 and [other.get(name) for name in _SETTINGS] == settings
    ]
    return BenchCell(
        model=cell["model"],
        precision=cell["precision"],
        policy=result["policy"],
        data=cell["data"],
        image_size=cell["image_size"],
        image_shape=list(result["image_shape"]),
        global_batch_size=cell["global_batch_size"],
        examples_per_sec=result["examples_per_sec"],
        step_seconds=cell["global_batch_size"] / result["examples_per_sec"],
        measured=measured,
    )
