"""The distributed train/eval step every tfmp run uses, for any compiled Keras model.

    model.compile(optimizer, loss, metrics)           # inside strategy.scope()
    engine = Engine(strategy, model, xla=False)
    result = engine.train(distributed_iterator, num_steps=10)   # one host call, 10 steps
    print(result.metrics)                              # {"loss": ..., "accuracy": ...}

Why not `model.fit`: in Keras 3.15 it fails under MultiWorkerMirroredStrategy ("Attempt to
convert a value (PerReplica...)") and `compile(jit_compile=True)` fails under MirroredStrategy
(a resource on CPU:1 read from CPU:0). Here each replica runs a plain `strategy.run` step that
does what Keras' own `train_step` does, so the numbers are Keras' numbers:

- the loss is the model's compiled loss (`model.compute_loss`: every output, `loss_weights`,
  `sample_weight`, plus `model.losses`). Keras divides each mean-reduced loss and each
  regulariser by the number of replicas, so the all-reduced (summed) gradients of N replicas
  equal the single-device gradient of the global batch. A loss that normalises by a count
  inside the batch uses `distribute.global_sum` for the global count (and `reduction="sum"`);
- metrics are the model's compiled metrics (and its loss trackers): Keras keeps them in
  SUM-on-read variables, so each replica accumulates locally (no communication per step) and a
  read after the host call reduces them over every replica and worker (all in one traced call);
- with XLA the model's forward pass (and with it its backward pass) is compiled per replica;
  a model that defines `compiled_forward()` (Faster R-CNN) compiles only the parts it names.
  The loss, the gradient all-reduce and the optimizer update stay outside the cluster, which is
  what makes XLA work under Mirrored and MultiWorkerMirrored alike, and lets a loss all-reduce;
- loss scaling is `optimizer.scale_loss` then `optimizer.apply` (which unscales); with
  `precision.LossScaleOptimizer` an overflow on any replica skips the step on all replicas; a
  fixed `loss_scale_factor` needs `compile(auto_scale_loss=False)` (Keras' wrapper clears it);
- non-finite numbers never reach the weights: a replica's verdict (loss and gradients finite;
  and only for a step that is not, whether its features, labels or sample weights are) is
  agreed where it must be: without a dynamic loss scaler the update waits for it (one
  merge_call per step), across workers a 4-float all-reduce keeps host calls in step; a loss
  scaler skips a non-finite step itself. A step that stops the run (non-finite without a loss
  scaler, or non-finite inputs) ends the host call, so the model keeps the weights of the step
  before; `StepResult.halted_at` names that step for the loop;
- `steps_per_execution` steps run in one `tf.function` call (a `tf.while_loop`; no AutoGraph),
  or as Python when the model was compiled with `run_eagerly=True`;
- a model that overrides `train_step`, `test_step` or `predict_step` has its own method run in
  place of the step above, per replica and in the same host calls (`model_steps.OwnSteps`);
- worker-local variables (a pipeline on every worker: MultiWorkerMirroredStrategy with one
  replica per worker, the model and optimizer made outside its scope so each stage's variables
  sit on its stage's device): the replica all-reduces its gradients itself, one collective per
  stage device, and each worker applies the sums once, outside `strategy.run`, with the same
  optimizer code as everywhere else. Overflow skips agree because every worker applies the same
  summed gradients; metrics are still summed over workers (compile in the strategy's scope).
"""

from __future__ import annotations

import contextlib
import functools

import keras
import numpy as np
import tensorflow as tf

from tfmp import compat, precision
from tfmp.distribute import allreduce
from tfmp.distribute import strategies as distribute
from tfmp.errors import UsageError
from tfmp.training import step_status
from tfmp.training.model_steps import OwnSteps, metrics_or_logs, overridden
from tfmp.training.step_status import StepResult


def _unpack(data):
    """(x, y, sample_weight, valid): Keras' 1-3 tuples, plus tfmp's padded eval 4-tuple.

    `valid` (1 for a real row, 0 for padding) lets eval batches be padded to full size, so every
    replica and worker runs the same number of steps while padded rows count nowhere.
    """
    if isinstance(data, (list, tuple)):
        data = tuple(data) + (None,) * (4 - len(data))
        return data
    return data, None, None, None


