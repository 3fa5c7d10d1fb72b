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
`metrics.jsonl`, TensorBoard scalars and the run card, one writer per directory (the chief
locks it; another fit or app on it is a `UsageError` naming the holder's host and PID), and a
write that fails (full disk, read-only, permission, file-size limit) raises
`tfmp.errors.WriteFailed` naming the file, the fix and the checkpoint a rerun resumes from.

Validation comes first, writing after: a mistake is one `UsageError` line and `model_dir` is
left untouched. Checked up front: the model is compiled and built in the strategy's scope, the
batch divides over the replicas, the training and validation data fit the model and its loss,
the labels suit Keras' loss (no strings; sparse categorical cross-entropy: class ids 0..N-1 of
the N-unit output; binary cross-entropy: 0..1; NumPy labels all of them, a dataset's its first
batch), and `model_dir` is a directory this process can write.
"""

from __future__ import annotations

import contextlib
import os

import keras
import tensorflow as tf
from absl import logging

from tfmp import precision, run_dir, write_faults
from tfmp.distribute import strategies as distribute
from tfmp.errors import UsageError, WriteFailed
from tfmp.precision import fused_norm
from tfmp.training import fit_data
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


def _check_compiled(model: keras.Model) -> None:
    if not isinstance(model, keras.Model):
        raise UsageError(f"tfmp.fit needs a keras.Model, got {type(model).__name__}")
    if not getattr(model, "compiled", False) or model.optimizer is None:
        raise UsageError(
            f"model {model.name!r} is not compiled; call model.compile(optimizer, loss, "
            "metrics) (inside the strategy's scope) before tfmp.fit"
        )


FUSE_HINT = (
    "tfmp.fuse_normalization(model) before fit would compute them with TensorFlow's fused kernel: "
    "half-precision activations stay half (Keras' layer keeps float32 copies for the backward pass), "
    "the same numbers within rounding, the same weights and .keras file"
)
_hinted = set()  # models told once about unfused normalization


def prepare(model: keras.Model, xla: bool = False) -> tuple[tf.distribute.Strategy, Engine, str | None]:
    """Strategy, engine and loss-scaling note for a compiled model (shared by fit and evaluate)."""
    _check_compiled(model)
    unfused = fused_norm.unfused(model)
    if unfused and id(model) not in _hinted:
        _hinted.add(id(model))
        logging.warning(
            "tfmp: %d BatchNormalization/GroupNormalization layer(s) run Keras' layer; %s",
            len(unfused),
            FUSE_HINT,
        )
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
    a file or not writable, or that another run holds; `TrainingDiverged` when the loss becomes
    non-finite without dynamic loss scaling, or float16 loss scaling keeps skipping (its scale
    below 1, or `precision.loss_scaling.skip_limit` steps in a row), and its subclass
    `NonFiniteInput` when the data hold NaN or inf (each names the step; the model keeps its
    weights of the step before); `Preempted` after saving a checkpoint on SIGTERM (with
    `model_dir`); `WriteFailed` when a write into `model_dir` fails.
    """
    if epochs < 1 or (steps_per_epoch is not None and steps_per_epoch < 1) or steps_per_execution < 1:
        raise UsageError(
            f"epochs={epochs}, steps_per_epoch={steps_per_epoch} and steps_per_execution="
            f"{steps_per_execution} must be positive"
        )
    model_dir = run_dir.writable_dir(model_dir, "model_dir") if model_dir else None
    _check_compiled(model)
    strategy = model_strategy(model)
    train = fit_data.FitData(x, y, sample_weight, batch_size, shuffle, seed, "training data")
    distribute.per_replica_batch(train.global_batch_size, strategy)
    steps_per_epoch = fit_data.steps_per_epoch_of(train, steps_per_epoch)
    validation = None
    if validation_data is not None:
        validation = fit_data.validation_data_of(validation_data, batch_size or train.global_batch_size)
    fit_data.check_data(model, strategy, train, validation)
    strategy, engine, note = prepare(model, xla)
    topology = distribute.describe(strategy)
    checkpoints = None
    try:
        with contextlib.ExitStack() as stack:  # closes what was opened, then unlocks
            checkpoints, reporter = _open_run_files(
                stack, model, engine, model_dir, keep_checkpoints, train.global_batch_size, bool(verbose)
            )
            start_step = checkpoints.restore() if checkpoints else 0
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
            settings = LoopSettings(
                total_steps=epochs * steps_per_epoch,
                steps_per_epoch=steps_per_epoch,
                global_batch_size=train.global_batch_size,
                steps_per_execution=steps_per_execution,
                checkpoint_every=checkpoint_every,
                log_every=log_every,
            )
            data_for_epoch, evaluate = _inputs(engine, train, steps_per_epoch, validation, validation_steps)
            loop = Loop(
                engine,
                data_for_epoch,
                settings,
                reporter=reporter,
                checkpoints=checkpoints,
                evaluate=evaluate,
                callbacks=callbacks,
            )
            result = loop.run(start_step)
            del loop, data_for_epoch, evaluate
            distribute.release_input_pipelines()
            reporter.close()
    except WriteFailed as error:
        saved_step, location = (checkpoints.saved_step, checkpoints.location) if checkpoints else (None, None)
        rerun = "tfmp.fit again with the same model_dir"
        raise write_faults.with_resume(error, saved_step, location, rerun) from error.__cause__
    distribute.barrier(strategy)  # last: after it a worker only returns and exits
    return result.history


