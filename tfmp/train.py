"""`train_and_evaluate(config)`: the whole run behind every tfmp app.

    from tfmp.train import TrainConfig, train_and_evaluate
    summary = train_and_evaluate(TrainConfig(model="lenet", dataset="digits", precision="mixed",
                                             strategy="mirrored", cpu_replicas=2, epochs=1))

Order matters: everything a user can get wrong (names, precision, strategy, batch split, model
shape) is checked before the model dir is created, so a bad command leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import signal
import threading
import time

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmp import data, distribute, models, optim, precision
from tfmp.checkpoint import Checkpoints
from tfmp.engine import Engine
from tfmp.errors import Preempted, TrainingDiverged, UsageError, unknown
from tfmp.reporting import Reporter

XLA_CHOICES = ("auto", "on", "off")
MODEL_FILE = "model.keras"
FLAGS_FILE = "flags.txt"


@dataclasses.dataclass
class TrainConfig:
    """Every knob of a run; apps fill it from flags. Batch sizes are global."""

    model: str = "seed_cnn"
    dataset: str = "shapes"
    image_size: int | None = None
    data_dir: str | None = None
    augment: bool = False
    cache: bool = False
    epochs: int = 1
    steps: int = 0  # total training steps; > 0 overrides epochs
    steps_per_epoch: int = 0  # 0: train examples // global batch
    global_batch_size: int = 64
    optimizer: str = "adam"
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    lr_scaling: str = "none"
    reference_batch_size: int = 256
    warmup_steps: int = 0
    lr_decay: str = "constant"
    precision: str = "float32"
    loss_scale: str = "auto"
    strategy: str = "auto"
    cpu_replicas: int = 0
    xla: str = "auto"
    steps_per_execution: int = 1
    model_dir: str | None = None
    keep_checkpoints: int = 3
    checkpoint_every: int = 0  # steps; 0: at the end of every epoch
    log_every: int = 50
    evaluate: bool = True
    seed: int = 0
    startup_timeout: float = distribute.DEFAULT_STARTUP_TIMEOUT  # multi-worker: wait for peers
    verbose: bool = True


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
    """runs/<model>-<dataset>-<time>: a fresh directory per run; resume by naming an old one."""
    dataset = "".join(c if c.isalnum() else "_" for c in config.dataset.split("/")[-1])
    return os.path.join("runs", f"{config.model}-{dataset}-{time.strftime('%Y%m%d-%H%M%S')}")


def _check_positive(**values):
    for name, value in values.items():
        if value is None or value < 0 or (value == 0 and name != "steps"):
            raise UsageError(f"--{name}={value} must be positive")


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything decided from the config before any file is written."""

    strategy: tf.distribute.Strategy
    topology: distribute.Topology
    policy: str
    policy_reason: str
    warning: str | None
    loss_scale: str | float | None
    info: data.DatasetInfo
    use_xla: bool
    xla_reason: str
    per_replica_batch: int
    steps_per_epoch: int
    total_steps: int
    epochs: int
    learning_rate: float
    schedule: optim.WarmupSchedule


