"""One benchmark measurement, in a process of its own: `python -m tfmp.bench.cell '<json>'`.

`tfmp.bench.runner` starts one process per cell (through `tfmp.launch` for multi-worker cells) so that
device splits, peak memory and compiled graphs never leak between cells. A cell is a dict:

    {"kind": "engine" | "fit" | "peak", "model": "resnet20", "precision": "float32",
     "replicas": 1, "xla": false, "data": "synthetic" | "builtin" | "tfds:...",
     "global_batch_size": 128, "steps_per_execution": 10, "mode": "train" | "inference",
     "warmup_executions": 2, "executions": 5, "repeats": 3, "image_size": 32, "cache": false}

`engine` times tfmp's Engine, `fit` the same model and data under plain Keras `model.fit` /
`predict`, `peak` the best of several square matmuls in the precision's compute dtype (the
FLOP/s ceiling the cells are compared to; keys "sizes", "repeats", "min_call_seconds", see `tfmp.bench.peak`).
What each model trains on, and how it is compiled: `tfmp.bench.workloads` (detectors on the
built-in detection `shapes`, "synthetic" one such batch repeated from memory). With
"xla": true Faster R-CNN compiles its static-shaped parts (`FasterRCNN.XLA_PARTS`). Optional keys "intra_op_threads",
"inter_op_threads" (set before TensorFlow starts) and "data_threads" (tf.data private pool)
change the thread settings.
More kinds: `pipeline` (`tfmp.bench.pipeline.measure` rows, "model", "image_size",
"global_batch_size", "micro_batches", "steps", "repeats", "precision"), `pipeline_2d` (the
same keys and "workers", run in every worker of a launched group: `tfmp.bench.pipeline_2d`)
and `python_threads`
(`tfmp.bench.python_threads.measure`, "unit_seconds"), `layer_profile` (`tfmp.bench.layer_profile`:
per-layer milliseconds in "policies" and the Engine step, "layer_repeats" and the engine keys)
`bn_study` (`tfmp.bench.bn_study`: one BatchNormalization's forward + backward, Keras' layer
vs fused, "precision", "shape", "rounds"; "groups": G > 0 studies GroupNormalization(G),
"layer": "LayerNormalization", "RMSNormalization" or "MultiHeadAttention" (with "heads") the
others on a (batch, tokens, width) "shape"), `engine_vs_fit` (`tfmp.bench.engine_vs_fit`: the
engine keys and "rounds"; the Engine and Keras' fit on two copies of the model, in turn) and
`environment` (the names and hardware facts the parent plans with, `matrix.Environment`).
Engine and fit cells take "fused_norm" (`tfmp.precision.fuse_normalization` before compile,
see `tfmp.bench.workloads`).
The result is printed as one line: `BENCH_RESULT {json}`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import sys
import time

import keras
import tensorflow as tf

from tfmp import models, precision
from tfmp.bench import (
    bn_study,
    engine_vs_fit,
    gradient_sums,
    input_cost,
    keras_models,
    layer_profile,
    live_memory,
    pipeline_2d,
    python_threads,
    rounds,
    studies,
    workloads,
)
from tfmp.bench import peak as bench_peak
from tfmp.bench import pipeline as bench_pipeline
from tfmp.bench.matrix import RESULT_PREFIX
from tfmp.classification import data
from tfmp.detection import faster_rcnn, retinanet
from tfmp.distribute import strategies as distribute
from tfmp.precision import probe
from tfmp.training.engine import Engine


def environment() -> dict:
    """What the parent (which never imports TensorFlow) needs to plan: `matrix.Environment`."""
    return {
        "classifiers": list(models.MODELS),
        "keras_models": list(keras_models.MODELS),
        "detectors": [*retinanet.DETECTORS, *faster_rcnn.DETECTORS],
        "policies": {choice: precision.resolve(choice).policy for choice in precision.CHOICES},
        "gpus": [gpu.name for gpu in tf.config.list_physical_devices("GPU")],
        "cpu_fast_bfloat16": precision.detect_hardware().cpu_fast_bfloat16,
        "versions": {"tensorflow": tf.__version__, "keras": keras.__version__},
    }


def precision_probe() -> dict:
    """The probe `--mixed` and `--precision=auto` choose by, measured afresh (not the cache): its
    table, printed lines and what each of the two would choose from it here."""
    table = probe.measure()
    hardware = precision.detect_hardware()
    return {
        "table": table,
        "speedups": probe.speedups(table),
        "lines": probe.format_table(table).splitlines(),
        "choices": {asked: precision.choose(table, hardware, asked).reason for asked in ("auto", "mixed")},
    }


def _engine_executions(cell, strategy, engine, dataset_fn):
    """executions(count): runs `count` engine calls on one iterator of `dataset_fn`'s batches
    and returns the seconds of each."""
    threads = cell.get("data_threads", 0)
    dataset = strategy.distribute_datasets_from_function(
        lambda context: data.with_threads(dataset_fn(context), threads)
    )
    iterator = iter(dataset)
    run = engine.train if cell["mode"] == "train" else engine.infer

    def executions(count):
        times = []
        for _ in range(count):
            started = time.perf_counter()
            run(iterator, cell["steps_per_execution"])  # returns metrics: waits for the steps
            times.append(time.perf_counter() - started)
        return times

    return executions


def _time_engine(cell, strategy, model, optimizer, dataset_fn, timer):
    plan = gradient_sums.plan_for(cell, strategy, model, optimizer)
    engine = Engine(strategy, model, optimizer, xla=cell["xla"], allreduce_plan=plan)
    return timer(_engine_executions(cell, strategy, engine, dataset_fn))


def is_paired(cell: dict) -> bool:
    """A detector's synthetic-input reference cell also times the real pipeline, in turn."""
    return cell.get("reference") == "input" and workloads.is_detector(cell["model"])


