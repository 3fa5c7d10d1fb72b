"""Model registry: build any tfmp model by name, and count its forward-pass FLOPs.

Provides:

* `MODELS` - a plain dict from registry name to builder function. Every builder has the
  signature `builder(input_shape, num_classes, dtype=None, name=...) -> keras.Model` and returns
  a functional Keras model that takes float32 images in [0, 1] and outputs float32 softmax
  probabilities.
* `build(name, input_shape, num_classes, dtype=None, **kwargs)` - look a builder up and call it
  with `name=name`, so every layer is called `f"{name}_..."`.
* `count_flops(model, batch_size=1)` - forward-pass floating-point operations of one batch.

Usage:

    import tfmp.models
    model = tfmp.models.build("resnet20", (32, 32, 3), 10, dtype="mixed_float16")
    forward_flops = tfmp.models.count_flops(model, batch_size=128)

`dtype` is a Keras dtype-policy name ("float32", "mixed_float16", "mixed_bfloat16") or None for
the current global policy. Builders never change the global policy; they pass the policy to each
layer, keep all variables in float32 and run the classifier head (`{name}_logits`,
`{name}_probs`) in float32.
"""

from __future__ import annotations

import functools
import inspect
import math

import keras

from tfmp import compat
from tfmp.errors import UsageError, unknown
from tfmp.models.cnn import lenet, seed_cnn
from tfmp.models.mlp import mnist_mlp
from tfmp.models.resnet import resnet50, resnet_cifar
from tfmp.models.vit import VIT_B16, VIT_TINY, vit

MODELS = {
    "seed_cnn": seed_cnn,
    "lenet": lenet,
    "mnist_mlp": mnist_mlp,
    "resnet20": functools.partial(resnet_cifar, depth=20),
    "resnet56": functools.partial(resnet_cifar, depth=56),
    "resnet50": resnet50,
    "vit_tiny": functools.partial(vit, **VIT_TINY),
    "vit_b16": functools.partial(vit, **VIT_B16),
}


def all_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """Every layer inside `model`, nested models' layers included (depth first, each once)."""
    found = []
    for layer in model.layers:
        if layer not in found:
            found.append(layer)
        if isinstance(layer, keras.Model):
            found += [inner for inner in all_layers(layer) if inner not in found]
    return found


def check_dtype_policy(dtype: str | None) -> None:
    """Refuses a dtype that is not a Keras policy name (None means the global policy)."""
    if dtype is not None:
        try:
            keras.dtype_policies.get(dtype)
        except ValueError as error:
            raise UsageError(f"bad dtype policy {dtype!r}: {error}") from None


def build(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    dtype: str | None = None,
    **kwargs,
) -> keras.Model:
    """Build the registered model `name`; `kwargs` are builder options such as `weight_decay`.

    Raises UsageError for an unknown name, an invalid dtype policy, or an option the model does
    not take (a config that sets `weight_decay` for `lenet` is a user mistake, not a TypeError
    traceback).
    """
    if name not in MODELS:
        raise unknown("model", name, MODELS)
    check_dtype_policy(dtype)
    builder = MODELS[name]
    parameters = inspect.signature(builder).parameters
    accepted = {key for key, param in parameters.items() if param.kind is param.KEYWORD_ONLY}
    # Options the registry entry fixes (resnet20's depth) are part of its identity, not knobs.
    accepted -= set(getattr(builder, "keywords", {}))
    rejected = sorted(set(kwargs) - accepted)
    if rejected:
        options = ", ".join(sorted(accepted)) or "none"
        raise UsageError(
            f"model {name!r} does not take option(s) {', '.join(rejected)}; its options: {options}"
        )
    return builder(tuple(input_shape), num_classes, dtype=dtype, name=name, **kwargs)


# Transposed, depthwise and separable convolutions are not subclasses of these, so they are
# (knowingly) not counted; no tfmp model uses them.
_COUNTED_LAYERS = (keras.layers.Dense, keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)


