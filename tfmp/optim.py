"""Optimizers and learning-rate schedules by name, and which variables weight decay leaves alone.

    from tfmp import optim
    schedule = optim.schedule(0.1, total_steps=1000, warmup_steps=50, decay="cosine")
    optimizer = optim.build("sgd", schedule)
    optimizer = optim.build("adamw", schedule, 0.05, exclude=optim.decay_exclusions(model))

Learning rates here are already scaled for the global batch (`distribute.scale_learning_rate`);
warmup ramps linearly from 0 so a large global batch does not blow up in the first steps
(Goyal et al. 2017).

Weight decay is Keras 3's, decoupled for every optimizer: each step, before the gradient update,
a decayed variable loses `learning_rate * weight_decay` of itself (AdamW's rule). DeiT, timm and
big_vision decay only the weight matrices; `decay_exclusions` lists the rest (its docstring says
by which rule), and `exclude=` / `exclude_from_decay` register them with the optimizer through
Keras' `exclude_from_weight_decay(var_list=...)`, which keys each variable by its TensorFlow
variable's id (`_unique_id`, through a MirroredVariable to its container): the exclusion holds on
every replica of a MirroredStrategy and through a LossScaleOptimizer (registered on the inner
optimizer, which applies the decay). Register after the variables are final and before the
optimizer is built: `pipeline.place` re-creates each variable on its stage's device, with a new
id, so a list registered before it excludes nothing.
"""

from __future__ import annotations

import math
import re

import keras
from keras import ops

from tfmp.distribute.strategies import scale_learning_rate
from tfmp.errors import UsageError, unknown
from tfmp.models import recipes
from tfmp.models.vit import ClassToken, PositionEmbedding

DECAYS = ("constant", "cosine")
# Layers whose own variables weight decay leaves alone, by type (subclasses included)...
NORMALIZATION_LAYERS = (
    keras.layers.BatchNormalization,
    keras.layers.LayerNormalization,
    keras.layers.GroupNormalization,
    keras.layers.RMSNormalization,
    keras.layers.UnitNormalization,
)
EMBEDDING_LAYERS = (keras.layers.Embedding, ClassToken, PositionEmbedding)
# ...and by class name: keras-hub's own normalization layers (RMSNormalization, LlamaLayerNorm,
# T5LayerNorm: plain keras.layers.Layer subclasses), tfmp.serving's FoldedBatchNorm.
NORMALIZATION_CLASS_NAME = re.compile("Norm")
# Variable names left alone in any layer: biases of every shape (MultiHeadAttention's query, key
# and value biases are (heads, key_dim) matrices), class and other tokens (keras-hub's ViT
# `class_token`, timm's `cls_token`), position embeddings (timm's `pos_embed`).
EXCLUDED_VARIABLE_NAME = re.compile("bias|token|pos_embed|position_embedding")


