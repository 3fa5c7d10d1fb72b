"""A user's data for `tfmp.fit` / `tfmp.evaluate`, and every check that would otherwise fail
inside a step or after an epoch, made before anything is written.

    train = fit_inputs.of(x, y, None, batch_size, True, 0, None, "training data")
    check_data(model, strategy, train, validation)   # label types and values, shapes, the model's build

Labels are checked against the compiled loss where it says what it takes (class ids below the
output's width, 0..1 targets, numbers); `build_for_data` builds the model, its loss and metrics
symbolically for the data's spec, so a shape mismatch is one UsageError, not a traceback.
"""

from __future__ import annotations

import re

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmp import compat
from tfmp.errors import UsageError
from tfmp.training import fit_inputs, model_steps
from tfmp.training.fit_inputs import FitData, x_y_weight


def _label_rule(loss) -> tuple[str, str, object] | None:
    """(kind, loss name, ignore_class) of a Keras loss whose labels can be checked: "sparse"
    (class ids), "binary" (0..1) or "numeric" (any number); None for other losses."""
    if isinstance(loss, str):
        try:
            loss = keras.losses.get(loss)
        except ValueError:
            return None
    function = getattr(loss, "fn", loss)  # a Keras loss class wraps its function
    name = getattr(function, "__name__", type(loss).__name__)
    ignore_class = loss.get_config().get("ignore_class") if isinstance(loss, keras.losses.Loss) else None
    if function is keras.losses.sparse_categorical_crossentropy:
        return "sparse", name, ignore_class
    if function in (keras.losses.binary_crossentropy, keras.losses.binary_focal_crossentropy):
        return "binary", name, None
    if (getattr(function, "__module__", None) or "").startswith("keras."):
        return "numeric", name, None
    return None


def _output_widths(model: keras.Model, x_spec) -> dict:
    """{output key: last dimension} of the model's outputs for inputs `x_spec` ({"": width} for a
    single output); traced symbolically, so subclassed models are measured too."""
    try:
        inputs = tf.nest.map_structure(lambda spec: keras.KerasTensor(spec.shape, spec.dtype.name), x_spec)
        output = model.compute_output_spec(inputs)
    except Exception:  # noqa: BLE001 - only the label check's upper bound depends on it
        return {}
    width = lambda tensor: tensor.shape[-1] if len(tensor.shape) > 1 else None  # noqa: E731
    if isinstance(output, dict):
        return {key: width(tensor) for key, tensor in output.items()}
    outputs = list(output) if isinstance(output, (list, tuple)) else [output]
    names = getattr(model, "output_names", None) if len(outputs) > 1 else None
    return dict(zip(names or [""], map(width, outputs)))


def _labelled_outputs(model: keras.Model, y, widths: dict) -> list[tuple[str, tuple, object, int | None]]:
    """(output key, label rule, labels, output width) of each output whose compiled loss is a
    checkable Keras loss and whose labels pair up with it plainly (by key or position)."""
    loss = model.loss
    if isinstance(loss, dict) and isinstance(y, dict):
        pairs = [(key, loss[key], y.get(key)) for key in loss]
    elif isinstance(loss, (list, tuple)) and isinstance(y, (list, tuple)) and len(loss) == len(y):
        names = list(getattr(model, "output_names", None) or [])
        keys = names if len(names) == len(loss) else [str(index) for index in range(len(loss))]
        pairs = list(zip(keys, loss, y))
    elif not isinstance(loss, (dict, list, tuple)) and not isinstance(y, (dict, list, tuple)):
        pairs = [(next(iter(widths), ""), loss, y)]
    else:
        return []
    found = []
    for key, item, labels in pairs:
        rule = _label_rule(item)
        if labels is not None and rule is not None:
            found.append((key, rule, labels, widths.get(key)))
    return found


def check_label_types(model: keras.Model, data: FitData) -> None:
    """String labels for a Keras loss (TF would fail inside the first step): one line, the fix."""
    y = x_y_weight(data.element_spec)[1]
    for key, (_, name, _), labels, _ in _labelled_outputs(model, y, {}):
        if any(spec.dtype == tf.string for spec in tf.nest.flatten(labels)):
            where = f" for output {key!r}" if key else ""
            raise UsageError(
                f"{data.what}: the labels{where} are strings; {name} needs numbers: map each class "
                "name to an id 0..N-1 first, e.g. with keras.layers.StringLookup(num_oov_indices=0)"
            )


