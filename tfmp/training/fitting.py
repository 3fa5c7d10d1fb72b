"""`tfmp.fit` and `tfmp.evaluate`: train a user's compiled Keras model the way tfmp's apps train.

    strategy = tfmp.distribute.strategies.get_strategy("auto")     # or tf.distribute.MirroredStrategy(), ...
    with strategy.scope():
        model = keras.Sequential([...])                   # logits, several outputs, anything
        model.compile(keras.optimizers.SGD(0.01),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    history = tfmp.fit(model, dataset, epochs=3, validation_data=val_dataset, model_dir="runs/a")
    tfmp.evaluate(model, val_dataset)                     # {"loss": ..., "accuracy": ...}

Works under every strategy, precision and XLA setting, including MultiWorkerMirroredStrategy
(where Keras 3.15's `model.fit` fails) and XLA under MirroredStrategy (where
`compile(jit_compile=True)` fails). The same script runs on one device, on N replicas, and on
N workers started by `python -m tfmp.launch --workers=N -- python my_train.py`.

Data: a `tf.data.Dataset` of `(x, y)` or `(x, y, sample_weight)` batched with the *global*
batch size, or NumPy arrays with `batch_size` (also global). tfmp distributes it over the
strategy's replicas and workers. Numbers equal `model.fit`'s on one device for the same batches:
same loss (the compiled loss, every output, `loss_weights`, sample weights, regularisers),
same metrics, over the whole global batch.

Mixed precision: a model that computes in float16 trains with tfmp's replica-safe
`precision.LossScaleOptimizer` (added, or swapped in for Keras' own; said once).
`model_dir` adds what the apps have: checkpoints and exact resume (step, optimizer and loss-scale
state), a checkpoint on SIGTERM (raises `tfmp.errors.Preempted`), chief-only writes,
`metrics.jsonl`, TensorBoard scalars and the run card.

Validation comes first, writing after: a mistake is one `UsageError` line and `model_dir` is
left untouched. Checked up front: the model is compiled and built in the strategy's scope, the
batch divides over the replicas, the training and validation data fit the model and its loss,
the labels suit Keras' loss (no strings; sparse categorical cross-entropy: class ids 0..N-1 of
the N-unit output; binary cross-entropy: 0..1; NumPy labels all of them, a dataset's its first
batch), and `model_dir` is a directory this process can write.
"""

from __future__ import annotations

import os
import re

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmp import compat, precision, run_dir
from tfmp.distribute import strategies as distribute
from tfmp.errors import UsageError
from tfmp.precision import fused_norm
from tfmp.training.checkpoint import Checkpoints
from tfmp.training.engine import Engine
from tfmp.training.loop import Loop, LoopSettings
from tfmp.training.reporting import Reporter


def model_strategy(model: keras.Model) -> tf.distribute.Strategy:
    """The strategy the model's variables belong to; refuses a model built outside the active scope."""
    variables = model.weights
    owner = getattr(variables[0].value, "distribute_strategy", None) if variables else None
    if owner is None and variables and isinstance(variables[0].value, tf.distribute.DistributedValues):
        owner = variables[0].value._distribute_strategy
    active = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    if owner is not None and active is not None and owner is not active:
        raise UsageError(
            "tfmp.fit was called inside one strategy's scope for a model built in another; "
            "build, compile and fit the model under the same strategy"
        )
    if owner is None and active is not None and active.num_replicas_in_sync > 1:
        raise UsageError(
            f"model {model.name!r} was built outside the scope of the "
            f"{type(active).__name__} that tfmp.fit is asked to distribute it with; "
            "build and compile it inside `with strategy.scope():`"
        )
    return owner or active or tf.distribute.get_strategy()


