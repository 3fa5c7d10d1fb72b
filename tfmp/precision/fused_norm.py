"""BatchNormalization on TensorFlow's fused kernel, GroupNormalization, LayerNormalization,
RMSNormalization and MultiHeadAttention's softmax on kernels of tfmp's, in place: half precision
stays half.

    from tfmp.precision.fused_norm import fuse_normalization
    result = fuse_normalization(model)      # any built keras.Model: functional, Sequential, nested
    result.fused                            # ("resnet/conv1_bn", ...) now on the fused kernels
    result.left_alone                       # (("resnet/head_bn", "2-D input"), ...)

Every normalization and attention layer of the model is listed, fused or left alone with the
reason: Keras' classes (and their subclasses) by type, and any other layer whose class name says
normalization or attention (keras-hub's `RMSNormalization`, `keras.layers.UnitNormalization`,
`GroupQueryAttention`, ...) and that holds no such layer itself, by name, left alone as a
computation tfmp does not know.

Why: Keras 3.15's `BatchNormalization.call` casts a float16/bfloat16 input to float32
(keras/src/layers/normalization/batch_normalization.py:348) and normalises with separate
element-wise ops (backend/tensorflow/nn.py:1492 `moments`, :1551 `batch_normalization`), so the
backward pass keeps float32 copies of every normalised activation and mixed precision can hold
more memory than float32. `FusedBatchNormV3` (oneDNN or Eigen on CPU, cuDNN on GPU, its own
lowering under XLA) reads and writes the activation in its own dtype, keeps float32 statistics,
and its gradient needs only the input and two per-channel vectors.

GroupNormalization (Keras 3.15's likewise casts half precision to float32 and normalises with
separate ops: group_normalization.py `_apply_normalization`) goes to
`tfmp.precision.group_norm`: float32 statistics per (example, group), the output rounded to the
input's dtype once, and a hand-written gradient that recomputes from the input in its own dtype
and two float32 numbers per (example, group), both passes XLA-compiled kernels. Left alone
there: axes other than the last (channels-first), float64, subclasses that override `call`,
layers not built yet. Keras' layer takes no mask and no `training`: neither does the fused one.

What changes: each fusable layer's `call` is replaced on that instance (an instance attribute,
never its class), so the layer objects, variables, names, weights, `get_config()` and the
`.keras`/checkpoint files stay exactly Keras' own: a saved model loads in plain Keras (unfused,
same outputs within rounding), and a clone or a loaded copy is unfused until fused again. The
numbers are Keras' within the dtype's rounding: batch statistics in training (the kernel's
Bessel-corrected variance converted back to Keras' biased one for the moving variance), moving
statistics in inference and for a frozen layer (`trainable=False`), the same moving-average
update, `momentum`, `epsilon`, `center`, `scale`. A call with a mask runs Keras' own `call`.

LayerNormalization (`rms_scaling=True` too) and RMSNormalization go to
`tfmp.precision.layer_norm` (float32 statistics per normalised row, one rounding, a hand-written
gradient that keeps the half-precision input and two float32 numbers per row; why not tf.keras
2's FusedBatchNormV3 reshape: that module's docstring). Left alone there: axes other than the
trailing ones, float64, subclasses that override `call`, layers not built yet.

MultiHeadAttention's attention core goes to `tfmp.precision.attention` (the softmax in float32
as Keras computes it, the probabilities the backward pass keeps in the compute dtype): its
`_compute_attention`, Keras' documented hook, is replaced on the instance instead of `call`.
Left alone there: `dropout` > 0 and attention over several axes (Keras' explicit path already
keeps half-precision probabilities), subclasses that override `_compute_attention`, or override
`call` with one that does not go through `_compute_attention` (XLNet's
`TwoStreamRelativeAttention`), `flash_attention=True`, float64, layers not built. A subclass
that overrides only `call`, with a `call` that does go through it, is fused (keras-hub's
`CachedMultiHeadAttention`: `tfmp.precision.attention` says why that is exact).

Keras' convolution layers that compute in float16 (and only those: others are neither changed
nor listed) go to `tfmp.precision.conv`: on a CPU their gradients are computed from float32
copies (TensorFlow's float16 filter gradient runs on oneDNN's reference kernel there, ~100-1000x
slower); on a GPU Keras' own op runs. Left alone there: subclasses that override `call` or
`convolution_op`, layers not built.

`Dense(activation="gelu")` (also keras-hub's `gelu_approximate`) and `Activation("gelu")` go to
`tfmp.precision.activation` in every precision: the bias-add and GELU in one float32 kernel with a
gradient that keeps only the input (Keras' `tf.nn.gelu` keeps three more tensors of its size). In
float16 on a CPU every Dense with a bias and an activation goes there too (Grappler would fold its
MatMul, bias and activation into a `_FusedMatMul` that oneDNN runs on its float16 reference
kernel). Left alone there: subclasses that override `call`, float64, quantized Dense layers.

keras-hub (0.32): `ViTBackbone` and `BertBackbone` build Keras' own `LayerNormalization` and
`MultiHeadAttention` inside their blocks (`ViTEncoderBlock`, `TransformerEncoder`): fused, found
through the blocks' attributes. keras-hub's own normalization layers are plain `keras.layers.Layer`
subclasses with their own `call` (`keras_hub.layers.RMSNormalization`, `LlamaLayerNorm`,
`T5LayerNorm`, Gemma's `RMSNormalization`, ...): listed by name, left alone.

Left alone, with the reason: other ranks than 4, axes other than channels-last or channels-first
(NCHW runs in the kernel itself: on CPU it transposes internally, cuDNN takes it natively),
`synchronized=True`, `renorm=True`, float64, subclasses that override `call`, layers not built
yet, and on ROCm builds epsilon < 1.001e-5 (MIOpen's minimum; cuDNN >= 7.5's is 0).

The route depends on (Keras 3.15.1 / TensorFlow 2.21):
- `Operation.__call__` calling `self.call`, an ordinary attribute lookup that finds the
  instance's before the class's (keras/src/ops/operation.py:58 and :81; `Layer.stateless_call`
  and remat likewise, layers/layer.py:1184-1188);
- `Layer.__init__` caching `inspect.signature(self.call)` (layers/layer.py:317): each fused call
  has its class's exact signature (BatchNormalization `(inputs, training=None, mask=None)`,
  GroupNormalization `(inputs)`);
- `BatchNormalization`'s attributes `axis`, `epsilon`, `momentum`, `center`, `scale`,
  `synchronized`, `renorm`, `gamma`, `beta`, `moving_mean`, `moving_variance`, `input_spec`;
- `tf.compat.v1.nn.fused_batch_norm` (FusedBatchNormV3) returning, in training, the batch mean
  and the variance times n / max(n - 1, 1) (fused_batch_norm_op.cc; the same under XLA);
- `GroupNormalization`'s attributes `groups` (-1 resolved to the channel count by `build`),
  `axis`, `epsilon`, `center`, `scale`, `gamma`, `beta`, `input_spec`, and its `autocast=False`
  (the input arrives in its own dtype; the output is cast to the compute dtype).
"""

