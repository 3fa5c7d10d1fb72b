"""Strategy choice, TF_CONFIG validation, global-batch arithmetic and learning-rate scaling."""

import json
import math
import socket
import sys
import threading
import time

import pytest
import tensorflow as tf

from tfmp.distribute import cluster, launch
from tfmp.distribute import strategies as distribute
from tfmp.errors import EXIT_PREEMPTED, UsageError


def _tf_config(cluster, task_type="worker", index=0):
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


def test_valid_tf_config():
    config = cluster.parse_tf_config(_tf_config({"worker": ["localhost:2222", "10.0.0.2:2222"]}, index=1))
    assert (config.num_workers, config.task_type, config.task_index, config.is_chief) == (
        2,
        "worker",
        1,
        False,
    )
    assert config.address == "10.0.0.2:2222"
    chief = cluster.parse_tf_config(_tf_config({"chief": ["a:1"], "worker": ["b:2"]}, "chief"))
    assert chief.is_chief and chief.num_workers == 2
    assert cluster.parse_tf_config("") is None and cluster.parse_tf_config(None) is None


@pytest.mark.parametrize(
    "raw, message",
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"task": {"type": "worker", "index": 0}}), "no 'cluster'"),
        (_tf_config({"worker": ["a:1", "b:2"]}, index=2), "index 2 is out of range for 2 worker"),
        (_tf_config({"chief": ["a:1", "b:2"]}, "chief"), "2 chiefs"),
        (_tf_config({"master": ["a:1"]}, "master"), "unknown task type 'master'"),
        (json.dumps({"cluster": {"worker": ["a:1"]}}), "no 'task'"),
        (_tf_config({"worker": ["a:1"]}, "chief"), "task type 'chief' is not in the cluster"),
        (_tf_config({"worker": ["localhost"]}), "not host:port"),
        (_tf_config({"worker": ["a:99999"]}), "port in 1-65535"),
        (_tf_config({"worker": ["a:1", "a:1"]}, index=1), "same host:port twice"),
        (_tf_config({"worker": []}), "non-empty list"),
    ],
)
def test_malformed_tf_config_is_one_clear_line(raw, message):
    with pytest.raises(UsageError, match=message) as error:
        cluster.parse_tf_config(raw)
    assert "\n" not in str(error.value)


def test_strategies_by_name_never_none():
    assert distribute.get_strategy("default", tf_config="") is tf.distribute.get_strategy()
    assert isinstance(distribute.get_strategy("one_device", tf_config=""), tf.distribute.OneDeviceStrategy)
    mirrored = distribute.get_strategy("mirrored", tf_config="")
    assert isinstance(mirrored, tf.distribute.MirroredStrategy)
    assert mirrored.num_replicas_in_sync == 2  # conftest split the CPU in two
    auto = distribute.get_strategy("auto", tf_config="")
    assert isinstance(auto, tf.distribute.MirroredStrategy)
    topology = distribute.describe(mirrored)
    assert (topology.replicas, topology.workers, topology.is_chief) == (2, 1, True)


def test_strategy_refusals():
    with pytest.raises(UsageError, match="unknown strategy 'horovod'"):
        distribute.get_strategy("horovod", tf_config="")
    with pytest.raises(UsageError, match="needs TF_CONFIG"):
        distribute.get_strategy("multi_worker", tf_config="")
    two_workers = _tf_config({"worker": ["localhost:1", "localhost:2"]})
    with pytest.raises(UsageError, match="--strategy=mirrored with a TF_CONFIG of 2 tasks"):
        distribute.get_strategy("mirrored", tf_config=two_workers)
    with pytest.raises(UsageError, match="one CPU replica per worker"):
        distribute.get_strategy("multi_worker", tf_config=two_workers)


def test_per_replica_batch_quotes_the_numbers():
    mirrored = distribute.get_strategy("mirrored", tf_config="")
    assert distribute.per_replica_batch(256, mirrored) == 128
    with pytest.raises(UsageError, match=r"global batch 101 is not divisible by 2 replicas; .* 100 or 102"):
        distribute.per_replica_batch(101, mirrored)
    with pytest.raises(UsageError, match="global batch 0 must be positive"):
        distribute.per_replica_batch(0, mirrored)


def test_learning_rate_scaling_rules():
    assert distribute.scale_learning_rate(0.1, 1024, 256, "linear") == pytest.approx(0.4)
    assert distribute.scale_learning_rate(0.1, 1024, 256, "sqrt") == pytest.approx(0.2)
    assert distribute.scale_learning_rate(0.1, 1024, 256, "none") == 0.1
    assert math.isclose(distribute.scale_learning_rate(0.1, 128, 256, "linear"), 0.05)
    with pytest.raises(UsageError, match="unknown lr scaling rule 'cube'"):
        distribute.scale_learning_rate(0.1, 1024, 256, "cube")


def test_split_cpu_after_start_is_refused_with_the_counts():
    with pytest.raises(
        UsageError, match="cannot split the CPU into 3 devices: TensorFlow already started with 2"
    ):
        distribute.split_cpu(3)
    distribute.split_cpu(2)  # the same split again is fine


# Stand-in workers (no TensorFlow): exit 42 (EXIT_PREEMPTED) the first time each runs, then 0.
PREEMPTED_ONCE = (
    "import json, os, sys; "
    "marker = os.path.join(sys.argv[1], str(json.loads(os.environ['TF_CONFIG'])['task']['index'])); "
    "first = not os.path.exists(marker); open(marker, 'w').close(); "
    "sys.exit(42 if first else 0)"
)


@pytest.mark.parametrize("max_restarts, code", [(0, EXIT_PREEMPTED), (1, 0)])
def test_a_preempted_group_exits_42_or_is_restarted(tmp_path, monkeypatch, capfd, max_restarts, code):
    """Workers that checkpointed on a preemption notice exit 42: without restarts the launcher
    exits 42 too (for a scheduler to requeue the job); with --max_restarts it restarts the group,
    which resumes (tests/test_multi_worker.py does it with real training)."""
    monkeypatch.setenv(launch.RUN_NAME_ENV, "preempted")
    command = [sys.executable, "-c", PREEMPTED_ONCE, str(tmp_path)]
    assert launch.launch_local(command, num_workers=2, max_restarts=max_restarts) == code
    assert ("[launch] restart 1/1" in capfd.readouterr().out) == (max_restarts == 1)


def _accepts(host, port):
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def test_rendezvous_listens_on_the_workers_own_address_only():
    """A worker named `localhost` in TF_CONFIG is reachable at 127.0.0.1 during the rendezvous but
    not at 127.0.0.2, which is loopback too: the listener is bound to the one address, not to
    every interface (where 127.0.0.2, and any other host, would reach it)."""
    own, missing = launch.free_ports(2)
    config = cluster.parse_tf_config(_tf_config({"worker": [f"localhost:{own}", f"localhost:{missing}"]}))
    failure = []

    def wait():
        try:
            cluster.rendezvous(config, timeout=2)
        except UsageError as error:
            failure.append(str(error))

    waiting = threading.Thread(target=wait)
    waiting.start()
    deadline = time.monotonic() + 2
    while not _accepts("127.0.0.1", own) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _accepts("127.0.0.1", own)
    assert not _accepts("127.0.0.2", own)
    assert _accepts("127.0.0.1", own)  # still up: 127.0.0.2 was refused by a listening worker
    waiting.join()
    assert f"could not reach localhost:{missing} within 2 s" in failure[0]
