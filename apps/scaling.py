"""Predict data-parallel scaling past one host: ring all-reduce time, step time, efficiency.

    python -m apps.scaling                                    # resnet50, published A100 step
    python -m apps.scaling --model=vit_b16 --devices=8,64,256 --links=nvlink,nvlink4,100gbe,400gbe
    python -m apps.scaling --model=my_model --step_seconds=0.25 --allreduce_dtype=bfloat16
    python -m apps.scaling --from_bench=bench-cpu-quick/bench.json --devices=2 --links=localhost
    python -m tfmp.launch --workers=2 -- python -m apps.scaling --measure_link   # this host's link

The compute time of one step on one device is --step_seconds, or the 1-worker cell of an
apps.bench report (--from_bench: global batch / examples/s, with the measured N-worker scaling
beside the prediction), or a published single-GPU figure (resnet50, vit_b16; the source is
printed). The gradient bytes are the model's trainable parameters (tfmp.models, built at 224x224,
1000 classes, or the bench cell's shape and classes) x 4 (float32) or 2 (bfloat16, float16).
Links: nvlink (A100), nvlink4 (H100), 100gbe, 400gbe, localhost (measured here), or your own
with --link_bandwidth and --link_latency. The model and its assumptions: tfmp/distribute/scaling.py
and docs/distributed.md ("Scaling past one host").
"""

import dataclasses
import math

from absl import flags

from apps import cli
from tfmp import models
from tfmp.bench import scaling_measure, workloads
from tfmp.classification import data
from tfmp.distribute import scaling, scaling_anchors
from tfmp.distribute import strategies as distribute
from tfmp.errors import UsageError, unknown

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "A tfmp.models name (default: resnet50, or the --from_bench report's).")
flags.DEFINE_float("step_seconds", None, "Compute time of one step on one device (default: see above).")
flags.DEFINE_list("allreduce_dtype", ["float32", "bfloat16"], "Dtypes the gradients are summed in.")
flags.DEFINE_list("devices", ["8", "64", "256"], "Numbers of data-parallel devices.")
flags.DEFINE_list("links", ["nvlink", "100gbe", "400gbe"], f"Any of {', '.join(scaling.LINKS)}, custom.")
flags.DEFINE_float("link_bandwidth", None, "The custom link: bytes/s each device sends (bus bandwidth).")
flags.DEFINE_float("link_latency", 10e-6, "The custom link: seconds per ring step.")
flags.DEFINE_integer("bucket_bytes", scaling.DEFAULT_BUCKET_BYTES, "Overlapped all-reduce bucket size.")
flags.DEFINE_float("overlap", 1.0, "Fraction of the backward pass that can hide communication (0-1).")
flags.DEFINE_string("from_bench", None, "An apps.bench bench.json: the 1-worker step time and model.")
flags.DEFINE_string("bench_precision", None, "--from_bench: which precision's cells (if several).")
flags.DEFINE_bool("measure_link", False, "Time all-reduces between launched workers; print the link.")
flags.DEFINE_list("measure_sizes", ["65536", "1048576", "4194304", "16777216"], "--measure_link: bytes.")
flags.DEFINE_integer("measure_repeats", 9, "--measure_link: timed calls per size (median of).")
flags.DEFINE_bool("measure_input", False, "Time one core's ResNet-50 ImageNet preprocessing per example.")
flags.DEFINE_string("input_jpeg", None, "--measure_input: a JPEG photo (default: matplotlib's grace_hopper).")
# The overheads (tfmp.distribute.scaling.Overheads); unset: the published anchor's, the bench
# report's (--from_bench) or none.
flags.DEFINE_float("sync_seconds", None, "Per-step synchronisation no compute hides (s).")
flags.DEFINE_integer("blocking_collectives", None, "Small all-reduces per step compute waits for.")
flags.DEFINE_float("step_cv", None, "Coefficient of variation of one device's step (stragglers).")
flags.DEFINE_float("input_core_seconds", None, "CPU core-seconds of one device's input per step.")
flags.DEFINE_float("compute_cores", None, "Cores one device's compute keeps busy (CPU workers).")
flags.DEFINE_integer("host_cores", None, "Cores of a host its devices share (0: not modelled).")
flags.DEFINE_integer("devices_per_host", None, "Devices sharing one host's cores.")
flags.DEFINE_float("host_share", None, "Fraction of the host the workers' session gets (--measure_share).")
flags.DEFINE_bool("measure_share", False, "Measure this session's share of a busy host's cores.")