def _time_paired(cell, strategy, model, optimizer, dataset_fn):
    """(synthetic repeats, real-pipeline repeats) of one engine, timed in turn in this process.

    Separate cell processes minutes apart differ by up to 15% on a shared 2-core VM; repeats
    of one compiled step taken in turn see the same machine, so their ratio keeps only the
    input pipeline's cost. Each repeat starts after one untimed call, so the batches a
    pipeline prefetched while the other one ran are not counted as free.
    """
    engine = Engine(strategy, model, optimizer, xla=cell["xla"])
    synthetic = _engine_executions(cell, strategy, engine, dataset_fn)
    real = _engine_executions(cell, strategy, engine, functools.partial(dataset_fn, synthetic=False))
    warmup = synthetic(cell["warmup_executions"])
    real(cell["warmup_executions"])
    live_memory.reset()
    count = _executions_per_repeat(cell, warmup[-1])
    timed = {synthetic: [], real: []}
    for index in range(cell["repeats"]):
        for executions in (synthetic, real) if index % 2 == 0 else (real, synthetic):
            executions(1)
            timed[executions].append(executions(count))
    return timed[synthetic], timed[real]


def _compiled_for_fit(cell, strategy, model, optimizer, dataset_fn):
    """`model` compiled as a plain Keras user compiles it for the cell (its optimizer, sparse
    cross-entropy, accuracy), and the endless dataset its `fit` reads."""
    dataset = data.with_threads(dataset_fn(None), cell.get("data_threads", 0))
    with strategy.scope():
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(),
            metrics=["accuracy"],
            steps_per_execution=cell["steps_per_execution"],
            jit_compile=cell["xla"],
        )
    return dataset.repeat()


def _time_fit(cell, strategy, model, optimizer, dataset_fn, timer):
    dataset = _compiled_for_fit(cell, strategy, model, optimizer, dataset_fn)
    if cell["mode"] == "inference":

        def predict(count):  # one Keras call per repeat, as a user makes one per evaluation
            started = time.perf_counter()
            model.predict(dataset, steps=cell["steps_per_execution"] * count, verbose=0)
            return [(time.perf_counter() - started) / count] * count

        return timer(predict)

    # One fit call for the timed repeats, as users make one per run, timed per epoch by a
    # callback so that fit's per-call set-up is not charged to Keras; a short call first warms
    # up (traces) and sizes the repeats like the engine cell's.
    started = time.perf_counter()
    model.fit(
        dataset, steps_per_epoch=cell["steps_per_execution"] * cell["warmup_executions"], epochs=1, verbose=0
    )
    count = _executions_per_repeat(cell, (time.perf_counter() - started) / cell["warmup_executions"])
    live_memory.reset()
    epoch_times = []
    in_rounds = bool(cell.get("rounds_dir"))
    if in_rounds:
        rounds.ready(cell)

    class EpochTimer(keras.callbacks.Callback):
        # In interleaved rounds each epoch is one round: it waits for its turn untimed.
        def on_epoch_begin(self, epoch, logs=None):
            if in_rounds:
                rounds.wait(cell, epoch)
            self.started = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            epoch_times.append(time.perf_counter() - self.started)
            if in_rounds:
                rounds.done(cell, epoch)

    model.fit(
        dataset,
        steps_per_epoch=cell["steps_per_execution"] * count,
        epochs=cell["repeats"],
        verbose=0,
        callbacks=[EpochTimer()],
    )
    return [[seconds / count] * count for seconds in epoch_times]


def _executions_per_repeat(cell: dict, seconds_per_execution: float) -> int:
    """At least `executions`, and enough for `min_repeat_seconds`: slow and fast models alike
    get repeats long enough that timer and scheduler noise stay small."""
    wanted = cell.get("min_repeat_seconds", 0) / max(seconds_per_execution, 1e-6)
    return max(cell["executions"], math.ceil(wanted))


