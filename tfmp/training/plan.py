"""Planning a run: everything decided from the config, and checked, before any file is written.

    plan = make_plan(config, task)        # strategy, policy, batch split, steps, learning rate

Order matters: thread pools and logical CPU devices must be set before TensorFlow initialises
its runtime, and MultiWorkerMirroredStrategy must exist before any TensorFlow op runs. Every
mistake a user can make (names, precision, strategy, batch split, model shape) is a UsageError
here, so a bad command leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import tensorflow as tf

from tfmp import models, optim, precision, pruning
from tfmp.distribute import allreduce
from tfmp.distribute import strategies as distribute
from tfmp.distribute.cluster import parse_tf_config
from tfmp.distribute.launch import RUN_NAME_ENV
from tfmp.errors import UsageError, unknown
from tfmp.input import mixing as input_mixing
from tfmp.input import randaugment
from tfmp.models import recipes
from tfmp.pipeline import plan as pipeline
from tfmp.training.config import TrainConfig


@runtime_checkable
class Plannable(Protocol):
    """What planning reads of a task (every `tfmp.training.task.Task` has it): its model registry,
    what an unknown model is called, and its dataset description."""

    models: Mapping[str, Callable[..., Any]]
    model_kind: str

    def describe(self, config: TrainConfig) -> Any: ...


XLA_CHOICES = ("auto", "on", "off")


def resolve_xla(xla: str) -> tuple[bool, str]:
    """`auto` compiles on GPUs, where XLA fuses mixed-precision kernels; on CPUs oneDNN's kernels
    are usually as fast, so auto leaves XLA off there."""
    if xla not in XLA_CHOICES:
        raise unknown("--xla value", xla, XLA_CHOICES)
    if xla == "auto":
        on = bool(tf.config.list_physical_devices("GPU"))
        return on, f"auto -> {'on (GPU)' if on else 'off (no GPU)'}"
    return xla == "on", xla


def default_model_dir(config: TrainConfig) -> str:
    """runs/<model>-<dataset>-<time>: a fresh directory per run; resume by naming an old one.

    Workers started by `tfmp.launch` share the launcher's time stamp, so they agree on it.
    """
    dataset = "".join(c if c.isalnum() else "_" for c in config.data.dataset.split("/")[-1])
    stamp = os.environ.get(RUN_NAME_ENV) or time.strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{config.model}-{dataset}-{stamp}")


def _check_positive(**values):
    for name, value in values.items():
        if value is None or value < 0 or (value == 0 and name != "steps"):
            raise UsageError(f"--{name}={value} must be positive")


def _check_ranges(config: TrainConfig) -> None:
    """The numbers whose zero means "default": negative, NaN or infinite ones are refused."""
    zero_means = {
        "steps_per_epoch": (config.optimization.steps_per_epoch, "train examples // global batch"),
        "checkpoint_every": (config.checkpointing.checkpoint_every, "save at every epoch end"),
        "warmup_steps": (config.optimization.warmup_steps, "no warmup"),
        "cpu_replicas": (config.distribution.cpu_replicas, "no split"),
        "intra_op_threads": (config.distribution.intra_op_threads, "TensorFlow's default"),
        "inter_op_threads": (config.distribution.inter_op_threads, "TensorFlow's default"),
        "data_threads": (config.data.data_threads, "the shared default"),
    }
    for name, (value, meaning) in zero_means.items():
        if value < 0:
            raise UsageError(f"--{name}={value} must be 0 ({meaning}) or positive")
    if config.data.image_size is not None and config.data.image_size < 1:
        raise UsageError(
            f"--image_size={config.data.image_size} must be a positive number of pixels, e.g. 32"
        )
    if not 0.0 <= config.optimization.label_smoothing < 1.0:
        raise UsageError(
            f"--label_smoothing={config.optimization.label_smoothing} must be in [0, 1): the share of "
            "each label spread over the classes, e.g. 0.1"
        )
    if config.optimization.reference_batch_size < 1:
        raise UsageError(
            f"--reference_batch_size={config.optimization.reference_batch_size} must be positive, e.g. 256"
        )
    if not 0 < config.distribution.startup_timeout < math.inf:  # also refuses NaN
        raise UsageError(
            f"--startup_timeout={config.distribution.startup_timeout} must be a positive number of seconds, e.g. 120"
        )
    if not 1 <= config.distribution.heartbeat_timeout < math.inf:  # also refuses NaN
        raise UsageError(
            f"--heartbeat_timeout={config.distribution.heartbeat_timeout} must be at least 1 second, e.g. 60"
        )
    if not 0 <= config.detection.score_threshold <= 1:
        raise UsageError(
            f"--score_threshold={config.detection.score_threshold} must be a score from 0 to 1, e.g. 0.05"
        )
    if config.detection.max_detections < 1:
        raise UsageError(
            f"--max_detections={config.detection.max_detections} must be a positive number of boxes, e.g. 100"
        )
    recipes.check(config.flat())
    if not 0 <= config.seed < 2**32:  # Keras' and NumPy's seeds are 32-bit
        raise UsageError(f"--seed={config.seed} must be from 0 to 2**32 - 1, e.g. 0")


def _check_recipe_pieces(config: TrainConfig, task: Plannable) -> None:
    """Stochastic depth only for a model that has it; RandAugment and Mixup/CutMix values in their
    ranges; Mixup/CutMix only where the loss takes the soft labels they make (a task says so with
    `soft_labels = True`)."""
    if config.stochastic_depth and config.model in models.MODELS:
        if "stochastic_depth" not in models.options(config.model):
            takers = sorted(name for name in models.MODELS if "stochastic_depth" in models.options(name))
            raise UsageError(
                f"--stochastic_depth={config.stochastic_depth}: model {config.model!r} has no residual "
                f"branches to drop; use it with {', '.join(takers)}, or leave it at 0"
            )
    # The input pieces' own checks, naming their values as flags.
    randaugment.check(config.data.randaugment_ops, config.data.randaugment_magnitude, as_flags=True)
    input_mixing.check(config.data.mixup_alpha, config.data.cutmix_alpha, as_flags=True)
    mixing = {"mixup_alpha": config.data.mixup_alpha, "cutmix_alpha": config.data.cutmix_alpha}
    for flag, alpha in mixing.items():
        if alpha and not getattr(task, "soft_labels", False):
            raise UsageError(
                f"--{flag}={alpha}: {type(task).__name__}'s loss takes no mixed soft labels; Mixup and "
                "CutMix are for classification (apps.classify, apps.mnist), leave it at 0"
            )


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything decided from the config before any file is written."""

    strategy: tf.distribute.Strategy
    topology: distribute.Topology
    policy: str
    policy_reason: str
    warning: str | None
    loss_scale: str | float | None
    info: object  # the task's dataset description (train_examples, eval_examples, ...)
    use_xla: bool
    xla_reason: str
    per_replica_batch: int
    steps_per_epoch: int
    total_steps: int
    epochs: int
    learning_rate: float
    schedule: optim.WarmupSchedule
    prune_schedule: pruning.ConstantSchedule | None
    allreduce: allreduce.Plan  # the gradients' sum: dtype and buckets
    label_smoothing: float  # a classifier's loss: the share of each label spread over the classes
    warmup_steps: int  # --warmup_steps, else --warmup_epochs in this run's steps
    soft_labels: bool  # Mixup or CutMix: training labels are rows of class shares
    # Whose scope makes the model's and the optimizer's variables: `strategy`, or with a
    # pipeline on every worker the default strategy (each worker's variables are its own, on its
    # stages' devices; the replicas all-reduce the gradients, see training.engine).
    model_strategy: tf.distribute.Strategy


