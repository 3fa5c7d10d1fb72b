"""`train_and_evaluate(config, task)`: the whole run behind every tfmp app: plan, build, loop.

    from tfmp.classification.task import TASK
    from tfmp.training.config import TrainConfig
    from tfmp.training.run import train_and_evaluate
    summary = train_and_evaluate(TrainConfig.from_flat(model="lenet", dataset="digits", precision="mixed",
                                                       strategy="mirrored", cpu_replicas=2, epochs=1), TASK)

Everything a user can get wrong is checked by `make_plan` before the model dir is created, so a
bad command leaves nothing behind; so is a resume whose flags differ from the run's flags.txt
in a way its checkpoint cannot take (`check_same_run`), and a directory another run is writing
(the chief locks it for the run's life: `run_dir.lock`). Every file is renamed into place whole;
a full disk, a read-only file system, a denied permission or a file-size limit ends the run with
`WriteFailed` naming the file, the fix and the checkpoint the same command resumes from, and a
data file that fails to decode mid-run (damaged inside) with `CorruptInput` naming it.
"""

from __future__ import annotations

import gzip
import hashlib
import os

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmp import optim, precision, pruning, run_dir, write_faults
from tfmp.distribute import strategies as distribute
from tfmp.errors import CorruptInput, UsageError, WriteFailed
from tfmp.input import decoding
from tfmp.pipeline import plan as pipeline
from tfmp.training import checkpoint, run_card
from tfmp.training.checkpoint import Checkpoints
from tfmp.training.config import TrainConfig
from tfmp.training.engine import Engine
from tfmp.training.loop import Loop, LoopSettings
from tfmp.training.plan import Plan, default_model_dir, make_plan
from tfmp.training.reporting import Reporter
from tfmp.training.task import Task


def train_and_evaluate(
    config: TrainConfig, task: Task, resolved_flags: str | None = None, resume_command: str | None = None
) -> dict:
    """Trains and evaluates per `config`; returns the summary (also printed as one line).

    `task` (default: image classification) owns what differs between tasks: the model
    registry, the dataset, compiling the model, the input pipelines and the eval metrics.
    `resolved_flags` (a flagfile's text) is saved as the run's flags.txt, and a resume is
    checked against the saved one; `resume_command` is the command line the messages on
    stopping (SIGTERM, ^C, a failed write) name. Raises UsageError for input a user must fix
    (before anything is written) and for a model dir another run holds, TrainingDiverged when
    the loss becomes non-finite without a loss scaler to skip the step, Preempted after saving
    a checkpoint on SIGTERM or SIGINT (or on SIGTERM while model.keras is written), WriteFailed
    when a write into the run fails, and CorruptInput when a data file fails to decode.
    """
    if not isinstance(task, Task):
        raise TypeError(f"{type(task).__name__} is not a tfmp Task (see tfmp.training.task)")
    plan = make_plan(config, task)
    # One absolute path from here on: `~` expanded (from a flagfile no shell expands it), and
    # nothing depends on the working directory any more. Only the chief writes there.
    shown_dir = config.checkpointing.model_dir
    if shown_dir is None:
        shown_dir = default_model_dir(config)
    if not plan.topology.is_chief:
        model_dir = os.path.abspath(os.path.expanduser(shown_dir))
        return _locked_run(config, task, plan, model_dir, shown_dir, resolved_flags, resume_command)
    model_dir = run_dir.writable_dir(shown_dir, "--model_dir")
    try:
        with write_faults.guarded("starting the run", model_dir):
            held = run_dir.lock(model_dir, shown_dir)
    except WriteFailed as error:
        raise write_faults.then_rerun(error, resume_command) from error.__cause__
    try:
        for path in run_dir.remove_leftovers(model_dir):
            logging.info("removed %s, left by a write that was cut short", path)
        return _locked_run(config, task, plan, model_dir, shown_dir, resolved_flags, resume_command)
    finally:
        held.release()


