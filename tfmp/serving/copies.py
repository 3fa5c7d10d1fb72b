"""Inference copies: a trained Keras model re-built for serving in one precision, BatchNorm folded.

    from tfmp.serving import copies
    served = copies.inference_copy(model, "bfloat16")   # bfloat16 variables and compute,
                                                        # float32 softmax, BatchNorm folded

Every inference copy folds each BatchNormalization that directly follows a bias-free linear
convolution or dense layer into that layer's kernel and bias (exact algebra, done in float64),
so a served ResNet runs one fused conv+bias+relu instead of five element-wise ops per layer.
Which layer feeds which is read from the model's functional config (`model.get_config()`: the
`inbound_nodes` of each layer, the format `.keras` files store), a public and stable description
of the graph. The softmax stays in float32 in every precision: it has no weights, and float32
keeps the small probabilities that top-k reports.
"""

from __future__ import annotations

import keras
import numpy as np

from tfmp import precision as precisions
from tfmp import pruning
from tfmp.errors import UsageError
from tfmp.serving.layers import FoldedBatchNorm

_FOLDABLE = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D, keras.layers.Dense)
PRECISIONS = ("float32", "float16", "bfloat16", "mixed")  # an inference copy's (apps.export --precision)


def layer_policy(precision: str) -> str:
    """The Keras dtype policy of an inference copy's layers for an export precision."""
    if precision == "mixed":
        # By the hardware rule, not the speed probe: an exported file's dtypes must not depend on
        # how fast the exporting host ran a probe (mixed_bfloat16 on CPU, mixed_float16 on GPU).
        return precisions.by_rule("mixed", precisions.detect_hardware()).policy
    return precision


def strip_for_inference(model: keras.Model) -> keras.Model:
    """Removes training-only state: pruning masks via `tfmp.pruning.strip` (a no-op copy for an
    unpruned model). New training-only wrappers get their strip call here."""
    return pruning.strip(model)


# ----------------------------------------------------------------------------- the graph
def _producers(value) -> list[str]:
    """Names of the layers whose outputs a serialized call argument holds (nested lists/dicts)."""
    if isinstance(value, dict):
        if value.get("class_name") == "__keras_tensor__":
            return [value["config"]["keras_history"][0]]
        return [name for item in value.values() for name in _producers(item)]
    if isinstance(value, (list, tuple)):
        return [name for item in value for name in _producers(item)]
    return []


def _graph(model: keras.Model) -> tuple[dict[str, list[list[str]]], set[str]]:
    """({layer name: one list of input-producing layer names per call}, names of output layers).

    A functional model's config lists every call of every layer; a Sequential chains its layers
    (one call each). Any other model gives ({}, set()): nothing is folded, and cloning it
    refuses with a UsageError."""
    if isinstance(model, keras.Sequential):
        names = [layer.name for layer in model.layers]
        calls = {name: [[previous]] for previous, name in zip(names, names[1:])}
        calls.update({name: [[]] for name in names[:1]})  # the first layer reads the input
        return calls, set(names[-1:])
    config = model.get_config()
    if "output_layers" not in config:
        return {}, set()
    calls = {
        layer["name"]: [
            sorted(set(_producers([node["args"], node["kwargs"]]))) for node in layer["inbound_nodes"]
        ]
        for layer in config["layers"]
    }
    return calls, set(_producers_of_outputs(config["output_layers"]))


def _producers_of_outputs(value) -> list[str]:
    """Layer names in a functional config's `output_layers` ([name, node, index] entries, nested)."""
    if isinstance(value, dict):
        return [name for item in value.values() for name in _producers_of_outputs(item)]
    if isinstance(value, (list, tuple)) and len(value) == 3 and isinstance(value[0], str):
        return [value[0]]
    return [name for item in value for name in _producers_of_outputs(item)]


def output_layer_names(model: keras.Model) -> set[str]:
    """Names of the layers that produce the model's outputs."""
    return _graph(model)[1]


