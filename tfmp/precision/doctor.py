"""The precision doctor: which layers of a model break in float16 or bfloat16, and why.

    from tfmp import precision
    report = precision.diagnose(model, dataset, steps=3)    # any compiled functional/Sequential model
    print(precision.format_report(report))
    model = precision.float32_layers(model, report.float32_layers)   # then compile and train

How it measures (the model and its weights are never touched):

1. A float32 copy of the model (every layer float32, weights copied, compiled with the model's
   loss) is rebuilt with `keras.models.clone_model(call_function=...)` into a "tap" model that
   also returns every layer call's inputs and outputs (a shared layer: every call).
2. Per batch (`steps` batches, no optimizer update, so each batch sees the same weights): the
   tap's forward pass and the model's compiled loss under a `GradientTape`; the gradients of
   the loss w.r.t. every layer output and every trainable weight. Magnitudes are summarised as
   float16 would see them: outputs as they are, gradients multiplied by the loss scale.
3. Per layer call: the layer alone in float32, and a copy of it with the policy mixed_float16
   and one with mixed_bfloat16 (weights copied), all on the same float32 inputs (cast down for
   the half copies, as the previous layer's half output would be). The norm-wise relative error
   ||half - float32|| / ||float32|| is this layer's own rounding error, with no error carried in
   from earlier layers, so it points at the layer to fix. A layer that is random in training
   (two float32 calls differ, e.g. Dropout) is compared in inference mode.

Verdict (float32_layers_for(policy)): keep a layer in float32 under mixed_float16 when its
outputs exceed 65504 (float16 makes them inf: every step is skipped whatever the loss scale),
when its gradients exceed 65504 even unscaled (no loss scale avoids it), or when its float16
relative error exceeds ERROR_FACTOR x float16's epsilon (2^-10); under mixed_bfloat16 only the
last rule applies, with bfloat16's epsilon (2^-7): bfloat16 has float32's range. Gradient
underflow is reported but does not ask for float32: it is what (a larger) loss scale fixes.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import keras
import numpy as np
import tensorflow as tf

from tfmp.errors import UsageError
from tfmp.precision import layers as precision_layers
from tfmp.precision.loss_scaling import DEFAULT_INITIAL_SCALE, current_loss_scale
from tfmp.precision.measures import (
    EPSILON,
    ERROR_FACTOR,
    FLOAT16_MAX,
    Magnitudes,
    RelativeError,
)
from tfmp.precision.policy import model_compute_dtypes
from tfmp.precision.report import HALF_POLICIES, LayerReport, Report

HALF_DTYPES = {"float16": "mixed_float16", "bfloat16": "mixed_bfloat16"}


@dataclasses.dataclass
class _LayerStats:
    layer: keras.layers.Layer
    calls: int = 0
    activation: Magnitudes = dataclasses.field(default_factory=Magnitudes)
    output_gradient: Magnitudes | None = None
    weight_gradient: Magnitudes | None = None
    errors: dict = dataclasses.field(
        default_factory=lambda: {dtype: RelativeError() for dtype in HALF_DTYPES}
    )


@dataclasses.dataclass(frozen=True)
class _Node:
    """One layer call in the float32 copy: (args, kwargs) and outputs, holding KerasTensors."""

    layer: keras.layers.Layer
    arguments: tuple
    outputs: object

    def tensors(self, structure) -> list:
        return [value for value in keras.tree.flatten(structure) if isinstance(value, keras.KerasTensor)]

    def fill_in(self, values: list) -> tuple[tuple, dict]:
        """(args, kwargs) of this call with its KerasTensors replaced by `values`, in order."""
        values = iter(values)
        leaves = [
            next(values) if isinstance(leaf, keras.KerasTensor) else leaf
            for leaf in keras.tree.flatten(self.arguments)
        ]
        args, kwargs = keras.tree.pack_sequence_as(self.arguments, leaves)
        return tuple(args), dict(kwargs)


def _floats(structure) -> list[np.ndarray]:
    return [
        np.asarray(value, np.float32)
        for value in keras.tree.flatten(structure)
        if hasattr(value, "dtype") and keras.backend.is_float_dtype(value.dtype)
    ]


class _Tap:
    """The float32 copy, compiled with the model's loss, plus a model returning every layer
    call's arguments and outputs, so one forward pass yields them all under one tape."""

    def __init__(self, model: keras.Model):
        self.reference = precision_layers.clone_with_policies(model, lambda layer: "float32")
        config = model.get_compile_config() or {}
        self.reference.compile(
            optimizer=keras.optimizers.SGD(), loss=model.loss, loss_weights=config.get("loss_weights")
        )
        functional = self.reference
        if isinstance(functional, keras.Sequential):  # clone_model's call_function needs a graph
            functional = keras.Model(functional.inputs, functional.outputs, name=functional.name)
        self.nodes: list[_Node] = []

        def record(layer, *args, **kwargs):
            outputs = layer(*args, **kwargs)
            self.nodes.append(_Node(layer, (args, kwargs), outputs))
            return outputs

        # The same layers (same weights) called on new inputs, every call recorded.
        graph = keras.models.clone_model(functional, clone_function=lambda layer: layer, call_function=record)
        self.model = keras.Model(
            graph.input,
            {
                "prediction": graph.output,
                "arguments": [node.tensors(node.arguments) for node in self.nodes],
                "outputs": [node.tensors(node.outputs) for node in self.nodes],
            },
        )
        self.owner = {
            id(variable): layer.name
            for layer in self.reference.layers
            for variable in layer.trainable_weights
        }


