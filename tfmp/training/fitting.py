"""`tfmp.fit`: `model.fit` for a user's compiled Keras model, trained the way tfmp's apps train
(docs/fit.md); `prepare` gives it and `tfmp.evaluate` / `tfmp.predict` (evaluating.py) the
model's strategy and its kept engine.

    strategy = tfmp.distribute.strategies.get_strategy("auto")     # or tf.distribute.MirroredStrategy(), ...
    with strategy.scope():
        model = keras.Sequential([...])                   # logits, several outputs, anything
        model.compile(keras.optimizers.SGD(0.01),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    history = tfmp.fit(model, x, y, epochs=3, validation_split=0.1, model_dir="runs/a")
    loss, accuracy = tfmp.evaluate(model, x_test, y_test)

Works under every strategy, precision and XLA setting, including MultiWorkerMirroredStrategy
(where Keras 3.15's `model.fit` fails) and XLA under MirroredStrategy (where
`compile(jit_compile=True)` fails). The same script runs on one device, on N replicas, and on
N workers started by `python -m tfmp.launch --workers=N -- python my_train.py`.

Arguments and data are `model.fit`'s (`fit_inputs`: arrays with a *global* `batch_size`,
`tf.data`, PyDataset, generators, `class_weight`, `validation_split`, ...); tfmp distributes the
global batches over the strategy's replicas and workers. Numbers equal `model.fit`'s on one
device for the same batches (tests/test_fit_conformance.py):
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

import keras
import tensorflow as tf
from absl import logging

from tfmp import precision, run_dir, write_faults
from tfmp.distribute import allreduce
from tfmp.distribute import strategies as distribute
from tfmp.errors import UsageError, WriteFailed
from tfmp.precision import fused_norm
from tfmp.training import fit_data, fit_inputs, model_steps, run_card
from tfmp.training.checkpoint import Checkpoints
from tfmp.training.engine import Engine
from tfmp.training.loop import Loop, LoopSettings
from tfmp.training.reporting import Reporter, format_run_card


def model_strategy(model: keras.Model) -> tf.distribute.Strategy:
    """The strategy the model's variables belong to; refuses a model built outside the active scope."""
    variables = model.weights
    owner = getattr(variables[0].value, "distribute_strategy", None) if variables else None
    if owner is None and variables and isinstance(variables[0].value, tf.distribute.DistributedValues):
        owner = variables[0].value._distribute_strategy
    if not variables:  # built on its first call: the scope Keras saw it made in (or the active one)
        owner = model.distribute_strategy
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


def check_compiled(model: keras.Model) -> None:
    if not isinstance(model, keras.Model):
        raise UsageError(f"tfmp.fit needs a keras.Model, got {type(model).__name__}")
    compiled = getattr(model, "compiled", False)
    if compiled and model.optimizer is None and "train_step" in model_steps.overridden(model):
        raise UsageError(
            f"{type(model).__name__}.train_step: model {model.name!r} was compiled with optimizer=None, and "
            "tfmp needs one (its loss scaling, checkpoints and run card read it); call compile(optimizer=...) "
            "(Keras' default 'rmsprop' will do if the step applies only optimizers of its own)"
        )
    if not compiled or model.optimizer is None:
        raise UsageError(
            f"model {model.name!r} is not compiled; call model.compile(optimizer, loss, "
            "metrics) (inside the strategy's scope) before tfmp.fit"
        )


_hinted = set()  # models told once about unfused normalization


def prepare(
    model: keras.Model,
    xla: bool | None = None,
    allreduce_dtype: str | None = None,
    allreduce_bucket_bytes: int = allreduce.DEFAULT_BUCKET_BYTES,
) -> tuple[tf.distribute.Strategy, Engine, str | None]:
    """Strategy, engine and loss-scaling note for a compiled model (shared by fit, evaluate and
    predict). The engine is kept on the model while the model's compilation, strategy, XLA
    setting and all-reduce stay the same, so a second call traces nothing again (as Keras keeps
    `model.train_function`); `allreduce_dtype=None` (evaluate, predict: nothing is summed) takes
    the kept engine's, or auto; `xla=None` the kept engine's, or `compile(jit_compile=...)`'s."""
    check_compiled(model)
    unfused = fused_norm.unfused(model)
    if unfused and id(model) not in _hinted:
        _hinted.add(id(model))
        logging.warning(
            "tfmp: %d normalization, attention, GELU or float16 convolution layer(s) run Keras' layer; %s",
            len(unfused),
            run_card.FUSE_HINT,
        )
    strategy = model_strategy(model)
    optimizer, note = precision.ensure_loss_scaling(model, strategy)
    if optimizer is not model.optimizer:
        logging.warning("tfmp: %s", note)
        model.optimizer = optimizer
    kept_key, engine = getattr(model, _ENGINE_ATTRIBUTE, (None, None))
    xla = engine.xla if xla is None and engine is not None else xla_of(model, xla)
    if allreduce_dtype is None:
        allreduce_dtype, allreduce_bucket_bytes = (
            ("auto", allreduce_bucket_bytes)
            if engine is None
            else (
                engine.allreduce.requested,
                engine.allreduce.bucket_bytes,
            )
        )
    summing = allreduce.resolve(
        allreduce_dtype,
        model.dtype_policy.name,
        isinstance(optimizer, keras.optimizers.LossScaleOptimizer),
        strategy.num_replicas_in_sync,
        allreduce_bucket_bytes,
    )
    key = (
        id(strategy),
        id(optimizer),
        xla,
        bool(model.run_eagerly),
        summing,
        id(model.loss),
        tuple(map(id, model.metrics)),
    )
    if kept_key != key:
        engine = Engine(strategy, model, optimizer, xla=xla, allreduce_plan=summing)
        # Not a Keras attribute: set past Layer.__setattr__, which would track it for saving.
        object.__setattr__(model, _ENGINE_ATTRIBUTE, (key, engine))
    return strategy, engine, note