def _devices() -> list[int]:
    try:
        devices = [int(value) for value in FLAGS.devices]
    except ValueError:
        raise UsageError(
            f"--devices={','.join(FLAGS.devices)} must be whole numbers, e.g. 8,64,256"
        ) from None
    if not devices or min(devices) < 1:
        raise UsageError(
            f"--devices={','.join(FLAGS.devices)}: every count must be at least 1, e.g. 8,64,256"
        )
    return devices


def _links() -> dict[str, scaling.Link]:
    links = {}
    for name in FLAGS.links:
        if name == "custom":
            if FLAGS.link_bandwidth is None:
                raise UsageError("--links=custom needs --link_bandwidth (bytes/s), e.g. 25e9")
            links[name] = scaling.Link("custom", FLAGS.link_bandwidth, FLAGS.link_latency, None, "flags")
        else:
            links[name] = scaling.link(name)
    return links


def _parameters(model: str, image_shape, num_classes: int) -> int:
    built = models.build(model, tuple(image_shape), num_classes)
    return sum(math.prod(weight.shape) for weight in built.trainable_weights)


def _compute(model: str | None):
    """(model, step seconds, where they come from, input shape, classes, measured efficiency,
    the overheads of that setting: a bench report's host, the published anchor's, or none)."""
    if FLAGS.from_bench:
        cell = scaling_measure.read_bench_report(FLAGS.from_bench, model, FLAGS.bench_precision)
        spec = workloads.dataset_spec({"model": cell.model, "data": cell.data})
        classes = data.describe(spec, image_size=cell.image_size, verify=False).num_classes
        source = (
            f"{FLAGS.from_bench}: {cell.model} {cell.policy}, 1 worker, {cell.examples_per_sec:,.0f} ex/s"
        )
        seconds = FLAGS.step_seconds or cell.step_seconds
        return cell.model, seconds, source, cell.image_shape, classes, cell.measured, _bench_overheads(cell)
    model = model or "resnet50"
    if model not in models.MODELS:
        raise unknown("model", model, models.MODELS)
    if FLAGS.step_seconds is not None:
        return model, FLAGS.step_seconds, "--step_seconds", (224, 224, 3), 1000, [], scaling.NO_OVERHEADS
    if model not in scaling.PUBLISHED:
        raise UsageError(
            f"no published step time for {model!r}; give --step_seconds (one device's step) or --from_bench"
        )
    published = scaling.PUBLISHED[model]
    source = (
        f"published: {published.examples_per_sec:,.0f} img/s, {published.device}, {published.precision}, "
        f"batch {published.batch_per_device} ({published.source})"
    )
    # ResNet-50's figure is the DGX A100 anchor's 1-GPU run: its run's terms apply.
    overheads = (
        scaling_anchors.ANCHORS["resnet50_a100_amp"].overheads
        if model == "resnet50"
        else scaling.NO_OVERHEADS
    )
    return model, published.step_seconds, source, (224, 224, 3), 1000, [], overheads


def _bench_overheads(cell: scaling_measure.BenchCell) -> scaling.Overheads:
    """The report's host: every worker local, one core each (apps.bench launches them with
    --devices_per_worker=1), the 1-worker cell's step variation for the stragglers."""
    return scaling.Overheads(
        step_cv=cell.step_cv or 0.0,
        compute_cores=1,
        host_cores=cell.host_cores or 0,
        devices_per_host=max(_devices()),
    )


def _overheads(base: scaling.Overheads) -> scaling.Overheads:
    """`base` with every overhead flag that is set in its place."""
    names = [field.name for field in dataclasses.fields(scaling.Overheads)]
    changes = {name: FLAGS[name].value for name in names if FLAGS[name].value is not None}
    overheads = dataclasses.replace(base, **changes)
    scaling.check_overheads(overheads)
    return overheads