class _Data:
    """A user's training or evaluation data as global batches, re-creatable per epoch."""

    def __init__(self, x, y, sample_weight, batch_size, shuffle, seed, what):
        self.what = what
        if isinstance(x, tf.data.Dataset):
            if y is not None:
                raise UsageError(f"{what}: y must be None when x is a tf.data.Dataset (it yields (x, y))")
            self._make = lambda epoch: x
        else:
            if batch_size is None:
                raise UsageError(f"{what}: NumPy inputs need batch_size= (the global batch size)")
            arrays = tuple(item for item in (x, y, sample_weight) if item is not None)
            arrays = arrays if len(arrays) > 1 else arrays[0]
            size = len(tf.nest.flatten(x)[0])
            self._sample = (x, y, sample_weight)  # in memory already: every label is checked

            def make(epoch):
                dataset = tf.data.Dataset.from_tensor_slices(arrays)
                if shuffle:
                    dataset = dataset.shuffle(size, seed=seed + epoch)
                return dataset.batch(batch_size)

            self._make = make
        self.element_spec = self._make(0).element_spec
        cardinality = int(self._make(0).cardinality())
        self.batches = cardinality if cardinality >= 0 else None  # None: infinite or unknown
        self.infinite = cardinality == tf.data.INFINITE_CARDINALITY
        self.global_batch_size = batch_size or self._first_batch_rows()

    def sample(self) -> tuple | None:
        """(x, y, sample_weight) to check: all of NumPy data, a dataset's first batch (None: empty)."""
        if not hasattr(self, "_sample"):
            first = next(iter(self._make(0).take(1)), None)
            self._sample = None if first is None else _x_y_weight(first)
        return self._sample

    def _first_batch_rows(self) -> int:
        first = self.sample()
        if first is None:
            raise UsageError(f"{self.what}: the dataset is empty")
        return int(tf.shape(tf.nest.flatten(first[0])[0])[0])

    def dataset(self, epoch: int, skip_batches: int = 0) -> tf.data.Dataset:
        return self._make(epoch).skip(skip_batches) if skip_batches else self._make(epoch)


def _x_y_weight(element) -> tuple:
    """(x, y, sample_weight) of a Keras element (tfmp's padded eval 4-tuple: its first three)."""
    if isinstance(element, (list, tuple)):
        return (tuple(element) + (None, None))[:3] if len(element) > 1 else (element[0], None, None)
    return element, None, None


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


def _check_label_types(model: keras.Model, data: _Data) -> None:
    """String labels for a Keras loss (TF would fail inside the first step): one line, the fix."""
    y = _x_y_weight(data.element_spec)[1]
    for key, (_, name, _), labels, _ in _labelled_outputs(model, y, {}):
        if any(spec.dtype == tf.string for spec in tf.nest.flatten(labels)):
            where = f" for output {key!r}" if key else ""
            raise UsageError(
                f"{data.what}: the labels{where} are strings; {name} needs numbers: map each class "
                "name to an id 0..N-1 first, e.g. with keras.layers.StringLookup(num_oov_indices=0)"
            )


def _check_label_values(model: keras.Model, data: _Data) -> None:
    """Labels a Keras loss cannot take (a class id past the output's units, a negative id, a
    binary target outside [0, 1]), found in `data.sample()` before any step runs."""
    sample = data.sample()
    if not sample or sample[1] is None:
        return
    widths = _output_widths(model, _x_y_weight(data.element_spec)[0])
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


def _check_validation_fits(model: keras.Model, train: _Data, validation: _Data) -> None:
    """Validation batches run through the model and its loss (else they fail after an epoch).

    Batches shaped like the training data's fit; others are traced through the model and the
    compiled loss (a graph is built, nothing is computed), which finds what does not fit."""
    x, y, sample_weight = _x_y_weight(validation.element_spec)
    if _same_shapes(_x_y_weight(train.element_spec)[:2], (x, y)):
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
            f"{shapes((x, y))} vs training {shapes(_x_y_weight(train.element_spec))}: "
            "give validation_data the training data's shapes"
        ) from None