def make_plan(config: TrainConfig, task: Plannable) -> Plan:
    """Validates the config and decides the run; raises UsageError before anything is written."""
    if not isinstance(task, Plannable):
        raise TypeError(f"{type(task).__name__} is not a tfmp Task (see tfmp.training.task)")
    _check_positive(
        epochs=config.optimization.epochs,
        steps=config.optimization.steps,
        global_batch_size=config.data.global_batch_size,
        steps_per_execution=config.distribution.steps_per_execution,
        keep_checkpoints=config.checkpointing.keep_checkpoints,
        log_every=config.checkpointing.log_every,
    )
    _check_ranges(config)
    if config.model not in task.models:
        raise unknown(task.model_kind, config.model, task.models)
    _check_recipe_pieces(config, task)
    # Thread pools and logical CPU devices can only be set before TensorFlow initialises its runtime.
    distribute.set_threads(config.distribution.intra_op_threads, config.distribution.inter_op_threads)
    strategy_name, one_replica_per_worker = _pipeline_strategy(config)
    distribute.split_cpu(config.distribution.cpu_replicas)
    # Next the strategy: MultiWorkerMirroredStrategy must exist before any TensorFlow op runs.
    strategy = distribute.get_strategy(
        strategy_name,
        startup_timeout=config.distribution.startup_timeout,
        heartbeat_timeout=config.distribution.heartbeat_timeout,
        one_replica_per_worker=one_replica_per_worker,
    )
    topology = distribute.describe(strategy)
    # Several workers choose by the hardware rule: each timing its own host could disagree.
    policy_choice = precision.resolve(config.precision.policy, workers=topology.workers)
    policy = policy_choice.policy
    loss_scale = precision.parse_loss_scale(config.precision.loss_scale)
    info = task.describe(config)
    use_xla, xla_reason = resolve_xla(config.distribution.xla)
    summing = allreduce.resolve(
        config.distribution.allreduce_dtype,
        policy,
        loss_scaling=policy == "mixed_float16" and loss_scale is not None,
        replicas=strategy.num_replicas_in_sync,
        bucket_bytes=config.distribution.allreduce_bucket_bytes,
    )
    per_replica_batch = distribute.per_replica_batch(config.data.global_batch_size, strategy)
    steps_per_epoch = (
        config.optimization.steps_per_epoch or info.train_examples // config.data.global_batch_size
    )
    if not info.train_examples and not config.optimization.steps_per_epoch:
        # TFDS does not know the size of an unprepared or mocked dataset: one epoch = --steps.
        steps_per_epoch = config.optimization.steps
        if not steps_per_epoch:
            raise UsageError(
                f"dataset {config.data.dataset} does not report its size; pass "
                "--steps_per_epoch (and --epochs) or --steps"
            )
    if steps_per_epoch < 1:
        raise UsageError(
            f"global batch {config.data.global_batch_size} is larger than the "
            f"{info.train_examples} training examples of {config.data.dataset}"
        )
    total_steps = config.optimization.steps or config.optimization.epochs * steps_per_epoch
    epochs = math.ceil(total_steps / steps_per_epoch)
    learning_rate = distribute.scale_learning_rate(
        config.optimization.learning_rate,
        config.data.global_batch_size,
        config.optimization.reference_batch_size,
        config.optimization.lr_scaling,
    )
    # A warmup given in epochs (a recipe's) is cut to the run's length: a 20-step smoke test of
    # a 5-warmup-epoch recipe warms up for its 20 steps rather than failing.
    warmup_steps = config.optimization.warmup_steps or min(
        total_steps, round(config.optimization.warmup_epochs * steps_per_epoch)
    )
    schedule = optim.schedule(learning_rate, total_steps, warmup_steps, config.optimization.lr_decay)
    if topology.workers > 1 and not config.checkpointing.model_dir and not os.environ.get(RUN_NAME_ENV):
        raise UsageError(
            "multi-worker training without tfmp.launch needs an explicit --model_dir shared by "
            "all workers (they restore from the chief's checkpoints)"
        )
    prune_schedule = None
    if config.pruning.prune_sparsity:
        # Zhu & Gupta start from a trained model: by default prune over the middle third.
        begin = (
            total_steps // 3 if config.pruning.prune_begin_step is None else config.pruning.prune_begin_step
        )
        end = (
            max(begin, total_steps * 2 // 3)
            if config.pruning.prune_end_step is None
            else config.pruning.prune_end_step
        )
        prune_schedule = pruning.make_schedule(
            config.pruning.prune_schedule,
            config.pruning.prune_sparsity,
            begin,
            end,
            config.pruning.prune_every,
        )
    return Plan(
        strategy,
        topology,
        policy,
        policy_choice.reason,
        policy_choice.warning,
        loss_scale,
        info,
        use_xla,
        xla_reason,
        per_replica_batch,
        steps_per_epoch,
        total_steps,
        epochs,
        learning_rate,
        schedule,
        prune_schedule,
        summing,
        config.optimization.label_smoothing,
        warmup_steps,
        bool(config.data.mixup_alpha or config.data.cutmix_alpha),
        tf.distribute.get_strategy() if one_replica_per_worker else strategy,
    )


def _pipeline_strategy(config: TrainConfig) -> tuple[str, bool]:
    """(strategy name, one replica per worker) for the run. A pipeline's stages are the local
    devices, so replicas cannot also use them: one worker runs it under the default strategy,
    several (TF_CONFIG, `tfmp.launch`) under MultiWorkerMirroredStrategy with one replica per
    worker whose step runs the worker's pipeline (two-dimensional parallelism)."""
    stages = config.pipeline.pipeline_stages
    strategy = config.distribution.strategy
    if stages <= 1:
        if stages < 0:
            raise UsageError(f"--pipeline_stages={stages} must be 0 (no pipeline) or >= 2")
        return strategy, False
    if strategy not in ("auto", "default", "multi_worker"):
        raise UsageError(
            f"--pipeline_stages={stages} with --strategy={strategy}: the pipeline's stages are the "
            "devices, so replicas cannot also use them; use --strategy=default (or auto) on one "
            "worker, or start several workers with tfmp.launch"
        )
    if config.distribution.cpu_replicas > 1:
        raise UsageError(
            f"--cpu_replicas={config.distribution.cpu_replicas} with --pipeline_stages={stages}: the "
            "stages take the logical CPUs (one each), so there are none left for replicas; leave "
            "--cpu_replicas out (more replicas: more workers with tfmp.launch)"
        )
    cluster = parse_tf_config(os.environ.get("TF_CONFIG"))
    multi_worker = strategy == "multi_worker" or (
        strategy == "auto" and cluster is not None and cluster.num_workers > 1
    )
    workers = cluster.num_workers if multi_worker and cluster is not None else 1
    if config.data.global_batch_size % workers == 0:  # else per_replica_batch names the fix
        # Before the strategy: a refused run must not wait for its peers first.
        pipeline.check_batch(config.pipeline.micro_batches, config.data.global_batch_size // workers, workers)
    if not tf.config.list_physical_devices("GPU"):
        distribute.split_cpu(stages, "--pipeline_stages")  # a logical CPU per stage
    return ("multi_worker" if multi_worker else "default"), multi_worker