def _plan(config: TrainConfig) -> _Plan:
    """Validates the config and decides the run; raises UsageError before anything is written."""
    _check_positive(epochs=config.epochs, steps=config.steps, global_batch_size=config.global_batch_size,
                    steps_per_execution=config.steps_per_execution, keep_checkpoints=config.keep_checkpoints,
                    log_every=config.log_every)
    if config.model not in models.MODELS:
        raise unknown("model", config.model, models.MODELS)
    # Logical CPU devices can only be made before TensorFlow initialises its runtime.
    distribute.split_cpu(config.cpu_replicas)
    # Next the strategy: MultiWorkerMirroredStrategy must exist before any TensorFlow op runs.
    strategy = distribute.get_strategy(config.strategy, startup_timeout=config.startup_timeout)
    policy_choice = precision.resolve(config.precision)
    policy = policy_choice.policy
    loss_scale = precision.parse_loss_scale(config.loss_scale)
    info = data.describe(config.dataset, image_size=config.image_size, data_dir=config.data_dir)
    use_xla, xla_reason = resolve_xla(config.xla)
    topology = distribute.describe(strategy)
    per_replica_batch = distribute.per_replica_batch(config.global_batch_size, strategy)
    steps_per_epoch = config.steps_per_epoch or info.train_examples // config.global_batch_size
    if not info.train_examples and not config.steps_per_epoch:
        # TFDS does not know the size of an unprepared or mocked dataset: one epoch = --steps.
        steps_per_epoch = config.steps
        if not steps_per_epoch:
            raise UsageError(f"dataset {config.dataset} does not report its size; pass "
                             "--steps_per_epoch (and --epochs) or --steps")
    if steps_per_epoch < 1:
        raise UsageError(f"global batch {config.global_batch_size} is larger than the "
                         f"{info.train_examples} training examples of {config.dataset}")
    total_steps = config.steps or config.epochs * steps_per_epoch
    epochs = math.ceil(total_steps / steps_per_epoch)
    learning_rate = distribute.scale_learning_rate(config.learning_rate, config.global_batch_size,
                                                   config.reference_batch_size, config.lr_scaling)
    schedule = optim.schedule(learning_rate, total_steps, config.warmup_steps, config.lr_decay)
    if topology.workers > 1 and not config.model_dir:
        raise UsageError("multi-worker training needs an explicit --model_dir shared by all workers "
                         "(they restore from the chief's checkpoints)")
    return _Plan(strategy, topology, policy, policy_choice.reason, policy_choice.warning, loss_scale,
                 info, use_xla, xla_reason, per_replica_batch, steps_per_epoch, total_steps, epochs,
                 learning_rate, schedule)


