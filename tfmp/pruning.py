"""Magnitude pruning of Dense/Conv kernels for Keras 3 models, under every precision and strategy.

    from tfmp import pruning
    schedule = pruning.PolynomialSchedule(target_sparsity=0.8, begin_step=0, end_step=1000, every=100)
    with strategy.scope():                       # masks become mirrored variables, like the model's
        pruner = pruning.Pruner(model, schedule)  # before the first training step is traced
    # custom loop, on the host between training calls (cross-replica context):
    if pruner.next_update_step(step) == step:
        pruner.update(step)
    # or a compiled Keras model: model.fit(..., callbacks=[pruning.PruningCallback(pruner)])
    export = pruning.strip(model)                # plain Keras model, pruned weights baked in

How: every pruned kernel gets a non-trainable float mask variable (1 = keep, 0 = pruned) and a
`MaskConstraint` on the kernel. Keras optimizers apply a variable's constraint right after each
update, inside the compiled (and distributed) step, so momentum or Adam moments cannot revive a
pruned weight, whatever the precision or loss scaling. `update(step)` recomputes the masks on the
host from the kernels' magnitudes at the schedule's sparsity for `step` (Zhu & Gupta 2017) and
zeroes the pruned weights. It reads only variable values and breaks ties by position, so every
replica and worker computes the same masks (their weights are identical in synchronous training).

tensorflow-model-optimization is not used: it takes only tf_keras models and switches the whole
process to legacy Keras when imported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import math
import os
import shutil

import keras
import numpy as np
import tensorflow as tf

from tfmp import models
from tfmp.errors import UsageError, unknown

# Layers whose `kernel` is pruned. Depthwise kernels are tiny and pruning them hurts accuracy most.
PRUNABLE_LAYERS = (
    keras.layers.Dense,
    keras.layers.EinsumDense,
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
    keras.layers.Conv1DTranspose,
    keras.layers.Conv2DTranspose,
    keras.layers.Conv3DTranspose,
)
SCHEDULES = ("polynomial", "constant")


@dataclasses.dataclass(frozen=True)
class ConstantSchedule:
    """`target_sparsity` from `begin_step` on; masks recomputed every `every` steps up to `end_step`."""

    target_sparsity: float
    begin_step: int
    end_step: int
    every: int = 100

    def __post_init__(self):
        if not 0.0 <= self.target_sparsity < 1.0:
            raise UsageError(f"prune sparsity {self.target_sparsity} must be in [0, 1), e.g. 0.8")
        if self.begin_step < 0:
            raise UsageError(f"prune begin_step {self.begin_step} must be >= 0")
        if self.end_step < self.begin_step:
            raise UsageError(
                f"prune end_step {self.end_step} is before begin_step {self.begin_step}; "
                "set end_step >= begin_step"
            )
        if self.every < 1:
            raise UsageError(f"prune every={self.every} must be >= 1 (steps between mask updates)")

    def sparsity(self, step: int) -> float:
        """Fraction of each kernel to prune at `step` (0 before `begin_step`)."""
        return 0.0 if step < self.begin_step else self.target_sparsity

    def next_update_step(self, step: int) -> int | None:
        """The first mask-update step >= `step`: begin, begin+every, ... and always end_step."""
        if step > self.end_step:
            return None
        if step <= self.begin_step:
            return self.begin_step
        return min(
            self.begin_step + math.ceil((step - self.begin_step) / self.every) * self.every, self.end_step
        )

    def describe(self) -> str:
        return (
            f"constant {self.target_sparsity:g} from step {self.begin_step} to {self.end_step}, "
            f"masks every {self.every} steps"
        )


@dataclasses.dataclass(frozen=True)
class PolynomialSchedule(ConstantSchedule):
    """Zhu & Gupta (2017): s(t) = s_f + (s_i - s_f) * (1 - (t - t0) / (t1 - t0))**exponent.

    Sparsity rises quickly while many weights are redundant and slowly near the target, which it
    reaches at `end_step`; masks are recomputed every `every` steps in between.
    """

    exponent: float = 3.0
    initial_sparsity: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.initial_sparsity <= self.target_sparsity:
            raise UsageError(
                f"prune initial_sparsity {self.initial_sparsity} must be in "
                f"[0, target_sparsity={self.target_sparsity}]"
            )
        if self.exponent <= 0:
            raise UsageError(f"prune exponent {self.exponent} must be > 0 (Zhu & Gupta use 3)")

    def sparsity(self, step: int) -> float:
        if step < self.begin_step:
            return 0.0
        if step >= self.end_step:
            return self.target_sparsity
        remaining = 1.0 - (step - self.begin_step) / (self.end_step - self.begin_step)
        return (
            self.target_sparsity + (self.initial_sparsity - self.target_sparsity) * remaining**self.exponent
        )

    def describe(self) -> str:
        return (
            f"polynomial (Zhu & Gupta, exponent {self.exponent:g}) {self.initial_sparsity:g} -> "
            f"{self.target_sparsity:g} from step {self.begin_step} to {self.end_step}, "
            f"masks every {self.every} steps"
        )


def make_schedule(
    name: str, target_sparsity: float, begin_step: int, end_step: int, every: int
) -> ConstantSchedule:
    """The schedule a `--prune_schedule=polynomial|constant` flag names."""
    if name not in SCHEDULES:
        raise unknown("prune schedule", name, SCHEDULES)
    kind = PolynomialSchedule if name == "polynomial" else ConstantSchedule
    return kind(target_sparsity=target_sparsity, begin_step=begin_step, end_step=end_step, every=every)


class MaskConstraint(keras.constraints.Constraint):
    """mask * inner(w): a user's own kernel constraint first, then the pruning mask.

    `where` rather than a product: pruned weights become +0.0, never -0.0, so sparse files
    compress to one repeated byte pattern.
    """

    def __init__(self, mask: keras.Variable, inner=None):
        self.mask = mask
        self.inner = inner

    def __call__(self, weights):
        if self.inner is not None:
            weights = self.inner(weights)
        return keras.ops.where(self.mask > 0, weights, keras.ops.zeros_like(weights))


def prunable_layers(model: keras.Model, skip_layers=(), include_head: bool = False) -> list:
    """The layers `Pruner` prunes: Dense/Conv layers with a kernel, in model order, minus the last
    one (the classifier head, float32 in tfmp models) unless `include_head`, minus `skip_layers`."""
    skip_layers = (skip_layers,) if isinstance(skip_layers, str) else tuple(skip_layers)
    candidates = [
        layer
        for layer in models.all_layers(model)
        if isinstance(layer, PRUNABLE_LAYERS) and isinstance(getattr(layer, "kernel", None), keras.Variable)
    ]
    names = {layer.name for layer in models.all_layers(model)}
    missing = sorted(set(skip_layers) - names)
    if missing:
        raise UsageError(
            f"skip_layers {missing} are not layers of model {model.name!r}; "
            f"its layers: {', '.join(sorted(names))}"
        )
    if candidates and not include_head:
        candidates = candidates[:-1]
    skip = set(skip_layers)
    layers = [layer for layer in candidates if layer.name not in skip]
    if not layers:
        raise UsageError(
            f"model {model.name!r} has no Dense/Conv kernel left to prune (head "
            f"{'included' if include_head else 'skipped'}, skip_layers={list(skip_layers)}); "
            "pass include_head=True or fewer skip_layers"
        )
    return layers


def magnitude_mask(weights: np.ndarray, sparsity: float) -> np.ndarray:
    """A float32 0/1 mask pruning the round(sparsity * size) smallest |weights|.

    Ties at the threshold are broken by position (lowest flat index pruned first), so the mask
    depends only on the values. O(size): a partition, no full sort.
    """
    magnitudes = np.abs(np.asarray(weights, dtype=np.float32)).ravel()
    count = int(round(sparsity * magnitudes.size))
    pruned = np.zeros(magnitudes.size, dtype=bool)
    if count >= magnitudes.size:
        pruned[:] = True
    elif count > 0:
        threshold = np.partition(magnitudes, count - 1)[count - 1]
        pruned = magnitudes < threshold
        ties = np.flatnonzero(magnitudes == threshold)[: count - int(pruned.sum())]
        pruned[ties] = True
    return np.where(pruned, 0.0, 1.0).astype(np.float32).reshape(np.shape(weights))


class _Masks(tf.Module):
    """Checkpoint holder: masks in pruned-layer order, as Keras checkpoints models by structure
    (auto-generated layer names differ between processes, positions do not)."""

    def __init__(self, masks):
        super().__init__(name="pruning_masks")
        self.masks = list(masks)


class Pruner:
    """Masks the kernels of `model` and recomputes the masks on `schedule`'s steps.

    Create it in the model's `strategy.scope()` (done for you when the kernels are distributed
    variables and no scope is active) and before the first training step is traced: the
    constraint becomes part of the optimizer's compiled update.
    """

    def __init__(
        self, model: keras.Model, schedule: ConstantSchedule, *, skip_layers=(), include_head: bool = False
    ):
        if not isinstance(schedule, ConstantSchedule):
            raise UsageError(
                f"schedule {schedule!r} is not a pruning schedule; use "
                "pruning.PolynomialSchedule or pruning.ConstantSchedule"
            )
        if not model.built:
            raise UsageError(
                f"model {model.name!r} is not built; call it on a batch or give it an Input first"
            )
        self.model = model
        self.schedule = schedule
        self.layers = prunable_layers(model, skip_layers, include_head)
        self.skipped = [
            layer.name
            for layer in models.all_layers(model)
            if isinstance(layer, PRUNABLE_LAYERS) and layer not in self.layers
        ]
        self.names = _unique_names(self.layers)
        for layer in self.layers:
            if isinstance(layer.kernel.constraint, MaskConstraint):
                raise UsageError(f"layer {layer.name!r} is already pruned; make one Pruner per model")
        self.masks = []
        for layer in self.layers:
            with _variable_scope(layer.kernel):
                self.masks.append(
                    keras.Variable(
                        initializer="ones",
                        shape=layer.kernel.shape,
                        dtype=layer.kernel.dtype,
                        trainable=False,
                        name=f"{layer.name}_pruning_mask",
                    )
                )
        for layer, mask in zip(self.layers, self.masks):
            layer.kernel.constraint = MaskConstraint(mask, layer.kernel.constraint)
        self._checkpointed = _Masks(self.masks)
        # A compiled Keras model caches its traced train step, which would lack the constraints.
        if getattr(model, "train_function", None) is not None:
            model.train_function = None

    def next_update_step(self, step: int) -> int | None:
        """The next step >= `step` at which `update` must run; None once the schedule is over.

        `step` counts optimizer steps done, so `update(step)` runs before step `step + 1`.
        """
        return self.schedule.next_update_step(step)

    def update(self, step: int) -> float:
        """Recomputes every mask at the schedule's sparsity for `step` and zeroes pruned weights.

        Host side, between training calls. Pruned weights are already zero and so the smallest:
        with a non-decreasing schedule they stay pruned, and repeating an update is a no-op.
        Returns the sparsity applied.
        """
        if tf.inside_function():
            raise UsageError(
                "Pruner.update runs on the host between training calls, not inside a tf.function"
            )
        sparsity = self.schedule.sparsity(step)
        for layer, mask in zip(self.layers, self.masks):
            weights = layer.kernel.numpy()
            new_mask = magnitude_mask(weights, sparsity)
            # Cross-replica assignments write the same host values into every replica's copy.
            mask.assign(new_mask)
            layer.kernel.assign(np.where(new_mask > 0, weights, 0).astype(weights.dtype))
        return sparsity

    def sparsity(self) -> dict:
        """{"<layer>": fraction pruned, ..., "overall": fraction over all pruned kernels}."""
        result, pruned, total = {}, 0, 0
        for name, mask in zip(self.names, self.masks):
            values = mask.numpy()
            zeros = int(values.size - np.count_nonzero(values))
            result[name] = zeros / values.size
            pruned, total = pruned + zeros, total + values.size
        result["overall"] = pruned / total
        return result

    def checkpoint_objects(self) -> dict:
        """Add to `tf.train.Checkpoint(...)`: the masks, restored on resume (not model weights)."""
        return {"pruning_masks": self._checkpointed}

    def describe(self) -> dict:
        """Run-card entries: schedule, layers pruned and skipped, current sparsity."""
        weights = sum(int(np.prod(mask.shape)) for mask in self.masks)
        return {
            "pruning": self.schedule.describe(),
            "pruning target": self.schedule.target_sparsity,
            "pruned layers": f"{', '.join(self.names)} ({weights:,} weights)",
            "unpruned layers": ", ".join(self.skipped) or "none",
            "pruning sparsity": round(self.sparsity()["overall"], 4),
        }


def _unique_names(layers) -> list[str]:
    # Nested models can repeat a layer name; the kernel's path is unique.
    names = [layer.name for layer in layers]
    return [
        name if names.count(name) == 1 else layer.kernel.path.rsplit("/", 1)[0]
        for name, layer in zip(names, layers)
    ]


def _variable_scope(kernel: keras.Variable):
    # Masks must be the same kind of variable as the kernels (mirrored under a strategy), and a
    # plain kernel's mask sits on its device (a pipeline stage's).
    variable = kernel.value
    if not isinstance(variable, tf.distribute.DistributedValues):
        return tf.device(variable.device)
    if not tf.distribute.has_strategy():
        return variable.distribute_strategy.scope()
    return contextlib.nullcontext()


class PruningCallback(keras.callbacks.Callback):
    """Runs `pruner.update` in `model.fit` when a mask update is due, and logs "sparsity".

    Steps are the optimizer's iterations (restored with the optimizer on resume). With
    `steps_per_execution > 1` an update due inside an execution runs at its start instead.
    """

    def __init__(self, pruner: Pruner):
        super().__init__()
        self.pruner = pruner
        self._from_step = None

    def on_train_batch_begin(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        due = self.pruner.next_update_step(step if self._from_step is None else self._from_step)
        if due is not None and due <= step:
            self.pruner.update(step)
        self._from_step = step + 1

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["sparsity"] = self.pruner.sparsity()["overall"]


def strip(model: keras.Model) -> keras.Model:
    """A plain copy of a pruned model for export: no masks, no mask constraints (a user's own
    kernel constraints stay), pruned weights zero. Same outputs; compile it again to train."""
    try:
        stripped = keras.models.clone_model(model)
    except Exception as error:  # noqa: BLE001 - clone_model raises many types for subclassed models
        raise UsageError(
            f"cannot strip model {model.name!r}: keras.models.clone_model fails "
            f"({str(error).splitlines()[0][:200]}); give it a get_config/from_config"
        ) from None
    if len(stripped.weights) != len(model.weights):
        raise UsageError(
            f"cannot strip model {model.name!r}: its clone has {len(stripped.weights)} "
            f"weights, the model {len(model.weights)}"
        )
    values = []
    for weight in model.weights:
        value = weight.numpy()
        if isinstance(weight.constraint, MaskConstraint):
            value = np.where(weight.constraint.mask.numpy() > 0, value, 0).astype(value.dtype)
        values.append(value)
    stripped.set_weights(values)
    # tfmp models carry their policy on the model itself (not in its config); keep it.
    stripped.dtype_policy = model.dtype_policy
    return stripped


def gzip_size(path: str) -> int:
    """Bytes of `path` gzip-compressed (level 9); for a directory, the sum over its files.

    Compare a pruned model's saved file with the dense one's: zeros compress, random floats don't.
    """
    if os.path.isdir(path):
        return sum(
            gzip_size(os.path.join(root, name))
            for root, _, names in sorted(os.walk(path))
            for name in sorted(names)
        )
    if not os.path.isfile(path):
        raise UsageError(f"gzip_size: {path!r} is not a file or directory")
    counter = _ByteCounter()
    with (
        open(path, "rb") as source,
        gzip.GzipFile(fileobj=counter, mode="wb", compresslevel=9, mtime=0) as sink,
    ):
        shutil.copyfileobj(source, sink, length=1 << 20)
    return counter.size


class _ByteCounter:
    """A write-only file object that only counts bytes."""

    def __init__(self):
        self.size = 0

    def write(self, data) -> int:
        self.size += len(data)
        return len(data)

    def flush(self):
        pass