def _rows(x):
    first = next(tensor for tensor in tf.nest.flatten(x) if tensor is not None)
    return tf.shape(first)[0]


class Engine:
    """Owns the compiled train, eval and predict functions for one compiled model and strategy."""

    def __init__(
        self,
        strategy: tf.distribute.Strategy,
        model: keras.Model,
        optimizer: keras.optimizers.Optimizer | None = None,
        *,
        xla: bool = False,
        gradients=None,
        forward=None,
        allreduce_plan: allreduce.Plan | None = None,
    ):
        """`gradients(engine, x, y, sample_weight) -> (y_pred, loss, gradients)` replaces the
        one-tape forward/backward pass (a pipeline computes it stage by stage); the loss it
        returns is unscaled and the gradients are those of `optimizer.scale_loss(loss)`.
        `forward(engine, x, training) -> y_pred` replaces the eval/predict forward pass (a
        pipeline's runs stage by stage, each stage compiled on its own device with XLA).
        `allreduce_plan` says in which dtype and buckets the gradients are summed (default:
        `allreduce.resolve("auto", ...)` for the model's policy)."""
        if not getattr(model, "compiled", False) or model.optimizer is None:
            raise UsageError(
                f"model {model.name!r} is not compiled; call model.compile(optimizer, loss, "
                "metrics) inside the strategy's scope first"
            )
        self.strategy = strategy
        self.model = model
        # compile(run_eagerly=True): every loop below runs as Python, each step too (as Keras' fit).
        self.run_eagerly = bool(model.run_eagerly)
        if optimizer is not None:
            precision.check_compiled_with(model, optimizer)
        self.optimizer = optimizer or model.optimizer
        # A dynamic loss scaler skips a non-finite step itself; any other optimizer would apply it.
        self.loss_scaling = isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
        self.xla = xla
        self.worker_local = _worker_local_variables(strategy, model, self.optimizer)
        self.allreduce = allreduce_plan or allreduce.resolve(
            "auto", model.dtype_policy.name, self.loss_scaling, strategy.num_replicas_in_sync
        )
        self.local_replicas = (
            len(strategy.extended.worker_devices) if strategy.num_replicas_in_sync > 1 else 1
        )
        with contextlib.nullcontext() if self.worker_local else strategy.scope():
            self.optimizer.build(model.trainable_variables)
        with strategy.scope():
            self._status = tf.Variable(
                tf.zeros([step_status.SLOTS], tf.float32),
                trainable=False,
                name="engine_status",
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.SUM,
            )
        # What XLA compiles, for run cards: the whole forward pass, or the parts a model names.
        self.xla_parts = getattr(model, "XLA_PARTS", "forward+backward compiled per replica")
        if forward is not None:
            self._forward = lambda x, training: forward(self, x, training)
        elif xla and hasattr(model, "compiled_forward"):
            # A model with ops XLA has no kernel for (Faster R-CNN's NMS, CropAndResize) hands
            # over a forward pass that compiles only its static-shaped parts.
            self._forward = model.compiled_forward()
        else:
            self._forward = self.traced(self._forward_fn, jit_compile=True) if xla else self._forward_fn
        self._gradients = (lambda *args: gradients(self, *args)) if gradients else self._forward_backward
        self._train_fn = self.traced(self._train_loop)
        self._eval_fn = self.traced(self._eval_loop)
        self._infer_fn = self.traced(self._infer_loop)
        self._predict_fn = self.traced(self._predict_batch)
        self._read_fn = self.traced(self._read_all)
        # The steps the model overrides (a GAN's train_step, ...) run as Keras runs them.
        self.own = OwnSteps(self) if overridden(model) else None

    def traced(self, function, jit_compile: bool = False):
        """`function` as the engine runs it: traced without AutoGraph, or as it is (Python) when
        the model was compiled with run_eagerly=True."""
        return function if self.run_eagerly else _traced(function, jit_compile=jit_compile)

    def _owns(self, method: str) -> bool:
        return self.own is not None and method in self.own.methods

    @functools.cached_property
    def loss_tracker(self) -> keras.metrics.Metric:
        """The compiled loss' tracker, which the engine's own train and test steps update (a
        model whose own steps do its tracking needs none)."""
        return _loss_tracker(self.model)

    def note_stop_request(self, stop_requested) -> None:
        """A replica counts this worker's stop request (SIGTERM) into the status every worker reads."""
        self._status.assign_add(step_status.stop_request_row(stop_requested))

    def _forward_fn(self, x, training):
        return self.model(x, training=training)

    def _loss(self, x, y, y_pred, sample_weight, training):
        """The model's compiled loss for this replica, already divided for the replica count."""
        return self.model.compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
        )

    def _track(self, loss, rows, finite, x, y, y_pred, sample_weight):
        """Keras' loss tracker (weighted by real rows; skipped steps count nowhere) and metrics."""
        # compute_loss divided by the replica count (so summed gradients are the global ones);
        # the tracker shows the replica's own mean loss, as Keras' train_step does.
        unscaled = tf.cast(loss, tf.float32) * self.strategy.num_replicas_in_sync
        rows = tf.cast(rows, tf.float32)
        self.loss_tracker.update_state(
            tf.where(finite, unscaled, 0.0), sample_weight=tf.where(finite, rows, 0.0)
        )
        self.model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _forward_backward(self, x, y, sample_weight):
        """(predictions, loss, gradients) of one replica's batch: one tape over the whole model."""
        with tf.GradientTape() as tape:
            y_pred = self._forward(x, True)
            loss = self._loss(x, y, y_pred, sample_weight, training=True)
            scaled_loss = self.optimizer.scale_loss(loss)
        return y_pred, loss, tape.gradient(scaled_loss, self.model.trainable_variables)

    def _train_replica_step(self, data, stop_requested, offset, apply: bool = True):
        """One replica's step; with `apply=False` (worker-local variables) it returns the
        gradients summed over every replica, and so over workers, instead of applying them, and
        whether to apply them."""
        x, y, sample_weight, _ = _unpack(data)
        y_pred, loss, gradients = self._gradients(x, y, sample_weight)
        context = tf.distribute.get_replica_context()
        if context.num_replicas_in_sync > 1:
            # Summed here, in the plan's dtype and buckets; the optimizer then applies the sums
            # as they are (its own float32 all-reduce is off: compat.gradients_summed_by_caller).
            gradients = allreduce.all_reduce(context, gradients, self.allreduce)
        with compat.gradients_summed_by_caller(self.optimizer):
            return self._verdict_and_update(
                x, y, sample_weight, y_pred, loss, gradients, stop_requested, offset, apply
            )

    def _verdict_and_update(
        self, x, y, sample_weight, y_pred, loss, gradients, stop_requested, offset, apply
    ):
        """The step's finite verdict, agreed, its metrics and status, then the update (or, with
        `apply=False`, the summed gradients and whether to apply them). The gradients are the
        replicas' sums already: an overflow in a sum is non-finite on every replica alike."""
        # The loss alone can look finite when the gradients are not (cross-entropy clips NaN
        # probabilities), so the verdict checks the gradients themselves.
        finite = step_status.finite([g for g in gradients if g is not None] + [loss])
        # Only a step that is not finite pays for a look at its inputs (a tf.cond: nothing else).
        inputs = tf.cond(
            finite,
            lambda: tf.zeros([len(step_status.INPUTS)]),
            lambda: step_status.nonfinite_inputs((x, y, sample_weight)),
        )
        nonfinite_here = 1.0 - tf.cast(finite, tf.float32)
        # Without a loss scaler a non-finite step would be applied: the update waits for the verdict.
        guarded = apply and not self.loss_scaling
        verdict = self._agree(tf.concat([[nonfinite_here], inputs], axis=0), gradients if guarded else None)
        nonfinite, bad_inputs = verdict[0] > 0, verdict[1:] > 0
        # The step that stops the run; the host loop runs no step after it. A loss scaler skips
        # it (its verdict is all-reduced) and halves the scale, as for any overflow.
        stops = tf.reduce_any(bad_inputs) if self.loss_scaling else nonfinite
        self._track(loss, _rows(x), finite & tf.logical_not(stops), x, y, y_pred, sample_weight)
        self._status.assign_add(
            step_status.step_row(nonfinite_here, stop_requested, stops, offset, bad_inputs)
        )
        if apply:
            if self.loss_scaling:
                self.optimizer.apply(gradients, self.model.trainable_variables)
            return None
        summed = {str(position): g for position, g in enumerate(gradients) if g is not None}
        return summed, tf.constant(True) if self.loss_scaling else tf.logical_not(nonfinite)

    def _agree(self, verdict, gradients=None):
        """This replica's verdict, summed over the workers' replicas when there are several
        workers (a 4-float all-reduce: each worker must end the host call at the same step) or
        `gradients` are given; then the optimizer applies them on every replica when no
        replica's were non-finite.

        On one worker a loss scaler needs no agreement (its own verdict is all-reduced, and the
        loop sums the replicas' status there). With `gradients`, one merge_call sums the verdicts
        of the worker's replicas and conditions the update in the cross-replica context, as its
        all-reduce cannot sit in a replica context's tf.cond (Keras' LossScaleOptimizer does it so).
        """
        context = tf.distribute.get_replica_context()
        summed = context.num_replicas_in_sync > self.local_replicas
        if summed:
            verdict = context.all_reduce(tf.distribute.ReduceOp.SUM, verdict)
        if gradients is None:
            return verdict
        variables = self.model.trainable_variables

        def cross_replica(strategy, verdict, gradients):
            local = strategy.experimental_local_results(verdict)
            total = local[0] if summed else tf.add_n(local)
            if gradients is not None:

                def update():
                    strategy.run(self.optimizer.apply, args=(gradients, variables))

                tf.cond(total[0] > 0, lambda: None, update)
            return total

        return context.merge_call(cross_replica, args=(verdict, gradients))

    def _worker_local_step(self, data, stop_requested, offset):
        # In the cross-replica context of no strategy: the optimizer (made outside the scope)
        # updates this worker's own variables once, with the sums every worker got alike.
        step = functools.partial(self._train_replica_step, apply=False)
        reduced, go = self.strategy.run(step, args=(data, stop_requested, offset))
        variables = self.model.trainable_variables
        gradients = [None] * len(variables)
        for position, gradient in reduced.items():
            gradients[int(position)] = self.strategy.experimental_local_results(gradient)[0]
        go = self.strategy.experimental_local_results(go)[0]
        tf.cond(go, lambda: self.optimizer.apply(gradients, variables), lambda: None)

    def _train_loop(self, iterator, num_steps, stop_requested):
        def step(offset, halted):
            if self.worker_local:
                self._worker_local_step(next(iterator), stop_requested, offset)
            else:
                self.strategy.run(self._train_replica_step, args=(next(iterator), stop_requested, offset))
            # A step stopped the run: no later step of this call runs, so the model keeps the
            # weights of the step before it. This worker's replicas' slots (no collective): on
            # several workers every replica holds the agreed verdict. (The stop request rides on
            # a SUM-on-read variable: no extra collective per step.)
            local = self.strategy.experimental_local_results(self._status)
            return offset + 1, tf.add_n([status[step_status.HALTING] for status in local]) > 0

        tf.while_loop(
            lambda offset, halted: (offset < num_steps) & tf.logical_not(halted),
            step,
            [tf.constant(0, num_steps.dtype), tf.constant(False)],
        )

    def _eval_replica_step(self, data):
        if self._owns("test_step"):
            return self.own.test_replica(data)
        x, y, sample_weight, valid = _unpack(data)
        y_pred = self._forward(x, False)
        loss = self._loss(x, y, y_pred, sample_weight, training=False)
        rows = tf.cast(_rows(x), tf.float32)
        if valid is not None:
            # Keras divides a mean loss by all rows; rescale so padded rows count nowhere.
            real_rows = tf.reduce_sum(tf.cast(valid, tf.float32))
            loss = tf.math.divide_no_nan(tf.cast(loss, tf.float32) * rows, real_rows)
            rows = real_rows
        self._track(loss, rows, tf.constant(True), x, y, y_pred, sample_weight)

    def _eval_loop(self, distributed_dataset):
        # An iterator and a while loop until the data ends, as Keras' evaluate: a plain
        # dataset's `reduce` (what a Python loop over it becomes under AutoGraph) would run the
        # model inside tf.data, which places it on the host CPU even beside a GPU
        # (tensorflow#32138). A distributed dataset's own `reduce` is this same loop, one batch
        # after the other.
        iterator = iter(distributed_dataset)

        def step(optional):
            self.strategy.run(self._eval_replica_step, args=(optional.get_value(),))
            return (iterator.get_next_as_optional(),)

        tf.while_loop(
            lambda optional: optional.has_value(),
            step,
            [iterator.get_next_as_optional()],
            parallel_iterations=1,
        )

    def _infer_loop(self, iterator, num_steps):
        def step(offset):
            self.strategy.run(self._eval_replica_step, args=(next(iterator),))
            return offset + 1

        tf.while_loop(lambda offset: offset < num_steps, step, [tf.constant(0, num_steps.dtype)])

    def _predict_batch(self, data):
        booleans = []

        def replica_fn(data):
            # Collective all-gathers (multi-worker) take no bool tensors: carry them as int32.
            booleans.append(tf.nest.map_structure(lambda value: value.dtype == tf.bool, data))
            gatherable = tf.nest.map_structure(
                lambda value: tf.cast(value, tf.int32) if value.dtype == tf.bool else value, data
            )
            if self._owns("predict_step"):
                return self.own.predict_replica(data), gatherable
            return self._forward(_unpack(data)[0], False), gatherable

        outputs, inputs = self.strategy.run(replica_fn, args=(data,))
        # Every worker gets every replica's rows, each output next to the input row it came from.
        # Leaf by leaf: TF 2.21's gather of a nested structure drops rows of its later leaves.
        gather = lambda value: self.strategy.gather(value, axis=0)  # noqa: E731
        inputs = tf.nest.map_structure(
            lambda value, boolean: tf.cast(gather(value), tf.bool) if boolean else gather(value),
            inputs,
            booleans[0],
        )
        return tf.nest.map_structure(gather, outputs), inputs

    def _read_all(self):
        # Every metric variable and the status are SUM-on-read: under MultiWorkerMirroredStrategy
        # each eager read is its own all-reduce round trip between workers (~60 ms each on
        # localhost, measured); read in one traced call, they go out together.
        skipped = getattr(self.optimizer, "skipped_in_a_row", None)
        skipped = tf.constant(-1, tf.int64) if skipped is None else tf.identity(skipped)
        return self.model.get_metrics_result(), self._status.read_value(), skipped

    def _read(self) -> tuple[dict, np.ndarray, int]:
        metrics, status, skipped = self._read_fn()
        return python_logs(metrics), status.numpy(), int(skipped)

    def _results(self) -> dict:
        return self._read()[0]

    def reset_metrics(self) -> None:
        """Starts a new averaging window (an epoch) for the model's metrics."""
        self.model.reset_metrics()

    def train(self, iterator, num_steps: int, stop_requested: bool = False) -> StepResult:
        """Runs `num_steps` steps in one call; returns the metrics since the last reset.

        `stop_requested` (this worker got SIGTERM) shows up on every worker as
        `StepResult.stop_requests > 0`, so all of them can checkpoint at the same step.
        """
        if self._owns("train_step"):
            logs = self.own.train(iterator, num_steps, float(stop_requested))
        else:
            self._train_fn(
                iterator, tf.constant(num_steps, tf.int64), tf.constant(float(stop_requested), tf.float32)
            )
        metrics, status, skipped = self._read()
        if self._owns("train_step"):
            metrics = metrics_or_logs(metrics, python_logs(logs))
        self._status.assign(tf.zeros([step_status.SLOTS], tf.float32))
        return step_status.result(metrics, status, skipped)

    def infer(self, iterator, num_steps: int) -> dict:
        """Forward passes only (inference throughput): `num_steps` batches in one call."""
        self.reset_metrics()
        self._infer_fn(iterator, tf.constant(num_steps, tf.int64))
        return self._results()

    def evaluate(self, distributed_dataset) -> dict:
        """One pass over a finite distributed dataset; the model's metrics over all of it.

        Elements are Keras' `(x, y[, sample_weight])`, or tfmp's padded `(x, y, sample_weight,
        valid)` whose `valid == 0` rows (padding to a full batch) count nowhere.
        """
        self.reset_metrics()
        if self._owns("test_step"):
            logs = python_logs(self.own.evaluate(distributed_dataset))
            results = metrics_or_logs(self._results(), logs)
        else:
            self._eval_fn(distributed_dataset)
            results = self._results()
        self.reset_metrics()
        return results

    def predict(self, distributed_dataset) -> tuple:
        """Model outputs for every element, with the elements themselves, as NumPy on every worker.

        Returns `(outputs, inputs)`, each the model output / input element structure with all
        batches concatenated; padded rows are still there (drop them with the element's mask).
        """
        batches = [self._predict_fn(data) for data in distributed_dataset]
        if not batches:
            return None, None
        concatenated = tf.nest.map_structure(
            lambda *parts: np.concatenate([p.numpy() for p in parts]), *batches
        )
        return concatenated