def check_label_values(model: keras.Model, data: FitData) -> None:
    """Labels a Keras loss cannot take (a class id past the output's units, a negative id, a
    binary target outside [0, 1]), found in `data.sample()` before any step runs."""
    sample = data.sample()
    if not sample or sample[1] is None:
        return
    widths = _output_widths(model, x_y_weight(data.element_spec)[0])
    for key, (kind, name, ignore_class), labels, width in _labelled_outputs(model, sample[1], widths):
        try:
            values = np.asarray(labels)
        except (ValueError, TypeError):  # ragged labels: not checked
            continue
        if values.dtype.kind not in "biuf" or kind == "numeric":
            continue
        values = values.ravel().astype(np.float64)
        checked = values[values != ignore_class] if ignore_class is not None else values
        if kind == "sparse":
            high = width if width else np.inf
            wrong = checked[(checked != np.floor(checked)) | (checked < 0) | (checked >= high)]
        else:
            wrong = checked[~((checked >= 0) & (checked <= 1))]
        if wrong.size:
            where = f" for output {key!r}" if key else ""
            raise UsageError(
                f"{data.what}: label {wrong[0]:g}{where} ({wrong.size} of {values.size} checked) "
                + _label_fix(kind, name, float(wrong[0]), width, model.name)
            )


def _label_fix(kind: str, name: str, value: float, width: int | None, model_name: str) -> str:
    if kind == "binary":
        return f"is outside [0, 1]: {name} takes 0/1 targets or probabilities; map the labels to 0 and 1"
    ids = f"class ids 0..{width - 1}" if width else "class ids from 0"
    if value != np.floor(value):
        return f"is not a whole number: {name} takes {ids}; map the labels to class ids"
    if value < 0:
        return (
            f"is negative: {name} takes {ids}; fix the labels, or pass ignore_class={value:g} "
            "to the loss to leave such rows out"
        )
    return (
        f"is out of range for the {width}-unit output of model {model_name!r}: {name} takes {ids}; "
        f"fix the labels, or give the output {int(value) + 1} units"
    )


def _same_shapes(specs, others) -> bool:
    """Same structure and dtypes, and shapes that agree past the batch dimension."""
    try:
        tf.nest.assert_same_structure(specs, others)
    except (ValueError, TypeError):
        return False
    return all(
        spec.dtype == other.dtype
        and spec.shape.rank == other.shape.rank
        and spec.shape[1:].is_compatible_with(other.shape[1:])
        for spec, other in zip(tf.nest.flatten(specs), tf.nest.flatten(others))
    )


def _check_validation_fits(model: keras.Model, train: FitData, validation: FitData) -> None:
    """Validation batches run through the model and its loss (else they fail after an epoch).

    Batches shaped like the training data's fit; others are traced through the model and the
    compiled loss (a graph is built, nothing is computed), which finds what does not fit."""
    x, y, sample_weight = x_y_weight(validation.element_spec)
    if _same_shapes(x_y_weight(train.element_spec)[:2], (x, y)):
        return

    def loss(x, y, sample_weight):
        y_pred = model(x, training=False)
        return model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False)

    try:
        tf.function(loss, autograph=False).get_concrete_function(x, y, sample_weight)
    except (ValueError, TypeError) as error:
        shapes = lambda spec: tf.nest.map_structure(lambda s: tuple(s.shape), spec[:2])  # noqa: E731
        raise UsageError(
            f"validation_data do not fit model {model.name!r} ({_error_line(error)}); validation (x, y) "
            f"{shapes((x, y))} vs training {shapes(x_y_weight(train.element_spec))}: "
            "give validation_data the training data's shapes"
        ) from None


