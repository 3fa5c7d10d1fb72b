"""Choosing and describing the `tf.distribute.Strategy` a run uses.

    from tfmp.distribute import strategies as distribute
    distribute.split_cpu(2)                       # before TensorFlow touches a device
    strategy = distribute.get_strategy("auto")
    distribute.per_replica_batch(256, strategy)   # 128 on 2 replicas; refuses 100 on 3

Strategies: `default` (no distribution), `one_device` (first GPU, else the CPU), `mirrored`
(all local GPUs, or the logical CPUs made by `split_cpu`), `multi_worker`
(MultiWorkerMirroredStrategy; every host runs the same program with its own TF_CONFIG), and
`auto`: multi_worker when TF_CONFIG names more than one task, mirrored with more than one local
device, else default. Batch sizes are always global: every replica gets global / replicas.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import math
import os
import re
import time

import tensorflow as tf
from absl import logging

from tfmp import compat
from tfmp.distribute.cluster import ClusterConfig, parse_tf_config, rendezvous
from tfmp.errors import UsageError, unknown

STRATEGIES = ("auto", "default", "one_device", "mirrored", "multi_worker")
LR_SCALING = ("none", "linear", "sqrt")
DEFAULT_STARTUP_TIMEOUT = 120.0
# Seconds a multi-worker task may go without a heartbeat before the coordination service calls
# it dead and aborts every worker's collectives. TensorFlow's 10 s cut off a healthy 2-worker
# group on a loaded 2-core host (training detectors beside other test processes): the leader's own
# heartbeat arrived late. A killed peer is still found at once (its connections reset); 60 s
# bounds only the silent cases: a frozen process or a lost machine.
DEFAULT_HEARTBEAT_TIMEOUT = 60.0


def usable_cores() -> int:
    """The cores this process may run on: its affinity (a launched worker's share), else all."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def max_cpu_devices() -> int:
    """The most logical CPU devices `split_cpu` makes: 4 per usable core. One per core is the
    useful split; a few more still test replica counts on a small host, while 1000 would stall
    the first step for many minutes (each device gets its own executor and copy of every variable)."""
    return 4 * usable_cores()


def split_cpu(num_devices: int, flag: str = "--cpu_replicas") -> None:
    """Splits the CPU into `num_devices` logical devices so MirroredStrategy runs without GPUs.

    Must run before TensorFlow initialises its devices (before the first op or strategy).
    """
    if num_devices <= 1:
        return
    if num_devices > max_cpu_devices():
        raise UsageError(
            f"{flag}={num_devices} is more than the {max_cpu_devices()} logical CPU devices this "
            f"process's {usable_cores()} core(s) can use (4 per core); use at most one per core, "
            f"e.g. {flag}={usable_cores()}"
        )
    cpu = tf.config.list_physical_devices("CPU")[0]
    wanted = [tf.config.LogicalDeviceConfiguration() for _ in range(num_devices)]
    try:
        tf.config.set_logical_device_configuration(cpu, wanted)
    except RuntimeError:
        existing = len(tf.config.list_logical_devices("CPU"))
        if existing != num_devices:
            raise UsageError(
                f"cannot split the CPU into {num_devices} devices: TensorFlow already started with "
                f"{existing}; call split_cpu before any TensorFlow op (each process splits once)"
            ) from None


def set_threads(intra_op: int = 0, inter_op: int = 0) -> None:
    """TensorFlow's two thread pools (0 keeps its default: one thread per core each).

    intra-op threads split one op (a matmul, a convolution); inter-op threads run independent
    ops at once. Like `split_cpu`, this must happen before TensorFlow initialises its runtime.
    """
    try:
        if intra_op:
            tf.config.threading.set_intra_op_parallelism_threads(intra_op)
        if inter_op:
            tf.config.threading.set_inter_op_parallelism_threads(inter_op)
    except RuntimeError:
        if (intra_op and tf.config.threading.get_intra_op_parallelism_threads() != intra_op) or (
            inter_op and tf.config.threading.get_inter_op_parallelism_threads() != inter_op
        ):
            raise UsageError(
                f"cannot set intra-op {intra_op} / inter-op {inter_op} threads: TensorFlow already "
                "started; set them before any TensorFlow op (once per process)"
            ) from None


def _local_devices() -> list[str]:
    gpus = tf.config.list_logical_devices("GPU")
    return [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]


def get_strategy(
    name: str = "auto",
    tf_config: str | None = None,
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    *,
    one_replica_per_worker: bool = False,
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
) -> tf.distribute.Strategy:
    """Returns the strategy for `name` (see STRATEGIES); never None.

    `tf_config` defaults to the TF_CONFIG environment variable and is validated first.
    Multi-worker: a worker that cannot reach its peers within `startup_timeout` seconds fails
    with the unreachable addresses (TensorFlow's own default is to wait an hour); once running,
    a peer silent for `heartbeat_timeout` seconds is taken for dead.
    `one_replica_per_worker`: multi_worker's replica is one device per worker (GPU:0 or CPU:0)
    however many the worker has, which a pipeline on every worker spreads its stages over.
    """
    if name not in STRATEGIES:
        raise unknown("strategy", name, STRATEGIES)
    raw = os.environ.get("TF_CONFIG") if tf_config is None else tf_config
    cluster = parse_tf_config(raw)
    multi_task = cluster is not None and cluster.num_workers > 1
    if name == "auto" and multi_task:
        name = "multi_worker"
    if name == "multi_worker":
        # Before anything lists logical devices: that starts TensorFlow's runtime, and
        # collective ops can only be configured before it starts.
        return _multi_worker(cluster, startup_timeout, heartbeat_timeout, one_replica_per_worker)
    devices = _local_devices()
    if name == "auto":
        name = "mirrored" if len(devices) > 1 else "default"
        logging.info("strategy auto -> %s (%d local devices)", name, len(devices))
    if multi_task:
        raise UsageError(
            f"--strategy={name} with a TF_CONFIG of {cluster.num_workers} tasks would "
            "train each worker alone; use --strategy=multi_worker (or auto) or unset TF_CONFIG"
        )
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "one_device":
        return tf.distribute.OneDeviceStrategy(devices[0])
    if tf.config.list_logical_devices("GPU"):
        return tf.distribute.MirroredStrategy(devices)  # NCCL all-reduce between GPUs
    # Logical CPUs share one memory: reduce on one device. TF's default for them, ring
    # collectives, also breaks when a process creates a second strategy (instance keys collide).
    return tf.distribute.MirroredStrategy(devices, cross_device_ops=tf.distribute.ReductionToOneDevice())


def _multi_worker(
    cluster: ClusterConfig | None,
    startup_timeout: float,
    heartbeat_timeout: float,
    one_replica_per_worker: bool = False,
) -> tf.distribute.Strategy:
    if cluster is None:
        raise UsageError(
            "--strategy=multi_worker needs TF_CONFIG naming the cluster and this task; "
            "start workers with `python -m tfmp.launch` or set TF_CONFIG"
        )
    if cluster.task_type in ("ps", "evaluator"):
        raise UsageError(
            f"TF_CONFIG task type {cluster.task_type!r} is not a training worker for "
            "MultiWorkerMirroredStrategy; use chief/worker"
        )
    cpu = tf.config.list_physical_devices("CPU")[0]
    split = tf.config.get_logical_device_configuration(cpu) or []
    if len(split) > 1 and not tf.config.list_physical_devices("GPU") and not one_replica_per_worker:
        raise UsageError(
            "--cpu_replicas>1 with --strategy=multi_worker is not supported: "
            "MultiWorkerMirroredStrategy runs one CPU replica per worker; start more workers"
        )
    rendezvous(cluster, startup_timeout)
    compat.configure_coordination(cluster.cluster, int(heartbeat_timeout * 1000))
    if not one_replica_per_worker:
        return tf.distribute.MultiWorkerMirroredStrategy()
    # MultiWorkerMirroredStrategy makes every local GPU a replica (the resolver's accelerator
    # count); a pipeline on every worker wants one replica whose stages use the rest.
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    return tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=tf.distribute.cluster_resolver.SimpleClusterResolver(
            resolver.cluster_spec(),
            task_type=resolver.task_type,
            task_id=resolver.task_id,
            num_accelerators={"GPU": 1} if tf.config.list_physical_devices("GPU") else {},
            rpc_layer=resolver.rpc_layer or "grpc",
        )
    )


