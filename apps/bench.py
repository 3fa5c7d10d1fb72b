"""Measure what each switch buys on this hardware: precision, replicas, workers, XLA.

    python -m apps.bench --flagfile=configs/bench_cpu_quick.cfg          # a few minutes on 2 cores
    python -m apps.bench --flagfile=configs/bench_parallelism_cpu.cfg    # detector, pipeline, threads
    python -m apps.bench --flagfile=configs/bench_memory_cpu.cfg         # live peak: fp32 vs mixed, fused BN
    python -m apps.bench --flagfile=configs/bench_memory_batch_cpu.cfg   # largest batch in a budget
    python -m apps.bench --mode=inference --models=seed_cnn,resnet20 --precisions=float32,bfloat16,float16
    python -m apps.bench --models=resnet50 --precisions=float32,mixed_float16 --replicas=1,8 \\
        --image_size=224 --global_batch_size=128 --xla=off,on               # a GPU host

Each cell runs in its own process, warm-up excluded, `--repeats` timed repeats (median and
spread), with its live peak memory (TensorFlow's allocator peak of live tensors, GPU or CPU). The
matmul peak of each precision is the best of --peak_sizes x --peak_repeats, in a fresh process
like the cells. Prints the table, writes bench.json (schema: docs/bench.md) and bench.png
into --output_dir. Batch sizes are per 1-replica cell: N replicas or workers get N x the batch
(weak scaling, as in NVIDIA's tables).

--models also takes detectors (retinanet_tiny, faster_rcnn_tiny, ...: images/s on the built-in
detection shapes at --image_size, a multiple of 32; with --xla=on Faster R-CNN compiles its
backbone, FPN, RPN and box head, not ROIAlign and NMS).
--pipeline_micro_batches=1,2,4,8 adds one pipeline cell (`tfmp.bench.pipeline`: K=2 stages on
two devices against the unsplit --study_model); --pipeline_2d_workers=2 adds one 2-D cell
(`tfmp.bench.pipeline_2d`: 2 launched workers x 2 stages beside 2-worker data parallelism and
the 1-worker pipeline, timed in turn in the same processes; --study_batch_size is the global
batch); --threads_study adds the compute-parallelism
cells (`tfmp.bench.threads`: intra-op, inter-op and tf.data threads 2 vs 1, steps per host
call 10 vs 1, Python threads vs the GIL).

--layer_profile=retinanet_tiny,faster_rcnn_tiny runs only a layer profile of each model at
--image_size and --global_batch_size (`tfmp.bench.layer_profile`): every layer's forward +
backward in float32 and mixed_bfloat16, summed by layer class, against the Engine's step
(timed with --steps_per_execution, --repeats, ...); prints the tables, writes layer_profile.json.

--fused_norm=false,true measures each model both as built (Keras' layers) and, like the default,
with every BatchNormalization, GroupNormalization, LayerNormalization, RMSNormalization and
MultiHeadAttention fused (`tfmp.precision.fuse_normalization`), giving the ratio
fused_vs_keras_norm (examples/s and live peak); --models also takes the plain Keras models
keras_bn_cnn and keras_resnet (`tfmp.bench.keras_models`: keras.layers only, trained by tfmp's
Engine) and vit_tiny_p2 (vit_tiny on 2x2 patches: 257 tokens at 32x32). --bn_study adds one
BatchNormalization alone, Keras' layer vs fused, forward + backward on a --bn_study_shape tensor
in float32, mixed_bfloat16 and mixed_float16 (fused_vs_keras_bn); --bn_study_groups=G studies
GroupNormalization(G) instead; --bn_study_layers=BatchNormalization,LayerNormalization,
RMSNormalization,MultiHeadAttention,GELU,DenseGELU adds the transformer layers on a
--bn_study_sequence_shape (batch, tokens, width) input, attention with --bn_study_heads heads.

--onednn_study adds, per model and precision, one training step broken down by oneDNN
primitive (ONEDNN_VERBOSE=1: ms per kind and implementation, oneDNN's reference kernels flagged,
the time outside oneDNN; `tfmp.bench.onednn`); where oneDNN's ops are off it says so in one line.

--engine_vs_fit adds, per classifier and precision, tfmp's Engine and Keras' fit on two copies
of the model in one process, timed in --engine_vs_fit_rounds alternating rounds: the engine /
fit ratio without the noise of two processes (`tfmp.bench.engine_vs_fit`).

--mode=memory --memory_budget_mb=N finds, per model and precision, the largest global batch
whose training step's live peak fits N MiB (`tfmp.bench.memory`: a line fitted through
--memory_probe_batches, the predicted batch and the next step measured, a bisection if the
prediction missed), and the mixed / float32 ratio of those batches; writes bench.json.

--mode=inference exports each model in each --precisions (float32, float16, bfloat16, mixed,
auto) as --export_formats and times every artifact next to the Keras model in float32: batch-1
latency p50/p99, throughput at --global_batch_size, size on disk (`tfmp.bench.inference`).
"""

