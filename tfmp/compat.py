"""Every private Keras / TensorFlow symbol tfmp uses, each behind one small named function.

tfmp uses public APIs wherever one exists. What remains has no public equivalent in Keras 3.15 /
TensorFlow 2.21; keeping it here means a Keras or TF upgrade breaks one module, and
`tests/test_compat.py` names the symbol that went away. `setup.cfg` pins Keras to the minor
versions that test passes on.

    symbol                                  used for
    Model._symbolic_build                   building a compiled model's loss and metrics for a
                                            data spec without computing anything (tfmp.fit)
    Sequential._functional                  the layer graph inside a built Sequential (pipeline)
    Functional._nodes, Layer._inbound_nodes,  which calls of a (shared) layer belong to a given
      the "<id>_ib-<index>" node key          functional model (FLOP counts, pipeline cuts)
    Node.arguments (.args, .kwargs)         the arguments a recorded layer call was made with,
                                            to trace it again (FLOP counts of custom layers)
    Variable._value, Variable._initialize   re-creating a variable on a pipeline stage's device
    Optimizer._distribution_strategy        the strategy an optimizer was made in, whose scope
                                            its slots must be built in (tfmp.fit)
    tensorflow.python.eager.context,        the coordination service's barrier and its
      tensorflow.compiler.xla.tsl.protobuf  heartbeat timeout (multi-worker)
    keras.src.trainers.data_adapters        a PyDataset or Python generator as tf.data, exactly as
      .get_data_adapter                     model.fit reads it (workers, on_epoch_end; tfmp.fit)
    Model._initial_epoch                    the epoch BackupAndRestore restored (tfmp.fit)
    MultiHeadAttention._compute_attention   the attention core Keras documents overriding
      and ._flash_attention                 (tfmp.precision.attention replaces it on the instance)
    Optimizer._all_reduce_sum_gradients     switched off while tfmp's engine has summed the
                                            gradients itself (tfmp.distribute.allreduce)
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf
from keras.src.trainers import data_adapters as keras_data_adapters
from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
from tensorflow.python.eager import context as eager_context


def symbolic_build(model: keras.Model, data_spec) -> None:
    """Builds `model`, its compiled loss and its metrics for batches of `data_spec` (symbolic).

    Keras' `fit` does this on its first batch; calling the model on real data would compute and,
    for the compiled metrics, change state.
    """
    model._symbolic_build(data_batch=data_spec)


def functional_graph(model: keras.Model):
    """The functional model whose operations make up `model` (a built Sequential's inner one),
    or None when `model` is not a built layer graph."""
    functional = getattr(model, "_functional", None) if isinstance(model, keras.Sequential) else model
    if functional is None or not hasattr(functional, "_nodes"):
        return None
    return functional


def calls_in(model, layer) -> list | None:
    """The nodes (each with `input_tensors`, `output_tensors`, `parent_nodes`) of the calls of
    `layer` that belong to the functional `model`; a layer shared with another model has calls
    of that model's too, which this leaves out. None when `model` is no layer graph (a
    Sequential, or any object with `.layers`)."""
    own_nodes = getattr(model, "_nodes", None)
    if not own_nodes:
        return None
    return [node for index, node in enumerate(layer._inbound_nodes) if f"{id(layer)}_ib-{index}" in own_nodes]


def call_arguments(node) -> tuple[tuple, dict]:
    """The (args, kwargs) a layer call recorded in `node` (from `calls_in`) was made with:
    symbolic tensors where tensors were passed, the other values as given."""
    return tuple(node.arguments.args), dict(node.arguments.kwargs)


def is_created(variable: keras.Variable) -> bool:
    """Whether the variable's backing tf.Variable exists yet (Keras creates it lazily)."""
    return getattr(variable, "_value", None) is not None


def recreate_on_current_device(variable: keras.Variable) -> None:
    """Re-creates the backing tf.Variable of `variable` under the current `tf.device` scope,
    keeping its value; Keras has no public way to move a variable."""
    variable._initialize(tf.identity(variable._value.read_value()))