@dataclasses.dataclass(frozen=True)
class Topology:
    """What the run card reports about a strategy."""

    strategy: str
    replicas: int
    workers: int
    is_chief: bool
    devices: tuple[str, ...]


def describe(strategy: tf.distribute.Strategy) -> Topology:
    resolver = getattr(strategy, "cluster_resolver", None)
    workers, is_chief = 1, True
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and resolver is not None:
        cluster = resolver.cluster_spec().as_dict()
        workers = len(cluster.get("chief", [])) + len(cluster.get("worker", []))
        task_type, task_id = resolver.task_type, resolver.task_id
        is_chief = task_type == "chief" or (task_type == "worker" and task_id == 0 and "chief" not in cluster)
    try:
        devices = tuple(strategy.extended.worker_devices)
    except RuntimeError:  # the default strategy has no device list: it places ops as TF does
        devices = tuple(_local_devices()[:1])
    return Topology(type(strategy).__name__, strategy.num_replicas_in_sync, workers, is_chief, devices)


def is_distributed(variable) -> bool:
    """Whether a (Keras) variable belongs to a strategy (mirrored, sync-on-read, ...). A model
    made outside every scope has plain variables: a pipeline's, placed on its stage devices."""
    return isinstance(getattr(variable, "value", variable), tf.distribute.DistributedValues)


def per_replica_batch(global_batch_size: int, strategy: tf.distribute.Strategy) -> int:
    """Global batch / replicas, refusing a global batch that does not split evenly."""
    replicas = strategy.num_replicas_in_sync
    if global_batch_size <= 0:
        raise UsageError(f"global batch {global_batch_size} must be positive")
    if global_batch_size % replicas:
        lower = global_batch_size // replicas * replicas
        suggestion = f"{lower} or {lower + replicas}" if lower else f"{replicas}"
        raise UsageError(
            f"global batch {global_batch_size} is not divisible by {replicas} "
            f"replicas; use a multiple of {replicas}, e.g. {suggestion}"
        )
    return global_batch_size // replicas


