"""One benchmark measurement, in a process of its own: `python -m tfmp.bench_cell '<json>'`.

`tfmp.bench` starts one process per cell (through `tfmp.launch` for multi-worker cells) so that
device splits, peak memory and compiled graphs never leak between cells. A cell is a dict:

    {"kind": "engine" | "fit" | "peak", "model": "resnet20", "precision": "float32",
     "replicas": 1, "xla": false, "data": "synthetic" | "builtin" | "tfds:...",
     "global_batch_size": 128, "steps_per_execution": 10, "mode": "train" | "inference",
     "warmup_executions": 2, "executions": 5, "repeats": 3, "image_size": 32, "cache": false}

`engine` times tfmp's Engine, `fit` the same model and data under plain Keras `model.fit` /
`predict`, `peak` a large matmul in the precision's compute dtype (the FLOP/s ceiling the
cells are compared to). The result is printed as one line: `BENCH_RESULT {json}`.
"""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import sys
import time

RESULT_PREFIX = "BENCH_RESULT "
MNIST_SHAPED = ("mnist_mlp", "lenet")


def _dataset_spec(cell: dict) -> str:
    if cell["data"] == "builtin":
        return "digits" if cell["model"] in MNIST_SHAPED else "shapes"
    return cell["data"]


def _image_size(cell: dict, spec: str):
    return None if spec == "digits" or cell["model"] in MNIST_SHAPED else cell.get("image_size")


def measure_peak(policy: str) -> dict:
    """FLOP/s of a large square matmul in the policy's compute dtype, the cells' ceiling."""
    import tensorflow as tf

    from tfmp import precision

    dtype = precision.compute_dtype(policy)
    size = 4096 if tf.config.list_physical_devices("GPU") else 1024
    a = tf.random.uniform([size, size], dtype=tf.float32)
    a, b = tf.cast(a, dtype), tf.cast(tf.transpose(a), dtype)

    @tf.function
    def repeat_matmul(count):
        total = tf.zeros([], tf.float32)
        for _ in tf.range(count):
            total += tf.cast(tf.reduce_sum(tf.linalg.matmul(a, b)[0, :1]), tf.float32)
        return total

    repeat_matmul(tf.constant(2)).numpy()  # compile and warm up
    count, seconds = 4, 0.0
    while seconds < 1.0:  # grow until a repeat takes a second: timer noise below 1%
        count *= 2
        started = time.perf_counter()
        repeat_matmul(tf.constant(count)).numpy()
        seconds = time.perf_counter() - started
    runs = []
    for _ in range(3):
        started = time.perf_counter()
        repeat_matmul(tf.constant(count)).numpy()
        runs.append(2 * size**3 * count / (time.perf_counter() - started))
    return {"peak_flops": max(runs), "matmul_size": size, "dtype": dtype}


def _build(cell: dict, strategy, info, policy: str):
    import keras

    from tfmp import models, precision
    from tfmp.classification import compile_classifier

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = models.build(cell["model"], info.image_shape, info.num_classes, dtype=policy)
        optimizer = precision.wrap_optimizer(keras.optimizers.SGD(0.01, momentum=0.9), policy, "auto")
    compile_classifier(model, optimizer, strategy)
    return model, optimizer


def _time_engine(cell, strategy, model, optimizer, spec, image_size, timer):
    from tfmp import data
    from tfmp.engine import Engine

    engine = Engine(strategy, model, optimizer, xla=cell["xla"])
    dataset = strategy.distribute_datasets_from_function(
        lambda context: data.load(spec, "train", cell["global_batch_size"], image_size=image_size,
                                  input_context=context, cache=cell.get("cache", False))[0])
    iterator = iter(dataset)
    run = engine.train if cell["mode"] == "train" else engine.infer

    def executions(count):
        times = []
        for _ in range(count):
            started = time.perf_counter()
            run(iterator, cell["steps_per_execution"])  # returns metrics: waits for the steps
            times.append(time.perf_counter() - started)
        return times

    return timer(executions)