def _timer(cell):
    """Runs `executions(n)` untimed first (warm-up: tracing, compiling, filling buffers), sizes
    the repeats from it, then times `repeats` repeats; returns their per-execution seconds. In
    interleaved rounds (`rounds_dir`, `tfmp.bench.rounds`) each repeat waits for its turn."""

    def run(executions):
        warmup = executions(cell["warmup_executions"])
        live_memory.reset()
        count = _executions_per_repeat(cell, warmup[-1])
        if not cell.get("rounds_dir"):
            return [executions(count) for _ in range(cell["repeats"])]
        rounds.ready(cell)
        timed = []
        for index in range(cell["repeats"]):
            rounds.wait(cell, index)
            timed.append(executions(count))
            rounds.done(cell, index)
        return timed

    return run


def measure(cell: dict) -> dict:
    """Runs the cell in this process (devices and thread pools are set here: once per process)."""
    if cell["kind"] == "environment":
        return environment()
    if cell["kind"] == "peak":
        return bench_peak.measure(cell["precision"], cell["sizes"], cell["repeats"], cell["min_call_seconds"])
    if cell["kind"] == "precision_probe":
        return precision_probe()
    if cell["kind"] == "python_threads":
        return python_threads.measure(cell["unit_seconds"])
    if cell["kind"] == "input_cost":
        return input_cost.measure(cell)
    if cell["kind"] == "pipeline_2d":  # in every launched worker; it splits the CPU itself
        return {
            "rows": pipeline_2d.measure(
                cell["model"],
                image_size=cell["image_size"],
                per_worker_batch=cell["global_batch_size"] // cell["workers"],
                micro_batches=cell["micro_batches"],
                steps=cell["steps"],
                repeats=cell["repeats"],
                policy=precision.resolve(cell["precision"]).policy,
            )
        }
    if cell["kind"] == "bn_study":
        return bn_study.measure(
            cell["precision"],
            cell["shape"],
            cell["rounds"],
            groups=cell.get("groups", 0),
            layer=cell.get("layer", studies.BATCH_NORMALIZATION),
            heads=cell.get("heads", 0),
        )
    # Before anything starts TensorFlow's runtime: it fixes its thread pools then.
    distribute.set_threads(cell.get("intra_op_threads", 0), cell.get("inter_op_threads", 0))
    if cell["kind"] == "pipeline":
        return _measure_pipeline(cell)
    if cell["kind"] == "layer_profile":
        return layer_profile.measure(
            cell, workloads.setup_for(cell["model"]), _time_engine, _executions_per_repeat
        )
    if cell["kind"] == "onednn_study":
        return _onednn_steps(cell)
    if cell["kind"] == engine_vs_fit.KIND:
        return _engine_vs_fit(cell)
    return _measure_training(cell)


def _onednn_steps(cell: dict) -> dict:
    """An `onednn_study` cell's training steps (`tfmp.bench.onednn`): warm-up, then `steps`
    single steps timed, and their wall-clock window for the parent to read oneDNN's lines in."""
    strategy = distribute.get_strategy("default")
    policy = precision.resolve(cell["precision"]).policy
    model, optimizer, dataset_fn, _ = workloads.setup_for(cell["model"])(cell, strategy, policy)
    executions = _engine_executions(cell, strategy, Engine(strategy, model, optimizer), dataset_fn)
    executions(cell["warmup_executions"])
    began = time.time()
    seconds = executions(cell["steps"])
    return {"policy": policy, "step_seconds": seconds, "window_ms": [1000 * began, 1000 * time.time()]}


def _engine_vs_fit(cell: dict) -> dict:
    """An `engine_vs_fit` cell (`tfmp.bench.engine_vs_fit`): two copies of the model, one trained
    by the Engine and one by Keras' fit, in alternating rounds of the same steps."""
    strategy = distribute.get_strategy("default")
    policy = precision.resolve(cell["precision"]).policy
    setup = workloads.setup_for(cell["model"])
    model, optimizer, dataset_fn, _ = setup(cell, strategy, policy)
    twin, twin_optimizer, twin_dataset_fn, _ = setup(cell, strategy, policy)  # same seed, same weights
    engine = _engine_executions(
        cell, strategy, Engine(strategy, model, optimizer, xla=cell["xla"]), dataset_fn
    )
    count = _executions_per_repeat(cell, engine(cell["warmup_executions"])[-1])
    dataset = _compiled_for_fit(cell, strategy, twin, twin_optimizer, twin_dataset_fn)
    steps = cell["steps_per_execution"] * count
    twin.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0)  # traces and warms up
    engine_seconds, fit_seconds = [], []

    class Alternate(keras.callbacks.Callback):
        # Each epoch is a round: the engine's repeat first, untimed for fit, then fit's epoch.
        def on_epoch_begin(self, epoch, logs=None):
            engine_seconds.append(sum(engine(count)))
            self.started = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            fit_seconds.append(time.perf_counter() - self.started)

    twin.fit(dataset, steps_per_epoch=steps, epochs=cell["rounds"], verbose=0, callbacks=[Alternate()])
    examples = cell["global_batch_size"] * steps
    per_round = [fit / engine for engine, fit in zip(engine_seconds, fit_seconds)]
    return {
        "policy": policy,
        "rounds": per_round,
        "value": statistics.median(per_round),
        "engine_examples_per_sec": examples / statistics.median(engine_seconds),
        "fit_examples_per_sec": examples / statistics.median(fit_seconds),
    }


