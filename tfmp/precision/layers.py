"""Copies of a Keras model whose chosen layers compute in another precision, weights copied.

    from tfmp import precision
    with strategy.scope():                       # the scope the model was built in, if any
        model = precision.float32_layers(model, ["seed_cnn_dense", "seed_cnn_conv[23]"])
        model.compile(...)                       # a copy is not compiled
    tfmp.fit(model, dataset)

What `--float32_layers=REGEX[,REGEX]` does in the apps and what the precision doctor recommends.
A pattern is a Python regular expression that must match a layer's *whole* name (so
`seed_cnn_conv1` does not also pick `seed_cnn_conv10`); a pattern matching no layer is a
`UsageError` naming it and listing some layer names. The copy is made with
`keras.models.clone_model`: every layer is rebuilt from its config, the matching ones with the
dtype policy "float32", and each layer's weights (trainable or not) are copied from the original.
Works for functional and Sequential models (nested models are one layer each: a match makes the
whole nested model float32); subclassed models have no graph to rewrite and are refused.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import keras

from tfmp.errors import UsageError

PolicyFor = Callable[[keras.layers.Layer], "str | None"]  # layer -> new policy name, None: keep


def layer_names(model: keras.Model) -> list[str]:
    """The names of a model's top-level layers, inputs left out, in graph order."""
    return [layer.name for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]


def matching_layers(model: keras.Model, patterns: str | Iterable[str]) -> list[str]:
    """The layer names some pattern fully matches, in graph order; every pattern must match one.

    A single string is one pattern (not one pattern per character)."""
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    names = layer_names(model)
    regexes = []
    for pattern in patterns:
        try:
            regex = re.compile(pattern)
        except re.error as error:
            raise UsageError(
                f"float32 layer pattern {pattern!r} is not a regular expression ({error}); "
                "give layer names or regexes such as 'seed_cnn_conv[12]'"
            ) from None
        if not any(regex.fullmatch(name) for name in names):
            shown = ", ".join(names[:6]) + (f", ... ({len(names)} layers)" if len(names) > 6 else "")
            raise UsageError(
                f"float32 layer pattern {pattern!r} matches no layer of model {model.name!r} "
                f"(a pattern must match a whole name); its layers: {shown}"
            )
        regexes.append(regex)
    return [name for name in names if any(regex.fullmatch(name) for regex in regexes)]


def with_policy(layer: keras.layers.Layer, policy: str | None) -> keras.layers.Layer:
    """A new, unbuilt layer from `layer`'s config computing in `policy` (None: the same policy)."""
    if isinstance(layer, keras.Model):
        # A nested model has no `dtype` in its config: rebuild each of its layers instead.
        return clone_with_policies(layer, lambda inner: policy, copy=False)
    config = layer.get_config()
    if policy is not None:
        config["dtype"] = policy
    try:
        return layer.__class__.from_config(config)
    except (TypeError, ValueError) as error:
        raise UsageError(
            f"layer {layer.name!r} ({type(layer).__name__}) cannot be rebuilt from its config "
            f"({error}); give the layer class a get_config() that lists every constructor argument"
        ) from None


def copy_weights(source: keras.Model, target: keras.Model) -> None:
    """Copies every top-level layer's weights from `source` to the same-named layer of `target`."""
    for layer in source.layers:
        if layer.weights:
            target.get_layer(layer.name).set_weights(layer.get_weights())


def clone_with_policies(
    model: keras.Model, policy_for: PolicyFor, *, copy: bool = True, call_function=None
) -> keras.Model:
    """A copy of `model` whose layers compute in `policy_for(layer)` (None keeps the layer's).

    `copy` copies the weights; `call_function` is `keras.models.clone_model`'s hook. The copy keeps
    the model's own dtype policy, which decides whether `compile` adds loss scaling.
    """
    if not isinstance(model, keras.Sequential) and not hasattr(model, "operations"):
        raise UsageError(
            f"model {model.name!r} is a subclassed {type(model).__name__}: only functional and "
            "Sequential models have a layer graph to rebuild with other precisions"
        )
    try:
        clone = keras.models.clone_model(
            model,
            clone_function=lambda layer: with_policy(layer, policy_for(layer)),
            call_function=call_function,
        )
    except ValueError as error:
        if "subclass" in str(error).lower() or "only supported" in str(error):
            raise UsageError(f"model {model.name!r} cannot be cloned: {error}") from None
        raise
    clone.dtype_policy = model.dtype_policy
    if copy:
        copy_weights(model, clone)
    return clone


def float32_layers(model: keras.Model, patterns: str | Iterable[str]) -> keras.Model:
    """A copy of `model` (weights copied, not compiled) whose layers matching `patterns` (a list
    of patterns, or one as a string) compute in float32; call it in the model's strategy scope
    and compile the copy."""
    names = set(matching_layers(model, patterns))
    return clone_with_policies(model, lambda layer: "float32" if layer.name in names else None)
