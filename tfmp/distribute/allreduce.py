"""The gradient all-reduce: in which dtype, in which buckets, and how many bytes it sends.

    plan = allreduce.resolve("auto", policy="mixed_bfloat16", loss_scaling=False, replicas=2)
    plan.dtype, plan.reason           # "bfloat16", "auto: the policy computes in bfloat16 ..."
    summed = allreduce.all_reduce(replica_context, gradients, plan)   # in a replica context

Keras 3's TensorFlow optimizer all-reduces float32 gradients in one call inside
`optimizer.apply`, after the whole backward pass. tfmp's engine all-reduces them itself, before
`apply` (whose own all-reduce is switched off while it traces: `compat.gradients_summed_by_caller`):

- in `plan.dtype`: each gradient is cast to it, summed over every replica and worker, and cast
  back to float32 for the optimizer. bfloat16 and float16 send half float32's bytes, as Horovod's
  `Compression.fp16` and PyTorch DDP's `bf16_compress_hook` do. Under float16 loss scaling the
  *scaled* gradients are summed, so an overflow in the sum is non-finite on every replica alike
  and the loss scaler skips the step everywhere;
- in buckets of at most `plan.bucket_bytes` (of the sent dtype), in reverse layer order: the
  last layers' gradients, which the backward pass computes first, form the first bucket, and
  each bucket's all-reduce depends only on its own gradients, so TensorFlow's dataflow executor
  can start it while the backward pass is still computing earlier layers (PyTorch DDP's 25 MiB
  buckets; 0 means one call for everything, as Keras does).

`auto` is the policy's compute dtype under mixed_bfloat16 (bfloat16 has float32's range: a sum
of N replicas' gradients cannot overflow where float32's would not) and float32 otherwise:
under mixed_float16 a float16 sum of N scaled gradients overflows N times sooner than each
one, and every overflow is a skipped step, so float16 is a choice to make knowingly. float16
without loss scaling is refused: unscaled gradients below float16's 6e-8 would flush to zero
in the sum, silently.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from tfmp.errors import UsageError, unknown

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's default bucket_cap_mb


@dataclasses.dataclass(frozen=True)
class Plan:
    dtype: str  # the dtype the gradients are summed in
    bucket_bytes: int  # at most this many bytes per all-reduce call; 0: one call
    reason: str  # why this dtype (for the run card)
    requested: str = "auto"  # what was asked for (auto resolves per policy and replica count)

    def describe(self) -> str:
        buckets = f"buckets of {_size(self.bucket_bytes)}" if self.bucket_bytes else "one call"
        return f"{self.dtype}, {buckets} ({self.reason})"


def resolve(
    requested: str, policy: str, loss_scaling: bool, replicas: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Plan:
    """The all-reduce a run uses; UsageError for an unknown dtype, a bucket size below 0, or
    float16 without loss scaling."""
    if requested not in DTYPES:
        raise unknown("--allreduce_dtype value", requested, DTYPES)
    if not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise UsageError(
            f"--allreduce_bucket_bytes={bucket_bytes} must be 0 (one all-reduce call) or a positive "
            f"number of bytes, e.g. {DEFAULT_BUCKET_BYTES} (25 MiB)"
        )
    if requested == "float16" and not loss_scaling:
        scaling = (
            "turn its loss scaling back on (--loss_scale=auto, dynamic or a number), which keeps them in range"
            if policy == "mixed_float16"
            else "train in mixed_float16, whose loss scaling keeps them in range"
        )
        raise UsageError(
            f"--allreduce_dtype=float16 under the {policy} policy, without loss scaling: gradients "
            f"below float16's 6e-8 would be summed as zero, silently; use bfloat16 (float32's range), or {scaling}"
        )
    if replicas == 1:
        return Plan("float32", bucket_bytes, "one replica: nothing is all-reduced")
    if requested != "auto":
        return Plan(requested, bucket_bytes, "asked for")
    if policy == "mixed_bfloat16":
        return Plan(
            "bfloat16", bucket_bytes, "auto: the policy computes in bfloat16, whose range is float32's"
        )
    return Plan("float32", bucket_bytes, f"auto: {policy} keeps float32 gradients")


def implementation(strategy: tf.distribute.Strategy) -> str:
    """The collective the strategies of `tfmp.distribute.strategies` sum gradients with (the
    run card names it): TensorFlow picks it per strategy and device kind, and tfmp sets
    `cross_device_ops` only for a CPU MirroredStrategy."""
    gpus = bool(tf.config.list_logical_devices("GPU"))
    if strategy.num_replicas_in_sync == 1:
        return "none"
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        # CommunicationImplementation.AUTO: NCCL between GPUs, ring collectives otherwise.
        return "NCCL collectives" if gpus else "ring collectives over gRPC"
    if isinstance(strategy, tf.distribute.MirroredStrategy):
        return "NCCL all-reduce" if gpus else "reduction to one device (logical CPUs share memory)"
    return type(strategy).__name__


def buckets(gradients: list, dtype: str, bucket_bytes: int) -> list[list[int]]:
    """Positions of the non-None gradients, last first, grouped into buckets of at most
    `bucket_bytes` in `dtype` (a gradient larger than that is a bucket of its own)."""
    size = tf.as_dtype(dtype).size
    groups, current, current_bytes = [], [], 0
    for position in reversed(range(len(gradients))):
        gradient = gradients[position]
        if gradient is None:
            continue
        nbytes = _elements(gradient) * size
        if current and bucket_bytes and current_bytes + nbytes > bucket_bytes:
            groups.append(current)
            current, current_bytes = [], 0
        current.append(position)
        current_bytes += nbytes
    if current:
        groups.append(current)
    return groups


def all_reduce(context, gradients: list, plan: Plan) -> list:
    """`gradients` summed over every replica of `context` in `plan.dtype`, bucket by bucket, each
    back in its own dtype; None stays None. Each bucket runs on the device its gradients are on
    (a pipeline's stages), as one all-reduce per (bucket, device)."""
    reduced = list(gradients)
    for bucket in buckets(gradients, plan.dtype, plan.bucket_bytes):
        by_device = {}
        for position in bucket:
            by_device.setdefault(gradients[position].device, []).append(position)
        for device, positions in by_device.items():
            with tf.device(device):
                sent = [_to(gradients[position], plan.dtype) for position in positions]
                sums = context.all_reduce(tf.distribute.ReduceOp.SUM, sent)
            for position, summed in zip(positions, sums):
                reduced[position] = _to(summed, gradients[position].dtype)
    return reduced


def gradient_bytes(variables, dtype: str) -> int:
    """The bytes one all-reduce of these variables' gradients sends per replica, in `dtype`."""
    return sum(_elements(variable) for variable in variables) * tf.as_dtype(dtype).size


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} bytes"


def _elements(tensor) -> int:
    shape = tf.TensorShape(tensor.shape)
    return int(shape.num_elements()) if shape.is_fully_defined() else 0


def _to(gradient, dtype):
    """A gradient in `dtype`: dense tensors are cast; an IndexedSlices (an embedding's sparse
    gradient) keeps its indices and casts its values."""
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(tf.cast(gradient.values, dtype), gradient.indices, gradient.dense_shape)
    return tf.cast(gradient, dtype)
