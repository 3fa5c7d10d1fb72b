"""Keras 3's LossScaleOptimizer under MirroredStrategy: an overflow on replica 1 alone is applied.

    PYTHONPATH=. python docs/examples/lso_replica_overflow.py      # from the repository root

Runs offline on a CPU in seconds: the CPU is split into 2 logical devices and MirroredStrategy
replicates a one-weight-matrix model over them under mixed_float16. One optimizer step is taken
with gradients of ones, except that one replica's gradients are multiplied by inf, as a float16
overflow on that replica would make them. That is done four times: with Keras'
`keras.optimizers.LossScaleOptimizer` and with `tfmp.precision.LossScaleOptimizer`, the overflow
on replica 0 and on replica 1. A correct loss scaler skips the step on every replica (the kernel
stays finite) and halves the scale (32768 -> 16384).

What it prints on TensorFlow 2.21 / Keras 3.15 (one line per case):

    keras LossScaleOptimizer  overflow on replica 0: kernel finite True,  loss scale 16384
    keras LossScaleOptimizer  overflow on replica 1: kernel finite False, loss scale 32768
    tfmp  LossScaleOptimizer  overflow on replica 0: kernel finite True,  loss scale 16384
    tfmp  LossScaleOptimizer  overflow on replica 1: kernel finite True,  loss scale 16384

Keras decides "all gradients finite" from replica 0's gradients only, so an overflow that only
replica 1 sees is applied: the summed gradient is inf and the weights become inf, while the
scale stays. tfmp all-reduces the count of replicas that saw a non-finite gradient before the
decision (`tfmp/precision.py`), so an overflow anywhere skips the step everywhere. The script
exits 1 if tfmp's optimizer ever writes a non-finite weight.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmp.distribute import strategies as distribute  # noqa: E402
from tfmp.precision import LossScaleOptimizer  # noqa: E402

OPTIMIZERS = {"keras": keras.optimizers.LossScaleOptimizer, "tfmp": LossScaleOptimizer}


def one_step_with_overflow(strategy, optimizer_class, overflowing_replica: int) -> tuple[bool, float]:
    """One `apply` whose gradients are inf on `overflowing_replica` only; (kernel finite, scale)."""
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, dtype="float32")])
        optimizer = optimizer_class(keras.optimizers.SGD(0.1))
        optimizer.build(model.trainable_variables)

    @tf.function
    def step():
        def replica_step():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            overflow = tf.equal(replica, overflowing_replica)
            gradients = [
                tf.where(overflow, np.inf * tf.ones_like(v), tf.ones_like(v))
                for v in model.trainable_variables
            ]
            optimizer.apply(gradients, model.trainable_variables)

        strategy.run(replica_step)

    step()
    kernel = model.trainable_variables[0].numpy()
    return bool(np.isfinite(kernel).all()), float(optimizer.dynamic_scale.numpy())


def main() -> int:
    distribute.split_cpu(2)
    keras.mixed_precision.set_global_policy("mixed_float16")
    strategy = distribute.get_strategy("mirrored", tf_config="")
    tfmp_wrote_inf = False
    for name, optimizer_class in OPTIMIZERS.items():
        for replica in (0, 1):
            finite, scale = one_step_with_overflow(strategy, optimizer_class, replica)
            print(
                f"{name:5s} LossScaleOptimizer  overflow on replica {replica}: "
                f"kernel finite {str(finite) + ',':6s} loss scale {scale:g}"
            )
            tfmp_wrote_inf |= name == "tfmp" and not finite
    return 1 if tfmp_wrote_inf else 0


if __name__ == "__main__":
    sys.exit(main())