def _locked_run(config, task, plan, model_dir, shown_dir, resolved_flags, resume_command) -> dict:
    """The run once its directory is locked (on the chief): check, build, restore, train."""
    if checkpoint.has_checkpoint(model_dir):
        check_same_run(model_dir, shown_dir, config, resolved_flags)
    if plan.warning:
        logging.warning("%s", plan.warning)
        if config.verbose and plan.topology.is_chief:
            print(f"WARNING: {plan.warning}", flush=True)
    keras.utils.set_random_seed(config.seed)
    built = model, engine, stages, pruner = _build(config, plan, task)
    # Validation is over: from here on the run writes files.
    task_id = getattr(getattr(plan.strategy, "cluster_resolver", None), "task_id", 0) or 0
    checkpoints = Checkpoints(
        model_dir,
        plan.topology.is_chief,
        task_id,
        keep=config.checkpointing.keep_checkpoints,
        global_batch_size=config.data.global_batch_size,
        model=model,
        optimizer=engine.optimizer,
        **(pruner.checkpoint_objects() if pruner else {}),
    )
    try:
        start_step = checkpoints.restore()
        summary = _train(config, task, plan, built, checkpoints, start_step, resolved_flags, resume_command)
    except WriteFailed as error:
        saved_step, location = checkpoints.saved_step, checkpoints.location
        raise write_faults.with_resume(error, saved_step, location, resume_command) from error.__cause__
    except tf.errors.OpError as error:  # a data file damaged inside: named, not a traceback
        failed = decoding.failing_file(getattr(plan.info, "files", ()), error)
        if failed is None:
            raise
        rerun = write_faults.rerun(checkpoints.saved_step, checkpoints.location, resume_command)
        raise CorruptInput(f"{decoding.stopped_by(config.data.dataset, *failed)}, then {rerun}") from None
    finally:
        checkpoints.close()
    distribute.barrier(plan.strategy)  # last: after it a worker only returns and exits
    return summary


def _train(config, task, plan, built, checkpoints, start_step, resolved_flags, resume_command) -> dict:
    """Writes the flags and the run card, trains from `start_step`, saves model.keras; the summary."""
    (model, engine, stages, pruner), model_dir = built, checkpoints.model_dir
    is_chief = plan.topology.is_chief
    reporter = Reporter(
        model_dir if is_chief else None,
        verbose=config.verbose and is_chief,
        tags={"allreduce_dtype": engine.allreduce.dtype},
        start_step=start_step,
    )
    try:
        if resolved_flags and is_chief:
            path = os.path.join(model_dir, run_dir.FLAGS_FILE)
            with write_faults.guarded("writing the run's flags", path):
                run_dir.write_text_atomic(path, resolved_flags)
        data_for_epoch, evaluate, shard_policies = task.inputs(config, plan, engine, start_step)
        card = run_card.describe(config, plan, model, engine, start_step, shard_policies, model_dir, task)
        reporter.run_card(
            {
                **card,
                **(pruner.describe() if pruner else {}),
                **(run_card.pipeline_rows(stages, plan.topology.workers) if stages else {}),
            }
        )
        settings = LoopSettings(
            total_steps=plan.total_steps,
            steps_per_epoch=plan.steps_per_epoch,
            global_batch_size=config.data.global_batch_size,
            steps_per_execution=config.distribution.steps_per_execution,
            checkpoint_every=config.checkpointing.checkpoint_every,
            log_every=config.checkpointing.log_every,
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
            resume_command=resume_command,
            stop_on_interrupt=True,
        ).run(start_step)
        del data_for_epoch, evaluate
        distribute.release_input_pipelines()
        # A pruned model is saved stripped: a plain Keras model with its zeros, no masks.
        saved = pruning.strip(model) if pruner else model
        if is_chief:
            checkpoints.save_model(saved, resume_command)
        summary = _summary(config, plan, saved, engine, result, model_dir, task, pruner)
    except BaseException:
        reporter.close(failing=True)
        raise
    reporter.close()
    return summary