@keras.saving.register_keras_serializable(package="tfmp")
class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup to `peak` over `warmup_steps`, then constant or cosine decay to 0."""

    def __init__(self, peak: float, total_steps: int, warmup_steps: int = 0, decay: str = "constant"):
        self.peak = float(peak)
        self.total_steps = int(total_steps)
        self.warmup_steps = int(warmup_steps)
        self.decay = decay

    def __call__(self, step):
        step = ops.cast(step, "float32")
        warmup = ops.minimum(1.0, (step + 1.0) / max(self.warmup_steps, 1))
        if self.decay == "constant":
            return self.peak * warmup
        decay_steps = max(self.total_steps - self.warmup_steps, 1)
        progress = ops.clip((step - self.warmup_steps) / decay_steps, 0.0, 1.0)
        return self.peak * warmup * 0.5 * (1.0 + ops.cos(math.pi * progress))

    def get_config(self):
        return {
            "peak": self.peak,
            "total_steps": self.total_steps,
            "warmup_steps": self.warmup_steps,
            "decay": self.decay,
        }


def schedule(
    learning_rate: float, total_steps: int, warmup_steps: int = 0, decay: str = "constant"
) -> WarmupSchedule:
    if decay not in DECAYS:
        raise unknown("learning-rate decay", decay, DECAYS)
    if not 0 < learning_rate < math.inf:  # also refuses NaN
        raise UsageError(f"learning rate {learning_rate} must be a positive finite number, e.g. 0.001")
    if warmup_steps < 0 or warmup_steps > total_steps:
        raise UsageError(
            f"warmup of {warmup_steps} steps does not fit the {total_steps} training steps; "
            f"use warmup_steps from 0 to {total_steps}"
        )
    return WarmupSchedule(learning_rate, total_steps, warmup_steps, decay)


def _sgd(learning_rate, weight_decay):
    return keras.optimizers.SGD(learning_rate, momentum=0.9, nesterov=True, weight_decay=weight_decay)


OPTIMIZERS = {
    "sgd": _sgd,
    "adam": lambda learning_rate, weight_decay: keras.optimizers.Adam(
        learning_rate, weight_decay=weight_decay
    ),
    # Keras' AdamW refuses None: no decay is 0.0 (a plain Adam step), never a decay nobody asked for.
    "adamw": lambda learning_rate, weight_decay: keras.optimizers.AdamW(
        learning_rate, weight_decay=weight_decay or 0.0
    ),
    "rmsprop": lambda learning_rate, weight_decay: keras.optimizers.RMSprop(
        learning_rate, weight_decay=weight_decay
    ),
}


def build(
    name: str, learning_rate, weight_decay: float | None = None, exclude: list | None = None
) -> keras.optimizers.Optimizer:
    """`sgd` (momentum 0.9, Nesterov), `adam`, `adamw` or `rmsprop`; `exclude` lists variables
    weight decay leaves alone (`decay_exclusions(model)`; see `exclude_from_decay`)."""
    if name not in OPTIMIZERS:
        raise unknown("optimizer", name, OPTIMIZERS)
    if weight_decay is not None and not 0 <= weight_decay < math.inf:  # also refuses NaN
        raise UsageError(
            f"weight decay {weight_decay} must be 0 (none) or a positive finite number, e.g. 1e-4"
        )
    optimizer = OPTIMIZERS[name](learning_rate, weight_decay or None)
    if exclude is not None:
        exclude_from_decay(optimizer, exclude)
    return optimizer


def exclude_from_decay(optimizer: keras.optimizers.Optimizer, variables) -> None:
    """Makes `optimizer` (or the one a LossScaleOptimizer wraps: it applies the decay) leave
    `variables` out of weight decay, replacing any list registered before. Call it before the
    optimizer is built, with the variables as they will be trained (after `pipeline.place`)."""
    variables = list(variables)
    for variable in variables:
        if not isinstance(variable, keras.Variable):
            raise UsageError(
                f"weight decay exclusions are the model's variables (optim.decay_exclusions(model)), "
                f"got {type(variable).__name__} {variable!r:.60}"
            )
    inner = (
        optimizer.inner_optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else optimizer
    )
    if optimizer.built or inner.built:
        raise UsageError(
            "weight decay exclusions must be registered before the optimizer is built "
            "(its first apply, or optimizer.build); register them first"
        )
    inner.exclude_from_weight_decay(var_list=variables)


def decay_exclusions(model: keras.layers.Layer) -> list:
    """The trainable variables of `model` that DeiT, timm and big_vision leave out of weight
    decay, in `model.trainable_variables`' order: all but the weight matrices and kernels.

    The rule, first by layer type, then by the variable itself as a fallback for layers it does
    not know:
    - every variable of a normalization layer's own (Batch-, Layer-, Group-, RMS-, Unit-
      Normalization and their subclasses, which is also what `tfmp.precision.fuse_normalization`
      fuses in place: the same layer objects; any layer whose class name contains "Norm", such
      as keras-hub's), and of an embedding or token layer's own (`keras.layers.Embedding` and
      subclasses, word embeddings included; tfmp's ViT `ClassToken` and `PositionEmbedding`);
    - in any layer, every variable of rank 0 or 1 (timm's "ndim <= 1": biases, scales and
      offsets, per-channel parameters), and every variable whose name contains "bias"
      (MultiHeadAttention's (heads, key_dim) biases), "token" or a position embedding's name
      ("pos_embed", "position_embedding": keras-hub's and timm's ViT).
    A layer's own variables are its trainable variables less those of the layers inside it: a
    wrapper named like a normalization (keras.layers.SpectralNormalization) keeps its wrapped
    kernel decayed.
    """
    excluded = set()
    for layer in filter(_excluded_by_type, _layers_within(model)):
        inner = {id(variable) for child in _sublayers(layer) for variable in child.trainable_variables}
        excluded |= {id(variable) for variable in layer.trainable_variables if id(variable) not in inner}
    return [
        variable
        for variable in model.trainable_variables
        if id(variable) in excluded
        or len(variable.shape) <= 1
        or EXCLUDED_VARIABLE_NAME.search(variable.name)
    ]


def _excluded_by_type(layer) -> bool:
    """Whether weight decay leaves all of `layer`'s own variables alone: a normalization (by type
    or class name), embedding or token layer."""
    if isinstance(layer, NORMALIZATION_LAYERS + EMBEDDING_LAYERS):
        return True
    return bool(NORMALIZATION_CLASS_NAME.search(type(layer).__name__))


def _layers_within(layer) -> list:
    """`layer` and every layer inside it, each once, depth first."""
    found, pending, seen = [], [layer], set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        found.append(current)
        pending.extend(reversed(_sublayers(current)))
    return found


def _sublayers(layer) -> list:
    """A model's `layers`; for any other layer, the layers its attributes hold (a block's
    `self.norm`, lists and dicts of them): Keras has no public list of a plain layer's sublayers."""
    if isinstance(layer, keras.Model):
        return list(layer.layers)
    found = []
    for value in vars(layer).values():
        values = list(value.values()) if isinstance(value, dict) else value
        for item in values if isinstance(values, (list, tuple)) else [values]:
            if isinstance(item, keras.layers.Layer):
                found.append(item)
    return found