def _error_line(error: Exception) -> str:
    """The line of a Keras/TF error that says what is wrong (Keras wraps it in a header, bold
    escape codes and the call's arguments)."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(error).splitlines()]
    lines = lines[: next((i for i, line in enumerate(lines) if line.startswith("Arguments received")), None)]
    useful = [line for line in lines if line and not line.startswith("Exception encountered when calling")]
    return (useful or [type(error).__name__])[0][:300]


def _check_compiled(model: keras.Model) -> None:
    if not isinstance(model, keras.Model):
        raise UsageError(f"tfmp.fit needs a keras.Model, got {type(model).__name__}")
    if not getattr(model, "compiled", False) or model.optimizer is None:
        raise UsageError(
            f"model {model.name!r} is not compiled; call model.compile(optimizer, loss, "
            "metrics) (inside the strategy's scope) before tfmp.fit"
        )


def build_for_data(model: keras.Model, strategy, element_spec) -> None:
    """Builds the model, compiled loss and metrics for this data; shape mismatches are user errors."""
    try:
        with strategy.scope():
            compat.symbolic_build(model, element_spec)
    except (ValueError, TypeError, RuntimeError) as error:
        raise UsageError(
            f"the data do not fit model {model.name!r} ({_error_line(error)}); inputs "
            f"{[tuple(i.shape) for i in model.inputs] if hasattr(model, 'inputs') else '?'} "
            f"vs data {tf.nest.map_structure(lambda s: tuple(s.shape), element_spec)}"
        ) from None


FUSE_HINT = (
    "tfmp.fuse_normalization(model) before fit would compute them with TensorFlow's fused kernel: "
    "half-precision activations stay half (Keras' layer keeps float32 copies for the backward pass), "
    "the same numbers within rounding, the same weights and .keras file"
)
_hinted = set()  # models told once about unfused BatchNormalization


def prepare(model: keras.Model, xla: bool = False) -> tuple[tf.distribute.Strategy, Engine, str | None]:
    """Strategy, engine and loss-scaling note for a compiled model (shared by fit and evaluate)."""
    _check_compiled(model)
    unfused = fused_norm.unfused(model)
    if unfused and id(model) not in _hinted:
        _hinted.add(id(model))
        logging.warning("tfmp: %d BatchNormalization layer(s) run Keras' layer; %s", len(unfused), FUSE_HINT)
    strategy = model_strategy(model)
    optimizer, note = precision.ensure_loss_scaling(model, strategy)
    if optimizer is not model.optimizer:
        logging.warning("tfmp: %s", note)
        model.optimizer = optimizer
    return strategy, Engine(strategy, model, optimizer, xla=xla), note


def fit(
    model: keras.Model,
    x=None,
    y=None,
    *,
    batch_size: int | None = None,
    epochs: int = 1,
    steps_per_epoch: int | None = None,
    validation_data=None,
    validation_steps: int | None = None,
    callbacks: list | None = None,
    verbose="auto",
    model_dir: str | None = None,
    sample_weight=None,
    shuffle: bool = True,
    seed: int = 0,
    steps_per_execution: int = 1,
    xla: bool = False,
    checkpoint_every: int = 0,
    keep_checkpoints: int = 3,
    log_every: int = 50,
) -> keras.callbacks.History:
    """Trains `model` (compiled, built in its strategy's scope) like `model.fit`; returns its History.

    Raises `tfmp.errors.UsageError` (one line, nothing written) for an uncompiled model, a batch
    not divisible by the replicas, training or validation data that do not fit the model, labels
    the loss cannot take, a model built outside the strategy's scope, or a `model_dir` that is
    a file or not writable; `TrainingDiverged` when the loss becomes non-finite without dynamic
    loss scaling; `Preempted` after saving a checkpoint on SIGTERM (with `model_dir`).
    """
    if epochs < 1 or (steps_per_epoch is not None and steps_per_epoch < 1) or steps_per_execution < 1:
        raise UsageError(
            f"epochs={epochs}, steps_per_epoch={steps_per_epoch} and steps_per_execution="
            f"{steps_per_execution} must be positive"
        )
    model_dir = run_dir.writable_dir(model_dir, "model_dir") if model_dir else None
    _check_compiled(model)
    strategy = model_strategy(model)
    train = _Data(x, y, sample_weight, batch_size, shuffle, seed, "training data")
    distribute.per_replica_batch(train.global_batch_size, strategy)
    steps_per_epoch = _steps_per_epoch(train, steps_per_epoch)
    validation = None
    if validation_data is not None:
        validation = _validation(validation_data, batch_size or train.global_batch_size)
    _check_data(model, strategy, train, validation)
    strategy, engine, note = prepare(model, xla)
    topology = distribute.describe(strategy)

    if model_dir and topology.is_chief:
        os.makedirs(model_dir, exist_ok=True)
    checkpoints = None
    if model_dir:
        task_id = getattr(getattr(strategy, "cluster_resolver", None), "task_id", 0) or 0
        checkpoints = Checkpoints(
            model_dir,
            topology.is_chief,
            task_id,
            keep=keep_checkpoints,
            global_batch_size=train.global_batch_size,
            model=model,
            optimizer=engine.optimizer,
        )
    start_step = checkpoints.restore() if checkpoints else 0
    reporter = Reporter(model_dir if topology.is_chief else None, verbose=bool(verbose) and topology.is_chief)
    reporter.run_card(
        run_card(
            model,
            engine,
            topology,
            train.global_batch_size,
            steps_per_epoch,
            epochs,
            start_step,
            xla,
            note,
            model_dir,
        )
    )

    def data_for_epoch(epoch, steps_done):
        if train.infinite:  # one endless stream: position it once
            steps_done, epoch = epoch * steps_per_epoch + steps_done, 0
        return iter(strategy.experimental_distribute_dataset(train.dataset(epoch, steps_done)))

    def evaluate():
        data = validation.dataset(0)
        data = data.take(validation_steps) if validation_steps else data
        return engine.evaluate(strategy.experimental_distribute_dataset(data))

    settings = LoopSettings(
        total_steps=epochs * steps_per_epoch,
        steps_per_epoch=steps_per_epoch,
        global_batch_size=train.global_batch_size,
        steps_per_execution=steps_per_execution,
        checkpoint_every=checkpoint_every,
        log_every=log_every,
    )
    loop = Loop(
        engine,
        _infinite_once(data_for_epoch, train.infinite),
        settings,
        reporter=reporter,
        checkpoints=checkpoints,
        evaluate=evaluate if validation else None,
        callbacks=callbacks,
    )
    try:
        result = loop.run(start_step)
        del loop, data_for_epoch, evaluate
        distribute.release_input_pipelines()
    finally:
        reporter.close()
        if checkpoints:
            checkpoints.close()
    distribute.barrier(strategy)  # last: after it a worker only returns and exits
    return result.history


def _steps_per_epoch(train: _Data, steps_per_epoch: int | None) -> int:
    steps_per_epoch = steps_per_epoch or train.batches
    if not steps_per_epoch:
        raise UsageError("the training dataset's length is unknown or infinite; pass steps_per_epoch=")
    if train.batches is not None and steps_per_epoch > train.batches:
        raise UsageError(
            f"steps_per_epoch={steps_per_epoch} is more than the {train.batches} batches "
            "of the training data; repeat the dataset or lower steps_per_epoch"
        )
    return steps_per_epoch


def _check_data(model: keras.Model, strategy, train: _Data, validation: _Data | None) -> None:
    """Everything about the data that would otherwise fail inside a step, or after an epoch."""
    _check_label_types(model, train)
    build_for_data(model, strategy, train.element_spec)
    _check_label_values(model, train)
    if validation is not None:
        _check_label_types(model, validation)
        _check_validation_fits(model, train, validation)
        _check_label_values(model, validation)


def _infinite_once(data_for_epoch, infinite: bool):
    """An endless dataset keeps one iterator across epochs (as model.fit does with steps_per_epoch)."""
    if not infinite:
        return data_for_epoch
    state = {}

    def once(epoch, steps_done):
        if "iterator" not in state:
            state["iterator"] = data_for_epoch(epoch, steps_done)
        return state["iterator"]

    return once


def _validation(validation_data, batch_size: int) -> _Data:
    if isinstance(validation_data, tf.data.Dataset):
        return _Data(validation_data, None, None, None, False, 0, "validation data")
    if not isinstance(validation_data, (tuple, list)) or len(validation_data) not in (2, 3):
        raise UsageError("validation_data must be a tf.data.Dataset or a tuple (x, y[, sample_weight])")
    return _Data(
        *validation_data[:2],
        validation_data[2] if len(validation_data) == 3 else None,
        batch_size,
        False,
        0,
        "validation data",
    )


def evaluate(
    model: keras.Model,
    x=None,
    y=None,
    *,
    batch_size: int | None = None,
    steps: int | None = None,
    sample_weight=None,
    xla: bool = False,
) -> dict:
    """The model's compiled loss and metrics over the data, on its strategy; returns a dict."""
    _check_compiled(model)
    strategy = model_strategy(model)
    data = _Data(x, y, sample_weight, batch_size, False, 0, "evaluation data")
    if data.infinite and not steps:
        raise UsageError("the evaluation dataset is infinite; pass steps=")
    _check_label_types(model, data)
    build_for_data(model, strategy, data.element_spec)
    _check_label_values(model, data)
    strategy, engine, _ = prepare(model, xla)
    dataset = data.dataset(0).take(steps) if steps else data.dataset(0)
    return engine.evaluate(strategy.experimental_distribute_dataset(dataset))


def run_card(
    model, engine, topology, global_batch_size, steps_per_epoch, epochs, start_step, xla, note, model_dir
) -> dict:
    policy = model.dtype_policy.name
    compute = sorted(precision.model_compute_dtypes(model))
    card = {
        "model": f"{model.name} ({model.count_params():,} parameters)",
        "precision": f"{policy} (layers compute in {', '.join(compute) or 'n/a'})",
        "output dtype": ", ".join(sorted({str(t.dtype) for t in tf.nest.flatten(model.outputs)}))
        if getattr(model, "outputs", None)
        else "n/a",
        "loss scale": f"{precision.loss_scale_mode(engine.optimizer)}, now "
        f"{precision.current_loss_scale(engine.optimizer):g}",
        "loss": _describe_loss(model),
        "strategy": topology.strategy,
        "replicas": f"{topology.replicas} ({topology.workers} worker(s))",
        "devices": ", ".join(topology.devices),
        "global batch": global_batch_size,
        "per-replica batch": global_batch_size // topology.replicas,
        "steps": f"{epochs * steps_per_epoch} ({epochs} epoch(s) x {steps_per_epoch}), from step {start_step}",
        "xla": f"on ({engine.xla_parts})" if xla else "off",
        "versions": f"TensorFlow {tf.__version__}, Keras {keras.__version__}",
        "model dir": os.path.abspath(model_dir) if model_dir else "none (no checkpoints or logs)",
    }
    if note:
        card["tfmp changed"] = note
    unfused = fused_norm.unfused(model)
    if unfused:
        card["batch normalization"] = f"{len(unfused)} layer(s) on Keras' layer; {FUSE_HINT}"
    return card


def _describe_loss(model) -> str:
    loss = getattr(model, "loss", None)
    names = tf.nest.map_structure(lambda item: getattr(item, "name", None) or str(item), loss)
    return str(names) + (f" + {len(model.losses)} regularisation term(s)" if model.losses else "")