def optimizer_strategy(optimizer: keras.optimizers.Optimizer) -> tf.distribute.Strategy:
    """The strategy `optimizer` was made under (the default one outside every scope). Keras'
    TensorFlow optimizer creates its slots with that strategy, so building it in another
    strategy's scope, or in none, fails; a pipeline's worker-local optimizer is made outside."""
    return optimizer._distribution_strategy


def wait_at_barrier(barrier_id: str, timeout_ms: int) -> None:
    """Blocks until every task of the coordination service (every worker) reaches `barrier_id`."""
    eager_context.context().wait_at_barrier(barrier_id, timeout_ms)


def configure_coordination(cluster: dict[str, list[str]], heartbeat_timeout_ms: int) -> None:
    """Sets up the coordination service a MultiWorkerMirroredStrategy made next starts, as the
    strategy itself would (standalone, led by the chief or else worker 0, coordinating the chief
    and worker jobs), but with its heartbeat timeout: the strategy keeps a configuration it finds
    and otherwise takes TensorFlow's 10 s. Call it before the strategy is made."""
    leader = "chief" if "chief" in cluster else "worker"
    jobs = [
        coordination_config_pb2.CoordinatedJob(name=job, num_tasks=len(cluster[job]))
        for job in ("chief", "worker")
        if job in cluster
    ]
    eager_context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=f"/job:{leader}/replica:0/task:0",
        coordinated_jobs=jobs,
        heartbeat_timeout_in_ms=heartbeat_timeout_ms,
    )


def coordination_heartbeat_timeout_ms() -> int | None:
    """The heartbeat timeout of this process's coordination service as configured (0:
    TensorFlow's default, 10 s), or None when no service is configured."""
    config = eager_context.context().coordination_service
    return None if config is None else config.heartbeat_timeout_in_ms


def keras_data_adapter(data, shuffle: bool):
    """Keras' own adapter for a `keras.utils.PyDataset` or a Python generator: `get_tf_dataset()`,
    `num_batches` (None: unknown or endless), `on_epoch_end()`. `model.fit` reads these through
    it; there is no public equivalent."""
    return keras_data_adapters.get_data_adapter(data, shuffle=shuffle)


def restored_epoch(model: keras.Model) -> int | None:
    """The epoch `keras.callbacks.BackupAndRestore` restored in `on_train_begin` (it sets the
    model's private `_initial_epoch`, which `model.fit` reads), or None."""
    return getattr(model, "_initial_epoch", None)


def clear_restored_epoch(model: keras.Model) -> None:
    """Forgets the restored epoch once a fit has used it (BackupAndRestore sets it again)."""
    if hasattr(model, "_initial_epoch"):
        model._initial_epoch = None


ATTENTION_CORE = "_compute_attention"  # MultiHeadAttention's hook for a custom attention core


def keras_attention_core(layer, *args, **kwargs):
    """Keras' own `MultiHeadAttention._compute_attention` for `layer` (its explicit path)."""
    return keras.layers.MultiHeadAttention._compute_attention(layer, *args, **kwargs)


def uses_flash_attention(layer) -> bool:
    """Whether a MultiHeadAttention was made with `flash_attention=True` (kept privately)."""
    return bool(getattr(layer, "_flash_attention", False))


def _innermost(optimizer):
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer


@contextlib.contextmanager
def gradients_summed_by_caller(optimizer: keras.optimizers.Optimizer):
    """While tracing `optimizer.apply` inside it, Keras' TensorFlow optimizer does not all-reduce
    the gradients (the caller has summed them: `tfmp.distribute.allreduce`). Only the instance
    is changed, and only for the trace: a later `model.fit` with the same optimizer sums as usual."""
    inner = _innermost(optimizer)
    # Past the trackable's __setattr__: a plain instance attribute, found before the class's method.
    object.__setattr__(inner, "_all_reduce_sum_gradients", lambda grads_and_vars: list(grads_and_vars))
    try:
        yield
    finally:
        vars(inner).pop("_all_reduce_sum_gradients", None)
