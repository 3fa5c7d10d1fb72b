"""Data parallelism past one host, on paper: the ring all-reduce time, the step time and the
scaling efficiency predicted from a measured single-device step, the gradient bytes and a link.

    from tfmp.distribute import scaling
    nbytes = scaling.gradient_bytes(25_557_032, "bfloat16")            # ResNet-50, half precision
    prediction = scaling.predict(0.108, nbytes, devices=64, link=scaling.LINKS["400gbe"])
    prediction.efficiency, prediction.efficiency_overlapped
    overheads = scaling.Overheads(sync_seconds=2.5e-3, step_cv=0.015)
    scaling.predict(0.108, nbytes, 8, scaling.LINKS["nvlink"], overheads=overheads)

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
- the overheads (`Overheads`, each zero at one device): synchronisation no compute hides, small
  blocking collectives, the wait for the slowest of N devices (sigma x E[max of N standard
  normals]), workers sharing a host's cores, and an input pipeline those cores cannot keep up
  with. Without them (the default) a prediction is an upper bound.
- scaling efficiency = single-device step / predicted step.

tfmp.distribute.scaling_anchors holds published N-device results with their run's terms, each
value from a named source or a measurement here; apps.scaling prints each one's published and
predicted efficiency and the residual. Still left out: contention of compute and communication for memory
bandwidth, links below their datasheet peak, and framework costs no source quantifies.

The measurements (TensorFlow) are in tfmp.bench.scaling_measure.
Pure Python: importing it does not import TensorFlow.
"""

from __future__ import annotations

import dataclasses
import functools
import math

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
class Overheads:
    """What a step of N synchronous replicas pays beyond its compute and the ring's bytes. Every
    term is zero at one device, and all default to nothing: the model's upper bound.

    - sync_seconds: per step, never hidden behind compute: the wait between the last gradient
      being ready and its all-reduce starting (Horovod's background loop runs every cycle, so
      on average half a cycle), a collective's launch and negotiation.
    - blocking_collectives: small all-reduces per step the compute must wait for (cross-replica
      batch norm: 2 per layer, forward and backward; a dynamic loss scale's finiteness check:
      1); each pays the ring's 2(N-1) step latencies.
    - step_cv: coefficient of variation of the one-device step (sigma = step_cv x
      compute_seconds). A synchronous step ends with the slowest of N devices: sigma x E[max of
      N standard normals] more than one device's.
    - input_core_seconds: CPU core-seconds one device's input pipeline needs per step. The k
      devices of a host share its `host_cores`, so the input takes k x input_core_seconds /
      host_cores per step; it runs beside the step (prefetched) and stalls it only when longer.
    - compute_cores: cores one device's compute keeps busy (a CPU worker: its threads; a GPU:
      0). k workers pinned round-robin to `host_cores` cores (tfmp.launch) stretch the compute
      by the busiest core's load, max(1, ceil(k x compute_cores / host_cores)).
    - host_share: the fraction of the host's cores the workers' session gets when it asks for
      all of them (1: the host to itself). Linux's autogroup scheduler gives each session an
      equal share of a busy host, however many processes it runs, so under G other busy
      sessions all k workers together get host_cores / (G + 1) cores: each worker's compute is
      stretched by k x compute_cores / (host_share x host_cores) when that is the larger.
    - host_cores, devices_per_host: the host these share (0 cores: not modelled).

    The optimizer update and batch normalization's own arithmetic are not terms: under weak
    scaling every replica does the same per-step work as the single device whose measured step
    is `compute_seconds`, so it is in both sides of the efficiency already."""

    sync_seconds: float = 0.0
    blocking_collectives: int = 0
    step_cv: float = 0.0
    input_core_seconds: float = 0.0
    compute_cores: float = 0.0
    host_cores: int = 0
    devices_per_host: int = 1
    host_share: float = 1.0


NO_OVERHEADS = Overheads()


@dataclasses.dataclass(frozen=True)
class Prediction:
    devices: int
    link: str
    gradient_bytes: int
    compute_seconds: float
    allreduce_seconds: float  # one call
    step_seconds: float  # compute + one all-reduce after the backward pass (+ overheads)
    efficiency: float
    buckets: int
    step_seconds_overlapped: float  # buckets all-reduced while the backward pass runs (+ overheads)
    efficiency_overlapped: float
    exposed_allreduce_seconds: float = 0.0  # what the overlapped step pays for the all-reduce
    contention_seconds: float = 0.0  # compute stretched by workers sharing a host's cores
    sync_seconds: float = 0.0
    straggler_seconds: float = 0.0
    input_stall_seconds: float = 0.0  # of the overlapped step


