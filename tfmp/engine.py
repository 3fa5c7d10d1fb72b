"""The distributed train/eval step every tfmp run uses, under every strategy and precision.

    engine = Engine(strategy, model, optimizer, global_batch_size=256, xla=False)
    totals = engine.train(distributed_iterator, num_steps=10)   # one host call, 10 steps
    print(totals.loss, totals.accuracy)

Why not `model.fit`: in Keras 3.15 it fails under MultiWorkerMirroredStrategy ("Attempt to
convert a value (PerReplica...)") and `compile(jit_compile=True)` fails under MirroredStrategy
(a resource on CPU:1 read from CPU:0). Here each replica runs a plain `strategy.run` step:

- the per-example loss is summed and divided by the *global* batch, so the all-reduced (summed)
  gradients equal the single-device gradient of the global batch;
- with XLA only the forward+backward pass is compiled, per replica. The gradient all-reduce and
  the optimizer update stay outside the cluster, which is what makes XLA work under Mirrored
  and MultiWorkerMirrored alike;
- loss scaling is `optimizer.scale_loss` then `optimizer.apply` (which unscales); with
  `precision.LossScaleOptimizer` an overflow on any replica skips the step on all replicas;
- metrics accumulate in SUM-on-read variables: no communication per step, one reduction when
  read. `steps_per_execution` steps run in one `tf.function` call (a `tf.range` loop).
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

# Accumulator slots, summed over replicas and steps: loss sum, examples in it, correct,
# examples, steps with non-finite values, steps run while a worker asked to stop.
_SLOTS = 6


@dataclasses.dataclass(frozen=True)
class Totals:
    """Metrics over the steps since the last reset, summed across all replicas and workers."""

    loss_sum: float
    loss_examples: float
    correct: float
    examples: float
    nonfinite_steps: float
    stop_requests: float  # > 0 when any worker asked to stop (preemption); not a count

    @property
    def loss(self) -> float:
        return self.loss_sum / self.loss_examples if self.loss_examples else float("nan")

    @property
    def accuracy(self) -> float:
        return self.correct / self.examples if self.examples else float("nan")


class Engine:
    """Owns the compiled train and eval functions for one model, optimizer and strategy."""

    def __init__(self, strategy: tf.distribute.Strategy, model: keras.Model,
                 optimizer: keras.optimizers.Optimizer, global_batch_size: int, xla: bool = False):
        self.strategy = strategy
        self.model = model
        self.optimizer = optimizer
        self.global_batch_size = global_batch_size
        self.xla = xla
        # Keras losses follow the global policy unless told otherwise; losses stay float32.
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(reduction=None, dtype="float32")
        with strategy.scope():
            optimizer.build(model.trainable_variables)
            self._train_totals = self._accumulator("train_totals")
            self._eval_totals = self._accumulator("eval_totals")
        self._gradients = tf.function(self._gradients_fn, jit_compile=True) if xla else self._gradients_fn
        self._forward = tf.function(self._forward_fn, jit_compile=True) if xla else self._forward_fn
        self._train_fn = tf.function(self._train_loop)
        self._eval_fn = tf.function(self._eval_loop)
        self._infer_fn = tf.function(self._infer_loop)

    @staticmethod
    def _accumulator(name: str) -> tf.Variable:
        return tf.Variable(tf.zeros([_SLOTS], tf.float32), trainable=False, name=name,
                           synchronization=tf.VariableSynchronization.ON_READ,
                           aggregation=tf.VariableAggregation.SUM)

    def _batch_statistics(self, labels, probabilities, padded=False):
        """Loss sum, correct count and example count of a batch.

        Eval batches are padded to full size (label -1) so every replica and worker runs the
        same number of full batches; padded rows count nowhere.
        """
        valid = labels >= 0 if padded else tf.ones_like(labels, tf.bool)
        labels = tf.maximum(labels, 0)
        weights = tf.cast(valid, tf.float32)
        loss_sum = tf.reduce_sum(self.loss_fn(labels, probabilities) * weights)
        predictions = tf.argmax(probabilities, axis=-1, output_type=labels.dtype)
        correct = tf.reduce_sum(tf.cast(tf.equal(predictions, labels), tf.float32) * weights)
        return loss_sum, correct, tf.reduce_sum(weights)

    def _gradients_fn(self, images, labels):
        with tf.GradientTape() as tape:
            probabilities = self.model(images, training=True)
            loss_sum, correct, examples = self._batch_statistics(labels, probabilities)
            loss = loss_sum / self.global_batch_size
            if self.model.losses:
                # Regularisers are added once per replica, and gradients are summed over replicas.
                loss += tf.add_n(self.model.losses) / self.strategy.num_replicas_in_sync
            scaled_loss = self.optimizer.scale_loss(loss)
        gradients = tape.gradient(scaled_loss, self.model.trainable_variables)
        # The loss alone can look finite when the gradients are not (cross-entropy clips NaN
        # probabilities), so the stop/skip statistics check the gradients themselves.
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in gradients if g is not None])
        return gradients, loss_sum, correct, examples, tf.logical_and(finite, tf.math.is_finite(loss_sum))

    def _train_replica_step(self, images, labels, stop_requested):
        gradients, loss_sum, correct, examples, finite = self._gradients(images, labels)
        self.optimizer.apply(gradients, self.model.trainable_variables)
        self._accumulate(self._train_totals, loss_sum, correct, examples, finite, stop_requested)

    @staticmethod
    def _accumulate(totals, loss_sum, correct, examples, finite=None, stop_requested=0.0):
        finite = tf.math.is_finite(loss_sum) if finite is None else finite
        totals.assign_add(tf.stack([
            tf.where(finite, loss_sum, 0.0), tf.where(finite, examples, 0.0), correct, examples,
            tf.where(finite, 0.0, 1.0), tf.cast(stop_requested, tf.float32)]))

    def _train_loop(self, iterator, num_steps, stop_requested):
        # The stop request rides on the metrics' own reduction: no extra collective per step.
        for _ in tf.range(num_steps):
            images, labels = next(iterator)
            self.strategy.run(self._train_replica_step, args=(images, labels, stop_requested))

    def _forward_fn(self, images):
        return self.model(images, training=False)

    def _eval_replica_step(self, images, labels):
        probabilities = self._forward(images)
        self._accumulate(self._eval_totals, *self._batch_statistics(labels, probabilities, padded=True))

    def _eval_loop(self, distributed_dataset):
        for images, labels in distributed_dataset:
            self.strategy.run(self._eval_replica_step, args=(images, labels))

    def _infer_loop(self, iterator, num_steps):
        for _ in tf.range(num_steps):
            images, labels = next(iterator)
            self.strategy.run(self._eval_replica_step, args=(images, labels))

    @staticmethod
    def _read_and_reset(totals: tf.Variable) -> Totals:
        values = totals.read_value().numpy()
        totals.assign(tf.zeros([_SLOTS], tf.float32))
        return Totals(*(float(v) for v in values))

    def train(self, iterator, num_steps: int, stop_requested: bool = False) -> Totals:
        """Runs `num_steps` steps in one call; returns (and resets) the metrics of those steps.

        `stop_requested` (this worker got SIGTERM) shows up on every worker as
        `Totals.stop_requests > 0`, so all of them can checkpoint at the same step.
        """
        self._train_fn(iterator, tf.constant(num_steps, tf.int64),
                       tf.constant(float(stop_requested), tf.float32))
        return self._read_and_reset(self._train_totals)

    def infer(self, iterator, num_steps: int) -> Totals:
        """Forward passes only (inference throughput): `num_steps` batches in one call."""
        self._infer_fn(iterator, tf.constant(num_steps, tf.int64))
        return self._read_and_reset(self._eval_totals)

    def evaluate(self, distributed_dataset) -> Totals:
        """One pass over a finite distributed dataset whose batches are full (pad with label -1)."""
        self._eval_fn(distributed_dataset)
        return self._read_and_reset(self._eval_totals)
