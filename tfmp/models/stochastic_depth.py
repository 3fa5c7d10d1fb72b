"""Stochastic depth (Huang et al. 2016): a residual add whose residual branch is dropped per example.

    shortcut_plus = StochasticDepth(0.1, name="block3_add1")([shortcut, residual])

In training, each example keeps its residual with probability 1 - rate, scaled by 1 / (1 - rate)
so the expected output is the plain sum (timm's `drop_path`, DeiT's and big_vision's "drop path"):

    output[i] = shortcut[i] + residual[i] * keep[i] / (1 - rate),   keep[i] ~ Bernoulli(1 - rate)

At inference (`training` False or None) the output is exactly `shortcut + residual`: the random
draw is behind a Python branch, so a SavedModel, a TFLite file or any inference trace holds no
random op and no read of the seed state. `rate` 0 is a plain add in training too.

How the draw is made, and why not `keras.random.dropout`:
- the seed is Keras' own: a `keras.random.SeedGenerator` attribute, as `keras.layers.Dropout`
  keeps one, so `keras.utils.set_random_seed` or `seed=` make runs repeatable, the state moves by
  one each training call, and it is a variable of the model (checkpointed beside the weights);
- under a distribution strategy every replica holds the same seed state (a mirrored variable),
  so Keras' Dropout draws the same mask on every replica: example i of replica 0 and example i of
  replica 1 are dropped together. Here the replica's id in its sync group is folded into the seed
  (`tf.random.experimental.stateless_fold_in`), so replicas draw independently, still from a
  state they share and advance alike. `keras.random.*` takes only an integer or a
  SeedGenerator as its seed, hence TensorFlow's stateless uniform (the op `keras.random.dropout`
  runs) on the folded seed;
- the mask is drawn in float32 and compared, then cast to the residual's dtype: the layer
  computes in its inputs' (compute) dtype under mixed_float16 and mixed_bfloat16, and the
  1 / (1 - rate) factor is rounded to that dtype once, as Keras' dropout rounds its scale.
  Everything is stateless and compiles under XLA (`jit_compile`).
"""

from __future__ import annotations

import numbers

import keras
import tensorflow as tf

from tfmp.errors import UsageError, spelt


def check_rate(rate: float, *, as_flag: bool = False) -> None:
    """Raises `UsageError` (a ValueError; one line) unless `rate` is a number in [0, 1);
    `as_flag` names it as the apps' --stochastic_depth."""
    if not isinstance(rate, numbers.Real) or isinstance(rate, bool) or not 0 <= rate < 1:  # NaN too
        raise UsageError(
            f"{spelt('stochastic_depth', rate, as_flag)} must be in [0, 1): the last block's drop rate, "
            "e.g. 0.1 (DeiT)"
        )


@keras.saving.register_keras_serializable(package="tfmp")
class StochasticDepth(keras.layers.Layer):
    """`shortcut + residual`, the residual dropped per example with probability `rate` in training
    (kept ones scaled by 1 / (1 - rate)); exactly the plain add at inference.

    Called on `[shortcut, residual]`, two tensors of one shape whose first axis is the batch.
    `rate` in [0, 1) (ValueError otherwise); `seed` an integer for the layer's SeedGenerator, None:
    drawn from Python's generator, which `keras.utils.set_random_seed` seeds.
    """

    def __init__(self, rate: float, seed: int | None = None, **kwargs):
        super().__init__(**kwargs)
        check_rate(rate)
        self.rate = float(rate)
        self.seed = seed
        # As keras.layers.Dropout: no seed state (no variable) when nothing is ever drawn.
        if self.rate > 0:
            self.seed_generator = keras.random.SeedGenerator(seed)

    def call(self, inputs, training=None):
        shortcut, residual = inputs
        if not training or self.rate == 0:
            return shortcut + residual
        return shortcut + residual * self._mask(residual)

    def _mask(self, residual):
        """keep / (1 - rate) per example, shaped (batch, 1, ..., 1), in the residual's dtype."""
        shape = [keras.ops.shape(residual)[0]] + [1] * (len(residual.shape) - 1)
        seed = self.seed_generator.next()
        replica = tf.distribute.get_replica_context()
        if replica is not None and replica.num_replicas_in_sync > 1:
            seed = tf.random.experimental.stateless_fold_in(seed, replica.replica_id_in_sync_group)
        uniform = tf.random.stateless_uniform(shape, seed=tf.cast(seed, tf.int64), dtype=tf.float32)
        keep = tf.cast(uniform >= self.rate, residual.dtype)
        return keep * tf.cast(1.0 / (1.0 - self.rate), residual.dtype)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[0])

    def get_config(self):
        return {**super().get_config(), "rate": self.rate, "seed": self.seed}