def _traced(function, jit_compile: bool = False):
    """`tf.function` without AutoGraph, as Keras traces its own train function: the loops here are
    TensorFlow loops as written, so no step code (tfmp's, the model's, its loss') is rewritten,
    and a process's first trace skips converting it (a tiny model's first `tfmp.fit`: 1.7 CPU-s
    with AutoGraph, 0.7 without; Keras' first `fit`: 0.3)."""
    return tf.function(function, jit_compile=jit_compile, autograph=False)


def python_logs(logs: dict) -> dict:
    """Logs as Keras' callbacks get them (`pythonify_logs`): a number where the value holds one,
    else the NumPy array (a vector or matrix metric, e.g. F1Score(average=None))."""
    values = {}
    for name, value in logs.items():
        array = np.asarray(value)
        values[name] = float(array.reshape(())) if array.size == 1 else array
    return values


def _worker_local_variables(strategy, model: keras.Model, optimizer) -> bool:
    """Whether the model's variables are each worker's own under a multi-worker strategy (a
    pipeline on every worker); refuses the mixes the update could not make consistent."""
    variables = model.trainable_variables
    if strategy.num_replicas_in_sync == 1 or not variables or all(map(distribute.is_distributed, variables)):
        return False
    if any(map(distribute.is_distributed, variables)):
        raise UsageError(
            f"model {model.name!r} mixes variables made inside and outside {type(strategy).__name__}'s "
            "scope; make all of them in it (data parallelism) or all outside (a pipeline per worker)"
        )
    local_replicas = len(strategy.extended.worker_devices)
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or local_replicas != 1:
        raise UsageError(
            f"model {model.name!r} was built outside {type(strategy).__name__}'s scope, with "
            f"{local_replicas} local replica(s); build it in strategy.scope(), or for a pipeline on "
            "every worker use distribute.get_strategy('multi_worker', one_replica_per_worker=True)"
        )
    if distribute.is_distributed(optimizer.iterations):
        raise UsageError(
            "the optimizer was made inside the strategy's scope but the model's variables outside "
            "it (a pipeline per worker); make the optimizer outside the scope too"
        )
    return True


def _loss_tracker(model: keras.Model) -> keras.metrics.Metric:
    """The compiled model's "loss" mean (the first of `model.metrics` once compiled)."""
    for metric in model.metrics:
        if isinstance(metric, keras.metrics.Mean) and metric.name == "loss":
            return metric
    raise UsageError(f"model {model.name!r} has no compiled loss tracker; compile it with a loss")