def for_recipe(
    recipe: recipes.Recipe,
    model: keras.Model,
    *,
    global_batch_size: int,
    steps_per_epoch: int,
    epochs: int | None = None,
) -> keras.optimizers.Optimizer:
    """`recipe`'s optimizer for any Keras model, to compile it for `tfmp.fit` (or Keras' fit):
    its learning rate scaled to `global_batch_size`, its warmup and decay over `epochs` (default:
    the recipe's) of `steps_per_epoch` steps, its weight decay with its exclusions on `model`.

        optimizer = optim.for_recipe(recipes.RECIPES["vit_tiny"], model, global_batch_size=64,
                                     steps_per_epoch=187)
        model.compile(optimizer, SmoothedSparseCrossentropy(0.1), metrics=["accuracy"])
        tfmp.fit(model, train, epochs=6, steps_per_epoch=187)
    """
    plain = recipes.NONE_VALUES | dict(recipe.values)
    recipes.check(plain)
    epochs = epochs or plain["epochs"]
    total_steps = epochs * steps_per_epoch
    learning_rate = scale_learning_rate(
        plain["learning_rate"], global_batch_size, plain["reference_batch_size"], plain["lr_scaling"]
    )
    warmup = min(total_steps, round(plain["warmup_epochs"] * steps_per_epoch))
    rate_schedule = schedule(learning_rate, total_steps, warmup, plain["lr_decay"])
    excluded = decay_exclusions(model) if plain["exclude_from_weight_decay"] else None
    return build(plain["optimizer"], rate_schedule, plain["weight_decay"], exclude=excluded)