def _check_inputs(model, steps: int, loss_scale: float | None, policy: str | None) -> str:
    if not isinstance(model, keras.Model) or not getattr(model, "compiled", False) or model.loss is None:
        raise UsageError(
            f"diagnose needs a compiled keras.Model with a loss, got {getattr(model, 'name', model)!r}; "
            "call model.compile(optimizer, loss) first"
        )
    if tf.distribute.has_strategy():
        raise UsageError("call precision.diagnose outside strategy.scope(): it runs on one device")
    if not isinstance(steps, int) or steps < 1:
        raise UsageError(f"diagnose steps={steps!r} must be a positive number of batches")
    if loss_scale is not None and not 0 < loss_scale < math.inf:
        raise UsageError(f"diagnose loss_scale={loss_scale} must be a positive finite number, e.g. 32768")
    model_policy = model.dtype_policy.name
    policy = policy or (model_policy if model_policy in HALF_POLICIES else "mixed_float16")
    if policy not in HALF_POLICIES:
        raise UsageError(f"diagnose policy={policy!r}: the verdict is for one of {', '.join(HALF_POLICIES)}")
    return policy


def _loss_scale(model: keras.Model, loss_scale: float | None) -> tuple[float, str]:
    if loss_scale is not None:
        return float(loss_scale), "given"
    optimizer = model.optimizer
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or getattr(
        optimizer, "loss_scale_factor", None
    ):
        return current_loss_scale(optimizer), "the model's optimizer, now"
    return DEFAULT_INITIAL_SCALE, "tfmp's initial dynamic scale for mixed_float16"