def _measure_training(cell: dict) -> dict:
    """An engine or fit cell: throughput, step times, FLOP/s, peak memory."""
    # Ampere+ GPUs run float32 matmuls in TF32 unless told not to; a no-op elsewhere.
    tf.config.experimental.enable_tensor_float_32_execution(cell.get("tf32", True))
    replicas = cell.get("replicas", 1)
    distribute.split_cpu(replicas)
    multi_worker = bool(os.environ.get("TF_CONFIG"))
    strategy = distribute.get_strategy(
        "multi_worker" if multi_worker else ("mirrored" if replicas > 1 else "default")
    )
    policy = precision.resolve(cell["precision"]).policy
    before_model = live_memory.process_peak_mb()  # TensorFlow's runtime and Python, no model yet
    model, optimizer, dataset_fn, image_shape = workloads.setup_for(cell["model"])(cell, strategy, policy)
    paired_input = None
    if is_paired(cell):
        repeats, real_repeats = _time_paired(cell, strategy, model, optimizer, dataset_fn)
        paired_input = _paired_input(cell, repeats, real_repeats)
    else:
        timing = _time_fit if cell["kind"] == "fit" else _time_engine
        repeats = timing(cell, strategy, model, optimizer, dataset_fn, _timer(cell))
    result = {
        "policy": policy,
        "dataset": workloads.dataset_spec(cell),
        "image_shape": list(image_shape),
        "replicas": strategy.num_replicas_in_sync,
        "workers": distribute.describe(strategy).workers,
        **_speed(cell, model, repeats),
        **live_memory.figures(before_model),
        "variables_mb": live_memory.variables_mb(model, optimizer),
        "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
        "inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads(),
        "paired_input": paired_input,
        **gradient_sums.measure(cell, strategy, model, optimizer),
    }
    result["examples_per_sec_per_replica"] = result["examples_per_sec"] / result["replicas"]
    return result


def _throughputs(cell: dict, repeats: list[list[float]]) -> list[float]:
    return [
        cell["global_batch_size"] * cell["steps_per_execution"] * len(times) / sum(times) for times in repeats
    ]


def _paired_input(cell: dict, synthetic_repeats, real_repeats) -> dict:
    """The real pipeline's throughput and its ratio to the synthetic one, repeat by repeat."""
    real = _throughputs(cell, real_repeats)
    ratios = [r / s for r, s in zip(real, _throughputs(cell, synthetic_repeats))]
    return {
        "real_examples_per_sec": statistics.median(real),
        "ratios": ratios,
        "value": statistics.median(ratios),
    }


def _speed(cell: dict, model, repeats: list[list[float]]) -> dict:
    """Throughput (median and spread of the repeats), step times and FLOP/s."""
    steps = cell["steps_per_execution"]
    step_times = sorted(t / steps for times in repeats for t in times)
    throughputs = _throughputs(cell, repeats)
    flops_per_step = workloads.flops_per_step(cell, model)
    median_step = statistics.median(step_times)
    return {
        "examples_per_sec": statistics.median(throughputs),
        "examples_per_sec_repeats": throughputs,  # in round order when timed in rounds
        "examples_per_sec_min": min(throughputs),
        "examples_per_sec_max": max(throughputs),
        "step_time_median": median_step,
        "step_time_p90": step_times[min(len(step_times) - 1, int(0.9 * len(step_times)))],
        "flops_per_step": flops_per_step,
        "flops_per_sec": flops_per_step / median_step,
    }


def _measure_pipeline(cell: dict) -> dict:
    """K=2 pipelines against the unsplit model (`tfmp.bench.pipeline`; it splits the CPU)."""
    rows = bench_pipeline.measure(
        cell["model"],
        image_size=cell["image_size"],
        global_batch=cell["global_batch_size"],
        micro_batches=tuple(cell["micro_batches"]),
        steps=cell["steps"],
        repeats=cell["repeats"],
        policy=precision.resolve(cell["precision"]).policy,
    )
    return {"rows": rows}


def main(argv: list[str]) -> int:
    cell = json.loads(argv[1])
    result = measure(cell)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