def _build(config: TrainConfig, plan: Plan, task: Task) -> tuple:
    """(model, engine, pipeline stages or None, pruner or None), compiled in the run's strategy."""
    model = build_model(config, plan, task)
    stages = None
    if config.pipeline.pipeline_stages > 1:
        stages = pipeline.plan(
            model,
            pipeline.stage_devices(config.pipeline.pipeline_stages),
            config.pipeline.micro_batches,
            list(config.pipeline.pipeline_boundaries) or None,
            config.pipeline.pipeline_balance,
        )
        with plan.model_strategy.scope():
            pipeline.place(model, stages)  # before compile: optimizer slots follow their variables
    # After the placement, which makes new variables: weight decay's exclusions name the final ones.
    optimizer = build_optimizer(config, plan, model)
    with plan.model_strategy.scope():  # its slots next to their variables, before compile's build
        optimizer.build(model.trainable_variables)
    task.compile(model, optimizer, plan)
    engine = Engine(
        plan.strategy,
        model,
        optimizer,
        xla=plan.use_xla,
        gradients=pipeline.gradients_fn(stages) if stages else None,
        forward=pipeline.forward_fn(stages) if stages else None,
        allreduce_plan=plan.allreduce,
    )
    pruner = None
    if plan.prune_schedule is not None:
        with plan.model_strategy.scope():  # masks become the same kind of variable as the kernels
            pruner = pruning.Pruner(model, plan.prune_schedule)
    return model, engine, stages, pruner


# Flags a resumed run may change. They decide how long it runs, how fast and on what (the
# strategy and replicas too: checkpoints hold no device placement, so a run may resume on
# other hardware), how often it saves and reports, where the same data live, and the learning
# rate's schedule (computed from the flags at every start, never saved: "lower the learning
# rate" is what a divergence's message advises, and apps.detect derives --warmup_steps from
# --steps). --global_batch_size is checked against the checkpoint itself, which names both
# sizes. Every other flag must match the run's flags.txt: it shapes the variables or their
# dtypes (model, image_size, dataset's classes, precision, float32_layers), the optimizer's
# slots (optimizer, loss_scale), the pruning masks, the pipeline's stages, or what data a saved
# step stands for (dataset, steps_per_epoch, seed, augment), and a run with mixed flags would
# have a flags.txt that reproduces neither half.
RESUMABLE_CHANGES = frozenset(
    {
        "model_dir",  # the same directory, spelt relative, absolute or with ~
        "steps",
        "epochs",
        "learning_rate",
        "weight_decay",
        "lr_scaling",
        "reference_batch_size",
        "warmup_steps",
        "warmup_epochs",
        "lr_decay",
        "exclude_from_weight_decay",  # which variables decay: their values, not their shapes
        "recipe",  # the recipe's values are flags of their own, compared one by one
        "global_batch_size",
        "allreduce_dtype",  # how the gradients are summed: not what they are
        "allreduce_bucket_bytes",
        "log_every",
        "checkpoint_every",
        "keep_checkpoints",
        "strategy",
        "cpu_replicas",
        "steps_per_execution",
        "xla",
        "startup_timeout",
        "heartbeat_timeout",
        "intra_op_threads",
        "inter_op_threads",
        "data_threads",
        "data_dir",
        "cache",
        "max_image_pixels",  # which files the pre-run check admits, not what training computes
        "fused_norm",  # the same variables either way: only the kernel that computes them
        # The checkpoint is the unsplit model's variables wherever they were placed, so a run
        # may change its pipeline layout (2 workers x 2 stages -> 1 worker, or no pipeline).
        "pipeline_stages",
        "micro_batches",
        "pipeline_boundaries",
        "pipeline_balance",
        "score_threshold",  # detection's evaluation only
        "max_detections",
    }
)


def flag_values(config: TrainConfig) -> dict[str, str]:
    """Flag name -> the value as flags.txt spells it (`--name=value`); unset (None) ones left out."""
    values = {}
    for name, value in config.flat().items():
        if value is not None:
            values[name] = ",".join(value) if isinstance(value, tuple) else str(value)  # list flags
    return values