def count_flops(model: keras.Model, batch_size: int = 1) -> int:
    """Forward-pass FLOPs (multiply and add counted separately) for one batch of `batch_size`.

    Counted from the layer shapes: a convolution costs 2 * (output positions) * (kernel
    elements), i.e. 2*H_out*W_out*K*K*C_in*C_out for Conv2D, and a Dense layer 2*in*out per
    position. A MultiHeadAttention layer costs its four projections (2 * tokens * kernel
    elements each: query and output on the query's tokens, key and value on the value's) plus
    its two matmuls, scores = Q K^T and scores x V: 2 * heads * T_query * T_value * (key_dim +
    value_dim). Biases, normalizations, activations, the attention softmax, pooling, additions
    and the head's softmax are left out: a few percent of the arithmetic, and memory-bound.

    A training step (forward, gradient w.r.t. activations, gradient w.r.t. weights) costs about
    3x the forward pass, so achieved FLOP/s = 3 * count_flops(model, batch) * steps / seconds.
    Nested models are counted recursively. Needs every non-batch dimension to be known.
    """
    total = 0
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            total += count_flops(layer, batch_size=1)
        elif isinstance(layer, keras.layers.MultiHeadAttention):
            total += sum(_attention_flops(layer, inputs, output) for inputs, output in _calls(model, layer))
        elif isinstance(layer, _COUNTED_LAYERS):
            # A layer shared across calls (a detector's heads run on every pyramid level) costs
            # once per call of this model; calls from other models sharing it do not count.
            for _, output in _calls(model, layer):
                positions = _fixed_positions(layer, output)
                total += 2 * math.prod(positions) * math.prod(layer.kernel.shape)
    return total * batch_size


def _attention_flops(layer: keras.layers.MultiHeadAttention, inputs: list, output) -> int:
    """One call's FLOPs. The query's tokens are the output's; the value's come from the call's
    second tensor (`layer(query, value, ...)`, as Keras documents the call), the query's again
    when it has only one. With `attention_axes`, T is the product of the attended axes and the
    other axes multiply the count like a batch."""
    query_positions = _fixed_positions(layer, output)
    value = inputs[1] if len(inputs) > 1 else output
    value_positions = _fixed_positions(layer, value)
    rank = len(output.shape)
    axes = layer.attention_axes or tuple(range(1, rank - 1))
    axes = [axis % rank - 1 for axis in axes]  # into positions' indices (batch axis dropped)
    attended_value = math.prod(value_positions[axis] for axis in axes)
    projections = math.prod(query_positions) * (
        math.prod(layer.query_dense.kernel.shape) + math.prod(layer.output_dense.kernel.shape)
    ) + math.prod(value_positions) * (
        math.prod(layer.key_dense.kernel.shape) + math.prod(layer.value_dense.kernel.shape)
    )
    matmuls = (
        math.prod(query_positions) * attended_value * layer.num_heads * (layer.key_dim + layer.value_dim)
    )
    return 2 * (projections + matmuls)


def _fixed_positions(layer, tensor) -> tuple[int, ...]:
    """The tensor's shape without its batch and feature axes; UsageError if any is unknown."""
    positions = tuple(tensor.shape[1:-1])
    if any(size is None for size in positions):
        raise UsageError(
            f"count_flops needs a fixed input shape; layer {layer.name!r} has a tensor of shape {tensor.shape}"
        )
    return positions


def _calls(model: keras.Model, layer) -> list[tuple[list, object]]:
    """(input tensors, first output tensor) of each of the layer's calls inside `model`
    (Sequential, or any object with `.layers`: its one call)."""
    calls = compat.calls_in(model, layer)
    if calls is None:
        inputs = layer.input
        return [(list(inputs) if isinstance(inputs, (list, tuple)) else [inputs], layer.output)]
    return [(list(node.input_tensors), node.outputs[0]) for node in calls]