def _open_run_files(stack, model, engine, model_dir, keep_checkpoints, global_batch_size, verbose):
    """(checkpoints or None, reporter): `model_dir` locked by the chief, its checkpoints and the
    reporter opened; `stack` closes them (the reporter as failing, unless closed before)."""
    topology, checkpoints = distribute.describe(engine.strategy), None
    if model_dir and topology.is_chief:
        stack.enter_context(_lock(model_dir))
    if model_dir:
        task_id = getattr(getattr(engine.strategy, "cluster_resolver", None), "task_id", 0) or 0
        checkpoints = Checkpoints(
            model_dir,
            topology.is_chief,
            task_id,
            keep=keep_checkpoints,
            global_batch_size=global_batch_size,
            model=model,
            optimizer=engine.optimizer,
        )
        stack.callback(checkpoints.close)
    reporter = Reporter(model_dir if topology.is_chief else None, verbose=verbose and topology.is_chief)
    stack.callback(reporter.close, failing=True)  # on an error; on success closed before, raising
    return checkpoints, reporter


@contextlib.contextmanager
def _lock(model_dir: str):
    """Holds `model_dir` for this fit (see `run_dir.lock`), after removing what a cut-short write left."""
    try:
        with write_faults.guarded("starting the fit", model_dir):
            held = run_dir.lock(model_dir, model_dir, "model_dir")
    except WriteFailed as error:
        raise write_faults.then_rerun(error, "tfmp.fit again") from error.__cause__
    try:
        for path in run_dir.remove_leftovers(model_dir):
            logging.info("removed %s, left by a write that was cut short", path)
        yield held
    finally:
        held.release()


def _inputs(engine: Engine, train, steps_per_epoch: int, validation, validation_steps: int | None):
    """The Loop's `data_for_epoch(epoch, steps_done)` and `evaluate()` (None without validation
    data), distributed by the engine's strategy."""
    strategy = engine.strategy

    def data_for_epoch(epoch, steps_done):
        if train.infinite:  # one endless stream: position it once
            steps_done, epoch = epoch * steps_per_epoch + steps_done, 0
        return iter(strategy.experimental_distribute_dataset(train.dataset(epoch, steps_done)))

    def evaluate():
        data = validation.dataset(0)
        data = data.take(validation_steps) if validation_steps else data
        return engine.evaluate(strategy.experimental_distribute_dataset(data))

    return _infinite_once(data_for_epoch, train.infinite), evaluate if validation else None


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
    data = fit_data.FitData(x, y, sample_weight, batch_size, False, 0, "evaluation data")
    if data.infinite and not steps:
        raise UsageError("the evaluation dataset is infinite; pass steps=")
    fit_data.check_label_types(model, data)
    fit_data.build_for_data(model, strategy, data.element_spec)
    fit_data.check_label_values(model, data)
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
        card["normalization"] = f"{len(unfused)} layer(s) on Keras' layer; {FUSE_HINT}"
    return card


def _describe_loss(model) -> str:
    loss = getattr(model, "loss", None)
    names = tf.nest.map_structure(lambda item: getattr(item, "name", None) or str(item), loss)
    return str(names) + (f" + {len(model.losses)} regularisation term(s)" if model.losses else "")
