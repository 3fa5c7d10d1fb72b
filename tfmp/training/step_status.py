"""What one host call of training reports (`StepResult`), and the per-step status behind it.

    status = tf.Variable(tf.zeros([step_status.SLOTS]), ...)   # SUM-on-read, in the strategy
    status.assign_add(step_status.step_row(...))               # each replica, each step
    result = step_status.result(metrics, status.numpy(), skipped_in_a_row)

Each replica adds one row per step to a SUM-on-read variable, so no step pays for a
collective: the host call's one read sums the rows over every replica and worker. The slots
say how many replica-steps were not finite, whether a worker asked to stop, and at which step
training stopped and which of its inputs were to blame. `finite` and `nonfinite_inputs` are
the checks that fill them; the engine (`tfmp.training.engine`) decides what a verdict does.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

# Slots, summed over replicas and steps: replica-steps with non-finite loss or gradients; steps
# run while a worker asked to stop; replicas that stopped training, and the sum of their (1 +
# the host call's step they stopped at: one step, as nothing runs after it); then the replicas
# whose features, labels, sample weights were not finite in that step.
NONFINITE, STOPS, HALTING, HALTED_AT = 0, 1, 2, 3
INPUTS = ("features", "labels", "sample weights")
SLOTS = 4 + len(INPUTS)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one host call of training reports."""

    metrics: dict  # the model's metrics since the last reset, over all replicas and workers
    nonfinite_steps: float  # replica-steps whose loss or summed gradients were not finite (an
    # overflow anywhere counts on every replica: the sums are alike)
    stop_requests: float  # > 0 when any worker asked to stop (preemption); not a count
    halted_at: int = 0  # 1 + the call's step that stopped training (not applied, nor any after); 0: none
    nonfinite_inputs: tuple = ()  # which of "features", "labels", "sample weights" of that step were not finite
    skipped_in_a_row: int | None = None  # dynamic loss scaling: steps skipped in a row up to now


def step_row(nonfinite_here, stop_requested, stops, offset, bad_inputs) -> tf.Tensor:
    """One replica's row for one step: `stops` (this step stops training) records the step's
    `offset` in the host call and which inputs were not finite."""
    return tf.concat(
        [
            [nonfinite_here, tf.cast(stop_requested, tf.float32), tf.where(stops, 1.0, 0.0)],
            [tf.where(stops, tf.cast(offset, tf.float32) + 1.0, 0.0)],
            tf.where(stops & bad_inputs, 1.0, 0.0),
        ],
        axis=0,
    )


def stop_request_row(stop_requested) -> tf.Tensor:
    """A row that counts only this worker's stop request (for steps the engine does not run)."""
    return tf.one_hot(STOPS, SLOTS) * tf.cast(stop_requested, tf.float32)


def result(metrics: dict, status, skipped_in_a_row: int) -> StepResult:
    """The host call's report from its metrics and its summed status (NumPy); a negative
    `skipped_in_a_row` means the optimizer does not count skips."""
    halting = float(status[HALTING])
    return StepResult(
        metrics,
        float(status[NONFINITE]),
        float(status[STOPS]),
        halted_at=round(float(status[HALTED_AT]) / halting) if halting else 0,
        nonfinite_inputs=tuple(name for name, count in zip(INPUTS, status[HALTED_AT + 1 :]) if count),
        skipped_in_a_row=skipped_in_a_row if skipped_in_a_row >= 0 else None,
    )


def finite(tensors) -> tf.Tensor:
    """Whether every value of every tensor is finite (one boolean)."""
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(tensor)) for tensor in tensors])


def nonfinite_inputs(inputs) -> tf.Tensor:
    """1.0 per part of (features, labels, sample weights) holding a NaN or inf, else 0.0."""
    flags = []
    for part in inputs:
        tensors = [_dense_values(tensor) for tensor in tf.nest.flatten(part) if tensor is not None]
        floating = [tensor for tensor in tensors if tensor.dtype.is_floating]
        flags.append(tf.where(finite(floating), 0.0, 1.0) if floating else tf.constant(0.0))
    return tf.stack(flags)


def _dense_values(tensor):
    if isinstance(tensor, tf.RaggedTensor):
        return tensor.flat_values
    if isinstance(tensor, tf.SparseTensor):
        return tensor.values
    return tensor
