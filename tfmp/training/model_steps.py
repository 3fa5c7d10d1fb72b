"""A model's own `train_step`, `test_step` and `predict_step`, run by tfmp's engine the way Keras'
TensorFlow trainer runs them (keras/src/backend/tensorflow/trainer.py).

Keras' guide "Customizing what happens in fit()" overrides these methods (GANs, VAEs, contrastive
learning, distillation) and keeps `fit`'s callbacks, distribution and step fusing. The `Engine`
hands each step a model overrides to `OwnSteps`:

    own = OwnSteps(engine)                                  # engine.own, when overridden(model)
    own.prepare(train_spec, validation_spec)                # before any file is written
    logs = own.train(iterator, num_steps, stop_requested)   # one host call: its last step's logs
    logs = own.evaluate(distributed_dataset)                # the last test_step's logs

As in Keras: the method runs per replica inside `strategy.run`, `steps_per_execution` of them in
one traced call; the dict it returns (nested dicts flattened, as Keras' callbacks flatten them)
is averaged over the replicas, and here over the workers too, so every worker logs alike; a host
call's logs are its last step's, or the model's metrics when the step returns exactly their names
(Keras' `_get_metrics_result_or_logs`); `jit_compile` compiles the whole step on each replica;
`run_eagerly` runs it as Python, every step.

What tfmp's own step adds cannot reach inside a user's step (`SCOPE`, on the run card): the
gradients are summed by the step's optimizers in float32 (Keras' all-reduce, not tfmp's
half-precision buckets); a non-finite step is the step's own business (no verdict, no stop: add
`keras.callbacks.TerminateOnNaN`); loss scaling is there when the step calls
`self.optimizer.scale_loss` and `self.optimizer.apply`, as in Keras: under float16 that optimizer
is tfmp's replica-safe `LossScaleOptimizer`. Checkpoints, preemption, the run lock, the logs and
several workers are the loop's, and stay.

Optimizers a step builds on its first `apply` (a GAN's two) cannot create their slots inside
`strategy.run` under several replicas (TensorFlow: "Unable to lift tensor"; Keras' own fit fails
there), so `prepare` traces the step once with those optimizers' `apply` noted instead of run,
and builds each for the variables it was given, in its strategy's scope.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmp import compat
from tfmp.errors import UsageError

METHODS = ("train_step", "test_step", "predict_step")
SCOPE = (
    "inside them tfmp's finite-step verdict, non-finite stop and half-precision all-reduce do not apply "
    "(their optimizers sum gradients in float32); loss scaling applies through self.optimizer.scale_loss "
    "and apply"
)


def overridden(model: keras.Model) -> tuple[str, ...]:
    """The step methods `model`'s class defines itself instead of inheriting Keras'."""
    return tuple(name for name in METHODS if getattr(type(model), name) is not getattr(keras.Model, name))


def describe(model: keras.Model) -> str | None:
    """The run card's row: which of the model's own steps run, and what reaches inside them."""
    methods = overridden(model)
    if not methods:
        return None
    names = ", ".join(f"{type(model).__name__}.{name}" for name in methods)
    return f"{names} run per replica as Keras runs them; {SCOPE}"


def metrics_or_logs(metrics: dict, logs: dict) -> dict:
    """What Keras logs for a host call: the model's metrics read across every replica when the
    step returned exactly their names (its logs were those metrics' per-replica results), else
    the step's own logs."""
    return metrics if set(logs) == set(metrics) else logs


class OwnSteps:
    """Runs the steps `engine.model` overrides, inside the engine's strategy and host calls."""

    def __init__(self, engine):
        self.engine, self.model, self.strategy = engine, engine.model, engine.strategy
        self.methods = overridden(engine.model)
        replicas = self.strategy.num_replicas_in_sync
        if engine.xla and replicas > 1:
            raise UsageError(
                f"XLA (xla=True or compile(jit_compile=True)) with {type(self.model).__name__}."
                f"{self.methods[0]} on {replicas} replicas: XLA would compile the whole step, whose variables "
                "sit on every replica's device and whose optimizer update all-reduces, which one XLA cluster "
                "cannot do (Keras' fit fails there too); train it with xla=False, or on one replica"
            )
        self._workers = self.strategy.num_replicas_in_sync > engine.local_replicas
        # Each method as a replica runs it; XLA (as Keras' jit_compile) compiles the whole step,
        # one tf.function per method, however many replicas and traces call it.
        self._steps = {
            name: tf.function(getattr(self.model, name), jit_compile=True, autograph=False)
            if engine.xla
            else getattr(self.model, name)
            for name in self.methods
        }
        traced = engine.traced
        self._train_step = traced(self._one_train_step)
        self._test_step = traced(self._one_test_step)
        self._train_fn = traced(self._train_loop)
        self._eval_fn = traced(self._eval_loop)

    def _one_train_step(self, data, stop_requested):
        def replica(data):
            logs = _checked(self._steps["train_step"](data), self.model, "train_step")
            self.engine.note_stop_request(stop_requested)
            return logs

        return self._replica_mean(self.strategy.run(replica, args=(data,)))

    def test_replica(self, data) -> dict:
        """One replica's test_step logs. Rows tfmp padded an evaluation batch with (so that every
        worker runs as many steps) reach the step with sample weight 0."""
        return _checked(self._steps["test_step"](_keras_element(data)), self.model, "test_step")

    def _one_test_step(self, data):
        return self._replica_mean(self.strategy.run(self.test_replica, args=(data,)))

    def _replica_mean(self, logs: dict) -> dict:
        """Each log averaged over this worker's replicas, as Keras reduces a step's outputs."""

        def mean(value):
            values = self.strategy.experimental_local_results(value)
            if len(values) == 1 or not (values[0].dtype.is_floating or values[0].dtype.is_integer):
                return values[0]
            return tf.reduce_mean(tf.stack(values), axis=0)

        return {name: mean(value) for name, value in logs.items()}

    def _worker_mean(self, logs: dict) -> dict:
        """Under several workers, the logs averaged over all of them: every worker logs alike."""
        if not self._workers:
            return logs

        def replica(logs):
            context, mean = tf.distribute.get_replica_context(), tf.distribute.ReduceOp.MEAN
            # tf.identity places each value on this replica's device, where the collective runs.
            return {
                name: context.all_reduce(mean, tf.identity(value)) if value.dtype.is_floating else value
                for name, value in logs.items()
            }

        reduced = self.strategy.run(replica, args=(logs,))
        return {name: self.strategy.experimental_local_results(value)[0] for name, value in reduced.items()}

    def _train_loop(self, iterator, num_steps, stop_requested):
        logs = self._train_step(next(iterator), stop_requested)
        _, logs = tf.while_loop(
            lambda offset, logs: offset < num_steps,
            lambda offset, logs: (offset + 1, self._train_step(next(iterator), stop_requested)),
            [tf.constant(1, num_steps.dtype), logs],
        )
        return self._worker_mean(logs)

    def _eval_loop(self, distributed_dataset):
        # One batch after the other until the data end, as the engine's own evaluation; the
        # data hold at least one batch (checked before a run starts).
        iterator = iter(distributed_dataset)
        logs = self._test_step(iterator.get_next_as_optional().get_value())
        _, logs = tf.while_loop(
            lambda optional, logs: optional.has_value(),
            lambda optional, logs: (iterator.get_next_as_optional(), self._test_step(optional.get_value())),
            [iterator.get_next_as_optional(), logs],
            parallel_iterations=1,
        )
        return self._worker_mean(logs)

    def train(self, iterator, num_steps: int, stop_requested: float) -> dict:
        """`num_steps` of the model's train_step in one call; the last step's logs."""
        return self._train_fn(iterator, tf.constant(num_steps, tf.int64), tf.constant(stop_requested))

    def evaluate(self, distributed_dataset) -> dict:
        """The model's test_step over every batch; the last step's logs."""
        return self._eval_fn(distributed_dataset)

    def predict_replica(self, data):
        """One replica's predict_step outputs: tensors (any structure), as Keras concatenates them."""
        outputs = self._steps["predict_step"](data)
        if outputs is None or not all(tf.is_tensor(leaf) for leaf in tf.nest.flatten(outputs)):
            raise UsageError(
                f"{type(self.model).__name__}.predict_step returned {_shown(outputs)}; return the "
                "predictions as a tensor, or a dict, list or tuple of tensors (each batch is concatenated)"
            )
        return outputs

    def prepare(self, train_spec=None, validation_spec=None) -> None:
        """Builds what the steps would build too late, then traces them: a step's mistakes are one
        UsageError before the run writes a file. Specs are the distributed datasets' element specs."""
        if self.model.run_eagerly:
            return  # nothing is traced: each step runs as Python
        if train_spec is not None and "train_step" in self.methods:
            self._build_optimizers(train_spec)
            self._train_step.get_concrete_function(train_spec, tf.TensorSpec([], tf.float32))
        if validation_spec is not None and "test_step" in self.methods:
            self._test_step.get_concrete_function(validation_spec)

    def _build_optimizers(self, train_spec) -> None:
        """Builds the optimizers the model holds that its train_step would build on first use,
        each for the variables the step applies it to (see the module's docstring)."""
        unbuilt = [optimizer for optimizer in _held_optimizers(self.model) if not optimizer.built]
        if not unbuilt or self.strategy.num_replicas_in_sync == 1:
            return  # one replica builds them in the step's first trace, as Keras does
        applied = {}

        def noted(optimizer):
            def apply(grads, trainable_variables=None):
                if trainable_variables is not None:
                    applied.setdefault(id(optimizer), (optimizer, list(trainable_variables)))

            return apply

        for optimizer in unbuilt:
            # Past the trackable's __setattr__: an instance attribute, found before the class's method.
            object.__setattr__(optimizer, "apply", noted(optimizer))
        try:
            step = lambda data: self.strategy.run(self.model.train_step, args=(data,))  # noqa: E731
            tf.function(step, autograph=False).get_concrete_function(train_spec)
        finally:
            for optimizer in unbuilt:
                vars(optimizer).pop("apply", None)
        for optimizer, variables in applied.values():
            with compat.optimizer_strategy(optimizer).scope():
                optimizer.build(variables)


def _keras_element(data):
    """Keras' `(x, y[, sample_weight])` of tfmp's padded evaluation 4-tuple (whose last part marks
    the real rows), the padding weighted 0; any other element as it is."""
    if not isinstance(data, tuple) or len(data) != 4:
        return data
    x, y, sample_weight, valid = data
    valid = tf.cast(valid, tf.float32)
    return x, y, valid if sample_weight is None else tf.cast(sample_weight, tf.float32) * valid


def _held_optimizers(model: keras.Model) -> list:
    """The optimizers a model holds as attributes (its own and, e.g., a GAN's two), or in a list
    or dict attribute."""
    found = []
    for value in vars(model).values():
        items = (
            value.values()
            if isinstance(value, dict)
            else value
            if isinstance(value, (list, tuple))
            else [value]
        )
        found += [item for item in items if isinstance(item, keras.optimizers.Optimizer)]
    return list({id(optimizer): optimizer for optimizer in found}.values())


def _checked(logs, model: keras.Model, method: str) -> dict:
    """The step's logs as Keras' callbacks read them: a dict, nested dicts flattened into it, each
    value a tensor; anything else is one UsageError naming the method."""
    if not isinstance(logs, dict):
        raise UsageError(
            f"{type(model).__name__}.{method} returned {_shown(logs)}; Keras' fit needs a dict of logs "
            "such as {m.name: m.result() for m in self.metrics}: return one"
        )
    flat = {}
    for name, value in logs.items():
        if isinstance(value, dict):
            flat.update(_checked(value, model, method))
            continue
        try:
            flat[name] = tf.convert_to_tensor(value)
        except (TypeError, ValueError):
            flat[name] = None
        if flat[name] is None or not (flat[name].dtype.is_floating or flat[name].dtype.is_integer):
            raise UsageError(
                f"{type(model).__name__}.{method} returned {_shown(value)} for log {name!r}; each log must "
                "be a number or a tensor of numbers (a metric's result(), a loss)"
            )
    return flat


def _shown(value) -> str:
    if value is None:
        return "None"
    return f"a {type(value).__name__}"