import signal
import sys

from absl import flags, logging

from apps import cli
from tfmp.bench import matrix as bench
from tfmp.bench import memory as bench_memory
from tfmp.bench import report as bench_report
from tfmp.bench import runner as bench_runner
from tfmp.errors import UsageError

FLAGS = flags.FLAGS
flags.DEFINE_list(
    "models",
    ["seed_cnn"],
    "Model builders to measure (classifiers; the bench's plain Keras models keras_bn_cnn, keras_resnet, "
    "vit_tiny_p2, hub_vit (keras-hub's ViTBackbone); or detectors: retinanet_tiny, faster_rcnn_tiny).",
)
flags.DEFINE_list("precisions", ["float32", "auto"], "float32, mixed_float16, mixed_bfloat16, auto, mixed.")
flags.DEFINE_list("replicas", ["1"], "MirroredStrategy replica counts (GPUs, or logical CPUs).")
flags.DEFINE_list(
    "workers", [], "Local MultiWorkerMirrored worker counts (tfmp.launch, one core/GPU share each)."
)
flags.DEFINE_list("xla", ["off"], "XLA settings to measure: off, on.")
flags.DEFINE_list(
    "allreduce_dtypes",
    ["auto"],
    "Multi-replica and multi-worker cells: the dtypes gradients are summed in (auto, float32, bfloat16, float16).",
)
flags.DEFINE_list(
    "allreduce_bucket_bytes",
    [str(bench.DEFAULT_BUCKET_BYTES)],
    "Multi-replica and multi-worker cells: the bucket sizes in bytes gradients are summed in, "
    "last layers first (0: one call after the backward pass).",
)
flags.DEFINE_list("tf32", ["on"], "TF32 for float32 cells (Ampere+ GPUs): on, off.")
flags.DEFINE_list(
    "ratio_models",
    [],
    "Scaling (replicas>1, workers) and reference cells only for these models (default: all).",
)
flags.DEFINE_string(
    "data", "synthetic", "synthetic (in-memory tensors), builtin (shapes/digits) or tfds:<name>."
)
flags.DEFINE_integer("global_batch_size", 64, "Batch of a 1-replica cell (N replicas: N x).")
flags.DEFINE_integer("steps_per_execution", 10, "Steps per host call (engine and Keras fit alike).")
flags.DEFINE_string(
    "mode",
    "train",
    "train; inference (exported artifacts, tfmp.bench.inference); memory (largest batch in --memory_budget_mb).",
)
flags.DEFINE_list("export_formats", ["saved_model", "tflite", "keras"], "--mode=inference: formats to time.")
flags.DEFINE_integer("image_size", 32, "Image size for shapes/synthetic data.")
flags.DEFINE_integer("warmup_executions", 3, "Untimed host calls first (tracing, compiling, buffers).")
flags.DEFINE_integer("executions", 5, "Host calls per timed repeat, at least.")
flags.DEFINE_float("min_repeat_seconds", 1.5, "A timed repeat lasts at least this long.")
flags.DEFINE_integer("repeats", 5, "Timed repeats per cell (median and spread).")
flags.DEFINE_bool("references", True, "Also measure plain Keras fit and synthetic-input references.")
flags.DEFINE_bool("cache", False, "Cache decoded examples (real-data cells).")
flags.DEFINE_string("output_dir", "bench", "Where bench.json and bench.png go.")
flags.DEFINE_list(
    "pipeline_micro_batches", [], "M values of one K=2 pipeline cell vs the unsplit model (empty: none)."
)
flags.DEFINE_integer(
    "pipeline_2d_workers", 0, "N > 1: one N workers x 2 stages cell vs N-worker data parallelism (0: none)."
)
flags.DEFINE_integer(
    "pipeline_2d_micro_batches", 4, "--pipeline_2d_workers: micro-batches per worker's step."
)
flags.DEFINE_bool("threads_study", False, "Also measure TF/tf.data threads, steps per call, Python threads.")
flags.DEFINE_integer("threads_rounds", 2, "--threads_study: runs of the thread cells in turn (best of).")
flags.DEFINE_string("study_model", "seed_cnn", "Classifier of the pipeline and thread studies.")
flags.DEFINE_integer("study_image_size", 32, "Image size of the pipeline and thread studies.")
flags.DEFINE_integer("study_batch_size", 64, "Global batch of the pipeline and thread studies.")
flags.DEFINE_list("peak_sizes", ["1024", "2048", "4096"], "Square matmul sizes of the peak (best of).")
flags.DEFINE_integer("peak_repeats", 3, "Timed calls per peak size (best of).")
flags.DEFINE_float("peak_min_call_seconds", 0.5, "A timed peak call chains matmuls this long, at least.")
flags.DEFINE_list(
    "layer_profile", [], "Only profile these models' layers, float32 vs mixed_bfloat16 (layer_profile.json)."
)
flags.DEFINE_integer("layer_profile_repeats", 20, "--layer_profile: interleaved rounds (median of).")
flags.DEFINE_list(
    "fused_norm",
    ["true"],
    "Normalization and attention layers fused, as the apps train them: true, false (Keras'), or both.",
)
flags.DEFINE_bool(
    "onednn_study",
    False,
    "Also break one training step per model and precision down by oneDNN primitive (ONEDNN_VERBOSE=1), "
    "flagging oneDNN's reference kernels.",
)
flags.DEFINE_integer("onednn_study_steps", 3, "--onednn_study: the timed steps it reads.")
flags.DEFINE_bool(
    "engine_vs_fit",
    False,
    "Also time tfmp's Engine and Keras' fit on two copies of each classifier in ONE process, per "
    "precision, in alternating rounds (engine / fit without the two-process noise).",
)
flags.DEFINE_integer("engine_vs_fit_rounds", 8, "--engine_vs_fit: rounds timing the engine and fit in turn.")
flags.DEFINE_bool("bn_study", False, "Also time one BatchNormalization alone, Keras' layer vs fused.")
flags.DEFINE_list(
    "bn_study_shape", ["64", "48", "48", "64"], "--bn_study: the input (batch, height, width, C)."
)
flags.DEFINE_integer(
    "bn_study_rounds", 20, "--bn_study: rounds timing Keras' layer and the fused one in turn."
)
flags.DEFINE_integer(
    "bn_study_groups", 0, "--bn_study: 0 studies BatchNormalization, G > 0 GroupNormalization(G)."
)
flags.DEFINE_list(
    "bn_study_layers",
    ["BatchNormalization"],
    "--bn_study: BatchNormalization (on --bn_study_shape), LayerNormalization, RMSNormalization, "
    "MultiHeadAttention, GELU, DenseGELU (on --bn_study_sequence_shape).",
)
flags.DEFINE_list(
    "bn_study_sequence_shape",
    ["64", "65", "192"],
    "--bn_study: the (batch, tokens, width) input of the sequence layers (vit_tiny's at batch 64).",
)
flags.DEFINE_integer("bn_study_heads", 3, "--bn_study: MultiHeadAttention's heads (width / heads each).")
flags.DEFINE_float("memory_budget_mb", 0, "--mode=memory: the live-peak budget (MiB) a batch must fit.")
flags.DEFINE_list(
    "memory_probe_batches", ["16", "32"], "--mode=memory: batches the live-peak line is fitted to."
)
flags.DEFINE_integer("memory_batch_step", 1, "--mode=memory: the batches tried are multiples of this.")


