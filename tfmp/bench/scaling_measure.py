"""What `apps.scaling` measures or reads to hold `tfmp.distribute.scaling`'s model to this host:
the all-reduce between launched workers (a link), the CPU cost of one ImageNet-style training
example (the input-pipeline term), and the N-worker cells of an `apps.bench` report.

    from tfmp.bench import scaling_measure
    seconds = scaling_measure.measure_allreduce(strategy, [[262_144]], repeats=9)
    cost = scaling_measure.measure_preprocessing(open("photo.jpg", "rb").read(), batches=8)
    cell = scaling_measure.read_bench_report("bench-cpu-quick/bench.json", precision="float32")

    python -m tfmp.launch --workers=2 -- python -m apps.scaling --measure_link
    python -m apps.scaling --measure_input                     # the input term's core-seconds
    python -m apps.scaling --measure_share                     # this session's share of the host
    python -m apps.scaling --from_bench=bench.json --devices=2,3,4 --links=localhost

The model itself (`tfmp.distribute.scaling`) stays pure Python; this module, which measures,
imports TensorFlow.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import statistics
import time

import tensorflow as tf

from tfmp.errors import UsageError

OUTPUT_SIZE = 224  # ResNet-50's training crop


def measure_host_share(seconds: float = 3.0) -> dict:
    """The fraction of this host's cores this session gets when it asks for all of them: one
    busy process pinned to each core for `seconds`, their CPU time over cores x wall time.

    Linux's autogroup scheduler (/proc/sys/kernel/sched_autogroup_enabled) shares a busy host
    equally between sessions, not processes, so G other busy sessions leave about 1 / (G + 1),
    however many workers this session launches (`tfmp.distribute.scaling.Overheads.host_share`).
    Pure Python: the processes only spin."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [None]
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    processes = [context.Process(target=_spin, args=(core, seconds, results)) for core in cores]
    started = time.perf_counter()
    for process in processes:
        process.start()
    cpu = [results.get() for _ in processes]
    for process in processes:
        process.join()
    wall = time.perf_counter() - started
    return {"share": min(1.0, sum(cpu) / (len(cores) * seconds)), "cores": len(cores), "wall_seconds": wall}


def _spin(core, seconds: float, results) -> None:
    """Keep one core busy for `seconds` of wall time; report the CPU seconds it got."""
    if core is not None:
        os.sched_setaffinity(0, {core})
    started_cpu, started = time.process_time(), time.perf_counter()
    while time.perf_counter() - started < seconds:
        pass
    results.put(time.process_time() - started_cpu)


def measure_preprocessing(jpeg: bytes, batches: int = 8, batch_size: int = 64, repeats: int = 5) -> dict:
    """CPU seconds one core spends per training example of ResNet-50's ImageNet pipeline, as
    NVIDIA's TensorFlow ResNet-50 trains (DeepLearningExamples, utils/image_processing.py):
    decode the JPEG in full (integer IDCT, no fancy upsampling), crop a random box of 5-100% of
    the area and aspect 3/4-4/3, flip at random, resize bilinearly to 224x224, batch.

    One tf.data thread and one intra-op thread, so the cost is one core's. Each repeat builds
    the pipeline afresh, skips one batch (tracing, buffers) and times `batches` more; returned:
    the median over repeats of process CPU seconds and of wall seconds per example. CPU time is
    the figure to use on a shared host: other processes stretch wall time, not this process's
    CPU time."""
    # TensorFlow only here: importing this module to read a report stays cheap.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)

    def preprocess(data):
        image = tf.io.decode_jpeg(data, channels=3, fancy_upscaling=False, dct_method="INTEGER_FAST")
        begin, size, _ = tf.image.sample_distorted_bounding_box(
            tf.shape(image),
            bounding_boxes=tf.zeros([1, 0, 4]),
            min_object_covered=0.1,
            aspect_ratio_range=[0.75, 1.33],
            area_range=[0.05, 1.0],
            max_attempts=100,
            use_image_if_no_bounding_boxes=True,
        )
        image = tf.image.random_flip_left_right(tf.slice(image, begin, size))
        return tf.image.resize(image, [OUTPUT_SIZE, OUTPUT_SIZE], method="bilinear")

    options = tf.data.Options()
    options.threading.private_threadpool_size = 1
    options.threading.max_intra_op_parallelism = 1
    cpu, wall = [], []
    for _ in range(repeats):
        dataset = tf.data.Dataset.from_tensors(tf.constant(jpeg)).repeat()
        dataset = dataset.map(preprocess).batch(batch_size).with_options(options)
        iterator = iter(dataset)
        next(iterator)
        started_cpu, started_wall = time.process_time(), time.perf_counter()
        for _ in range(batches):
            next(iterator)
        examples = batches * batch_size
        cpu.append((time.process_time() - started_cpu) / examples)
        wall.append((time.perf_counter() - started_wall) / examples)
        del iterator, dataset
    shape = tf.io.extract_jpeg_shape(jpeg).numpy().tolist()
    return {
        "cpu_seconds_per_example": statistics.median(cpu),
        "wall_seconds_per_example": statistics.median(wall),
        "cpu_spread": [min(cpu), max(cpu)],
        "image_shape": shape,
        "jpeg_bytes": len(jpeg),
    }


def measure_allreduce(strategy, calls: list[list[int]], repeats: int = 5) -> list[float]:
    """Median seconds of each all-reduce call (SUM over every replica of `strategy`): a call is a
    list of float32 tensor sizes in elements, summed in one `all_reduce` as a model's gradients
    are. Each is timed `repeats` times after one untimed call. Every worker of a multi-worker
    strategy runs it at once (`python -m tfmp.launch --workers=2 -- python -m apps.scaling
    --measure_link`)."""
    # TensorFlow only here, so that importing this module (the model, its table) stays cheap.
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
    # The 1-worker cell's host-call times: (p90 - median) / 1.2816 / median, the coefficient of
    # variation of a normal with that median and 90th percentile; None in older reports.
    step_cv: float | None = None
    host_cores: int | None = None  # the report's hardware: the cores its workers shared


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
            report = json.load(file)
        cells = [cell for cell in report["cells"] if cell["kind"] == "engine"]
        host_cores = (report.get("hardware") or {}).get("cpu_cores")
        single = [
            cell
            for cell in cells
            if cell["workers"] == 1
            and model in (None, cell["model"])
            and precision in (None, cell["precision"])
        ]
        found = sorted({(cell["model"], cell["precision"]) for cell in single})
        if len(found) == 1:
            return _bench_cell(single[0], cells, host_cores)
        choices = sorted({f"{cell['model']} {cell['precision']}" for cell in cells if cell["workers"] == 1})
    except OSError as error:
        raise UsageError(f"--from_bench={path}: {error.strerror}; give an apps.bench bench.json") from None
    except (ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError):
        raise UsageError(f"--from_bench={path} is not an apps.bench report (bench.json)") from None
    raise UsageError(
        f"--from_bench={path}: {len(found)} 1-worker cells match --model={model} --bench_precision="
        f"{precision}; its 1-worker cells: {', '.join(choices) or 'none (run apps.bench --workers=1,2)'}"
    )


def _bench_cell(cell: dict, cells: list[dict], host_cores: int | None) -> BenchCell:
    result = cell["result"]
    median, p90 = result.get("step_time_median"), result.get("step_time_p90")
    step_cv = (p90 - median) / 1.2816 / median if median and p90 is not None else None
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
        step_cv=step_cv,
        host_cores=host_cores,
    )