def _measure_link() -> None:
    """Every launched worker times single all-reduces of --measure_sizes bytes and, with --model,
    one of the model's gradients (as the engine sums them: a list in one call), then fits a link."""
    strategy = distribute.get_strategy("auto")
    sizes = [int(size) for size in FLAGS.measure_sizes]
    calls = [[max(1, size // 4)] for size in sizes]
    if FLAGS.model:
        # Shaped as apps.bench's quick config trains it: the built-in data at 32x32.
        spec = workloads.dataset_spec({"model": FLAGS.model, "data": "builtin"})
        info = data.describe(spec, image_size=32, verify=False)
        built = models.build(FLAGS.model, info.image_shape, info.num_classes)
        calls.append([math.prod(weight.shape) for weight in built.trainable_weights])
    seconds = scaling_measure.measure_allreduce(strategy, calls, FLAGS.measure_repeats)
    replicas = strategy.num_replicas_in_sync
    for size, time in zip(sizes, seconds):
        print(f"{replicas} replicas, {size:>10,} bytes: {time * 1e3:8.2f} ms")
    link = scaling.fit_link("measured", replicas, sizes, seconds[: len(sizes)])
    print(
        f"fitted: {link.bandwidth / 1e9:.3f} GB/s per device, {link.step_latency * 1e6:.0f} us per ring step"
    )
    if FLAGS.model:
        nbytes = 4 * sum(calls[-1])
        predicted = scaling.ring_allreduce_seconds(nbytes, replicas, link)
        print(
            f"{FLAGS.model}'s {len(calls[-1])} gradients ({nbytes:,} bytes) in one call: "
            f"{seconds[-1] * 1e3:.2f} ms measured, {predicted * 1e3:.2f} ms from the fitted link"
        )
    distribute.barrier(strategy)  # no worker exits while another still talks to it


def _table(model: str, compute_seconds: float, rows: list[tuple[str, str, scaling.Prediction]]) -> str:
    """The predictions as a text table; rows are (all-reduce dtype, link key, prediction). A `*`
    marks a link that joins fewer devices than the row's in any shipped system."""
    header = (
        "model",
        "all-reduce",
        "MB/step",
        "link",
        "devices",
        "all-reduce ms",
        "step ms",
        "efficiency",
        "buckets",
        "step ms (overlap)",
        "efficiency (overlap)",
    )
    body, beyond_reach = [], False
    for dtype, key, prediction in rows:
        reach = scaling.LINKS[key].reach if key in scaling.LINKS else None
        beyond = reach is not None and prediction.devices > reach
        beyond_reach = beyond_reach or beyond
        body.append(
            (
                model,
                dtype,
                f"{prediction.gradient_bytes / 1e6:.1f}",
                prediction.link + (" *" if beyond else ""),
                str(prediction.devices),
                f"{prediction.allreduce_seconds * 1e3:.2f}",
                f"{prediction.step_seconds * 1e3:.1f}",
                f"{prediction.efficiency:.3f}",
                str(prediction.buckets),
                f"{prediction.step_seconds_overlapped * 1e3:.1f}",
                f"{prediction.efficiency_overlapped:.3f}",
            )
        )
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = [
        "  ".join(value.ljust(width) for value, width in zip(row, widths)).rstrip() for row in [header, *body]
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    lines.append(f"compute (1 device): {compute_seconds * 1e3:.1f} ms per step")
    if beyond_reach:
        lines.append(
            "* more devices than such links join in any shipped system (the ring crosses a slower link)"
        )
    return "\n".join(lines)


def _measured_line(cell: scaling_measure.Measured, prediction: scaling.Prediction) -> str:
    line = f"measured in that report: {cell.workers} workers / ({cell.workers} x 1 worker) = {cell.efficiency:.3f}"
    if cell.allreduce_dtype:
        line += f", {cell.allreduce_dtype} all-reduce"
    if cell.gradient_bytes and cell.collective_seconds is not None:
        line += f" of {cell.gradient_bytes:,} bytes: {cell.collective_seconds * 1e3:.2f} ms per step"
    predicted = prediction.efficiency_overlapped
    return line + (
        f"; predicted ({prediction.link}, with overheads) {predicted:.3f}, residual "
        f"{predicted - cell.efficiency:+.3f}"
    )


def _terms_ms(prediction: scaling.Prediction) -> list[str]:
    """The N-device step's terms beyond compute, in ms, as the tables print them."""
    terms = (
        prediction.exposed_allreduce_seconds,
        prediction.contention_seconds,
        prediction.sync_seconds,
        prediction.straggler_seconds,
        prediction.input_stall_seconds,
    )
    return [f"{term * 1e3:.2f}" for term in terms]


TERMS_HEADER = ("all-reduce ms", "cores ms", "sync ms", "stragglers ms", "input stall ms")


def _columns(header: tuple, body: list[tuple]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = [
        "  ".join(value.ljust(width) for value, width in zip(row, widths)).rstrip() for row in [header, *body]
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return lines


def _anchor_table() -> str:
    """Every published anchor: its efficiency, the model's (overlapped, with the anchor's
    overheads) and the residual, predicted - published; `*` past 0.02."""
    header = ("anchor", "devices", "published", "predicted", "residual", *TERMS_HEADER)
    body, missed = [], False
    for anchor in scaling_anchors.ANCHORS.values():
        prediction = anchor.predict()
        residual = scaling_anchors.residual(anchor)
        missed = missed or abs(residual) > scaling_anchors.ANCHOR_TOLERANCE
        mark = " *" if abs(residual) > scaling_anchors.ANCHOR_TOLERANCE else ""
        body.append(
            (
                anchor.name,
                str(anchor.devices),
                f"{anchor.published_efficiency:.3f}",
                f"{prediction.efficiency_overlapped:.3f}",
                f"{residual:+.3f}{mark}",
                *_terms_ms(prediction),
            )
        )
    lines = ["anchors (published scaling; residual = predicted - published):", *_columns(header, body)]
    if missed:
        lines.append(
            f"* more than {scaling_anchors.ANCHOR_TOLERANCE} off: a step cost the model's terms do not name"
        )
    lines += [f"  {anchor.name}: {anchor.source}" for anchor in scaling_anchors.ANCHORS.values()]
    return "\n".join(lines)


def _measure_input() -> None:
    """One core's CPU seconds per ResNet-50 training example (tfmp.bench.scaling_measure)."""
    path = FLAGS.input_jpeg
    if path is None:
        import matplotlib.cbook

        path = matplotlib.cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)
    try:
        with open(path, "rb") as file:
            jpeg = file.read()
    except OSError as error:
        raise UsageError(f"--input_jpeg={path}: {error.strerror}; give a JPEG photo") from None
    result = scaling_measure.measure_preprocessing(jpeg)
    height, width, _ = result["image_shape"]
    low, high = result["cpu_spread"]
    print(
        f"{path} ({width}x{height}, {result['jpeg_bytes']:,} bytes): "
        f"{result['cpu_seconds_per_example'] * 1e3:.3f} ms CPU per example on one core "
        f"({low * 1e3:.3f}-{high * 1e3:.3f} over the repeats; wall {result['wall_seconds_per_example'] * 1e3:.3f} ms)"
    )


def main(argv):
    del argv
    if FLAGS.measure_link:
        return _measure_link()
    if FLAGS.measure_input:
        return _measure_input()
    if FLAGS.measure_share:
        share = scaling_measure.measure_host_share()
        return print(
            f"this session got {share['share']:.3f} of the host's {share['cores']} cores "
            f"(one busy process pinned to each, {share['wall_seconds']:.1f} s): --host_share={share['share']:.2f}"
        )
    devices, links = _devices(), _links()
    if FLAGS.step_seconds is not None:
        scaling.check(FLAGS.step_seconds, 1, scaling.LINKS["100gbe"], FLAGS.bucket_bytes, FLAGS.overlap)
    dtypes = [(dtype, scaling.gradient_bytes(1, dtype)) for dtype in FLAGS.allreduce_dtype]
    model, seconds, source, shape, classes, measured, base = _compute(FLAGS.model)
    overheads = _overheads(base)
    parameters = _parameters(model, shape, classes)

    def predict(size: int, count: int, link: scaling.Link) -> scaling.Prediction:
        return scaling.predict(
            seconds, parameters * size, count, link, FLAGS.bucket_bytes, FLAGS.overlap, overheads=overheads
        )

    rows = [
        (dtype, key, predict(size, count, link))
        for dtype, size in dtypes
        for key, link in links.items()
        for count in devices
    ]
    print(f"{model}: {parameters:,} trainable parameters; step time from {source}")
    print(_table(model, seconds, rows))
    print(_overheads_line(overheads))
    first_link = next(iter(links.values()))
    for cell in measured:
        dtype = cell.allreduce_dtype or FLAGS.allreduce_dtype[0]
        print(_measured_line(cell, predict(scaling.gradient_bytes(1, dtype), cell.workers, first_link)))
    print(_anchor_table())


def _overheads_line(overheads: scaling.Overheads) -> str:
    if overheads == scaling.NO_OVERHEADS:
        return "overheads: none (an upper bound: set --sync_seconds, --step_cv, ... or see the anchors)"
    values = ", ".join(
        f"{field.name}={getattr(overheads, field.name):g}" for field in dataclasses.fields(overheads)
    )
    return f"overheads: {values}"


if __name__ == "__main__":
    cli.run(main)
