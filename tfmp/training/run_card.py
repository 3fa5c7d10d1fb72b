"""The run card of a run: every setting that decides speed and numerics, as `key: value` rows.

    card = run_card.describe(config, plan, model, engine, start_step, shard_policies, model_dir, task)
    card = run_card.describe_fit(model, engine, topology, settings, start_step, note, model_dir)

`train_and_evaluate` prints it at the start and writes it as run_card.json (see `Reporter.run_card`),
with the pruning and pipeline rows (`pipeline_rows`) when the run has them.
"""

from __future__ import annotations

import os

import keras
import numpy as np
import tensorflow as tf

from tfmp import optim, precision
from tfmp.distribute import allreduce
from tfmp.models import recipes
from tfmp.precision import fused_norm
from tfmp.training import model_steps
from tfmp.training.config import TrainConfig

FUSE_HINT = (
    "tfmp.fuse_normalization(model) before fit would compute them on fused kernels (TensorFlow's "
    "FusedBatchNormV3, tfmp's for the others; a float16 convolution's gradients through float32 on a CPU): "
    "half-precision activations stay half (Keras' layers keep float32 copies for the backward pass), the "
    "same numbers within rounding, the same weights and .keras file"
)


def _normalization_card(model: keras.Model) -> dict:
    """Which BatchNormalization and GroupNormalization layers run fused (--fused_norm), and why not the rest."""
    state, unfused = fused_norm.status(model), fused_norm.unfused(model)
    rows = [f"{len(state.fused)} on the fused kernel"] if state.fused else []
    if unfused:
        rows.append(f"{len(unfused)} on Keras' layer (--nofused_norm)")
    rows += [f"{path} on Keras' layer: {reason}" for path, reason in state.left_alone]
    return {"normalization": "; ".join(rows)} if rows else {}


def _float32_layers_card(config: TrainConfig, model: keras.Model) -> dict:
    patterns = config.precision.float32_layers
    if not patterns:
        return {}
    names = precision.matching_layers(model, patterns)
    return {"float32 layers": f"{', '.join(names)} (--float32_layers={','.join(patterns)})"}


def describe(config, plan, model, engine, start_step, shard_policies, model_dir, task) -> dict:
    optimizer = engine.optimizer
    task_rows = task.card(config, plan, model)
    optimization, distribution = config.optimization, config.distribution
    return {
        "model": f"{config.model} ({model.count_params():,} parameters)",
        "dataset": task_rows.pop("dataset"),
        "precision": f"{plan.policy} ({plan.policy_reason})",
        "compute dtype": precision.compute_dtype(plan.policy),
        "variable dtype": keras.DTypePolicy(plan.policy).variable_dtype,
        **_float32_layers_card(config, model),
        **_normalization_card(model),
        **task_rows,  # head and output dtypes, the loss
        "loss scale": f"{precision.loss_scale_mode(optimizer)}, now {precision.current_loss_scale(optimizer):g}",
        "strategy": f"{plan.topology.strategy} ({config.distribution.strategy})",
        "replicas": f"{plan.topology.replicas} ({plan.topology.workers} worker(s))",
        "devices": ", ".join(plan.topology.devices),
        "global batch": config.data.global_batch_size,
        "per-replica batch": plan.per_replica_batch,
        "learning rate": f"{plan.learning_rate:g} ({optimization.optimizer}, base {optimization.learning_rate:g}, "
        f"scaling {optimization.lr_scaling} vs batch {optimization.reference_batch_size}, "
        f"warmup {plan.warmup_steps}, decay {optimization.lr_decay})",
        **_weight_decay_row(config, model),
        **recipe_rows(config),
        "steps": f"{plan.total_steps} ({plan.epochs} epoch(s) x {plan.steps_per_epoch}), from step {start_step}",
        "steps per execution": config.distribution.steps_per_execution,
        "xla": f"{'on' if plan.use_xla else 'off'} ({plan.xla_reason}; {engine.xla_parts})",
        "all-reduce": allreduce_row(engine),
        "shard policy": ", ".join(sorted(set(shard_policies))) or "n/a",
        "threads": f"intra-op {distribution.intra_op_threads or 'default'}, "
        f"inter-op {distribution.inter_op_threads or 'default'}, "
        f"tf.data {config.data.data_threads or 'default (shared pool)'}",
        "versions": f"TensorFlow {tf.__version__}, Keras {keras.__version__}",
        "model dir": os.path.abspath(model_dir),
    }


def _weight_decay_row(config: TrainConfig, model: keras.Model) -> dict:
    weight_decay = config.optimization.weight_decay
    if not weight_decay:
        return {}
    variables = model.trainable_variables
    excluded = optim.decay_exclusions(model) if config.optimization.exclude_from_weight_decay else []
    return {
        "weight decay": f"{weight_decay:g} on {len(variables) - len(excluded)} of {len(variables)} variables"
        + (" (none on normalization scales and offsets, biases, embeddings, tokens)" if excluded else "")
    }