def _integers(name: str) -> list[int]:
    try:
        return [int(value) for value in FLAGS[name].value]
    except ValueError:
        raise UsageError(f"--{name}={','.join(FLAGS[name].value)} must be whole numbers, e.g. 1,2") from None


def _switches(name: str) -> list[bool]:
    settings = {"off": False, "on": True}
    for value in FLAGS[name].value:
        if value not in settings:
            raise UsageError(f"--{name} value {value!r} must be off or on (e.g. --{name}=off,on)")
    return [settings[value] for value in FLAGS[name].value]


def _booleans(name: str) -> list[bool]:
    settings = {"false": False, "true": True}
    for value in FLAGS[name].value:
        if value not in settings:
            raise UsageError(f"--{name} value {value!r} must be false or true (e.g. --{name}=false,true)")
    return [settings[value] for value in FLAGS[name].value]


def _inference_main():
    # Imported here, not at the top: it imports TensorFlow, and a training matrix's parent
    # process must not (see tfmp.bench.runner); the inference bench measures in this process.
    from tfmp.bench import inference as bench_inference

    logging.set_verbosity(logging.WARNING)  # TensorFlow's saver chatter from the exports
    config = bench_inference.InferenceBenchConfig(
        models=FLAGS.models,
        precisions=FLAGS.precisions,
        formats=FLAGS.export_formats,
        image_size=FLAGS.image_size,
        batch_size=FLAGS.global_batch_size,
        repeats=FLAGS.repeats,
        min_repeat_seconds=FLAGS.min_repeat_seconds,
        output_dir=FLAGS.output_dir,
    )
    report = bench_inference.run(config, progress=lambda line: print(line, flush=True))
    print()
    print(bench_inference.table(report))
    print(f"\nwrote {config.output_dir}/inference_bench.json")


