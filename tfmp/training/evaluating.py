"""`tfmp.evaluate` and `tfmp.predict`: `model.evaluate` and `model.predict` for a user's compiled
Keras model on the strategy it was built under, through the same engine `tfmp.fit` trains it
with (kept on the model: a call after fit traces nothing again; docs/fit.md).

    loss, accuracy = tfmp.evaluate(model, x_test, y_test)      # as model.evaluate returns
    probabilities = tfmp.predict(model, x_test, batch_size=64)  # every example, on every worker

The data are `fit_inputs`' (arrays with a global `batch_size`, `tf.data`, PyDataset,
generators), checked before anything runs: an endless dataset without `steps`, labels the loss
cannot take, or data that do not fit the model are one `UsageError` line.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmp.distribute import strategies as distribute
from tfmp.errors import UsageError
from tfmp.training import fit_data, fit_inputs, model_steps
from tfmp.training.fitting import check_compiled, model_strategy, prepare
from tfmp.training.reporting import format_logs


def evaluate(
    model: keras.Model,
    x=None,
    y=None,
    batch_size: int | None = None,
    verbose="auto",
    sample_weight=None,
    steps: int | None = None,
    callbacks: list | None = None,
    return_dict: bool = False,
    *,
    xla: bool | None = None,
):
    """`model.evaluate` on the model's strategy: the compiled loss and metrics over the data.

    Returns what Keras returns: the loss alone for a model without metrics, else the list
    `[loss, *metrics]` in `model.metrics_names` order, or a dict with `return_dict=True`.
    `verbose` prints one line of results (the whole pass runs in one traced call, so there is no
    per-batch bar); `callbacks` get `on_test_begin` / `on_test_end` with the results.
    """
    check_compiled(model)
    strategy = model_strategy(model)
    what = "evaluation data"
    data = fit_inputs.of(
        x, y, sample_weight, batch_size, False, 0, None, what, fit_inputs.preprocessor(model)
    )
    if data.infinite and not steps:
        raise UsageError(f"{what}: the dataset is endless; pass steps=")
    if data.batches == 0:
        raise UsageError(f"{what}: the data are empty")
    own = model_steps.overridden(model)
    fit_data.check_label_types(model, data)
    fit_data.build_for_data(model, strategy, data.element_spec, deferred="test_step" in own)
    fit_data.check_label_values(model, data)
    strategy, engine, _ = prepare(model, xla)
    callback_list = keras.callbacks.CallbackList(callbacks, model=model, verbose=0)
    callback_list.on_test_begin()
    dataset = data.dataset(0).take(steps) if steps else data.dataset(0)
    results = engine.evaluate(strategy.experimental_distribute_dataset(dataset))
    callback_list.on_test_end(results)
    if verbose and distribute.describe(strategy).is_chief:
        print(format_logs(results), flush=True)
    if return_dict:
        return results
    values = _in_keras_order(model, results)
    return values[0] if len(values) == 1 else values


def _in_keras_order(model: keras.Model, results: dict) -> list:
    """The results as `model.evaluate` lists them: the model's metrics in order (a compiled
    metrics container's own metrics in its place), then any other key alphabetically."""
    names = []
    for metric in model.metrics:
        inner = getattr(metric, "metrics", None)  # Keras' container of the compiled metrics
        names += [item.name for item in inner] if isinstance(inner, list) and inner else [metric.name]
    ordered = [name for name in names if name in results]
    return [results[name] for name in ordered + sorted(set(results) - set(ordered))]


def predict(model: keras.Model, x, batch_size: int | None = None, verbose="auto", steps: int | None = None):
    """`model.predict` on the model's strategy: the outputs for every example, as NumPy (every
    worker gets all of them), in the input's order."""
    check_compiled(model)
    strategy = model_strategy(model)
    data = fit_inputs.of(
        x, None, None, batch_size, False, 0, None, "prediction data", fit_inputs.preprocessor(model)
    )
    if data.infinite and not steps:
        raise UsageError("prediction data: the dataset is endless; pass steps=")
    fit_data.build_for_data(
        model, strategy, data.element_spec, deferred="predict_step" in model_steps.overridden(model)
    )
    strategy, engine, _ = prepare(model)
    dataset = data.dataset(0).take(steps) if steps else data.dataset(0)
    outputs, _ = engine.predict(strategy.experimental_distribute_dataset(dataset))
    if verbose and distribute.describe(strategy).is_chief:
        rows = len(tf.nest.flatten(outputs)[0]) if outputs is not None else 0
        print(f"predicted {rows} examples", flush=True)
    return outputs
