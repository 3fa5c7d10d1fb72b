"""Multi-worker training for real: tfmp.launch starting 2 worker processes on localhost.

Happy path against a single process, a SIGTERMed worker checkpointing with its peer and a
SIGKILLed one, each restarting the group from its checkpoint, an unreachable peer, malformed
TF_CONFIGs.
"""

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
from conftest import (
    ROOT,
    finish,
    listening_ports,
    peer_errors_once_formed,
    run_python,
    start_python,
    wait_for_log_past,
    workers_of,
)

from tfmp.distribute import launch, netns
from tfmp.errors import EXIT_PEER_LOST

pytestmark = pytest.mark.slow

# LeNet has neither dropout nor BatchNorm, so 2 workers can match 1 process to float rounding.
APP = [
    "-m",
    "apps.classify",
    "--model=lenet",
    "--dataset=digits",
    "--global_batch_size=32",
    "--optimizer=sgd",
    "--learning_rate=0.05",
    "--log_every=10",
]


def _launch(tmp_path, app_flags, *launch_flags):
    return [
        sys.executable,
        "-m",
        "tfmp.launch",
        "--workers=2",
        *launch_flags,
        "--",
        sys.executable,
        *APP,
        "--strategy=multi_worker",
        f"--model_dir={tmp_path / 'run'}",
        *app_flags,
    ]


def _env(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    return dict(os.environ, TMPDIR=str(scratch), TF_CPP_MIN_LOG_LEVEL="2")


def _summaries(output):
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"\[worker (\d)\] tfmp summary: (.*)", output)}


def _digest(summary):
    return re.search(r"weights ([0-9a-f]{12})", summary).group(1)


def _checkpoint_steps(tmp_path):
    paths = glob.glob(str(tmp_path / "run" / "checkpoints" / "ckpt-*.index"))
    return sorted(int(re.search(r"ckpt-(\d+)", p).group(1)) for p in paths)


def test_two_workers_match_one_process_and_only_the_chief_writes(tmp_path):
    # 20 steps: past ~25 steps at this learning rate, training amplifies float rounding
    # (measured: losses equal to 6 digits up to step 23, 1e-5 apart from step 24).
    flags = ["--steps=20", "--steps_per_epoch=20", "--checkpoint_every=5"]
    result = subprocess.run(
        _launch(tmp_path, flags), cwd=ROOT, env=_env(tmp_path), text=True, capture_output=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summaries = _summaries(result.stdout)
    assert set(summaries) == {0, 1}
    assert _digest(summaries[0]) == _digest(summaries[1])  # identical weights on both workers
    assert "2 replica(s) on 2 worker(s), 20 steps (20 applied)" in summaries[0]
    # Only the chief wrote the model dir; the non-chief's checkpoint copies were temporary.
    run = tmp_path / "run"
    assert _checkpoint_steps(tmp_path) == [10, 15, 20]  # --keep_checkpoints=3
    assert json.load(open(run / "run_card.json"))["replicas"] == "2 (2 worker(s))"
    assert not os.listdir(tmp_path / "tmp")

    single = run_python([*APP, "--strategy=default", *flags, f"--model_dir={tmp_path / 'single'}"])
    assert single.returncode == 0, single.stderr[-3000:]
    multi = keras.models.load_model(run / "model.keras", compile=False)
    one = keras.models.load_model(tmp_path / "single" / "model.keras", compile=False)
    for a, b in zip(multi.weights, one.weights):
        # Same global batches; only the summation order of the gradients differs.
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5)


