"""The compatibility matrix in README.md: strategy x precision x XLA, every cell trains.

Single-process strategies run in-process on the two logical CPUs of conftest; the
multi-worker column runs two real worker processes on localhost ports.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from conftest import ROOT

from tfmp import models, precision
from tfmp.classification import data
from tfmp.classification.task import compile_classifier
from tfmp.distribute import launch
from tfmp.distribute import strategies as distribute
from tfmp.training.engine import Engine

GLOBAL_BATCH = 16


@pytest.fixture(scope="module")
def strategies():
    return {
        name: distribute.get_strategy(name, tf_config="") for name in ("default", "one_device", "mirrored")
    }


@pytest.mark.parametrize("xla", [False, True], ids=["xla_off", "xla_on"])
@pytest.mark.parametrize("policy", precision.POLICIES)
@pytest.mark.parametrize("strategy_name", ["default", "one_device", "mirrored"])
def test_single_process_cell_trains(strategies, strategy_name, policy, xla):
    strategy = strategies[strategy_name]
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = models.build("lenet", (28, 28, 1), 10, dtype=policy)
        optimizer = precision.wrap_optimizer(keras.optimizers.SGD(0.05), policy, "auto")
    compile_classifier(model, optimizer, strategy)
    engine = Engine(strategy, model, optimizer, xla=xla)
    train = strategy.distribute_datasets_from_function(
        lambda context: data.load("digits", "train", GLOBAL_BATCH, input_context=context)[0]
    )
    first = engine.train(iter(train), 1)
    later = engine.train(iter(train), 8)
    assert np.isfinite(first.metrics["loss"]) and later.nonfinite_steps == 0
    for weight in model.trainable_weights:
        assert weight.dtype == "float32"
        assert np.isfinite(weight.numpy()).all()


@pytest.mark.slow
def test_multi_worker_cells_train_and_agree():
    """2 workers x every precision x XLA off/on: same weights on both workers, full batches;
    and a float16 overflow on worker 1 alone skips the step on both."""
    workers = [f"localhost:{port}" for port in launch.free_ports(2)]
    processes = []
    for index in range(2):
        tf_config = json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})
        env = dict(os.environ, TF_CONFIG=tf_config, TF_CPP_MIN_LOG_LEVEL="2")
        processes.append(
            subprocess.Popen(
                [sys.executable, os.path.join(ROOT, "tests", "mwms_worker.py")],
                cwd=ROOT,
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    outputs = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr[-3000:]
        records = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        overflow = records.pop()
        # Worker 1's overflow skipped the step everywhere: weights unchanged, scale halved.
        assert overflow["unchanged"] and overflow["nonfinite_steps"] >= 1, overflow
        assert overflow["loss_scale"] == 2.0**14, overflow
        outputs.append(records)
    chief, other = outputs
    assert len(chief) == len(other) == 2 * len(precision.POLICIES)
    assert [r["chief"] for r in chief] == [True] * 6 and [r["chief"] for r in other] == [False] * 6
    for mine, theirs in zip(chief, other):
        assert (mine["policy"], mine["xla"]) == (theirs["policy"], theirs["xla"])
        assert mine["workers"] == 2 and mine["replicas"] == 2
        assert mine["finite"] and np.isfinite(mine["loss"])
        # Every eval example counted once across both workers: the distributed loss is the one a
        # single worker computes over the whole split (a missing or doubled example would move it
        # by ~5e-4 relative); accuracy may differ by a near-tie of this barely trained model.
        local_loss, local_accuracy = mine["local_eval"]
        assert mine["eval_loss"] == pytest.approx(local_loss, rel=2e-5)
        assert mine["eval_accuracy"] == pytest.approx(local_accuracy, abs=1.01 / 2000)
        assert mine["eval_accuracy"] == theirs["eval_accuracy"]
        assert mine["checksum"] == theirs["checksum"], mine
