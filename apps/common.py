"""Flags shared by the training apps (classify, mnist).

Flags live here and in the apps only; `config_from_flags` turns them into a plain
`tfmp.training.config.TrainConfig`. Error handling is `apps.cli.run`.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys

from absl import flags

from tfmp import optim, precision
from tfmp.distribute import allreduce
from tfmp.distribute import strategies as distribute
from tfmp.distribute.launch import LAUNCH_COMMAND_ENV, STARTUP_TIMEOUT_ENV
from tfmp.errors import UsageError
from tfmp.models import MODELS, recipes
from tfmp.training.config import TrainConfig
from tfmp.training.diagnosis import DEFAULT_STEPS as DEFAULT_DIAGNOSE_STEPS
from tfmp.training.diagnosis import diagnose_precision
from tfmp.training.plan import XLA_CHOICES, default_model_dir
from tfmp.training.run import flag_values, train_and_evaluate

FLAGS = flags.FLAGS
# The recipe knobs' flags default to the plain values (`--recipe=none`), defined once in the library.
PLAIN = recipes.NONE_VALUES

# Strings, not enums: tfmp validates them itself so every mistake gets the same one-line error.
flags.DEFINE_string("model", "seed_cnn", f"Model builder: {', '.join(MODELS)}.")
flags.DEFINE_string("dataset", "shapes", "shapes | digits | synthetic | tfds:<name> | folder:<path>.")
flags.DEFINE_integer("image_size", None, "Resize images to this square size (built-in shapes: any size).")
flags.DEFINE_string("data_dir", None, "Local TFDS data directory (for tfds:<name>).")
flags.DEFINE_integer(
    "max_image_pixels",
    None,
    "Refuse folder:/coco: images whose header declares more pixels (decompression bombs), before "
    "the run starts; default 89478485 (Pillow's), 0: no limit.",
)
flags.DEFINE_string(
    "recipe",
    "auto",
    f"Training recipe for the flags you leave unset: auto (the model's own), {', '.join(recipes.RECIPES)} "
    "(docs/recipes.md).",
)
flags.DEFINE_bool("augment", PLAIN["augment"], "Random flips and crops on training images.")
flags.DEFINE_integer(
    "randaugment_ops",
    PLAIN["randaugment_ops"],
    "RandAugment: image ops per training image (0: off; DeiT: 2).",
)
flags.DEFINE_float(
    "randaugment_magnitude",
    PLAIN["randaugment_magnitude"],
    "RandAugment: the ops' strength from 0 to 10 (DeiT: 9).",
)
flags.DEFINE_float(
    "mixup_alpha", PLAIN["mixup_alpha"], "Mixup's Beta(alpha, alpha) on training batches (0: off; DeiT: 0.8)."
)
flags.DEFINE_float(
    "cutmix_alpha",
    PLAIN["cutmix_alpha"],
    "CutMix's Beta(alpha, alpha) on training batches (0: off; DeiT: 1.0).",
)
flags.DEFINE_float(
    "stochastic_depth",
    PLAIN["stochastic_depth"],
    "Residual-branch drop rate of the last block, linear from 0 (ViTs; DeiT: 0.1).",
)
flags.DEFINE_bool("cache", False, "Cache decoded examples in memory after the first epoch.")
flags.DEFINE_integer("epochs", PLAIN["epochs"], "Training epochs (ignored when --steps > 0).")
flags.DEFINE_integer("steps", 0, "Total training steps; overrides --epochs when > 0.")
flags.DEFINE_integer("steps_per_epoch", 0, "Steps per epoch; 0 means train examples // global batch.")
flags.DEFINE_integer("global_batch_size", 64, "Global batch over all replicas and workers.")
flags.DEFINE_string("optimizer", PLAIN["optimizer"], f"One of {', '.join(optim.OPTIMIZERS)}.")
flags.DEFINE_float("learning_rate", PLAIN["learning_rate"], "Base learning rate, for --reference_batch_size.")
flags.DEFINE_float("weight_decay", PLAIN["weight_decay"], "Decoupled weight decay of the optimizer.")
flags.DEFINE_bool(
    "exclude_from_weight_decay",
    PLAIN["exclude_from_weight_decay"],
    "No weight decay on normalization scales and offsets, biases, embeddings and tokens (DeiT, timm).",
)
flags.DEFINE_float(
    "label_smoothing",
    PLAIN["label_smoothing"],
    "Classification: the share of each label spread over all classes (DeiT: 0.1).",
)
flags.DEFINE_string(
    "lr_scaling", PLAIN["lr_scaling"], "Scale the learning rate with the global batch: none, linear, sqrt."
)
flags.DEFINE_integer(
    "reference_batch_size", PLAIN["reference_batch_size"], "Batch size the base learning rate was tuned for."
)
flags.DEFINE_integer("warmup_steps", 0, "Linear learning-rate warmup steps.")
flags.DEFINE_float(
    "warmup_epochs", PLAIN["warmup_epochs"], "Linear warmup in epochs, when --warmup_steps is 0."
)
flags.DEFINE_string("lr_decay", PLAIN["lr_decay"], f"After warmup: {', '.join(optim.DECAYS)}.")
flags.DEFINE_string("precision", "float32", f"Policy: {', '.join(precision.CHOICES)}.")
flags.DEFINE_bool("mixed", False, "Best mixed policy for this hardware (same as --precision=mixed).")
flags.DEFINE_string(
    "loss_scale", "auto", "auto (dynamic for mixed_float16), dynamic, none or a fixed number."
)
flags.DEFINE_list(
    "float32_layers",
    [],
    "Layers (regexes matching whole names) built in float32 whatever --precision; what "
    "--diagnose_precision recommends.",
)
flags.DEFINE_bool(
    "fused_norm",
    True,
    "BatchNormalization on TensorFlow's fused kernel and GroupNormalization on tfmp's (half precision in "
    "and out, float32 statistics); "
    "--nofused_norm runs Keras' own layer, to compare.",
)
flags.DEFINE_bool(
    "diagnose_precision",
    False,
    "Run the precision doctor instead of training: per-layer float16/bfloat16 overflow, underflow and "
    "error on the first --diagnose_steps batches; writes precision_report.json in the run dir.",
)
flags.DEFINE_integer("diagnose_steps", DEFAULT_DIAGNOSE_STEPS, "Batches --diagnose_precision measures.")
flags.DEFINE_string("strategy", "auto", f"Distribution: {', '.join(distribute.STRATEGIES)}.")
flags.DEFINE_integer(
    "cpu_replicas", 0, "Split the CPU into N logical devices (MirroredStrategy without GPUs)."
)
flags.DEFINE_string(
    "allreduce_dtype",
    "auto",
    f"dtype the gradients are summed in across replicas and workers: {', '.join(allreduce.DTYPES)} "
    "(auto: bfloat16 under mixed_bfloat16, float32 otherwise).",
)
flags.DEFINE_integer(
    "allreduce_bucket_bytes",
    allreduce.DEFAULT_BUCKET_BYTES,
    "Gradients all-reduced per call, in bytes, last layers first (overlaps the backward pass); 0: one call.",
)
flags.DEFINE_string("xla", PLAIN["xla"], f"XLA-compile forward+backward: {', '.join(XLA_CHOICES)}.")
flags.DEFINE_integer("steps_per_execution", 1, "Training steps per host call.")
flags.DEFINE_string(
    "model_dir", None, "Checkpoints, logs, run card and model; resumes if it holds a checkpoint."
)
flags.DEFINE_integer("keep_checkpoints", 3, "Checkpoints kept in --model_dir.")
flags.DEFINE_integer("checkpoint_every", 0, "Save every N steps; 0 saves at every epoch end.")
flags.DEFINE_integer("log_every", 50, "Steps between metrics.jsonl/TensorBoard records.")
flags.DEFINE_integer("seed", 0, "Seed for weights, shuffling and augmentation.")
flags.DEFINE_float(
    "startup_timeout",
    float(os.environ.get(STARTUP_TIMEOUT_ENV, 120)),
    "Multi-worker: seconds to wait for every peer before failing (tfmp.launch sets it).",
)
flags.DEFINE_float(
    "heartbeat_timeout",
    distribute.DEFAULT_HEARTBEAT_TIMEOUT,
    "Multi-worker: seconds a worker may go without a heartbeat before every peer stops (TF: 10).",
)

flags.DEFINE_float(
    "prune_sparsity",
    0.0,
    "Magnitude-prune Dense/Conv kernels (not the head) to this sparsity, e.g. 0.8; 0 = dense.",
)
flags.DEFINE_string("prune_schedule", "polynomial", "polynomial (Zhu & Gupta) or constant.")
flags.DEFINE_integer(
    "prune_begin_step", None, "First step at which masks are computed (default: a third into the run)."
)
flags.DEFINE_integer(
    "prune_end_step", None, "Step at which the target sparsity is reached (default: two thirds into the run)."
)
flags.DEFINE_integer("prune_every", 100, "Steps between mask updates.")
flags.DEFINE_integer(
    "pipeline_stages",
    0,
    "Model parallelism: split the model into K>=2 stages on K devices (GPUs, or logical CPUs).",
)
flags.DEFINE_integer("micro_batches", 4, "GPipe micro-batches per step (must divide the per-replica batch).")
flags.DEFINE_list(
    "pipeline_boundaries", [], "Layer names that start a stage (default: balanced by --pipeline_balance)."
)
flags.DEFINE_string("pipeline_balance", "flops", "Balance stages by counted flops or params.")
flags.DEFINE_integer(
    "intra_op_threads", 0, "Threads that split one op (0: TensorFlow's default, one per core)."
)
flags.DEFINE_integer(
    "inter_op_threads", 0, "Threads that run independent ops at once (0: TensorFlow's default)."
)
flags.DEFINE_integer(
    "data_threads", 0, "tf.data's private thread pool for the input pipeline (0: the shared default)."
)

# Every flag that becomes part of the run's TrainConfig (a field per flag, grouped by concern);
# `evaluate` and `verbose` are library switches with no flag.
TRAIN_FLAGS = tuple(name for name in TrainConfig().flat() if name in FLAGS)


def precision_from_flags() -> str:
    if not FLAGS.mixed:
        return FLAGS.precision
    if FLAGS["precision"].present and FLAGS.precision not in ("mixed", "auto"):
        raise UsageError(f"--mixed conflicts with --precision={FLAGS.precision}; give one of them")
    return "mixed"


def config_from_flags(**overrides) -> TrainConfig:
    values = {name: FLAGS[name].value for name in TRAIN_FLAGS}
    values["precision"] = precision_from_flags()
    values["pipeline_boundaries"] = tuple(values["pipeline_boundaries"])
    values["float32_layers"] = tuple(values["float32_layers"])
    values.update(overrides)
    config = TrainConfig.from_flat(**values)
    # The recipe fills in what the user left unset: flags given on the command line or in a
    # flagfile, and the app's own overrides, win.
    explicit = {name for name in TRAIN_FLAGS if FLAGS[name].present} | set(overrides)
    return config.with_recipe(recipes.resolve(FLAGS.recipe, config.model), explicit)


def resolved_flags(app_name: str, config: TrainConfig) -> str:
    """The flags as resolved for this run, as a flagfile that reproduces it."""
    lines = [f"# resolved flags of: python -m apps.{app_name} {' '.join(sys.argv[1:])}"]
    values = flag_values(config)
    lines += [f"--{name}={values[name]}" for name in TRAIN_FLAGS if name in values]
    return "\n".join(lines) + "\n"


def resume_command(app_name: str, model_dir: str, had_model_dir: bool) -> str:
    """The exact command that resumes this run, for the messages on SIGTERM and ^C.

    The command as it was typed (`sys.orig_argv`), or the launcher's when `tfmp.launch` started
    this worker (re-running one worker's command would not start its peers), plus
    `--model_dir=<absolute dir>` when it named none: the default `runs/<model>-<dataset>-<time>`
    is new per run (and per launch: the launcher stamps a new TFMP_RUN_NAME), so without it
    the same command would start again from step 0. Appended to the launcher's command it
    lands after `--`, among the worker command's flags.
    """
    launched = os.environ.get(LAUNCH_COMMAND_ENV)
    if launched:
        command = launched
    else:
        argv = list(getattr(sys, "orig_argv", None) or ["python", "-m", f"apps.{app_name}", *sys.argv[1:]])
        command = shlex.join(argv)
    if had_model_dir:
        return command
    return f"{command} {shlex.quote('--model_dir=' + os.path.abspath(os.path.expanduser(model_dir)))}"


def train_or_diagnose(app_name: str, config: TrainConfig, task) -> None:
    """Trains per `config`, or with --diagnose_precision only runs the precision doctor (exit 0)."""
    if FLAGS.diagnose_precision:
        if FLAGS.diagnose_steps < 1:
            raise UsageError(f"--diagnose_steps={FLAGS.diagnose_steps} must be a positive number of batches")
        diagnose_precision(config, task, FLAGS.diagnose_steps)
        return
    flags_text = resolved_flags(app_name, config)  # without a default dir: a copy starts a new run
    had_model_dir = config.checkpointing.model_dir is not None
    if not had_model_dir:  # named here, once, so the resume command can name it
        config = dataclasses.replace(
            config,
            checkpointing=dataclasses.replace(config.checkpointing, model_dir=default_model_dir(config)),
        )
    command = resume_command(app_name, config.checkpointing.model_dir, had_model_dir)
    train_and_evaluate(config, task, resolved_flags=flags_text, resume_command=command)
