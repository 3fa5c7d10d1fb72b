"""tfmp.compat: every private Keras/TF symbol tfmp relies on still exists and still behaves.

When a Keras or TensorFlow upgrade removes or changes one, the failing test names the symbol, so
the fix starts in tfmp/compat.py (and setup.cfg's Keras pin moves only once these pass).
"""

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import multi_worker_util  # TF's own choice of leader
from tensorflow.python.eager import context as eager_context  # the symbol under test

from tfmp import compat


def _shared_dense_model():
    """A functional model calling one Dense(3) layer twice."""
    dense = keras.layers.Dense(3, name="shared")
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3, name="first")(inputs)
    return keras.Model(inputs, dense(keras.layers.Dense(3)(dense(hidden)))), dense


def _require(owner, symbol: str):
    assert hasattr(owner, symbol), (
        f"{type(owner).__name__}.{symbol} is gone in Keras {keras.__version__}: update tfmp/compat.py"
    )


def test_symbolic_build_builds_loss_and_metrics_without_computing():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse", metrics=["mae"])
    _require(model, "_symbolic_build")
    spec = (tf.TensorSpec((None, 4), tf.float32), tf.TensorSpec((None, 2), tf.float32))
    compat.symbolic_build(model, spec)
    assert model.built
    variables = [variable for metric in model.metrics for variable in metric.variables]
    assert len(variables) >= 4, "the loss tracker's and the compiled mae's total and count"
    assert all(float(np.sum(variable.numpy())) == 0.0 for variable in variables), "nothing was computed"


def test_calls_in_counts_each_call_of_a_shared_layer_in_this_model_only():
    model, dense = _shared_dense_model()
    _require(dense, "_inbound_nodes")
    _require(model, "_nodes")
    extra = keras.Input((3,))
    keras.Model(extra, dense(extra))  # a third call, in another model
    calls = compat.calls_in(model, dense)
    assert len(calls) == 2, "Functional._nodes / Layer._inbound_nodes / the '<id>_ib-<index>' key changed"
    assert [tuple(node.output_tensors[0].shape) for node in calls] == [(None, 3), (None, 3)]
    assert compat.calls_in(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]), dense) is None


def test_call_arguments_of_a_recorded_call_keep_positions_and_keywords():
    inputs, mask = keras.Input((5, 4)), keras.Input((5,), dtype="bool")
    attention = keras.layers.MultiHeadAttention(2, 2)
    model = keras.Model([inputs, mask], attention(inputs, inputs, attention_mask=mask[:, None, :]))
    (node,) = compat.calls_in(model, attention)
    _require(node, "arguments")
    args, kwargs = compat.call_arguments(node)
    assert args == (inputs, inputs), "Node.arguments.args changed"
    assert list(kwargs) == ["attention_mask"] and tuple(kwargs["attention_mask"].shape) == (None, 1, 5)


def test_functional_graph_of_a_sequential():
    sequential = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d")])
    _require(sequential, "_functional")
    graph = compat.functional_graph(sequential)
    assert graph is not None and [op.name for op in graph.operations][-1] == "d"
    assert compat.functional_graph(keras.Sequential([keras.layers.Dense(2)])) is None  # not built


def test_variable_is_recreated_on_the_current_device_with_its_value():
    variable = keras.Variable(np.arange(3, dtype=np.float32))
    _require(variable, "_value")
    _require(variable, "_initialize")
    assert compat.is_created(variable)
    with tf.init_scope(), tf.device("/CPU:0"):
        compat.recreate_on_current_device(variable)
    np.testing.assert_array_equal(variable.numpy(), [0, 1, 2])
    assert "CPU:0" in variable.value.device


def test_the_coordination_barrier_exists():
    assert hasattr(eager_context.context(), "wait_at_barrier"), (
        "tensorflow.python.eager.context.Context.wait_at_barrier is gone: update tfmp/compat.py"
    )


def test_the_coordination_service_is_configured_as_the_strategy_would_with_our_heartbeat():
    """MultiWorkerMirroredStrategy keeps a coordination service configured before it (the
    launched group checks that end to end: tests/test_matrix.py); here, that the configuration
    is the strategy's own but for the timeout: the leader TensorFlow picks, the chief and worker
    jobs with their sizes."""
    context = eager_context.context()
    _require(context, "configure_coordination_service")
    before = context.coordination_service
    try:
        for cluster in (
            {"worker": ["a:1", "b:2"]},
            {"chief": ["a:1"], "worker": ["b:2", "c:3"], "evaluator": ["d:4"]},
        ):
            compat.configure_coordination(cluster, 60_000)
            config = context.coordination_service
            assert config.service_type == "standalone"
            assert config.service_leader == multi_worker_util.coordination_leader(cluster)
            jobs = [(job.name, job.num_tasks) for job in config.coordinated_job_list]
            assert jobs == [(job, len(cluster[job])) for job in ("chief", "worker") if job in cluster]
            assert compat.coordination_heartbeat_timeout_ms() == 60_000
    finally:
        context._coordination_service_config = before  # this process runs no multi-worker strategy


def test_optimizer_strategy_is_the_one_it_was_made_under():
    one_device = tf.distribute.OneDeviceStrategy("/cpu:0")
    with one_device.scope():
        inside = keras.optimizers.SGD()
    _require(inside, "_distribution_strategy")
    assert compat.optimizer_strategy(inside) is one_device
    assert compat.optimizer_strategy(keras.optimizers.SGD()) is tf.distribute.get_strategy()


def test_multi_head_attentions_core_hook_and_flash_flag():
    for symbol in (compat.ATTENTION_CORE, "_flash_attention"):
        _require(keras.layers.MultiHeadAttention(2, 4), symbol)
    layer = keras.layers.MultiHeadAttention(2, 4)
    layer(tf.zeros([1, 3, 8]), tf.zeros([1, 3, 8]))  # built: its einsum equations exist
    query = tf.random.normal([1, 3, 2, 4])
    output, scores = compat.keras_attention_core(layer, query, query, query, None, False, True)
    assert tuple(output.shape) == (1, 3, 2, 4) and tuple(scores.shape) == (1, 2, 3, 3)
    assert compat.uses_flash_attention(layer) is False


def test_optimizer_skips_its_all_reduce_only_inside_the_context(mirrored):
    """Keras' TF optimizer sums the gradients over replicas in `_all_reduce_sum_gradients`;
    inside `gradients_summed_by_caller` it applies what it is given, and after it sums again."""
    with mirrored.scope():
        variable = tf.Variable(0.0)
        optimizer = keras.optimizers.SGD(1.0)
        optimizer.build([variable])
    _require(optimizer, "_all_reduce_sum_gradients")

    @tf.function
    def step(summed_by_caller):
        def replica():
            if summed_by_caller:
                with compat.gradients_summed_by_caller(optimizer):
                    optimizer.apply([tf.constant(1.0)], [variable])
            else:
                optimizer.apply([tf.constant(1.0)], [variable])

        mirrored.run(replica)

    step(True)
    assert float(variable.numpy()) == -1.0  # each replica's 1.0, not summed
    step(False)
    assert float(variable.numpy()) == -3.0  # Keras' own: 1.0 summed over 2 replicas
    assert "_all_reduce_sum_gradients" not in vars(optimizer)