def _layer_profile_main(config: bench.BenchConfig):
    report = bench_runner.run_layer_profile(config, progress=lambda line: print(line, flush=True))
    for cell in report["cells"]:
        print()
        print(bench_report.layer_profile_table(cell))
    load = report["load_average"]
    print(f"\nload average (1/5/15 min) before {load['before']}, after {load['after']}")
    print(f"wrote {config.output_dir}/layer_profile.json")


def _memory_main(config: bench.BenchConfig):
    report = bench_runner.run_memory_search(config, progress=lambda line: print(line, flush=True))
    print()
    print(bench_memory.table(report))
    load = report["load_average"]
    print(f"\nload average (1/5/15 min) before {load['before']}, after {load['after']}")
    print(f"wrote {config.output_dir}/bench.json")


def _config() -> bench.BenchConfig:
    return bench.BenchConfig(
        models=FLAGS.models,
        precisions=FLAGS.precisions,
        replicas=_integers("replicas"),
        workers=_integers("workers"),
        xla=_switches("xla"),
        tf32=_switches("tf32"),
        allreduce_dtypes=FLAGS.allreduce_dtypes,
        allreduce_bucket_bytes=_integers("allreduce_bucket_bytes"),
        ratio_models=FLAGS.ratio_models,
        data=FLAGS.data,
        global_batch_size=FLAGS.global_batch_size,
        steps_per_execution=FLAGS.steps_per_execution,
        mode=FLAGS.mode,
        image_size=FLAGS.image_size,
        warmup_executions=FLAGS.warmup_executions,
        executions=FLAGS.executions,
        min_repeat_seconds=FLAGS.min_repeat_seconds,
        repeats=FLAGS.repeats,
        references=FLAGS.references,
        cache=FLAGS.cache,
        output_dir=FLAGS.output_dir,
        pipeline_micro_batches=_integers("pipeline_micro_batches"),
        pipeline_2d_workers=FLAGS.pipeline_2d_workers,
        pipeline_2d_micro_batches=FLAGS.pipeline_2d_micro_batches,
        threads_study=FLAGS.threads_study,
        threads_rounds=FLAGS.threads_rounds,
        study_model=FLAGS.study_model,
        study_image_size=FLAGS.study_image_size,
        study_batch_size=FLAGS.study_batch_size,
        peak_sizes=_integers("peak_sizes"),
        peak_repeats=FLAGS.peak_repeats,
        peak_min_call_seconds=FLAGS.peak_min_call_seconds,
        layer_profile=FLAGS.layer_profile,
        layer_profile_repeats=FLAGS.layer_profile_repeats,
        fused_norm=_booleans("fused_norm"),
        onednn_study=FLAGS.onednn_study,
        onednn_study_steps=FLAGS.onednn_study_steps,
        engine_vs_fit=FLAGS.engine_vs_fit,
        engine_vs_fit_rounds=FLAGS.engine_vs_fit_rounds,
        bn_study=FLAGS.bn_study,
        bn_study_shape=_integers("bn_study_shape"),
        bn_study_rounds=FLAGS.bn_study_rounds,
        bn_study_groups=FLAGS.bn_study_groups,
        bn_study_layers=FLAGS.bn_study_layers,
        bn_study_sequence_shape=_integers("bn_study_sequence_shape"),
        bn_study_heads=FLAGS.bn_study_heads,
        memory_budget_mb=FLAGS.memory_budget_mb,
        memory_probe_batches=_integers("memory_probe_batches"),
        memory_batch_step=FLAGS.memory_batch_step,
    )


