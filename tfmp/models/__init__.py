"""Model registry: build any tfmp model by name, and count its forward-pass FLOPs.

Provides:

* `MODELS` - a plain dict from registry name to builder function. Every builder has the
  signature `builder(input_shape, num_classes, dtype=None, name=...) -> keras.Model` and returns
  a functional Keras model that takes float32 images in [0, 1] and outputs float32 softmax
  probabilities.
* `build(name, input_shape, num_classes, dtype=None, **kwargs)` - look a builder up and call it
  with `name=name`, so every layer is called `f"{name}_..."`.
* `count_flops(model, batch_size=1)` - forward-pass floating-point operations of one batch, of
  any Keras model (`tfmp.models.flops`).

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

import keras

from tfmp.errors import UsageError, unknown
from tfmp.models.cnn import lenet, seed_cnn
from tfmp.models.flops import count_flops as count_flops  # re-exported: tfmp.models.count_flops
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


def options(name: str) -> set[str]:
    """The builder options (keyword-only arguments) the registered model `name` takes."""
    builder = MODELS[name]
    parameters = inspect.signature(builder).parameters
    accepted = {key for key, param in parameters.items() if param.kind is param.KEYWORD_ONLY}
    # Options the registry entry fixes (resnet20's depth) are part of its identity, not knobs.
    return accepted - set(getattr(builder, "keywords", {}))


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
    accepted = options(name)
    rejected = sorted(set(kwargs) - accepted)
    if rejected:
        offered = ", ".join(sorted(accepted)) or "none"
        raise UsageError(
            f"model {name!r} does not take option(s) {', '.join(rejected)}; its options: {offered}"
        )
    return builder(tuple(input_shape), num_classes, dtype=dtype, name=name, **kwargs)