def train_and_evaluate(config: TrainConfig, resolved_flags: str | None = None) -> dict:
    """Trains and evaluates per `config`; returns the summary (also printed as one line).

    Raises UsageError for input a user must fix (before anything is written) and
    TrainingDiverged when the loss becomes non-finite without a loss scaler to skip the step.
    """
    plan = _plan(config)
    strategy, topology, policy, info = plan.strategy, plan.topology, plan.policy, plan.info
    total_steps, steps_per_epoch, schedule = plan.total_steps, plan.steps_per_epoch, plan.schedule
    if plan.warning:
        logging.warning("%s", plan.warning)
        if config.verbose and topology.is_chief:
            print(f"WARNING: {plan.warning}", flush=True)

    keras.utils.set_random_seed(config.seed)
    with strategy.scope():
        model = models.build(config.model, info.image_shape, info.num_classes, dtype=policy)
        # Weight decay is the optimizer's (decoupled, as in AdamW), never a loss term.
        optimizer = precision.wrap_optimizer(
            optim.build(config.optimizer, plan.schedule, config.weight_decay), policy, plan.loss_scale)
    engine = Engine(strategy, model, optimizer, config.global_batch_size, xla=plan.use_xla)
    dynamic_scaling = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

    # Validation is over: from here on the run writes files.
    model_dir = config.model_dir or default_model_dir(config)
    if topology.is_chief:
        os.makedirs(model_dir, exist_ok=True)
    task_id = getattr(getattr(strategy, "cluster_resolver", None), "task_id", 0) or 0
    checkpoints = Checkpoints(model_dir, topology.is_chief, task_id, keep=config.keep_checkpoints,
                              model=model, optimizer=optimizer)
    start_step = checkpoints.restore(model_dir)
    reporter = Reporter(model_dir if topology.is_chief else None, verbose=config.verbose and topology.is_chief)
    if resolved_flags and topology.is_chief:
        with open(os.path.join(model_dir, FLAGS_FILE), "w", encoding="utf-8") as file:
            file.write(resolved_flags)

    shard_policies = []

    def train_input(input_context):
        # Resume: each input pipeline skips what it fed before the checkpoint.
        skip = start_step * config.global_batch_size // input_context.num_input_pipelines
        dataset, shard_policy = data.load(
            config.dataset, "train", config.global_batch_size, image_size=config.image_size,
            data_dir=config.data_dir, input_context=input_context, training=True, augment=config.augment,
            cache=config.cache, seed=config.seed, skip_examples=skip)
        shard_policies.append(shard_policy)
        return dataset

    def eval_input(input_context):
        return data.load(config.dataset, "eval", config.global_batch_size, image_size=config.image_size,
                         data_dir=config.data_dir, input_context=input_context, training=False,
                         cache=config.cache)[0]

    train_iterator = iter(strategy.distribute_datasets_from_function(train_input))
    eval_dataset = strategy.distribute_datasets_from_function(eval_input) if config.evaluate else None

    reporter.run_card({
        "model": f"{config.model} ({model.count_params():,} parameters)",
        "dataset": f"{config.dataset} {info.image_shape}, {info.num_classes} classes, "
                   f"{info.train_examples} train / {info.eval_examples} eval",
        "precision": f"{policy} ({plan.policy_reason})",
        "compute dtype": precision.compute_dtype(policy),
        "variable dtype": keras.DTypePolicy(policy).variable_dtype,
        "head dtype": model.layers[-1].dtype_policy.compute_dtype,
        "output dtype": model.output.dtype,
        "loss scale": f"{precision.loss_scale_mode(optimizer)}, now {precision.current_loss_scale(optimizer):g}",
        "strategy": f"{topology.strategy} ({config.strategy})",
        "replicas": f"{topology.replicas} ({topology.workers} worker(s))",
        "devices": ", ".join(topology.devices),
        "global batch": config.global_batch_size,
        "per-replica batch": plan.per_replica_batch,
        "learning rate": f"{plan.learning_rate:g} ({config.optimizer}, base {config.learning_rate:g}, "
                         f"scaling {config.lr_scaling} vs batch {config.reference_batch_size}, "
                         f"warmup {config.warmup_steps}, decay {config.lr_decay})",
        "steps": f"{total_steps} ({plan.epochs} epoch(s) x {steps_per_epoch}), from step {start_step}",
        "steps per execution": config.steps_per_execution,
        "xla": f"{'on' if plan.use_xla else 'off'} ({plan.xla_reason}; forward+backward compiled per replica)",
        "shard policy": ", ".join(sorted(set(shard_policies))) or "n/a",
        "versions": f"TensorFlow {tf.__version__}, Keras {keras.__version__}",
        "model dir": os.path.abspath(model_dir),
    })

    step = start_step
    last_eval = None
    steady_examples, steady_seconds, first_call = 0, 0.0, True
    preemption = _PreemptionNotice()
    try:
        while step < total_steps:
            epoch = step // steps_per_epoch
            epoch_start = epoch * steps_per_epoch
            epoch_end = min(epoch_start + steps_per_epoch, total_steps)
            reporter.start_epoch(epoch + 1, plan.epochs, epoch_end - epoch_start)
            log_loss = log_examples = log_correct = log_seen = 0.0
            log_started, log_step = time.perf_counter(), step
            while step < epoch_end:
                num_steps = min(config.steps_per_execution, epoch_end - step)
                if config.checkpoint_every:
                    num_steps = min(num_steps, config.checkpoint_every - step % config.checkpoint_every)
                started = time.perf_counter()
                totals = engine.train(train_iterator, num_steps, stop_requested=preemption.received)
                seconds = time.perf_counter() - started
                step += num_steps
                if totals.stop_requests:
                    # Every worker sees the same reduced value, so all save at this step.
                    checkpoints.save(step)
                    raise Preempted(f"SIGTERM on a worker: checkpoint saved at step {step} in "
                                    f"{model_dir}; run the same command again to resume")
                if not first_call:  # the first call traces and compiles: not throughput
                    steady_examples += num_steps * config.global_batch_size
                    steady_seconds += seconds
                first_call = False
                if totals.nonfinite_steps and not dynamic_scaling:
                    raise TrainingDiverged(
                        f"loss became non-finite at step {step} under {policy} "
                        f"(loss scale: {precision.loss_scale_mode(optimizer)}); training stopped, the last "
                        f"good checkpoint in {checkpoints.directory} is kept; lower --learning_rate")
                if dynamic_scaling and precision.current_loss_scale(optimizer) < 1.0:
                    raise TrainingDiverged(
                        f"loss scale fell below 1 at step {step}: gradients are non-finite even "
                        "unscaled; lower --learning_rate")
                log_loss += totals.loss_sum
                log_examples += totals.loss_examples
                log_correct += totals.correct
                log_seen += totals.examples
                examples_per_sec = num_steps * config.global_batch_size / seconds
                reporter.progress(step - epoch_start, {
                    "loss": log_loss / max(log_examples, 1), "accuracy": log_correct / max(log_seen, 1),
                    "examples/s": examples_per_sec})
                if step - log_step >= config.log_every or step == epoch_end:
                    elapsed = time.perf_counter() - log_started
                    reporter.scalars(step, "train", {
                        "loss": log_loss / max(log_examples, 1), "accuracy": log_correct / max(log_seen, 1),
                        "learning_rate": float(schedule(step - 1)),
                        "loss_scale": precision.current_loss_scale(optimizer),
                        "examples_per_sec": (step - log_step) * config.global_batch_size / elapsed})
                    log_loss = log_examples = log_correct = log_seen = 0.0
                    log_started, log_step = time.perf_counter(), step
                if config.checkpoint_every and step % config.checkpoint_every == 0 and step < total_steps:
                    checkpoints.save(step)
            if eval_dataset is not None:
                last_eval = engine.evaluate(eval_dataset)
                reporter.scalars(step, "eval", {"loss": last_eval.loss, "accuracy": last_eval.accuracy})
                reporter.message(f"  eval: loss {last_eval.loss:.4f}, accuracy {last_eval.accuracy:.4f}")
            checkpoints.save(step)
        if eval_dataset is not None and last_eval is None:  # resumed a finished run
            last_eval = engine.evaluate(eval_dataset)
            reporter.message(f"  eval: loss {last_eval.loss:.4f}, accuracy {last_eval.accuracy:.4f}")
        if topology.is_chief:
            model.save(os.path.join(model_dir, MODEL_FILE))
    finally:
        preemption.restore()
        reporter.close()
        checkpoints.close()

    summary = {
        "eval_accuracy": last_eval.accuracy if last_eval else None,
        "eval_loss": last_eval.loss if last_eval else None,
        "examples_per_sec": steady_examples / steady_seconds if steady_seconds else None,
        "precision": policy, "replicas": topology.replicas, "workers": topology.workers,
        "steps": step, "loss_scale": precision.current_loss_scale(optimizer),
        "model_dir": os.path.abspath(model_dir),
        "optimizer_iterations": int(optimizer.iterations.numpy()),
        "weights_sha256": _weights_digest(model),
    }
    accuracy = f"{summary['eval_accuracy']:.4f}" if last_eval else "n/a"
    speed = f"{summary['examples_per_sec']:.0f}" if summary["examples_per_sec"] else "n/a"
    if config.verbose:  # every worker: identical weights digests show the workers agree
        print(f"tfmp summary: eval accuracy {accuracy}, {speed} examples/s, precision {policy}, "
              f"{topology.replicas} replica(s) on {topology.workers} worker(s), {step} steps "
              f"({summary['optimizer_iterations']} applied), "
              f"weights {summary['weights_sha256'][:12]}, model dir {summary['model_dir']}", flush=True)
    return summary


def _weights_digest(model: keras.Model) -> str:
    digest = hashlib.sha256()
    for weight in model.weights:
        digest.update(np.ascontiguousarray(weight.numpy()).tobytes())
    return digest.hexdigest()


class _PreemptionNotice:
    """Notes SIGTERM (a scheduler's preemption notice) instead of dying mid-step."""

    def __init__(self):
        self.received = False
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum, frame):
        logging.warning("SIGTERM received: checkpointing with every worker after this execution")
        self.received = True

    def restore(self):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