def _time_fit(cell, strategy, model, optimizer, spec, image_size, timer):
    import keras

    from tfmp import data

    dataset = data.load(spec, "train", cell["global_batch_size"], image_size=image_size,
                        cache=cell.get("cache", False))[0]
    with strategy.scope():
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(),
                      metrics=["accuracy"], steps_per_execution=cell["steps_per_execution"],
                      jit_compile=cell["xla"])
    dataset = dataset.repeat()
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
    model.fit(dataset, steps_per_epoch=cell["steps_per_execution"] * cell["warmup_executions"],
              epochs=1, verbose=0)
    count = _executions_per_repeat(cell, (time.perf_counter() - started) / cell["warmup_executions"])
    epoch_times = []

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.started = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            epoch_times.append(time.perf_counter() - self.started)

    model.fit(dataset, steps_per_epoch=cell["steps_per_execution"] * count, epochs=cell["repeats"],
              verbose=0, callbacks=[EpochTimer()])
    return [[seconds / count] * count for seconds in epoch_times]


def _executions_per_repeat(cell: dict, seconds_per_execution: float) -> int:
    """At least `executions`, and enough for `min_repeat_seconds`: slow and fast models alike
    get repeats long enough that timer and scheduler noise stay small."""
    wanted = cell.get("min_repeat_seconds", 0) / max(seconds_per_execution, 1e-6)
    return max(cell["executions"], math.ceil(wanted))


def _timer(cell):
    """Runs `executions(n)` untimed first (warm-up: tracing, compiling, filling buffers), sizes
    the repeats from it, then times `repeats` repeats; returns their per-execution seconds."""

    def run(executions):
        warmup = executions(cell["warmup_executions"])
        count = _executions_per_repeat(cell, warmup[-1])
        return [executions(count) for _ in range(cell["repeats"])]

    return run


def measure(cell: dict) -> dict:
    """Runs the cell in this process (devices are split here: call once per process)."""
    if cell["kind"] == "peak":
        return measure_peak(cell["precision"])
    from tfmp import data, distribute, models, precision

    import tensorflow as tf

    # Ampere+ GPUs run float32 matmuls in TF32 unless told not to; a no-op elsewhere.
    tf.config.experimental.enable_tensor_float_32_execution(cell.get("tf32", True))
    replicas = cell.get("replicas", 1)
    distribute.split_cpu(replicas)
    multi_worker = bool(os.environ.get("TF_CONFIG"))
    strategy = distribute.get_strategy("multi_worker" if multi_worker else
                                       ("mirrored" if replicas > 1 else "default"))
    policy = precision.resolve(cell["precision"]).policy
    spec = _dataset_spec(cell)
    image_size = _image_size(cell, spec)
    info = data.describe(spec, image_size=image_size)
    model, optimizer = _build(cell, strategy, info, policy)
    timing = _time_fit if cell["kind"] == "fit" else _time_engine
    repeats = timing(cell, strategy, model, optimizer, spec, image_size, _timer(cell))

    steps = cell["steps_per_execution"]
    batch = cell["global_batch_size"]
    step_times = sorted(t / steps for times in repeats for t in times)
    throughputs = [batch * steps * len(times) / sum(times) for times in repeats]
    forward_flops = models.count_flops(model, batch)
    flops_per_step = forward_flops * (3 if cell["mode"] == "train" else 1)
    median_step = statistics.median(step_times)
    result = {
        "policy": policy, "dataset": spec, "image_shape": list(info.image_shape),
        "replicas": strategy.num_replicas_in_sync, "workers": distribute.describe(strategy).workers,
        "examples_per_sec": statistics.median(throughputs),
        "examples_per_sec_min": min(throughputs), "examples_per_sec_max": max(throughputs),
        "step_time_median": median_step,
        "step_time_p90": step_times[min(len(step_times) - 1, int(0.9 * len(step_times)))],
        "flops_per_step": flops_per_step,
        "flops_per_sec": flops_per_step / median_step,
        "peak_host_memory_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    result["examples_per_sec_per_replica"] = result["examples_per_sec"] / result["replicas"]
    result.update(_gpu_memory())
    return result


def _gpu_memory() -> dict:
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    if not gpus:
        return {}
    return {"peak_gpu_memory_mb": max(tf.config.experimental.get_memory_info(g.name)["peak"]
                                      for g in gpus) / 2**20}


def main(argv: list[str]) -> int:
    cell = json.loads(argv[1])
    result = measure(cell)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