def test_app_goes_multi_worker_under_the_launcher_and_prunes_identically(tmp_path):
    """apps.mnist defaults to MirroredStrategy; started by the launcher it must go multi-worker,
    pick a run dir both workers share, and end without a shutdown error. The same group prunes
    (flags that do not choose the strategy): both workers end with the same weights, so the same
    masks, at the target sparsity."""
    command = [
        sys.executable,
        "-m",
        "tfmp.launch",
        "--workers=2",
        "--",
        sys.executable,
        "-m",
        "apps.mnist",
        "--steps=8",
        "--steps_per_epoch=8",
        "--prune_sparsity=0.5",
        "--prune_end_step=4",
        "--prune_every=2",
    ]
    result = subprocess.run(
        command,
        cwd=tmp_path,
        env=dict(_env(tmp_path), PYTHONPATH=ROOT),
        text=True,
        capture_output=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summaries = _summaries(result.stdout)
    assert set(summaries) == {0, 1} and "2 replica(s) on 2 worker(s)" in summaries[0]
    runs = os.listdir(tmp_path / "runs")
    assert len(runs) == 1 and (tmp_path / "runs" / runs[0] / "model.keras").exists()
    # No worker loses its peer once the group formed (training logged), the shutdown included.
    assert not peer_errors_once_formed(result.stdout, ["tfmp run card", "Epoch 1/", "tfmp summary:"])
    assert "Traceback" not in result.stdout + result.stderr
    assert _digest(summaries[0]) == _digest(summaries[1])  # same weights, so the same masks
    assert "sparsity 0.50" in summaries[0] and "sparsity 0.50" in summaries[1]
    assert re.search(r"size [0-9.]+ MB \(gzip [0-9.]+ MB\), weights [0-9a-f]{12}", summaries[0]), summaries[0]
    model = keras.models.load_model(tmp_path / "runs" / runs[0] / "model.keras", compile=False)
    first = model.get_layer("mnist_mlp_dense1").kernel.numpy()
    assert np.mean(first == 0) == pytest.approx(0.5, abs=0.02)


def _next_group(process, group, timeout=300):
    """The worker pids of the group the launcher starts after `group` ended."""
    deadline = time.time() + timeout
    while time.time() < deadline and process.poll() is None:
        workers = workers_of(process)
        if len(workers) == 2 and not set(workers) & set(group):
            return workers
        time.sleep(0.05)
    pytest.fail(f"the launcher started no new group (launcher exit {process.poll()})")


def test_sigterm_then_sigkill_on_a_worker_each_restart_the_group_from_its_checkpoint(tmp_path):
    """One launched group, two failures (one group start instead of two):
    1. SIGTERM on worker 1 (a preemption notice): both workers save the same checkpoint between
       the periodic ones and exit 42; with --max_restarts the launcher restarts the group;
    2. SIGKILL on worker 1 of the restarted group: the launcher restarts it again;
    the group resumes from the last checkpoint and ends exactly at the planned step count with
    identical weights on both workers. (Without restarts a preempted group's exit status is 42:
    tests/test_distribute.py, with stand-in workers.)"""
    # 200 steps: the SIGTERM lands right after the first log (step 10), ~190 steps before the end.
    flags = ["--steps=200", "--steps_per_epoch=200", "--checkpoint_every=50"]
    process = subprocess.Popen(
        _launch(tmp_path, flags, "--max_restarts=2"),
        cwd=ROOT,
        env=_env(tmp_path),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    wait_for_log_past(process, tmp_path / "run" / "metrics.jsonl", 0)
    first_group = workers_of(process)
    _assert_private_network(first_group)
    os.kill(first_group[1], signal.SIGTERM)
    second_group = _next_group(process, first_group)
    preempted_at = _checkpoint_steps(tmp_path)[-1]
    wait_for_log_past(
        process, tmp_path / "run" / "metrics.jsonl", preempted_at
    )  # the restarted group trains again
    os.kill(second_group[1], signal.SIGKILL)
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-4000:]
    assert output.count("preempted: SIGTERM on a worker: checkpoint saved at step") == 2, output[-4000:]
    assert preempted_at % 50 != 0, preempted_at  # the preemption checkpoint, between periodic ones
    assert "[launch] restart 1/2" in output and "[launch] restart 2/2" in output
    assert "[launch] worker 1 exited with -9 (killed by SIGKILL)" in output
    # The survivor's collective failed at once; the launcher dropped what it said about it.
    assert "Traceback" not in output and "Aborting RingReduce" not in output, output[-4000:]
    summaries = _summaries(output)
    assert _digest(summaries[0]) == _digest(summaries[1])
    # Resumed from a checkpoint: the step count ends exactly at the plan, every step applied once.
    assert "200 steps (200 applied)" in summaries[0], summaries[0]
    resumed_from = json.load(open(tmp_path / "run" / "run_card.json"))["steps"].split("from step ")[1]
    assert int(resumed_from) >= preempted_at
    assert not os.listdir(tmp_path / "tmp")


def _assert_private_network(workers):
    """Done when of issue 30, with real training: the workers' gRPC servers (bound to 0.0.0.0)
    listen in a network of their own, and none of their ports listens in the host's (`ss -ltn`)."""
    assert not any(netns.same_network_as(pid) for pid in workers)
    ports = listening_ports(workers[0])
    assert len(ports) >= 2  # both workers' servers (and their start-up listeners' successors)
    assert not ports & listening_ports(), ports


@pytest.mark.parametrize("loss", ["killed", "frozen"])
def test_a_lost_peer_is_one_line_exit_5(tmp_path, loss):
    """Two workers started by hand (as on two hosts, no launcher to stop the survivor): worker 1
    is killed mid-run (its connections reset), or frozen (SIGSTOP: connections open, no
    heartbeats, as a hung process or a vanished machine), which `--heartbeat_timeout` seconds
    later the coordination service calls dead; worker 0's collective fails, and instead of
    TensorFlow's UnavailableError traceback it prints one `error:` line naming the lost worker
    and what a resume starts from."""
    ports = launch.free_ports(2)
    addresses = [f"localhost:{port}" for port in ports]
    flags = [*APP, "--strategy=multi_worker", "--steps=400", "--steps_per_epoch=400", "--checkpoint_every=10"]
    flags.append("--heartbeat_timeout=5")
    workers = [
        start_python(
            [*flags, f"--model_dir={tmp_path / 'run'}"], env={"TF_CONFIG": launch.tf_config(addresses, i)}
        )
        for i in range(2)
    ]
    wait_for_log_past(workers[0], tmp_path / "run" / "metrics.jsonl", 10)
    if loss == "frozen":
        workers[1].send_signal(signal.SIGSTOP)
        survivor = finish(workers[0], timeout=120)
        workers[1].kill()
        finish(workers[1])
    else:
        workers[1].kill()
        finish(workers[1])
        survivor = finish(workers[0], timeout=120)
    assert survivor.returncode == EXIT_PEER_LOST, survivor.stderr[-3000:]
    assert "Traceback" not in survivor.stderr, survivor.stderr[-3000:]
    lines = [line for line in survivor.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and survivor.stderr.rstrip().endswith(lines[0]), survivor.stderr[-3000:]
    assert lines[0].startswith(f"error: worker 1 ({addresses[1]}) stopped answering"), lines[0]
    assert "a resume starts from the checkpoint of step" in lines[0], lines[0]
    if loss == "frozen":
        assert "no heartbeats" in lines[0], lines[0]


def test_unreachable_peer_fails_fast_naming_it(tmp_path):
    own, missing = launch.free_ports(2)
    tf_config = launch.tf_config([f"localhost:{own}", f"localhost:{missing}"], 0)
    result = run_python(
        [
            "-m",
            "apps.mnist",
            "--strategy=multi_worker",
            "--startup_timeout=5",
            f"--model_dir={tmp_path / 'run'}",
        ],
        env={"TF_CONFIG": tf_config},
        timeout=120,
    )
    assert result.returncode == 2
    assert f"could not reach localhost:{missing} within 5 s" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "tf_config, message",
    [
        ("{oops", "TF_CONFIG is not valid JSON"),
        (
            '{"cluster": {"worker": ["localhost:1"]}, "task": {"type": "worker", "index": 1}}',
            "TF_CONFIG task index 1 is out of range for 1 worker",
        ),
        ('{"cluster": {"chief": ["a:1", "b:2"]}, "task": {"type": "chief", "index": 0}}', "2 chiefs"),
        ('{"cluster": {"boss": ["a:1"]}, "task": {"type": "boss", "index": 0}}', "unknown task type 'boss'"),
        ('{"cluster": {"worker": ["a:1"]}}', "TF_CONFIG has no 'task'"),
    ],
)
def test_malformed_tf_config_is_one_line_exit_2(tf_config, message):
    result = run_python(
        ["-m", "tfmp.launch", "--", sys.executable, "-m", "apps.mnist"],
        env={"TF_CONFIG": tf_config},
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and message in result.stderr, result.stderr