_ENGINE_ATTRIBUTE = "_tfmp_engine"


def xla_of(model: keras.Model, xla: bool | None) -> bool:
    """Whether to compile with XLA: `xla` when given, else what `compile(jit_compile=...)` asked
    (Keras' "auto" is off on a CPU and under a tf.distribute strategy, as in `model.fit`)."""
    xla = bool(model.jit_compile) if xla is None else bool(xla)
    if xla and model.run_eagerly:
        raise UsageError(
            f"model {model.name!r} was compiled with run_eagerly=True, which runs every step as Python, "
            "and XLA was asked for too; use one of them (Keras' compile refuses both as well)"
        )
    return xla


def fit(
    model: keras.Model,
    x=None,
    y=None,
    batch_size: int | None = None,
    epochs: int = 1,
    verbose="auto",
    callbacks: list | None = None,
    validation_split: float = 0.0,
    validation_data=None,
    shuffle: bool = True,
    class_weight: dict | None = None,
    sample_weight=None,
    initial_epoch: int = 0,
    steps_per_epoch: int | None = None,
    validation_steps: int | None = None,
    validation_batch_size: int | None = None,
    validation_freq: int | list = 1,
    *,
    model_dir: str | None = None,
    seed: int = 0,
    steps_per_execution: int = 1,
    xla: bool | None = None,
    allreduce_dtype: str = "auto",
    allreduce_bucket_bytes: int = allreduce.DEFAULT_BUCKET_BYTES,
    checkpoint_every: int = 0,
    keep_checkpoints: int = 3,
    log_every: int = 50,
    show_run_card: bool | None = None,
) -> keras.callbacks.History:
    """Trains `model` (compiled, built in its strategy's scope) like `model.fit`; returns its History.

    Takes `model.fit`'s arguments, in its order and with its defaults and meaning; tfmp's own
    come after, by keyword: `model_dir` (checkpoints, exact resume, logs), `seed` (array
    shuffling), `steps_per_execution`, `xla` (default: what `compile(jit_compile=...)` asked),
    `allreduce_dtype` and `allreduce_bucket_bytes` (how the gradients are summed:
    `tfmp.distribute.allreduce`), `checkpoint_every`, `keep_checkpoints`, `log_every`, and
    `show_run_card` (default: printed when `model_dir` is given and `verbose`).

    Raises `tfmp.errors.UsageError` (one line, nothing written) for arguments Keras refuses too,
    an uncompiled model, a batch not divisible by the replicas, data that do not fit the model,
    labels the loss cannot take, a model built outside the strategy's scope, or a `model_dir`
    that is a file, not writable, or held by another run; `TrainingDiverged` when the loss becomes
    non-finite without dynamic loss scaling and without `keras.callbacks.TerminateOnNaN` (with
    it, training stops and the History returns, as in Keras), or float16 loss scaling keeps
    skipping, and its subclass `NonFiniteInput` when the data hold NaN or inf (each names the
    step; the model keeps its weights of the step before); `Preempted` after saving a
    checkpoint on SIGTERM (with `model_dir`); `WriteFailed` when a write into `model_dir` fails.
    """
    _check_arguments(epochs, initial_epoch, steps_per_epoch, steps_per_execution, validation_freq)
    model_dir = run_dir.writable_dir(model_dir, "model_dir") if model_dir else None
    check_compiled(model)
    strategy = model_strategy(model)
    if validation_split and validation_data is None:
        (x, y, sample_weight), validation_data = fit_inputs.validation_split(
            x, y, sample_weight, validation_split
        )
    preprocess = fit_inputs.preprocessor(model)
    train = fit_inputs.of(
        x, y, sample_weight, batch_size, shuffle, seed, class_weight, "training data", preprocess=preprocess
    )
    distribute.per_replica_batch(train.global_batch_size, strategy)
    topology = distribute.describe(strategy)
    steps_per_epoch = fit_data.steps_per_epoch_of(train, steps_per_epoch, topology.workers > 1)
    validation = None
    if validation_data is not None:
        validation = fit_data.validation_data_of(
            validation_data, validation_batch_size or batch_size, preprocess
        )
    fit_data.check_data(model, strategy, train, validation)
    strategy, engine, note = prepare(model, xla_of(model, xla), allreduce_dtype, allreduce_bucket_bytes)
    if engine.own is not None:  # the model's own steps: traced now, so their mistakes write nothing
        engine.own.prepare(*(_distributed_spec(strategy, data) for data in (train, validation)))
    verbose = verbose if topology.is_chief else 0  # one progress bar for the whole job
    settings = LoopSettings(
        total_steps=epochs * steps_per_epoch,
        steps_per_epoch=steps_per_epoch,
        global_batch_size=train.global_batch_size,
        steps_per_execution=steps_per_execution,
        checkpoint_every=checkpoint_every,
        log_every=log_every,
        validation_freq=validation_freq,
        verbose=verbose,
    )
    checkpoints = None
    try:
        with contextlib.ExitStack() as stack:  # closes what was opened, then unlocks
            checkpoints, reporter = _open_run_files(stack, model, engine, model_dir, keep_checkpoints, train)
            start_step = checkpoints.restore() if checkpoints else 0  # 0: nothing saved yet
            start_step = start_step or initial_epoch * steps_per_epoch
            reporter.start_step = start_step  # metrics.jsonl keeps what precedes it, then logs on
            card = run_card.describe_fit(model, engine, topology, settings, start_step, note, model_dir)
            reporter.run_card(card)
            if show_run_card or (show_run_card is None and model_dir and verbose):
                print(format_run_card(card), flush=True)
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
            train.epoch_ended()  # once before the first epoch too, as model.fit's epoch iterator resets
            result = loop.run(start_step)
            train.epoch_ended()
            del loop, data_for_epoch, evaluate
            distribute.release_input_pipelines()
            reporter.close()
    except WriteFailed as error:
        saved_step, location = (checkpoints.saved_step, checkpoints.location) if checkpoints else (None, None)
        rerun = "tfmp.fit again with the same model_dir"
        raise write_faults.with_resume(error, saved_step, location, rerun) from error.__cause__
    distribute.barrier(strategy)  # last: after it a worker only returns and exits
    return result.history