class _Stopped(Exception):
    """A stop signal (SIGTERM, SIGHUP) raised where the bench was, so what runs cells stops them."""


def _stop(signum, frame):
    raise _Stopped(signal.Signals(signum).name)


def main(argv):
    # By default SIGTERM and SIGHUP end this process at once, and its cell processes, which
    # hold GBs and CPUs, would run on: raised here instead, they unwind through what started
    # the cells (subprocess.run, the rounds' `finally`), which kills them. A SIGKILLed bench
    # takes them with it too (tfmp.distribute.workers.dies_with_this_process).
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _stop)
    try:
        _measure()
    except (_Stopped, KeyboardInterrupt) as stop:
        name = str(stop) if isinstance(stop, _Stopped) else "SIGINT"
        print(
            f"interrupted: {name} stopped the bench and its running cells (bench.json is written "
            "only once every cell is measured)",
            file=sys.stderr,
        )
        sys.exit(128 + signal.Signals[name])


def _measure():
    if FLAGS.mode == "inference":
        return _inference_main()
    config = _config()
    if config.layer_profile:
        return _layer_profile_main(config)
    if config.mode == "memory":
        return _memory_main(config)
    report = bench_runner.run(config, progress=lambda line: print(line, flush=True))
    print()
    print(bench_report.table(report["cells"], report["ratios"]))
    load = report["load_average"]
    print(
        f"\nload average (1/5/15 min) before {load['before']}, after {load['after']} on "
        f"{report['hardware']['cpu_cores']} cores"
    )
    print(f"wrote {config.output_dir}/bench.json" + (f" and {report['chart']}" if report["chart"] else ""))


if __name__ == "__main__":
    cli.run(main)
