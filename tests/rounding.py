"""Comparisons that summation order cannot make flaky: bounds from the dtype, not from a run.

* Accuracy: two passes over the same model and data (eager vs tf.function vs XLA, one batch
  size vs another) sum in different orders, so an example whose two best classes are nearly
  tied may be predicted either way. `count_near_ties` counts those examples from the compute
  dtype's epsilon; `assert_accuracy_within_ties` allows exactly that many flips.
* Weights: N replicas vs one device sum the same gradient in another order.
  `assert_replicas_step_like_one_device` trains one step each way and compares the updates
  within float32 epsilon x the number of summed terms x the update's scale.
"""

import keras
import numpy as np
import tensorflow as tf

# Logits come out of layers computing in the policy's dtype; 64 epsilons of it covers rounding
# in any summation order of these small models (a few hundred terms per output, errors of
# random sign), and is still far below a real difference between two models.
TIE_EPSILONS = 64


def count_near_ties(probabilities, policy):
    """How many rows' top-two classes are within TIE_EPSILONS epsilons of `policy`'s compute
    dtype, compared as log-probabilities (i.e. as logits)."""
    compute_dtype = keras.mixed_precision.Policy(policy).compute_dtype
    margin = TIE_EPSILONS * float(np.finfo(tf.as_dtype(compute_dtype).as_numpy_dtype).eps)
    top_two = np.log(np.clip(np.sort(np.asarray(probabilities, np.float64), axis=-1)[:, -2:], 1e-30, 1.0))
    return int((top_two[:, 1] - top_two[:, 0] < margin).sum())


def assert_accuracy_within_ties(accuracy, reference, examples, ties):
    """`accuracy` and `reference` over `examples` differ by at most `ties` predictions."""
    flipped = round(abs(accuracy - reference) * examples)
    assert flipped <= ties, f"accuracy {accuracy} vs {reference}: {flipped} flips > {ties} near ties"


def assert_replicas_step_like_one_device(build_engine, batches, replicated_strategy, summed_terms):
    """One step of `build_engine(strategy)` on `batches(strategy)` under `replicated_strategy`
    moves each variable as on one device, within float32 epsilon x `summed_terms` (the most
    terms a gradient element sums) x that variable's largest update. One step only: later
    steps start from weights that already differ by rounding, and any non-smooth choice (a ReLU
    at zero, a top-k near tie) then parts the runs by more than rounding. `build_engine` must
    seed its initial weights."""
    one_device = tf.distribute.OneDeviceStrategy("/cpu:0")
    single = build_engine(one_device)
    before = [w.numpy() for w in single.model.trainable_weights]
    single.train(batches(one_device), 1)
    replicated = build_engine(replicated_strategy)
    replicated.train(batches(replicated_strategy), 1)
    assert_same_update(
        before,
        [w.numpy() for w in single.model.trainable_weights],
        [w.numpy() for w in replicated.model.trainable_weights],
        summed_terms,
        names=[w.path for w in single.model.trainable_weights],
    )


def assert_same_update(start, one_device, replicated, summed_terms, names=None):
    """Weights after one step from `start` on one device and on replicas (lists of arrays)
    moved alike: within float32 epsilon x `summed_terms` x each variable's largest update, plus
    the rounding of storing each result: a weight w + update is rounded to float32 at w's
    magnitude (half an ulp, up to epsilon x |w| / 2, in each run), which an update far smaller
    than the weight cannot hide (one step of a small learning rate: updates of 1e-9 on 0.003)."""
    epsilon = np.finfo(np.float32).eps
    for index, (before, reference, variable) in enumerate(zip(start, one_device, replicated)):
        name = names[index] if names else f"weight {index}"
        update = reference - before
        scale = np.abs(update).max()
        assert scale > 0, f"{name} did not train"
        stored = epsilon * np.maximum(np.abs(reference), np.abs(variable))
        tolerance = summed_terms * epsilon * scale + stored
        difference = np.abs((variable - before) - update)
        worst = np.unravel_index(np.argmax(difference - tolerance), difference.shape)
        assert np.all(difference <= tolerance), (
            f"{name}: update {float((variable - before)[worst])} vs one device's {float(update[worst])} "
            f"at {worst} differ by {float(difference[worst])} > {float(tolerance[worst])} "
            f"({int((difference > tolerance).sum())} of {difference.size} elements)"
        )