from __future__ import annotations

import dataclasses
import re
import types

import keras
import tensorflow as tf

from tfmp import compat
from tfmp.errors import UsageError
from tfmp.precision import activation, attention, conv, group_norm, layer_norm

FUSED_DTYPES = ("float16", "bfloat16", "float32")
# MIOpen (ROCm) refuses epsilon below 1e-5, and a float32 1e-5 is just below that.
ROCM_MIN_EPSILON = 1.001e-5
# The Keras classes fuse_normalization computes (each with its subclasses).
FUSABLE = (
    keras.layers.BatchNormalization,
    keras.layers.GroupNormalization,
    keras.layers.LayerNormalization,
    keras.layers.RMSNormalization,
    keras.layers.MultiHeadAttention,
)
# Other layers listed (left alone) by their class name: keras-hub's normalization layers,
# keras.layers.UnitNormalization, GroupQueryAttention, ...
LISTED_BY_NAME = re.compile("Norm|Attention")


@dataclasses.dataclass(frozen=True)
class FusedNormalization:
    """What `fuse_normalization` did: layer paths ("model/block/bn") fused, and left alone."""

    fused: tuple[str, ...]
    left_alone: tuple[tuple[str, str], ...]  # (path, reason)


def fuse_normalization(model) -> FusedNormalization:
    """Makes every BatchNormalization, GroupNormalization, LayerNormalization, RMSNormalization
    and MultiHeadAttention in `model` that the fused kernels can compute use them, in place, from
    the next call (re-trace a `tf.function` that already traced the model).

    Each layer is listed once, by the first path that reaches it; fusing twice changes nothing.
    """
    if not isinstance(model, keras.Model):
        raise UsageError(
            f"fuse_normalization takes a keras.Model, got {type(model).__name__} {model!r:.80}; "
            "build the model first and pass the model object"
        )
    fused, left_alone = [], []
    for path, layer in _norms(model):
        reason = unfusable_reason(layer)
        if reason is not None:
            left_alone.append((path, reason))
            continue
        if not is_fused(layer):
            # A bound method in the instance's __dict__: Operation.__call__ finds it before the
            # class's. Copies (deepcopy, clone_model, load_model) go through the config: unfused.
            setattr(layer, _replaced(layer), types.MethodType(_fused_call_of(layer), layer))
        fused.append(path)
    return FusedNormalization(tuple(fused), tuple(left_alone))