def _distributed_spec(strategy: tf.distribute.Strategy, data):
    """The element spec of `data` (a FitData, or None) as the strategy distributes it."""
    return None if data is None else strategy.experimental_distribute_dataset(data.dataset(0)).element_spec


def _check_arguments(epochs, initial_epoch, steps_per_epoch, steps_per_execution, validation_freq) -> None:
    """What Keras refuses (or would fail on later), as one line each."""
    if epochs < 1 or (steps_per_epoch is not None and steps_per_epoch < 1) or steps_per_execution < 1:
        raise UsageError(
            f"epochs={epochs}, steps_per_epoch={steps_per_epoch} and steps_per_execution="
            f"{steps_per_execution} must be positive"
        )
    if initial_epoch < 0:
        raise UsageError(f"initial_epoch={initial_epoch} must be 0 or more (the epoch to start at)")
    valid_list = isinstance(validation_freq, list) and all(
        isinstance(item, int) and item >= 1 for item in validation_freq
    )
    if not valid_list and not (isinstance(validation_freq, int) and validation_freq >= 1):
        raise UsageError(
            f"validation_freq={validation_freq!r} must be a positive int (validate every Nth epoch) "
            "or a list of 1-based epochs, as in Keras"
        )


def _open_run_files(stack, model, engine, model_dir, keep_checkpoints, train):
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
            global_batch_size=train.global_batch_size,
            model=model,
            optimizer=engine.optimizer,
        )
        stack.callback(checkpoints.close)
    # Keras' progress bar (a callback of the loop's) shows the progress; the reporter writes files.
    reporter = Reporter(
        model_dir if topology.is_chief else None,
        verbose=False,
        tags={"allreduce_dtype": engine.allreduce.dtype},
    )
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
    data), distributed by the engine's strategy.

    Training reads one stream across epochs, as `model.fit` does: an epoch of `steps_per_epoch`
    shorter than the data continues where the last one stopped. The stream is opened once, at
    the first epoch this fit runs (at a resumed position, after a checkpoint)."""
    strategy, state = engine.strategy, {}

    def data_for_epoch(epoch, steps_done):
        if "iterator" in state:
            train.epoch_ended()  # the Loop asks at each epoch's start: the last one ended
        else:
            stream = train.stream(epoch * steps_per_epoch + steps_done)
            state["iterator"] = iter(strategy.experimental_distribute_dataset(stream))
        return state["iterator"]

    def evaluate():
        data = validation.dataset(0)
        data = data.take(validation_steps) if validation_steps else data
        return engine.evaluate(strategy.experimental_distribute_dataset(data))

    return data_for_epoch, evaluate if validation else None