def _error_line(error: Exception) -> str:
    """The line of a Keras/TF error that says what is wrong (Keras wraps it in a header, bold
    escape codes and the call's arguments)."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(error).splitlines()]
    lines = lines[: next((i for i, line in enumerate(lines) if line.startswith("Arguments received")), None)]
    useful = [line for line in lines if line and not line.startswith("Exception encountered when calling")]
    return (useful or [type(error).__name__])[0][:300]


def build_for_data(model: keras.Model, strategy, element_spec, deferred: bool = False) -> None:
    """Builds the model, compiled loss and metrics for this data; shape mismatches are user errors.
    With `deferred` (the model runs its own step, which may build what it needs, e.g. a GAN with
    no `call`) a model Keras cannot build from the data is left to its step, as `model.fit` leaves
    it without a strategy."""
    optimizer = getattr(model, "optimizer", None)
    variables = model.trainable_variables
    if optimizer is not None and not optimizer.built and variables:
        # Slots beside their variables: in the scope the optimizer was made in, which for a
        # pipeline per worker is none (Keras' build below would make them in `strategy`'s).
        with compat.optimizer_strategy(optimizer).scope():
            optimizer.build(variables)
    try:
        with strategy.scope():
            compat.symbolic_build(model, element_spec)
    except (ValueError, TypeError, RuntimeError) as error:
        if deferred:
            logging.info("model %r is built by its own step (%s)", model.name, _error_line(error))
            return
        raise UsageError(
            f"the data do not fit model {model.name!r} ({_error_line(error)}); inputs "
            f"{[tuple(i.shape) for i in model.inputs] if hasattr(model, 'inputs') else '?'} "
            f"vs data {tf.nest.map_structure(lambda s: tuple(s.shape), element_spec)}"
        ) from None


def steps_per_epoch_of(train: FitData, steps_per_epoch: int | None, multi_worker: bool) -> int:
    """The epoch's length: `steps_per_epoch`, else one pass of the data (counted once when the
    data do not say, as Keras learns it in the first epoch)."""
    if train.kind in ("PyDataset", "generator") and multi_worker:
        raise UsageError(
            f"{train.what}: a {train.kind} runs in each worker's process and every worker would read all "
            "of it; give tfmp.fit a tf.data.Dataset (e.g. from_tensor_slices of the arrays, or files "
            "each worker shards) under several workers"
        )
    if steps_per_epoch:
        return steps_per_epoch
    if train.infinite:
        raise UsageError(f"{train.what}: the dataset is endless; pass steps_per_epoch=")
    if train.batches is None and not train.repeatable:
        raise UsageError(
            f"{train.what}: a Python generator has no length and is read once; pass steps_per_epoch= "
            "(with a generator that loops: `while True: ... yield`)"
        )
    if train.batches is None:
        train.batches = int(train.dataset(0).reduce(np.int64(0), lambda count, _: count + 1))
        logging.info("%s: %d batches per pass (counted: the dataset does not say)", train.what, train.batches)
    if train.batches == 0:
        raise UsageError(f"{train.what}: the data are empty")
    return train.batches


def check_data(model: keras.Model, strategy, train: FitData, validation: FitData | None) -> None:
    """Everything about the data that would otherwise fail inside a step, or after an epoch (a
    model's own train_step and test_step are traced on the data by `Engine.own.prepare`)."""
    own = model_steps.overridden(model)
    check_label_types(model, train)
    build_for_data(model, strategy, train.element_spec, deferred="train_step" in own)
    check_label_values(model, train)
    if validation is not None:
        if validation.batches == 0:
            raise UsageError(f"{validation.what}: the data are empty")
        check_label_types(model, validation)
        if "test_step" not in own:
            _check_validation_fits(model, train, validation)
        check_label_values(model, validation)


def validation_data_of(validation_data, batch_size: int, preprocess=None) -> FitData:
    """Keras' `validation_data`: a dataset, a PyDataset, a generator, or (x, y[, sample_weight]);
    `preprocess` as `fit_inputs.of` takes it."""
    what = "validation data"
    if fit_inputs.is_stream(validation_data):
        return fit_inputs.of(validation_data, None, None, None, False, 0, None, what, preprocess=preprocess)
    if not isinstance(validation_data, (tuple, list)) or len(validation_data) not in (2, 3):
        raise UsageError(
            "validation_data must be a tf.data.Dataset, a PyDataset, a generator or a tuple (x, y[, sample_weight])"
        )
    x, y, sample_weight = (tuple(validation_data) + (None,))[:3]
    return fit_inputs.of(x, y, sample_weight, batch_size, False, 0, None, what, preprocess=preprocess)