def unfused(model: keras.Model) -> tuple[str, ...]:
    """Paths of the normalization and attention layers `fuse_normalization` would fuse and has not."""
    return tuple(
        path for path, layer in _norms(model) if unfusable_reason(layer) is None and not is_fused(layer)
    )


def status(model: keras.Model) -> FusedNormalization:
    """What is fused in `model` now, and what `fuse_normalization` leaves alone (changes nothing)."""
    layers = list(_norms(model))
    return FusedNormalization(
        tuple(path for path, layer in layers if is_fused(layer)),
        tuple(
            (path, unfusable_reason(layer)) for path, layer in layers if unfusable_reason(layer) is not None
        ),
    )


def is_fused(layer) -> bool:
    """Whether `layer` runs `fuse_normalization`'s fused call."""
    call = vars(layer).get(_replaced(layer))
    return getattr(call, "__func__", None) is _fused_call_of(layer)


def _replaced(layer) -> str:
    """The method fusing replaces on the instance: MultiHeadAttention keeps Keras' `call`."""
    return compat.ATTENTION_CORE if isinstance(layer, keras.layers.MultiHeadAttention) else "call"


def _fused_call_of(layer):
    if isinstance(layer, conv.CLASSES):
        return conv.fused_call
    if isinstance(layer, (keras.layers.Dense, keras.layers.Activation)):
        return activation.fused_call_of(layer)
    if isinstance(layer, keras.layers.GroupNormalization):
        return group_norm.fused_call
    if isinstance(layer, (keras.layers.LayerNormalization, keras.layers.RMSNormalization)):
        return layer_norm.fused_call
    if isinstance(layer, keras.layers.MultiHeadAttention):
        return attention.fused_compute_attention
    return _fused_call


def unfusable_reason(layer) -> str | None:
    """Why the fused kernel cannot stand in for this normalization or attention layer, or None
    if it can."""
    if isinstance(layer, conv.CLASSES):
        if not conv.listed(layer):
            return f"compute dtype {layer.compute_dtype}: only float16 convolutions are changed"
        return _already_replaced(layer) or conv.unfusable_reason(layer)
    if isinstance(layer, (keras.layers.Dense, keras.layers.Activation)):
        if not activation.listed(layer):
            return "no GELU (nor float16 with a bias and an activation on a CPU): nothing to fuse"
        return _already_replaced(layer) or activation.unfusable_reason(layer)
    if not isinstance(layer, FUSABLE):
        return f"{type(layer).__module__}.{type(layer).__qualname__}: not a layer tfmp fuses (its own computation)"
    if _already_replaced(layer):
        return _already_replaced(layer)
    if isinstance(layer, keras.layers.GroupNormalization):
        return group_norm.unfusable_reason(layer)
    if isinstance(layer, (keras.layers.LayerNormalization, keras.layers.RMSNormalization)):
        return layer_norm.unfusable_reason(layer)
    if isinstance(layer, keras.layers.MultiHeadAttention):
        return attention.unfusable_reason(layer)
    if type(layer).call is not keras.layers.BatchNormalization.call:
        return f"{type(layer).__name__} overrides call"
    if layer.synchronized:
        return "synchronized=True (cross-replica statistics)"
    if layer.renorm:
        return "renorm=True"
    if not layer.built or layer.input_spec is None or layer.input_spec.ndim is None:
        return "not built: call or build the model first"
    if layer.input_spec.ndim != 4:
        return f"{layer.input_spec.ndim}-D input"
    if layer.axis % 4 not in (1, 3):
        return f"axis {layer.axis} (the kernel normalises axis 1 or 3 of a 4-D input)"
    if layer.compute_dtype not in FUSED_DTYPES:
        return f"compute dtype {layer.compute_dtype}"
    if tf.test.is_built_with_rocm() and layer.epsilon < ROCM_MIN_EPSILON:
        return f"epsilon {layer.epsilon:g} below ROCm's fused minimum {ROCM_MIN_EPSILON:g}"
    return None


