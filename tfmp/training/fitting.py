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
"""

from __future__ import annotations

import os

import keras
import tensorflow as tf
from absl import logging

from tfmp import compat, precision
from tfmp.distribute import strategies as distribute
from tfmp.errors import UsageError
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

    def _first_batch_rows(self) -> int:
        first = next(iter(self._make(0).take(1)), None)
        if first is None:
            raise UsageError(f"{self.what}: the dataset is empty")
        return int(tf.shape(tf.nest.flatten(first)[0])[0])

    def dataset(self, epoch: int, skip_batches: int = 0) -> tf.data.Dataset:
        return self._make(epoch).skip(skip_batches) if skip_batches else self._make(epoch)


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
        first_line = (str(error).strip().splitlines() or [""])[0][:300]
        raise UsageError(
            f"the data do not fit model {model.name!r} ({first_line}); inputs "
            f"{[tuple(i.shape) for i in model.inputs] if hasattr(model, 'inputs') else '?'} "
            f"vs data {tf.nest.map_structure(lambda s: tuple(s.shape), element_spec)}"
        ) from None


def prepare(model: keras.Model, xla: bool = False) -> tuple[tf.distribute.Strategy, Engine, str | None]:
    """Strategy, engine and loss-scaling note for a compiled model (shared by fit and evaluate)."""
    _check_compiled(model)
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
    not divisible by the replicas, data that do not fit the model, or a model built outside the
    strategy's scope; `TrainingDiverged` when the loss becomes non-finite without loss scaling;
    `Preempted` after saving a checkpoint on SIGTERM (with `model_dir`).
    """
    if epochs < 1 or (steps_per_epoch is not None and steps_per_epoch < 1) or steps_per_execution < 1:
        raise UsageError(
            f"epochs={epochs}, steps_per_epoch={steps_per_epoch} and steps_per_execution="
            f"{steps_per_execution} must be positive"
        )
    _check_compiled(model)
    strategy = model_strategy(model)
    train = _Data(x, y, sample_weight, batch_size, shuffle, seed, "training data")
    distribute.per_replica_batch(train.global_batch_size, strategy)
    steps_per_epoch = steps_per_epoch or train.batches
    if not steps_per_epoch:
        raise UsageError("the training dataset's length is unknown or infinite; pass steps_per_epoch=")
    if train.batches is not None and steps_per_epoch > train.batches:
        raise UsageError(
            f"steps_per_epoch={steps_per_epoch} is more than the {train.batches} batches "
            "of the training data; repeat the dataset or lower steps_per_epoch"
        )
    build_for_data(model, strategy, train.element_spec)
    validation = None
    if validation_data is not None:
        validation = _validation(validation_data, batch_size or train.global_batch_size)
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
    build_for_data(model, strategy, data.element_spec)
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
    return card


def _describe_loss(model) -> str:
    loss = getattr(model, "loss", None)
    names = tf.nest.map_structure(lambda item: getattr(item, "name", None) or str(item), loss)
    return str(names) + (f" + {len(model.losses)} regularisation term(s)" if model.losses else "")