def _forward_backward(tap: _Tap, batch, scale: float, stats: dict) -> tuple[dict, int]:
    """One batch through the float32 tap: magnitudes of outputs and gradients, per layer."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
    weights = tap.reference.trainable_weights
    x = keras.tree.map_structure(tf.convert_to_tensor, x)
    with tf.GradientTape() as tape:
        # Watched inputs: a tape records an op only if it touches a watched tensor, so a
        # weightless first layer (Flatten, Rescaling) would otherwise have no output gradient.
        tape.watch([tensor for tensor in keras.tree.flatten(x) if tensor.dtype.is_floating])
        values = tap.model(x, training=True)
        loss = tap.reference.compute_loss(
            x=x, y=y, y_pred=values["prediction"], sample_weight=sample_weight, training=True
        )
    outputs = [
        [tensor for tensor in node_outputs if tensor.dtype.is_floating] for node_outputs in values["outputs"]
    ]
    sources = [tensor for node_outputs in outputs for tensor in node_outputs]
    gradients = iter(tape.gradient(loss, sources + list(weights)))
    for node, node_outputs in zip(tap.nodes, outputs):
        layer_stats = stats[node.layer.name]
        layer_stats.calls += 1
        for tensor in node_outputs:
            layer_stats.activation.add(tensor)
            gradient = next(gradients)
            if gradient is not None:
                layer_stats.output_gradient = layer_stats.output_gradient or Magnitudes()
                layer_stats.output_gradient.add(gradient, scale)
    for variable, gradient in zip(weights, gradients):
        if gradient is not None:
            layer_stats = stats[tap.owner[id(variable)]]
            layer_stats.weight_gradient = layer_stats.weight_gradient or Magnitudes()
            layer_stats.weight_gradient.add(tf.convert_to_tensor(gradient), scale)
    rows = int(tf.shape(keras.tree.flatten(x)[0])[0])
    return values, rows


def _half_copy(layer: keras.layers.Layer, policy: str, args: tuple, kwargs: dict) -> keras.layers.Layer:
    copy = precision_layers.with_policy(layer, policy)
    copy(*args, **kwargs)  # builds it
    copy.set_weights(layer.get_weights())
    return copy


def _cast(args: tuple, kwargs: dict, dtype: str) -> tuple[tuple, dict]:
    cast = lambda value: (  # noqa: E731
        tf.cast(value, dtype) if isinstance(value, tf.Tensor) and value.dtype.is_floating else value
    )
    return keras.tree.map_structure(cast, args), keras.tree.map_structure(cast, kwargs)


def _compare_in_half(tap: _Tap, values: dict, stats: dict, copies: dict) -> None:
    """Each layer call alone in float32 and in float16/bfloat16 on the same float32 inputs."""
    for node, arguments in zip(tap.nodes, values["arguments"]):
        args, kwargs = node.fill_in(arguments)
        kwargs.setdefault("training", True)
        reference = _floats(node.layer(*args, **kwargs))
        if any(not np.array_equal(a, b) for a, b in zip(reference, _floats(node.layer(*args, **kwargs)))):
            kwargs["training"] = False  # random in training (dropout): compare inference behaviour
            reference = _floats(node.layer(*args, **kwargs))
        for dtype, policy in HALF_DTYPES.items():
            half_args, half_kwargs = _cast(args, kwargs, dtype)
            key = (node.layer.name, dtype)
            if key not in copies:
                copies[key] = _half_copy(node.layer, policy, half_args, half_kwargs)
            stats[node.layer.name].errors[dtype].add(
                _floats(copies[key](*half_args, **half_kwargs)), reference
            )


def _reasons(layer_stats: _LayerStats, thresholds: dict) -> dict:
    activation = layer_stats.activation
    gradient_max = max(
        (item.max_abs for item in (layer_stats.output_gradient, layer_stats.weight_gradient) if item),
        default=0.0,
    )
    float16, bfloat16 = [], []
    if activation.overflow:
        float16.append(f"outputs overflow float16 (max |y| {activation.max_abs:.3g} > {FLOAT16_MAX:g})")
    if gradient_max > FLOAT16_MAX:
        float16.append(
            f"gradients overflow float16 even unscaled (max {gradient_max:.3g}); no loss scale helps"
        )
    for dtype, reasons in (("float16", float16), ("bfloat16", bfloat16)):
        error = layer_stats.errors[dtype].value()
        if error is not None and error > thresholds[dtype]:
            what = "is not finite" if error == math.inf else f"{error:.2g}"
            reasons.append(
                f"{dtype} output error {what} > {thresholds[dtype]:.2g} ({ERROR_FACTOR:g} x {dtype} epsilon)"
            )
    return {"mixed_float16": float16, "mixed_bfloat16": bfloat16}


def diagnose(
    model: keras.Model,
    dataset,
    *,
    steps: int = 3,
    loss_scale: float | None = None,
    policy: str | None = None,
) -> Report:
    """Measures, per layer, what float16 and bfloat16 would do to `model`; returns a `Report`.

    `model`: a compiled functional or Sequential model (its weights are not changed). `dataset`:
    a `tf.data.Dataset` (or any iterable) of `(x, y[, sample_weight])` batches; the first `steps`
    are used. `loss_scale`: what float16 gradients are multiplied by (default: the model's
    optimizer's current scale, else tfmp's initial dynamic scale 2^15). `policy`: the verdict's
    target, mixed_float16 or mixed_bfloat16 (default: the model's policy if mixed, else float16).
    """
    policy = _check_inputs(model, steps, loss_scale, policy)
    scale, scale_source = _loss_scale(model, loss_scale)
    tap = _Tap(model)
    stats = {layer.name: _LayerStats(layer) for layer in (node.layer for node in tap.nodes)}
    copies, examples, batches = {}, 0, 0
    for batch in itertools.islice(iter(dataset), steps):
        values, rows = _forward_backward(tap, batch, scale, stats)
        _compare_in_half(tap, values, stats, copies)
        examples, batches = examples + rows, batches + 1
    if not batches:
        raise UsageError(f"diagnose got no batch from the dataset of model {model.name!r}; is it empty?")
    thresholds = {dtype: ERROR_FACTOR * epsilon for dtype, epsilon in EPSILON.items()}
    layers, notes = [], []
    for name, layer_stats in stats.items():
        original = model.get_layer(name)
        if layer_stats.activation.nonfinite:
            notes.append(f"{name} is already non-finite in float32: not a precision problem")
        layers.append(
            LayerReport(
                name=name,
                kind=type(original).__name__,
                calls=layer_stats.calls // batches,
                compute_dtype=original.dtype_policy.compute_dtype,
                activation=layer_stats.activation.summary(),
                output_gradient=layer_stats.output_gradient.summary()
                if layer_stats.output_gradient
                else None,
                weight_gradient=layer_stats.weight_gradient.summary()
                if layer_stats.weight_gradient
                else None,
                relative_error={dtype: layer_stats.errors[dtype].value() for dtype in HALF_DTYPES},
                reasons=_reasons(layer_stats, thresholds),
            )
        )
    report = Report(
        model.name,
        policy,
        batches,
        examples,
        scale,
        scale_source,
        thresholds,
        layers,
        computes_in_half=bool(model_compute_dtypes(model) - {"float32"}),
        notes=notes,
    )
    report.safe_loss_scale = _safe_loss_scale(report)
    return report


def _safe_loss_scale(report: Report) -> float | None:
    """Largest 2^k with 2^k * |gradient| <= 65504 for every gradient float16 computes once the
    float16 verdict is followed (layers computing in float32 then are left out)."""
    float32 = set(report.float32_layers_for("mixed_float16"))
    largest = max(
        (
            summary["max_abs"]
            for layer in report.layers
            if layer.name not in float32
            and not (report.computes_in_half and layer.compute_dtype == "float32")
            for summary in (layer.output_gradient, layer.weight_gradient)
            if summary
        ),
        default=0.0,
    )
    return 2.0 ** math.floor(math.log2(FLOAT16_MAX / largest)) if largest else None
