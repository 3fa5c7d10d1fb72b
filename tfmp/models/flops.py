"""Forward-pass FLOPs of any Keras model: `count_flops(model, batch_size=1)`.

    from tfmp.models import count_flops
    forward_flops = count_flops(model, batch_size=128)   # a training step costs about 3x this

Multiply and add are counted separately. Two ways, one set of rules:

- From the layer shapes, for the layers whose arithmetic is known: Dense and Conv1D/2D/3D (2 x
  output positions x kernel elements, once per call of the layer in this model), and
  MultiHeadAttention and its subclasses (its four projections, plus the two matmuls scores =
  Q K^T and scores x V: 2 x heads x T_query x T_value x (key_dim + value_dim)). Nested models
  are walked the same way. Instant: nothing is traced.
- From the traced graph, for any other layer that holds a matrix-shaped weight: a user's own
  block, or a library's (keras-hub's ViTEncoder or TransformerEncoder call their Dense and
  attention layers inside `call`, where no layer graph records their shapes). The layer is
  called on each of its calls' arguments at batch 1 inside a `tf.function`, and the graph's
  MatMul, BatchMatMul, Einsum and convolution ops are counted from their static shapes by the
  same rules (a MatMul of (m, k) x (k, n) is 2 m k n, an Einsum 2 x its output x the sizes it
  sums over, a convolution 2 x its output x the filter's elements per output). So is a nested
  model whose own inputs leave a dimension open (keras-hub's BertBackbone takes any sequence
  length), called on the shapes of the model around it.

Biases, normalizations, activations, softmaxes, pooling, additions and gathers (embeddings) are
left out in both: a few percent of the arithmetic, and memory-bound. Transposed convolutions are
not counted (no tfmp model has one), nor one-operand einsums (transposes, reductions), nor ops
inside a traced loop's body (an RNN's while loop). Every non-batch dimension must be known
(UsageError naming the layer otherwise).
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from tfmp import compat
from tfmp.errors import UsageError

_SHAPED_LAYERS = (keras.layers.Dense, keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
_MATMULS = {
    "MatMul": "transpose_a",
    "BatchMatMul": "adj_x",
    "BatchMatMulV2": "adj_x",
    "BatchMatMulV3": "adj_x",
}
_CONVOLUTIONS = ("Conv2D", "Conv3D", "DepthwiseConv2dNative")  # Conv1D runs as a Conv2D


def count_flops(model: keras.Model, batch_size: int = 1) -> int:
    """Forward-pass FLOPs of one batch of `batch_size` (see the module docstring for the rules).

    `model` is a Keras model (functional, Sequential or nested), or any object with `.layers`.
    """
    total = 0
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            total += _nested_flops(model, layer)
        elif isinstance(layer, keras.layers.MultiHeadAttention):
            total += sum(_attention_flops(layer, inputs, output) for inputs, output in _calls(model, layer))
        elif isinstance(layer, _SHAPED_LAYERS):
            # A layer shared across calls (a detector's heads run on every pyramid level) costs
            # once per call of this model; calls from other models sharing it do not count.
            for _, output in _calls(model, layer):
                positions = _fixed_positions(layer, output)
                total += 2 * math.prod(positions) * math.prod(layer.kernel.shape)
        elif any(len(weight.shape) >= 2 for weight in layer.weights):
            total += sum(_traced_flops(layer, args, kwargs) for args, kwargs in _call_arguments(model, layer))
    return total * batch_size


def _nested_flops(model: keras.Model, nested: keras.Model) -> int:
    """A nested model's FLOPs: walked layer by layer when its own inputs fix every shape, else
    counted on the traced graph of its calls in `model` (keras-hub's BertBackbone takes any
    sequence length; the model around it fixes one)."""
    try:
        return count_flops(nested, batch_size=1)
    except UsageError:
        return sum(_traced_flops(nested, args, kwargs) for args, kwargs in _call_arguments(model, nested))


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
    """The tensor's shape without its batch and feature axes; UsageError if a non-batch axis is
    unknown."""
    _check_fixed(layer, tensor)
    return tuple(tensor.shape[1:-1])


def _check_fixed(layer, tensor) -> None:
    if any(size is None for size in tensor.shape[1:]):
        raise UsageError(
            f"count_flops needs a fixed input shape; layer {layer.name!r} has a tensor of shape "
            f"{tensor.shape}: build the model on keras.Input shapes without None past the batch axis"
        )


def _calls(model: keras.Model, layer) -> list[tuple[list, object]]:
    """(input tensors, first output tensor) of each of the layer's calls inside `model`
    (Sequential, or any object with `.layers`: its one call)."""
    calls = compat.calls_in(model, layer)
    if calls is None:
        inputs = layer.input
        return [(list(inputs) if isinstance(inputs, (list, tuple)) else [inputs], layer.output)]
    return [(list(node.input_tensors), node.outputs[0]) for node in calls]


def _call_arguments(model: keras.Model, layer) -> list[tuple[tuple, dict]]:
    """(args, kwargs) of each of the layer's calls inside `model`, symbolic tensors included
    (Sequential, or any object with `.layers`: its one call, on its input)."""
    calls = compat.calls_in(model, layer)
    if calls is None:
        return [((layer.input,), {})]
    return [compat.call_arguments(node) for node in calls]


def _traced_flops(layer, args: tuple, kwargs: dict) -> int:
    """FLOPs of `layer(*args, **kwargs)` at batch 1, counted on its traced graph."""
    symbolic = [value for value in keras.tree.flatten((args, kwargs)) if isinstance(value, keras.KerasTensor)]
    for tensor in symbolic:
        _check_fixed(layer, tensor)

    def call(*tensors):
        supply = iter(tensors)
        call_args, call_kwargs = keras.tree.map_structure(
            lambda value: next(supply) if isinstance(value, keras.KerasTensor) else value, (args, kwargs)
        )
        with tf.name_scope("count_flops"):  # a root scope may not start with "_"; a layer's name may
            return layer(*call_args, **call_kwargs)

    specs = [tf.TensorSpec((1, *tensor.shape[1:]), tensor.dtype) for tensor in symbolic]
    graph = tf.function(call).get_concrete_function(*specs).graph
    return sum(_op_flops(layer, op) for op in graph.get_operations())


def _op_flops(layer, op: tf.Operation) -> int:
    """One graph op's FLOPs by the module's rules; 0 for ops that are not counted."""
    einsum = op.type == "Einsum" and len(op.inputs) == 2
    if op.type not in _MATMULS and op.type not in _CONVOLUTIONS and not einsum:
        return 0
    output = op.outputs[0].shape
    if not output.is_fully_defined():
        raise UsageError(
            f"count_flops cannot count layer {layer.name!r}: its {op.type} {op.name!r} makes a "
            f"data-dependent shape {output}"
        )
    if op.type in _MATMULS:
        left = op.inputs[0].shape
        per_output = left[-2] if op.get_attr(_MATMULS[op.type]) else left[-1]
    elif einsum:
        per_output = math.prod(_summed_sizes(op))
    elif op.type == "DepthwiseConv2dNative":
        per_output = math.prod(op.inputs[1].shape[:2])  # each output channel sees one input channel
    else:
        per_output = math.prod(op.inputs[1].shape[:-1])  # the filter's window x input channels (per group)
    return 2 * math.prod(output) * per_output


def _summed_sizes(op: tf.Operation) -> list[int]:
    """The sizes of the labels an Einsum sums over (in an input, not in its output)."""
    inputs, output = op.get_attr("equation").decode().replace(" ", "").split("->")
    sizes = {}
    for labels, tensor in zip(inputs.split(","), op.inputs):
        shape = tensor.shape.as_list()
        head, _, tail = labels.partition("...")
        sizes.update(zip(head, shape[: len(head)]))
        sizes.update(zip(tail, shape[len(shape) - len(tail) :]))
    return [size for label, size in sizes.items() if label not in output]
