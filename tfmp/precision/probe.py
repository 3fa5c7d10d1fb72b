"""The precision probe: how fast this host runs a model's kind of work in float32, bfloat16, float16.

    from tfmp.precision import probe
    table, note = probe.cached_timings()   # {dtype: {workload: seconds per call}}, cached per host
    probe.speedups(table)                  # {"bfloat16": 0.52, "float16": 0.01}: float32's time / theirs
    print(probe.format_table(table))

The workload stands for a model's work: a dense layer's matmul and a 3x3 convolution, forward and
backward (the two gradients each), in a `tf.function`, the first (tracing) call excluded. The
convolution runs as `tfmp.fuse_normalization` makes a model's run (`tfmp.precision.conv`: in
float16 on a CPU its gradients from float32 copies), so the table is what a fused model pays. The
workloads and dtypes are timed in turn, round after round in a rotating order, and each keeps
its median: one slow spell of a shared VM does not decide. In all a fraction of a second where
half precision is fast; a CPU that emulates float16 (about 100x slower) stops after
`MIN_ROUNDS` rounds.

The table is cached in `cache_path()` (`$XDG_CACHE_HOME/tfmp/precision_probe.json`, else
`~/.cache/tfmp/...`) under a key of what decides the speeds: the CPU model and its flags, the GPUs
and their compute capabilities, TensorFlow's version and `TF_ENABLE_ONEDNN_OPTS`. A cache that
is unreadable or malformed is measured again and rewritten; one that cannot be written is left
alone (the table is used all the same). `TFMP_PRECISION_PROBE=off` skips the probe: `--mixed`
and `--precision=auto` then choose by the hardware rule alone (reproducible runs, the tests).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import time

import tensorflow as tf

from tfmp import run_dir
from tfmp.errors import UsageError
from tfmp.precision import conv

ENVIRONMENT_VARIABLE = "TFMP_PRECISION_PROBE"
DTYPES = ("float32", "bfloat16", "float16")
HALF_DTYPES = ("bfloat16", "float16")
CACHE_FILE = "precision_probe.json"
# Bump when the workloads change: older tables measured something else (2: the convolution's
# float16 gradients as a fused model computes them on a CPU, tfmp.precision.conv).
CACHE_VERSION = 2
MATMUL_SHAPE = (256, 512, 512)  # (batch, units in, units out): a dense layer of a small model
CONV_SHAPE = (8, 32, 32, 32, 32)  # (batch, height, width, channels in, channels out), 3x3 kernel
MIN_ROUNDS, MAX_ROUNDS = 3, 7
BUDGET_SECONDS = 0.5  # no new round starts after this much timing


def enabled() -> bool:
    """False when `TFMP_PRECISION_PROBE=off` (default on)."""
    value = os.environ.get(ENVIRONMENT_VARIABLE, "on").strip().lower()
    if value not in ("on", "off"):
        raise UsageError(f"{ENVIRONMENT_VARIABLE}={value!r}: use on (measure, the default) or off")
    return value == "on"


# ----------------------------------------------------------------------------- the workloads
def _matmul_step(dtype: str):
    batch, units_in, units_out = MATMUL_SHAPE
    inputs = tf.random.stateless_normal((batch, units_in), (1, 2), dtype=tf.float32)
    kernel = tf.random.stateless_normal((units_in, units_out), (3, 4), dtype=tf.float32) * 0.05
    inputs, kernel = tf.cast(inputs, dtype), tf.cast(kernel, dtype)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            tape.watch([inputs, kernel])
            outputs = tf.matmul(inputs, kernel)
        return _checksum(tape.gradient(outputs, [inputs, kernel], output_gradients=outputs))

    return step


def _conv_step(dtype: str):
    batch, height, width, channels_in, channels_out = CONV_SHAPE
    images = tf.random.stateless_normal((batch, height, width, channels_in), (5, 6), dtype=tf.float32)
    kernel = tf.random.stateless_normal((3, 3, channels_in, channels_out), (7, 8), dtype=tf.float32) * 0.05
    images, kernel = tf.cast(images, dtype), tf.cast(kernel, dtype)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            tape.watch([images, kernel])
            # As a fused model convolves (`tfmp.precision.conv`): a float16 convolution's gradients
            # from float32 copies on a CPU, whose float16 filter gradient is ~100x slower.
            outputs = conv.backward_in_float32(
                lambda x, k: tf.nn.conv2d(x, k, strides=1, padding="SAME"), images, kernel
            )
        return _checksum(tape.gradient(outputs, [images, kernel], output_gradients=outputs))

    return step


def _checksum(tensors) -> tf.Tensor:
    # One scalar that needs every gradient: fetching it waits for all the work.
    return tf.add_n([tf.reduce_sum(tf.cast(tensor, tf.float32)) for tensor in tensors])


WORKLOADS = {"matmul": _matmul_step, "conv": _conv_step}


def describe_workloads() -> str:
    batch, units_in, units_out = MATMUL_SHAPE
    images, height, width, channels_in, channels_out = CONV_SHAPE
    return (
        f"matmul {batch}x{units_in} @ {units_in}x{units_out}, conv 3x3 {images}x{height}x{width}x"
        f"{channels_in} -> {channels_out}; forward and backward"
    )


# ----------------------------------------------------------------------------- measuring
def measure(workloads=None, budget_seconds: float = BUDGET_SECONDS) -> dict[str, dict[str, float]]:
    """{dtype: {workload: median seconds per call}} for every dtype of DTYPES. `workloads` maps
    a name to `make(dtype) -> step` (default WORKLOADS); an op that fails raises its error."""
    workloads = workloads or WORKLOADS
    steps = {(name, dtype): make(dtype) for name, make in workloads.items() for dtype in DTYPES}
    for step in steps.values():
        step().numpy()  # traces and warms up: not timed
    order = list(steps)
    samples = {key: [] for key in order}
    started = time.perf_counter()
    for round_index in range(MAX_ROUNDS):
        if round_index >= MIN_ROUNDS and time.perf_counter() - started > budget_seconds:
            break
        shift = round_index % len(order)  # each round starts with another (workload, dtype)
        for key in order[shift:] + order[:shift]:
            begin = time.perf_counter()
            steps[key]().numpy()
            samples[key].append(time.perf_counter() - begin)
    return {
        dtype: {name: statistics.median(samples[(name, dtype)]) for name in workloads} for dtype in DTYPES
    }


def speedups(table: dict[str, dict[str, float]]) -> dict[str, float]:
    """{half dtype: float32's total time / its total time}: 2.0 is twice as fast as float32."""
    float32 = sum(table["float32"].values())
    return {dtype: float32 / sum(table[dtype].values()) for dtype in HALF_DTYPES}


def format_table(table: dict[str, dict[str, float]]) -> str:
    """The table in milliseconds per call, one row per workload, and each dtype's speed."""
    names = list(table["float32"])
    width = max(len(name) for name in [*names, "vs float32"])
    lines = [f"precision probe ({describe_workloads()}), ms per call:"]
    lines.append("  " + " " * width + "".join(f"{dtype:>10}" for dtype in DTYPES))
    for name in names:
        lines.append("  " + name.ljust(width) + "".join(f"{1000 * table[d][name]:>10.2f}" for d in DTYPES))
    speed = {"float32": 1.0, **speedups(table)}
    lines.append("  " + "vs float32".ljust(width) + "".join(f"{speed[d]:>9.2f}x" for d in DTYPES))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the cache
def host_key() -> dict:
    """What the relative speeds depend on: the cache holds one table per distinct key."""
    model, flags = _cpu()
    gpus = []
    for gpu in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(gpu)
        gpus.append([details.get("device_name", gpu.name), list(details.get("compute_capability", ()))])
    return {
        "probe": CACHE_VERSION,
        "cpu": model,
        "cpu_flags": flags,
        "gpus": gpus,
        "tensorflow": tf.__version__,
        "TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
    }


def _cpu() -> tuple[str, str]:
    """(model name, sorted flags) from /proc/cpuinfo; elsewhere what `platform` knows."""
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    model = fields.get("model name") or platform.processor() or platform.machine()
    flags = fields.get("flags") or fields.get("Features") or ""
    return model, " ".join(sorted(flags.split()))


def cache_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tfmp", CACHE_FILE)


def cached_timings(path: str | None = None, measure_fn=measure) -> tuple[dict, str]:
    """(table, note): the cached table for this host's key, else a new measurement, cached.
    The note says which ("cached 2026-12-04", "measured now", "measured now, not cached: ...")."""
    path = path or cache_path()
    key = host_key()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    entries = _read_entries(path)
    entry = entries.get(digest)
    if isinstance(entry, dict) and _valid(entry.get("table")):
        return entry["table"], f"cached {entry.get('measured', '')}".strip()
    table = measure_fn()
    entries[digest] = {"host": key, "measured": time.strftime("%Y-%m-%d %H:%M"), "table": table}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        run_dir.write_text_atomic(path, json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=1))
    except OSError as error:
        return table, f"measured now, not cached ({error.strerror or error})"
    return table, "measured now"


def _read_entries(path: str) -> dict:
    """The cache's entries; {} for a missing, unreadable or malformed file (it is rewritten)."""
    try:
        with open(path, encoding="utf-8") as file:
            cache = json.load(file)
    except (OSError, ValueError):
        return {}
    if not isinstance(cache, dict) or cache.get("version") != CACHE_VERSION:
        return {}
    entries = cache.get("entries")
    return entries if isinstance(entries, dict) else {}


def _valid(table) -> bool:
    return (
        isinstance(table, dict)
        and set(table) == set(DTYPES)
        and all(
            isinstance(row, dict)
            and set(row) == set(WORKLOADS)
            and all(
                isinstance(value, (int, float)) and math.isfinite(value) and value > 0
                for value in row.values()
            )
            for row in table.values()
        )
    )
