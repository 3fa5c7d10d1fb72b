"""`train_and_evaluate(config)`: the whole run behind every tfmp app.

    from tfmp.training.run import TrainConfig, train_and_evaluate
    summary = train_and_evaluate(TrainConfig(model="lenet", dataset="digits", precision="mixed",
                                             strategy="mirrored", cpu_replicas=2, epochs=1))

Order matters: everything a user can get wrong (names, precision, strategy, batch split, model
shape) is checked before the model dir is created, so a bad command leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import math
import os
import time

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmp import optim, precision, pruning, run_dir
from tfmp.classification import task as classification
from tfmp.distribute import strategies as distribute
from tfmp.distribute.launch import RUN_NAME_ENV
from tfmp.errors import UsageError, unknown
from tfmp.pipeline import plan as pipeline
from tfmp.training.checkpoint import Checkpoints
from tfmp.training.engine import Engine
from tfmp.training.loop import Loop, LoopSettings
from tfmp.training.reporting import Reporter

XLA_CHOICES = ("auto", "on", "off")


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
    # Detection: detections kept for COCO eval (and drawn by --predict above the threshold).
    score_threshold: float = 0.05
    max_detections: int = 100
    # Magnitude pruning (tfmp.pruning): 0 = dense. None: from a third to two thirds of the run.
    prune_sparsity: float = 0.0
    prune_schedule: str = "polynomial"
    prune_begin_step: int | None = None
    prune_end_step: int | None = None
    prune_every: int = 100
    # Model parallelism (tfmp.pipeline): K >= 2 stages on K devices, M micro-batches per step.
    pipeline_stages: int = 0
    micro_batches: int = 4
    pipeline_boundaries: tuple[str, ...] = ()  # layer names that start a stage; () = balanced
    pipeline_balance: str = "flops"
    # Compute parallelism: 0 = TensorFlow's defaults (one thread per core).
    intra_op_threads: int = 0
    inter_op_threads: int = 0
    data_threads: int = 0


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
    dataset = "".join(c if c.isalnum() else "_" for c in config.dataset.split("/")[-1])
    stamp = os.environ.get(RUN_NAME_ENV) or time.strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{config.model}-{dataset}-{stamp}")


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


def _plan(config: TrainConfig, task) -> _Plan:
    """Validates the config and decides the run; raises UsageError before anything is written."""
    _check_positive(
        epochs=config.epochs,
        steps=config.steps,
        global_batch_size=config.global_batch_size,
        steps_per_execution=config.steps_per_execution,
        keep_checkpoints=config.keep_checkpoints,
        log_every=config.log_every,
    )
    for name in ("intra_op_threads", "inter_op_threads", "data_threads"):
        if getattr(config, name) < 0:
            raise UsageError(f"--{name}={getattr(config, name)} must be 0 (TensorFlow's default) or positive")
    if config.cpu_replicas < 0:
        raise UsageError(
            f"--cpu_replicas={config.cpu_replicas} must be 0 (no split) or a positive "
            "number of logical CPU devices"
        )
    if config.model not in task.models:
        raise unknown(task.model_kind, config.model, task.models)
    # Thread pools and logical CPU devices can only be set before TensorFlow initialises its runtime.
    distribute.set_threads(config.intra_op_threads, config.inter_op_threads)
    strategy_name = _pipeline_strategy(config)
    distribute.split_cpu(config.cpu_replicas)
    # Next the strategy: MultiWorkerMirroredStrategy must exist before any TensorFlow op runs.
    strategy = distribute.get_strategy(strategy_name, startup_timeout=config.startup_timeout)
    policy_choice = precision.resolve(config.precision)
    policy = policy_choice.policy
    loss_scale = precision.parse_loss_scale(config.loss_scale)
    info = task.describe(config)
    use_xla, xla_reason = resolve_xla(config.xla)
    topology = distribute.describe(strategy)
    per_replica_batch = distribute.per_replica_batch(config.global_batch_size, strategy)
    steps_per_epoch = config.steps_per_epoch or info.train_examples // config.global_batch_size
    if not info.train_examples and not config.steps_per_epoch:
        # TFDS does not know the size of an unprepared or mocked dataset: one epoch = --steps.
        steps_per_epoch = config.steps
        if not steps_per_epoch:
            raise UsageError(
                f"dataset {config.dataset} does not report its size; pass "
                "--steps_per_epoch (and --epochs) or --steps"
            )
    if steps_per_epoch < 1:
        raise UsageError(
            f"global batch {config.global_batch_size} is larger than the "
            f"{info.train_examples} training examples of {config.dataset}"
        )
    total_steps = config.steps or config.epochs * steps_per_epoch
    epochs = math.ceil(total_steps / steps_per_epoch)
    learning_rate = distribute.scale_learning_rate(
        config.learning_rate, config.global_batch_size, config.reference_batch_size, config.lr_scaling
    )
    schedule = optim.schedule(learning_rate, total_steps, config.warmup_steps, config.lr_decay)
    if topology.workers > 1 and not config.model_dir and not os.environ.get(RUN_NAME_ENV):
        raise UsageError(
            "multi-worker training without tfmp.launch needs an explicit --model_dir shared by "
            "all workers (they restore from the chief's checkpoints)"
        )
    prune_schedule = None
    if config.prune_sparsity:
        # Zhu & Gupta start from a trained model: by default prune over the middle third.
        begin = total_steps // 3 if config.prune_begin_step is None else config.prune_begin_step
        end = max(begin, total_steps * 2 // 3) if config.prune_end_step is None else config.prune_end_step
        prune_schedule = pruning.make_schedule(
            config.prune_schedule, config.prune_sparsity, begin, end, config.prune_every
        )
    return _Plan(
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
    )


def _pipeline_strategy(config: TrainConfig) -> str:
    """The strategy name to use: a pipeline's stages are the devices, so it runs on one worker
    under the default strategy (`auto` resolves to it); replicas on the same devices are refused."""
    if config.pipeline_stages <= 1:
        if config.pipeline_stages < 0:
            raise UsageError(f"--pipeline_stages={config.pipeline_stages} must be 0 (no pipeline) or >= 2")
        return config.strategy
    if config.strategy not in ("auto", "default"):
        raise UsageError(
            f"--pipeline_stages={config.pipeline_stages} with --strategy={config.strategy}: the "
            "pipeline's stages are the devices, so replicas cannot also use them; use "
            "--strategy=default (or auto)"
        )
    if config.cpu_replicas and config.cpu_replicas < config.pipeline_stages:
        raise UsageError(
            f"--pipeline_stages={config.pipeline_stages} needs {config.pipeline_stages} devices, "
            f"--cpu_replicas={config.cpu_replicas} makes fewer"
        )
    if not tf.config.list_physical_devices("GPU"):
        distribute.split_cpu(max(config.cpu_replicas, config.pipeline_stages))  # a logical CPU per stage
    return "default"


def train_and_evaluate(config: TrainConfig, resolved_flags: str | None = None, task=None) -> dict:
    """Trains and evaluates per `config`; returns the summary (also printed as one line).

    `task` (default: image classification) owns what differs between tasks: the model
    registry, the dataset, compiling the model, the input pipelines and the eval metrics.
    Raises UsageError for input a user must fix (before anything is written) and
    TrainingDiverged when the loss becomes non-finite without a loss scaler to skip the step.
    """
    task = task or classification.TASK
    plan = _plan(config, task)
    if plan.warning:
        logging.warning("%s", plan.warning)
        if config.verbose and plan.topology.is_chief:
            print(f"WARNING: {plan.warning}", flush=True)
    keras.utils.set_random_seed(config.seed)
    with plan.strategy.scope():
        # Weight decay is the optimizer's (decoupled, as in AdamW), never a loss term.
        optimizer = precision.wrap_optimizer(
            optim.build(config.optimizer, plan.schedule, config.weight_decay), plan.policy, plan.loss_scale
        )
    model = task.build_model(config, plan)
    stages = None
    if config.pipeline_stages > 1:
        stages = pipeline.plan(
            model,
            pipeline.stage_devices(config.pipeline_stages),
            config.micro_batches,
            list(config.pipeline_boundaries) or None,
            config.pipeline_balance,
        )
        with plan.strategy.scope():
            pipeline.place(model, stages)  # before compile: optimizer slots follow their variables
        stages.check_batch(plan.per_replica_batch)
    task.compile(model, optimizer, plan)
    engine = Engine(
        plan.strategy,
        model,
        optimizer,
        xla=plan.use_xla,
        gradients=pipeline.gradients_fn(stages) if stages else None,
        forward=pipeline.forward_fn(stages) if stages else None,
    )
    pruner = None
    if plan.prune_schedule is not None:
        with plan.strategy.scope():  # masks become mirrored, like the kernels
            pruner = pruning.Pruner(model, plan.prune_schedule)
    # Validation is over: from here on the run writes files.
    model_dir = config.model_dir or default_model_dir(config)
    if plan.topology.is_chief:
        os.makedirs(model_dir, exist_ok=True)
    task_id = getattr(getattr(plan.strategy, "cluster_resolver", None), "task_id", 0) or 0
    checkpoints = Checkpoints(
        model_dir,
        plan.topology.is_chief,
        task_id,
        keep=config.keep_checkpoints,
        global_batch_size=config.global_batch_size,
        model=model,
        optimizer=engine.optimizer,
        **(pruner.checkpoint_objects() if pruner else {}),
    )
    try:
        start_step = checkpoints.restore()
    except UsageError:
        checkpoints.close()
        raise
    reporter = Reporter(
        model_dir if plan.topology.is_chief else None, verbose=config.verbose and plan.topology.is_chief
    )
    if resolved_flags and plan.topology.is_chief:
        with open(os.path.join(model_dir, run_dir.FLAGS_FILE), "w", encoding="utf-8") as file:
            file.write(resolved_flags)
    try:
        data_for_epoch, evaluate, shard_policies = task.inputs(config, plan, engine, start_step)
        card = _run_card(config, plan, model, engine, start_step, shard_policies, model_dir, task)
        reporter.run_card(
            {**card, **(pruner.describe() if pruner else {}), **(_pipeline_card(stages) if stages else {})}
        )
        settings = LoopSettings(
            total_steps=plan.total_steps,
            steps_per_epoch=plan.steps_per_epoch,
            global_batch_size=config.global_batch_size,
            steps_per_execution=config.steps_per_execution,
            checkpoint_every=config.checkpoint_every,
            log_every=config.log_every,
            learning_rate=plan.schedule,
        )
        result = Loop(
            engine,
            data_for_epoch,
            settings,
            reporter=reporter,
            checkpoints=checkpoints,
            evaluate=evaluate,
            hooks=(pruner,) if pruner else (),
            scalars=(lambda: _sparsity_scalars(pruner)) if pruner else None,
        ).run(start_step)
        # A pruned model is saved stripped: a plain Keras model with its zeros, no masks.
        saved = pruning.strip(model) if pruner else model
        if plan.topology.is_chief:
            saved.save(os.path.join(model_dir, run_dir.MODEL_FILE))
        distribute.barrier(plan.strategy)
    finally:
        reporter.close()
        checkpoints.close()
    return _summary(config, plan, saved, engine, result, model_dir, task, pruner)


def _run_card(config, plan, model, engine, start_step, shard_policies, model_dir, task) -> dict:
    optimizer = engine.optimizer
    task_rows = task.card(config, plan, model)
    return {
        "model": f"{config.model} ({model.count_params():,} parameters)",
        "dataset": task_rows.pop("dataset"),
        "precision": f"{plan.policy} ({plan.policy_reason})",
        "compute dtype": precision.compute_dtype(plan.policy),
        "variable dtype": keras.DTypePolicy(plan.policy).variable_dtype,
        **task_rows,  # head and output dtypes, the loss
        "loss scale": f"{precision.loss_scale_mode(optimizer)}, now {precision.current_loss_scale(optimizer):g}",
        "strategy": f"{plan.topology.strategy} ({config.strategy})",
        "replicas": f"{plan.topology.replicas} ({plan.topology.workers} worker(s))",
        "devices": ", ".join(plan.topology.devices),
        "global batch": config.global_batch_size,
        "per-replica batch": plan.per_replica_batch,
        "learning rate": f"{plan.learning_rate:g} ({config.optimizer}, base {config.learning_rate:g}, "
        f"scaling {config.lr_scaling} vs batch {config.reference_batch_size}, "
        f"warmup {config.warmup_steps}, decay {config.lr_decay})",
        "steps": f"{plan.total_steps} ({plan.epochs} epoch(s) x {plan.steps_per_epoch}), from step {start_step}",
        "steps per execution": config.steps_per_execution,
        "xla": f"{'on' if plan.use_xla else 'off'} ({plan.xla_reason}; forward+backward compiled per replica)",
        "shard policy": ", ".join(sorted(set(shard_policies))) or "n/a",
        "threads": f"intra-op {config.intra_op_threads or 'default'}, inter-op {config.inter_op_threads or 'default'}, "
        f"tf.data {config.data_threads or 'default (shared pool)'}",
        "versions": f"TensorFlow {tf.__version__}, Keras {keras.__version__}",
        "model dir": os.path.abspath(model_dir),
    }


def _pipeline_card(stages) -> dict:
    described = stages.describe()
    rows = {
        "pipeline": f"{described['stages']} stages x {described['micro_batches']} micro-batches (GPipe), "
        f"balanced by {described['balance']}, bubble (K-1)/(M+K-1) = {described['bubble']:.3f}"
    }
    for index, stage in enumerate(described["per_stage"]):
        rows[f"stage {index}"] = (
            f"{stage['device']}: {stage['layers']} ({stage['num_layers']} layers, "
            f"{stage['parameters']:,} parameters, {stage['flops_per_example']:,} FLOPs/example)"
        )
    return rows


def _sparsity_scalars(pruner: pruning.Pruner) -> dict:
    sparsity = pruner.sparsity()
    return {
        "sparsity": sparsity.pop("overall"),
        **{f"sparsity/{name}": value for name, value in sparsity.items()},
    }


def _weights_gzip_bytes(model: keras.Model) -> int:
    """gzip size of the model's raw weights (no optimizer slots, no file format): what pruning
    shrinks, measured the same way for dense and pruned runs."""
    raw = b"".join(np.ascontiguousarray(weight.numpy()).tobytes() for weight in model.weights)
    return len(gzip.compress(raw, compresslevel=9, mtime=0))


def _summary(config, plan, model, engine, result, model_dir, task, pruner=None) -> dict:
    fields, headline = task.headline(result.last_eval or {})
    summary = {
        **fields,
        "examples_per_sec": result.examples_per_sec,
        "precision": plan.policy,
        "replicas": plan.topology.replicas,
        "workers": plan.topology.workers,
        "steps": result.step,
        "loss_scale": precision.current_loss_scale(engine.optimizer),
        "model_dir": os.path.abspath(model_dir),
        "optimizer_iterations": int(engine.optimizer.iterations.numpy()),
        "weights_sha256": weights_digest(model),
        "history": dict(result.history.history) if result.history else {},
        "sparsity": pruner.sparsity()["overall"] if pruner else 0.0,
        "weights_gzip_bytes": _weights_gzip_bytes(model),
    }
    speed = f"{summary['examples_per_sec']:.0f}" if summary["examples_per_sec"] else "n/a"
    if config.verbose:  # every worker: identical weights digests show the workers agree
        print(
            f"tfmp summary: {headline}, {speed} {task.unit}/s, precision {plan.policy}, "
            f"{plan.topology.replicas} replica(s) on {plan.topology.workers} worker(s), {result.step} steps "
            f"({summary['optimizer_iterations']} applied), sparsity {summary['sparsity']:.2f}, "
            f"weights gzip {summary['weights_gzip_bytes'] / 1e6:.2f} MB, "
            f"weights {summary['weights_sha256'][:12]}, model dir {summary['model_dir']}",
            flush=True,
        )
    return summary


def weights_digest(model: keras.Model) -> str:
    """SHA-256 of every weight: equal digests mean bit-identical models (across workers too)."""
    digest = hashlib.sha256()
    for weight in model.weights:
        digest.update(np.ascontiguousarray(weight.numpy()).tobytes())
    return digest.hexdigest()