def _already_replaced(layer) -> str | None:
    if _replaced(layer) in vars(layer) and not is_fused(layer):
        return f"its {_replaced(layer)} was already replaced on the instance"
    return None


def _norms(layer, path=None, seen=None):
    """(path, layer) for each distinct normalization or attention layer reachable from `layer`
    (FUSABLE's classes, and layers without sublayers named like one), in order."""
    path, seen = path or layer.name, seen or {id(layer)}
    for child in _sublayers(layer):
        if id(child) in seen:
            continue
        seen.add(id(child))
        child_path = f"{path}/{child.name}"
        if _computed_here(child) or (
            LISTED_BY_NAME.search(type(child).__name__) and not any(map(_listed, _sublayers(child)))
        ):
            yield child_path, child
        yield from _norms(child, child_path, seen)


def _computed_here(layer) -> bool:
    """Whether `layer` is one tfmp has a kernel for: FUSABLE's classes, float16 convolutions,
    GELU layers (and float16 Dense layers with a bias and an activation on a CPU)."""
    return isinstance(layer, FUSABLE) or conv.listed(layer) or activation.listed(layer)


def _listed(layer) -> bool:
    """Whether `layer` or a layer inside it is one `_norms` lists (a block named "...Attention"
    that holds a MultiHeadAttention is not listed itself: its attention layer is)."""
    if _computed_here(layer) or LISTED_BY_NAME.search(type(layer).__name__):
        return True
    return any(map(_listed, _sublayers(layer)))


def _sublayers(layer) -> list:
    """A model's `layers`; for any other layer, the layers its attributes hold (a block's
    `self.bn`, a wrapper's `self.layer`, lists and dicts of them): Keras has no public
    sub-layer list for plain layers."""
    if isinstance(layer, keras.Model):
        return list(layer.layers)
    found = []
    for value in vars(layer).values():
        if isinstance(value, dict):
            value = list(value.values())
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, keras.layers.Layer):
                found.append(item)
    return found


def _float32(variable) -> tf.Tensor:
    return tf.cast(variable.value, tf.float32)


def _fused_call(self, inputs, training=None, mask=None):
    """`BatchNormalization.call` (same signature and semantics) on FusedBatchNormV3."""
    if mask is not None or inputs.dtype.name not in FUSED_DTYPES:
        # Masked statistics have no fused kernel: Keras' own computation, as before fusing.
        return keras.layers.BatchNormalization.call(self, inputs, training=training, mask=mask)
    data_format = "NHWC" if self.axis % 4 == 3 else "NCHW"
    channels = inputs.shape[self.axis]
    scale = _float32(self.gamma) if self.scale else tf.ones([channels], tf.float32)
    offset = _float32(self.beta) if self.center else tf.zeros([channels], tf.float32)
    # As Keras: a frozen layer (trainable=False) normalises with its moving statistics.
    if training and self.trainable:
        outputs, mean, unbiased_variance = tf.compat.v1.nn.fused_batch_norm(
            inputs, scale, offset, epsilon=self.epsilon, data_format=data_format, is_training=True
        )
        # The kernel's variance output carries Bessel's correction n / max(n - 1, 1); Keras
        # averages the biased batch variance into moving_variance.
        count = tf.cast(tf.size(inputs, out_type=tf.int64) // channels, tf.float32)
        variance = unbiased_variance * (tf.maximum(count - 1.0, 1.0) / count)
        # Keras' update, term for term (batch_normalization.py:385).
        self.moving_mean.assign(_float32(self.moving_mean) * self.momentum + mean * (1.0 - self.momentum))
        self.moving_variance.assign(
            _float32(self.moving_variance) * self.momentum + variance * (1.0 - self.momentum)
        )
    else:
        outputs, _, _ = tf.compat.v1.nn.fused_batch_norm(
            inputs,
            scale,
            offset,
            mean=_float32(self.moving_mean),
            variance=_float32(self.moving_variance),
            epsilon=self.epsilon,
            data_format=data_format,
            is_training=False,
        )
    return tf.cast(outputs, self.compute_dtype)