@functools.lru_cache(maxsize=256)
def expected_max_standard_normal(count: int) -> float:
    """E[max of `count` independent standard normals]: the integral of x n phi(x) Phi(x)^(n-1),
    by Simpson's rule on [-9, 9] (4,000 intervals: 1e-9 of the exact 1/sqrt(pi) at n = 2). 0 for
    one device; 1.4236 for 8, 2.8 for 256; it grows like sqrt(2 ln n)."""
    if count < 1:
        raise UsageError(f"{count} devices: give at least 1")
    if count == 1:
        return 0.0
    low, high, intervals = -9.0, 9.0, 4000
    width = (high - low) / intervals

    def integrand(x: float) -> float:
        density = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        below = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        return x * count * density * below ** (count - 1)

    total = integrand(low) + integrand(high)
    for index in range(1, intervals):
        total += (4 if index % 2 else 2) * integrand(low + index * width)
    return total * width / 3


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
    overheads: Overheads = NO_OVERHEADS,
) -> Prediction:
    """The step time and scaling efficiency of `devices` data-parallel replicas (weak scaling):
    the one-device step `compute_seconds` against the N-device step, which adds the ring
    all-reduce (after the backward pass, or bucketed under it) and the `overheads`."""
    check(compute_seconds, devices, link, bucket_bytes, overlap)
    allreduce = ring_allreduce_seconds(nbytes, devices, link)
    buckets = max(1, math.ceil(nbytes / bucket_bytes)) if bucket_bytes else 1
    bucketed = ring_allreduce_seconds(nbytes, devices, link, calls=buckets)
    # Buckets fill from the last layer back, so the last one holds the first layers: the remainder.
    last_bucket = ring_allreduce_seconds(nbytes - (buckets - 1) * bucket_bytes, devices, link)
    hidden = overlap * backward_share * compute_seconds if buckets > 1 else 0.0
    exposed = max(bucketed - hidden, last_bucket) if buckets > 1 else bucketed
    terms = _overhead_terms(compute_seconds, devices, link, overheads)
    contention, sync, straggler, input_floor, baseline = terms
    device_path = compute_seconds + contention + sync + straggler
    step = max(device_path + allreduce, input_floor)
    overlapped = max(device_path + exposed, input_floor)
    return Prediction(
        devices=devices,
        link=link.name,
        gradient_bytes=nbytes,
        compute_seconds=compute_seconds,
        allreduce_seconds=allreduce,
        step_seconds=step,
        efficiency=baseline / step,
        buckets=buckets,
        step_seconds_overlapped=overlapped,
        efficiency_overlapped=baseline / overlapped,
        exposed_allreduce_seconds=exposed,
        contention_seconds=contention,
        sync_seconds=sync,
        straggler_seconds=straggler,
        input_stall_seconds=max(0.0, input_floor - device_path - exposed),
    )


def _overhead_terms(compute_seconds: float, devices: int, link: Link, overheads: Overheads) -> tuple:
    """(core contention, synchronisation, straggler wait, input floor of N devices, the
    one-device step) in seconds: the terms `Overheads` describes."""
    on_host = min(devices, max(1, overheads.devices_per_host))
    cores = overheads.host_cores
    stretch = _core_stretch(on_host, overheads.compute_cores, cores, overheads.host_share)
    one_stretch = _core_stretch(1, overheads.compute_cores, cores, overheads.host_share)
    # compute_seconds was measured at one worker's stretch already.
    contention = compute_seconds * (stretch / one_stretch - 1)
    sync = 0.0
    if devices > 1:
        latency = overheads.blocking_collectives * 2 * (devices - 1) * link.step_latency
        sync = overheads.sync_seconds + latency
    sigma = overheads.step_cv * compute_seconds  # the variation measured on the one-device step
    straggler = sigma * expected_max_standard_normal(devices)
    input_floor = on_host * overheads.input_core_seconds / cores if cores else 0.0
    one_input = overheads.input_core_seconds / cores if cores else 0.0
    return contention, sync, straggler, input_floor, max(compute_seconds, one_input)


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


def _core_stretch(workers: int, compute_cores: float, host_cores: int, host_share: float) -> float:
    """How much slower each worker computes than on a core of its own (at least 1): the busiest
    core's load (tfmp.launch pins workers to cores round-robin, so 3 one-core workers on 2 cores
    put two on one core, whose step doubles), or the session's share of a busy host spread over
    its workers, whichever is slower."""
    if not host_cores or not compute_cores:
        return 1.0
    busiest = float(math.ceil(workers * compute_cores / host_cores - 1e-9))
    shared = workers * compute_cores / (host_share * host_cores)
    return max(1.0, busiest, shared)


def check_overheads(overheads: Overheads) -> None:
    """UsageError for an overhead no step can have: a negative time, share or count."""
    for name in ("sync_seconds", "blocking_collectives", "step_cv", "input_core_seconds", "compute_cores"):
        value = getattr(overheads, name)
        if not value >= 0 or math.isinf(value):
            raise UsageError(f"{name} {value} must be a finite number, 0 or more")
    if not 0 < overheads.host_share <= 1:
        raise UsageError(
            f"host_share {overheads.host_share} must be a fraction of the host, above 0 and at most 1"
        )
    if overheads.host_cores < 0 or overheads.devices_per_host < 1:
        raise UsageError(
            f"host_cores {overheads.host_cores} must be 0 (not modelled) or more, devices_per_host "
            f"{overheads.devices_per_host} at least 1"
        )