def check_same_run(
    model_dir: str, shown_dir: str, config: TrainConfig, resolved_flags: str | None = None
) -> None:
    """A UsageError naming every flag this command changes that a resume of the run in
    `model_dir` (which holds checkpoints) cannot take (see RESUMABLE_CHANGES).

    Checked before anything is restored, so the user reads one line instead of TensorFlow's
    mismatched tensor shapes. `shown_dir` is the directory as the user spelt it. A flags.txt
    that is empty or unreadable is refused, and so is a missing one when this command has flags
    to compare (an app's): nothing would tell what the checkpoints were trained with. Only a
    library call's run, which saves no flags.txt, resumes without one.
    """
    path = os.path.join(model_dir, run_dir.FLAGS_FILE)
    try:
        saved = run_dir.read_flags(model_dir)
    except (OSError, UnicodeDecodeError):
        saved = {}
    if not saved:
        if not resolved_flags and not os.path.lexists(path):
            return
        state = "is missing" if not os.path.lexists(path) else "is empty or unreadable"
        raise UsageError(
            f"{os.path.join(shown_dir, run_dir.FLAGS_FILE)} {state}, but {shown_dir} holds checkpoints: "
            "nothing tells which flags they were trained with; write the run's flags back into it "
            "(--name=value lines, as `--flagfile=` reads) or use a fresh --model_dir"
        )
    if resolved_flags:
        lines = (line.strip().partition("=") for line in resolved_flags.splitlines())
        now = {name[2:]: value for name, equals, value in lines if name.startswith("--") and equals}
    else:  # a library call: only the flags the run saved can be compared
        now = {name: value for name, value in flag_values(config).items() if name in saved}
    changed = sorted(
        name for name in (set(saved) | set(now)) - RESUMABLE_CHANGES if saved.get(name) != now.get(name)
    )
    if not changed:
        return

    def spelt(values: dict, name: str) -> str:
        return f"--{name}={values[name]}" if name in values else f"no --{name}"

    raise UsageError(
        f"{shown_dir} was trained with {', '.join(spelt(saved, name) for name in changed)}, this command "
        f"says {', '.join(spelt(now, name) for name in changed)}; resume with the run's flags "
        f"({os.path.join(shown_dir, run_dir.FLAGS_FILE)}) or use a fresh --model_dir"
    )


def build_optimizer(config: TrainConfig, plan: Plan, model: keras.Model) -> keras.optimizers.Optimizer:
    """The run's optimizer, with the loss scaling its policy needs, in the model's strategy;
    `model`'s normalization, bias and embedding variables keep no weight decay when the config
    excludes them."""
    optimization = config.optimization
    excluded = optim.decay_exclusions(model) if optimization.exclude_from_weight_decay else None
    with plan.model_strategy.scope():
        # Weight decay is the optimizer's (decoupled, as in AdamW), never a loss term.
        return precision.wrap_optimizer(
            optim.build(optimization.optimizer, plan.schedule, optimization.weight_decay, exclude=excluded),
            plan.policy,
            plan.loss_scale,
        )


def build_model(config: TrainConfig, plan: Plan, task: Task) -> keras.Model:
    """The task's model, with the layers `--float32_layers` names rebuilt in float32."""
    model = task.build_model(config, plan)
    if config.precision.float32_layers:
        with plan.model_strategy.scope():  # the copy's variables belong where the model's do
            model = precision.float32_layers(model, config.precision.float32_layers)
    if config.precision.fused_norm:  # after the copy above: copies come back unfused
        precision.fuse_normalization(model)
    return model


def _sparsity_scalars(pruner: pruning.Pruner) -> dict:
    sparsity = pruner.sparsity()
    return {
        "sparsity": sparsity.pop("overall"),
        **{f"sparsity/{name}": value for name, value in sparsity.items()},
    }


def _weights_gzip_bytes(model: keras.Model) -> int:
    """gzip size of the model's raw weights (no optimizer slots, no file format): what pruning
    shrinks. Only pruned runs pay for it: level-9 gzip runs at ~5-10 MB/s on these CPUs (ViT-B/16's
    330 MB: about a minute at every run end, on every worker), and dense float32 weights
    compress to ~93 % of their raw size anyway."""
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
        "weights_bytes": sum(
            int(np.prod(weight.shape)) * tf.as_dtype(weight.dtype).size for weight in model.weights
        ),
        "weights_gzip_bytes": _weights_gzip_bytes(model) if pruner else None,
    }
    size = f"size {summary['weights_bytes'] / 1e6:.2f} MB"
    if pruner:
        size += f" (gzip {summary['weights_gzip_bytes'] / 1e6:.2f} MB)"
    speed = f"{summary['examples_per_sec']:.0f}" if summary["examples_per_sec"] else "n/a"
    if config.verbose:  # every worker: identical weights digests show the workers agree
        print(
            f"tfmp summary: {headline}, {speed} {task.unit}/s, precision {plan.policy}, "
            f"{plan.topology.replicas} replica(s) on {plan.topology.workers} worker(s), {result.step} steps "
            f"({summary['optimizer_iterations']} applied), sparsity {summary['sparsity']:.2f}, "
            f"{size}, "
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