def scale_learning_rate(
    learning_rate: float, global_batch_size: int, reference_batch_size: int, rule: str
) -> float:
    """Goyal et al.'s linear rule (or the sqrt rule) for a global batch vs a reference batch."""
    if rule not in LR_SCALING:
        raise unknown("lr scaling rule", rule, LR_SCALING)
    if reference_batch_size <= 0:
        raise UsageError(f"reference batch {reference_batch_size} must be positive")
    ratio = global_batch_size / reference_batch_size
    return learning_rate * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]


def global_sum(value):
    """Sum of `value` over every replica and worker, for losses that normalise by a batch count.

    A detector divides its loss by the number of positive anchors. Each replica only sees its
    own share of the global batch, so dividing by the local count would weight replicas
    unequally; dividing by the *global* count makes the summed gradients of N replicas equal
    the single-device gradient of the global batch:

        num_positives = distribute.global_sum(tf.reduce_sum(positive_mask))
        return tf.reduce_sum(per_anchor_loss) / tf.maximum(num_positives, 1.0)

    Call it inside a replica's step (a loss called by tfmp's engine); outside a strategy, or with
    one replica, it returns `value`. Give such a loss `reduction="sum"`, so Keras does not divide
    it by the number of replicas a second time. The engine computes the loss outside the XLA
    cluster, so this collective works with `--xla=on` too.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return value
    return context.all_reduce(tf.distribute.ReduceOp.SUM, value)


# What a collective raises when a peer of a multi-worker run stops answering mid-run: gRPC's
# UNAVAILABLE ("Connection reset by peer", "Socket closed"), or the abort it causes elsewhere.
PEER_FAILURES = (
    tf.errors.UnavailableError,
    tf.errors.DeadlineExceededError,
    tf.errors.CancelledError,
    tf.errors.AbortedError,
)
_TASK = re.compile(r"/job:(\w+)/replica:\d+/task:(\d+)")
_CAUSE = re.compile(r"aborted by: ([^\n]+)")


def lost_peer(error: Exception, strategy: tf.distribute.Strategy) -> str | None:
    """Which peer `error` says stopped answering, e.g. "worker 1 (localhost:41749) stopped
    answering (recvmsg:Connection reset by peer)"; None when `error` is no lost peer of a
    multi-worker `strategy` (a bug, then: keep its traceback)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if not isinstance(error, PEER_FAILURES) or resolver is None:
        return None
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return None
    cluster, own = resolver.cluster_spec().as_dict(), (resolver.task_type, resolver.task_id)
    message = str(getattr(error, "message", error))
    peers = [(job, int(index)) for job, index in _TASK.findall(message) if job in cluster]
    peers = [peer for peer in peers if peer != own and peer[1] < len(cluster[peer[0]])]
    who = f"{peers[0][0]} {peers[0][1]} ({cluster[peers[0][0]][peers[0][1]]})" if peers else "a peer worker"
    if "heartbeat" in message:
        return f"{who} stopped answering (no heartbeats: the process crashed or was killed)"
    cause = _CAUSE.search(message)
    return f"{who} stopped answering" + (f" ({cause.group(1).strip().rstrip(':')})" if cause else "")


_barriers = itertools.count()
LEADER_GRACE_SECONDS = 3.0


def release_input_pipelines() -> None:
    """Destroys, now, the input iterators a finished run has dropped (call after `del`).

    Destroying a tf.data iterator joins its background threads, which can take seconds (15 s
    measured on a busy 2-core host). Done while every worker is still inside the run, that wait
    is harmless; done after the end `barrier`, while unwinding, it keeps one worker alive long
    after its peers exited, and the coordination service reports them as "unhealthy (stopped
    sending heartbeats)" although the run succeeded. The garbage collection also reaches
    iterators held in reference cycles.
    """
    gc.collect()


def barrier(
    strategy: tf.distribute.Strategy,
    timeout_seconds: float = 600.0,
    leader_grace_seconds: float = LEADER_GRACE_SECONDS,
) -> None:
    """Waits until every worker of a multi-worker run gets here; a no-op on one host.

    Ending a run at a barrier lets the workers leave together, so call it last, once the input
    pipelines are released (`release_input_pipelines`) and the files are written. Then the
    workers only return and exit, well within the coordination service's heartbeat timeout
    of each other. The service lives in the leader (the chief, else worker 0): when it exits
    while a peer is still tearing down, that peer's agent fails to reach it and logs a gRPC
    error. So after the barrier the leader gives its peers `leader_grace_seconds` to leave first.
    """
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return
    compat.wait_at_barrier(f"tfmp_barrier_{next(_barriers)}", int(timeout_seconds * 1000))
    if describe(strategy).is_chief:
        time.sleep(leader_grace_seconds)