def recipe_rows(config: TrainConfig) -> dict:
    """The recipe, and every recipe knob's value with where it came from: the recipe, or the
    flag (the user's value, or the flag's plain default where neither set it)."""
    recipe = recipes.RECIPES.get(config.recipe, recipes.NONE)
    values, taken = config.flat(), set(config.recipe_fields)
    shown = [f"{knob}={values[knob]} ({'recipe' if knob in taken else 'flag'})" for knob in recipes.KNOBS]
    return {"recipe": f"{recipe.name}: {recipe.sources}", "recipe values": ", ".join(shown)}


def pipeline_rows(stages, workers: int) -> dict:
    described = stages.describe()
    rows = {
        "pipeline": f"{described['stages']} stages x {described['micro_batches']} micro-batches (GPipe), "
        f"balanced by {described['balance']}, bubble (K-1)/(M+K-1) = {described['bubble']:.3f}"
        + (f"; on each of {workers} workers, gradients all-reduced across them (2-D)" if workers > 1 else "")
    }
    for index, stage in enumerate(described["per_stage"]):
        rows[f"stage {index}"] = (
            f"{stage['device']}: {stage['layers']} ({stage['num_layers']} layers, "
            f"{stage['parameters']:,} parameters, {stage['flops_per_example']:,} FLOPs/example)"
        )
    return rows


def allreduce_row(engine) -> str:
    """The gradients' sum: dtype, buckets, why, and the bytes each replica sends per step."""
    if engine.own is not None and "train_step" in engine.own.methods:
        return (
            "in the model's own train_step: its optimizers sum the gradients in float32 (Keras' all-reduce)"
        )
    plan = engine.allreduce
    sent = allreduce.gradient_bytes(engine.model.trainable_variables, plan.dtype)
    calls = len(allreduce.buckets(engine.model.trainable_variables, plan.dtype, plan.bucket_bytes))
    via = allreduce.implementation(engine.strategy)
    return f"{plan.describe()}; {sent / 2**20:.2f} MiB of gradients per replica per step" + (
        "" if via == "none" else f" in {calls} call{'s' if calls != 1 else ''}, {via}"
    )


def describe_fit(model, engine, topology, settings, start_step, note, model_dir) -> dict:
    """The run card of a `tfmp.fit` call (`settings`: its LoopSettings)."""
    global_batch_size, steps_per_epoch = settings.global_batch_size, settings.steps_per_epoch
    policy = model.dtype_policy.name
    compute = sorted(precision.model_compute_dtypes(model))
    card = {
        "model": f"{model.name} ({_parameters(model):,} parameters)",
        "precision": f"{policy} (layers compute in {', '.join(compute) or 'n/a'})",
        "output dtype": ", ".join(sorted({str(t.dtype) for t in tf.nest.flatten(model.outputs)}))
        if getattr(model, "outputs", None)
        else "n/a",
        "loss scale": f"{precision.loss_scale_mode(engine.optimizer)}, now "
        f"{precision.current_loss_scale(engine.optimizer):g}",
        "loss": _describe_loss(model),
        "strategy": topology.strategy,
        "replicas": f"{topology.replicas} ({topology.workers} worker(s))",
        "devices": ", ".join(topology.devices),
        "global batch": global_batch_size,
        "per-replica batch": global_batch_size // topology.replicas,
        "steps": f"{settings.total_steps} ({settings.total_steps // steps_per_epoch} epoch(s) x "
        f"{steps_per_epoch}), from step {start_step}",
        "xla": _xla_row(model, engine),
        **(
            {"run eagerly": "yes (compile(run_eagerly=True)): every step runs as Python"}
            if engine.run_eagerly
            else {}
        ),
        **({"own steps": model_steps.describe(model)} if engine.own is not None else {}),
        "all-reduce": allreduce_row(engine),
        "versions": f"TensorFlow {tf.__version__}, Keras {keras.__version__}",
        "model dir": os.path.abspath(model_dir) if model_dir else "none (no checkpoints or logs)",
    }
    if note:
        card["tfmp changed"] = note
    unfused = fused_norm.unfused(model)
    if unfused:
        card["normalization"] = f"{len(unfused)} layer(s) on Keras' layer; {FUSE_HINT}"
    return card


def _xla_row(model, engine) -> str:
    if not engine.xla:
        return "off"
    where = (
        "the whole step per replica"
        if engine.own is not None and "train_step" in engine.own.methods
        else engine.xla_parts
    )
    asked = " (compile(jit_compile=True))" if model.jit_compile else ""
    return f"on{asked} ({where})"


def _parameters(model) -> int:
    """Keras' count_params, also for a model that is built only in its own step (a GAN)."""
    return sum(int(np.prod(weight.shape)) for weight in model.weights)


def _describe_loss(model) -> str:
    loss = getattr(model, "loss", None)
    names = tf.nest.map_structure(lambda item: getattr(item, "name", None) or str(item), loss)
    return str(names) + (f" + {len(model.losses)} regularisation term(s)" if model.losses else "")