def batch_norm_folds(model: keras.Model) -> dict[str, str]:
    """{batch-norm layer name: name of the conv/dense layer whose output only it reads}."""
    calls, outputs = _graph(model)
    readers: dict[str, int] = {}  # how many calls (and model outputs) read each layer's output
    for call_inputs in (inputs for layer_calls in calls.values() for inputs in layer_calls):
        for name in call_inputs:
            readers[name] = readers.get(name, 0) + 1
    for name in outputs:
        readers[name] = readers.get(name, 0) + 1
    folds = {}
    for layer in model.layers:
        layer_calls = calls.get(layer.name, [])
        if not isinstance(layer, keras.layers.BatchNormalization) or len(layer_calls) != 1:
            continue
        if len(layer_calls[0]) != 1:
            continue
        producer = model.get_layer(layer_calls[0][0])
        axis = layer.axis if isinstance(layer.axis, int) else None
        if (
            isinstance(producer, _FOLDABLE)
            and not producer.use_bias
            and producer.get_config().get("activation") == "linear"
            and len(calls.get(producer.name, [])) == 1
            and readers.get(producer.name) == 1
            and axis in (-1, len(layer.input.shape) - 1)
        ):
            folds[layer.name] = producer.name
    return folds


def _folded_weights(producer, batch_norm) -> list[np.ndarray]:
    """Kernel and bias of `producer` followed by `batch_norm` in inference mode, in float64."""
    value = lambda variable: np.asarray(variable.numpy(), np.float64)
    scale = 1.0 / np.sqrt(value(batch_norm.moving_variance) + batch_norm.epsilon)
    if batch_norm.scale:
        scale = scale * value(batch_norm.gamma)
    shift = -value(batch_norm.moving_mean) * scale
    if batch_norm.center:
        shift = shift + value(batch_norm.beta)
    kernel = value(producer.kernel) * scale  # output channels are the last axis
    return [kernel.astype(np.float32), shift.astype(np.float32)]


# ----------------------------------------------------------------------------- the copy
def inference_copy(
    model: keras.Model, precision: str, fold_batch_norms: bool = True, keep_float32_layers: bool = False
) -> keras.Model:
    """A functional copy for serving: BatchNorm folded, every layer in `precision`'s policy
    (float16/bfloat16: half variables, half compute), the softmax output in float32.
    `keep_float32_layers`: layers a half/mixed model runs in float32 on purpose (a detector's
    output convs) stay float32."""
    policy = layer_policy(precision)
    source_policies = [layer.dtype_policy.name for layer in model.layers if layer.weights]
    mostly_float32 = source_policies.count("float32") * 2 > len(source_policies)
    keep = {
        layer.name
        for layer in model.layers
        if keep_float32_layers and not mostly_float32 and layer.dtype_policy.name == "float32"
    }
    folds = batch_norm_folds(model) if fold_batch_norms else {}
    folded_producers = set(folds.values())
    output_layers = output_layer_names(model)

    def clone_layer(layer):
        config = layer.get_config()
        if layer.name in folds:  # the producer's new bias does the batch norm's work
            return FoldedBatchNorm(name=layer.name, dtype=policy)
        if layer.name in folded_producers:
            config["use_bias"] = True
        softmax_out = layer.name in output_layers and not layer.weights
        config["dtype"] = "float32" if softmax_out or layer.name in keep else policy
        return layer.__class__.from_config(config)

    try:
        copy = keras.models.clone_model(model, clone_function=clone_layer)
    except (TypeError, ValueError) as error:
        raise UsageError(
            f"model {model.name!r} cannot be copied for export (only functional and "
            f"sequential models can): {str(error).splitlines()[0]}"
        ) from None
    source_layers = {layer.name: layer for layer in model.layers}
    for layer in copy.layers:
        source = source_layers.get(layer.name)
        if source is None or layer.name in folds or not source.weights:
            continue
        if layer.name in folded_producers:
            batch_norm = next(source_layers[bn] for bn, producer in folds.items() if producer == layer.name)
            layer.set_weights(_folded_weights(source, batch_norm))
        else:
            layer.set_weights(source.get_weights())  # set_weights casts to the copy's dtype
    return copy
