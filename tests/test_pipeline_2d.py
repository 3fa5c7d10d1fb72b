"""Two-dimensional parallelism: a 2-stage pipeline on each of 2 launched workers.

The model-level cells run in the shared launched group (tests/pipeline_2d_worker.py, from
tests/mwms_worker.py): the 2 x 2 run against the unsplit model trained data-parallel on the same
2 workers and against the 1-worker pipeline (here, in-process on conftest's 2 logical CPUs),
every precision with XLA off and on, placement, a float16 overflow on one worker, pruning.
The app-level test launches apps.mnist 2 x 2, kills a worker, and resumes the run on 1 worker
(a 1-D pipeline), then unsplit, then 2 x 2 again.
"""

import json
import os
import re
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import ROOT, run_python, wait_for_log_past, workers_of

from tfmp import models, precision
from tfmp.classification import data
from tfmp.classification.task import compile_classifier
from tfmp.pipeline import plan as pipeline
from tfmp.training.engine import Engine

pytestmark = pytest.mark.slow

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
EPSILON = {"float32": 2.0**-23, "mixed_float16": 2.0**-10, "mixed_bfloat16": 2.0**-7}
# Same batches, same arithmetic, different summation order (micro-batches, then workers; or
# replicas): the layouts differ by float32 rounding of 3 SGD steps on weights of scale <= ~1.
FLOAT32_ATOL = 64 * EPSILON["float32"]


def _records(launched_workers, kind):
    assert launched_workers.returncode == 0, launched_workers.tail
    by_worker = launched_workers.records[kind]
    assert set(by_worker) == {0, 1}
    return by_worker


def _saved(launched_workers, name, worker=0):
    with np.load(launched_workers.out / f"{name}_{worker}.npz") as saved:
        return [saved[f"arr_{i}"].astype(np.float64) for i in range(len(saved.files))]


def _max_difference(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def _one_worker_pipeline(steps):
    """The float32 1-worker pipeline (default strategy, conftest's 2 logical CPUs) on the same
    global batches, seed and optimizer as the launched cells."""
    keras.utils.set_random_seed(0)
    strategy = tf.distribute.get_strategy()
    model = models.build("lenet", (16, 16, 1), 10, dtype="float32")
    plan = pipeline.plan(model, ["/CPU:0", "/CPU:1"], micro_batches=2)
    pipeline.place(model, plan)
    optimizer = precision.wrap_optimizer(keras.optimizers.SGD(0.05), "float32", "auto")
    compile_classifier(model, optimizer, strategy)
    engine = Engine(strategy, model, optimizer, gradients=pipeline.gradients_fn(plan))
    engine.train(iter(data.load("digits", "train", 32, image_size=16)[0]), steps)
    return [w.numpy().astype(np.float64) for w in model.trainable_weights]


def test_2_workers_x_2_stages_train_like_data_parallel_and_the_1_worker_pipeline(launched_workers):
    by_worker = _records(launched_workers, "pipeline_2d")
    cells = {}
    for worker, records in by_worker.items():
        for record in records:
            cells.setdefault((record["policy"], record["xla"]), {})[worker] = record
    assert set(cells) == {(policy, xla) for policy in POLICIES for xla in (False, True)}
    for (policy, xla), workers in cells.items():
        for record in workers.values():
            assert record["replicas"] == 2 and record["worker_local"], record
            assert record["finite"] and record["nonfinite"] == 0, record
            # Each variable on its stage's device (the CPU index of both agrees).
            assert all(device == stage for device, stage in record["placement"].values()), record
        assert workers[0]["checksum"] == workers[1]["checksum"], (policy, xla)  # every variable
    one_worker = _one_worker_pipeline(steps=3)
    for xla in (False, True):
        two_d = _saved(launched_workers, f"pipeline_2d_float32_{xla}")
        data_parallel = _saved(launched_workers, f"dp_float32_{xla}")
        assert _max_difference(two_d, data_parallel) <= FLOAT32_ATOL, xla
        assert _max_difference(two_d, one_worker) <= FLOAT32_ATOL, xla
        assert _max_difference(two_d, _saved(launched_workers, f"pipeline_2d_float32_{xla}", 1)) == 0
    for policy in POLICIES[1:]:
        for xla in (False, True):
            # Half precision: the 2-D run is as close to the float32 run as data parallelism is
            # (micro-batches sum weight gradients in float32 where the unsplit model sums them in
            # the compute dtype), give or take the dtype's rounding.
            reference = _saved(launched_workers, f"dp_float32_{xla}")
            two_d = _max_difference(_saved(launched_workers, f"pipeline_2d_{policy}_{xla}"), reference)
            data_parallel = _max_difference(_saved(launched_workers, f"dp_{policy}_{xla}"), reference)
            assert two_d <= 2 * data_parallel + 8 * EPSILON[policy], (policy, xla, two_d, data_parallel)


def test_each_stage_keeps_its_variables_and_optimizer_slots_on_its_device(launched_workers):
    for records in _records(launched_workers, "pipeline_2d_placement").values():
        (record,) = records
        # Adam: 2 slots per trainable variable beside it; iterations and learning rate on CPU:0.
        assert record["slots"] == {
            "0": 2 * record["trainable"]["0"] + 2,
            "1": 2 * record["trainable"]["1"],
        }, record


def test_float16_overflow_in_one_stage_of_one_worker_skips_the_step_on_both(launched_workers):
    for records in _records(launched_workers, "pipeline_2d_overflow").values():
        (record,) = records
        assert record["unchanged"] and record["nonfinite_steps"] > 0, record
        assert record["loss_scale"] == precision.loss_scaling.DEFAULT_INITIAL_SCALE / 2, record


def test_pruning_a_2d_model_masks_on_their_stages_and_identical_on_both_workers(launched_workers):
    records = {
        worker: records[0] for worker, records in _records(launched_workers, "pipeline_2d_pruning").items()
    }
    for record in records.values():
        assert record["sparsity"] == pytest.approx(0.5, abs=0.01), record
        assert record["pruned_weights_zero"] and record["masks_on_kernels"], record
    assert records[0]["checksum"] == records[1]["checksum"]


APP = [
    "-m",
    "apps.mnist",
    "--pipeline_stages=2",
    "--micro_batches=4",
    "--global_batch_size=64",
    "--log_every=5",
    "--checkpoint_every=10",
]


def _summaries(output):
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"\[worker (\d)\] tfmp summary: (.*)", output)}


def _weights_digest(summary):
    return re.search(r"weights ([0-9a-f]{12})", summary).group(1)


def test_launched_2x2_mnist_survives_a_killed_worker_resumes_on_1_worker_unsplit_and_back(tmp_path):
    run = tmp_path / "run"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = dict(os.environ, TMPDIR=str(scratch), TF_CPP_MIN_LOG_LEVEL="2")
    command = [sys.executable, "-m", "tfmp.launch", "--workers=2", "--max_restarts=1", "--"]
    command += [sys.executable, *APP, "--steps=40", f"--model_dir={run}"]
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    wait_for_log_past(process, run / "metrics.jsonl", 10)  # a checkpoint exists at step 10
    os.kill(workers_of(process)[1], signal.SIGKILL)
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-4000:]
    assert "[launch] worker 1 exited with -9" in output and "[launch] restart 1/1" in output
    summaries = _summaries(output)
    assert "2 replica(s) on 2 worker(s), 40 steps (40 applied)" in summaries[0], summaries[0]
    card = json.load(open(run / "run_card.json"))
    assert (
        card["pipeline"].startswith("2 stages x 4 micro-batches")
        and int(card["steps"].split("from step ")[1]) >= 10
    )

    # Elastic: the same checkpoint on 1 worker (a 1-D pipeline on its 2 logical CPUs), then unsplit.
    one_worker = run_python([*APP, "--steps=50", f"--model_dir={run}"])
    assert one_worker.returncode == 0, one_worker.stderr[-3000:]
    assert "from step 40" in json.load(open(run / "run_card.json"))["steps"]
    unsplit = run_python(
        [*APP, "--pipeline_stages=0", "--strategy=default", "--steps=60", f"--model_dir={run}"]
    )
    assert unsplit.returncode == 0, unsplit.stderr[-3000:]
    card = json.load(open(run / "run_card.json"))
    assert "from step 50" in card["steps"] and "pipeline" not in card
    assert "60 steps (60 applied)" in unsplit.stdout, unsplit.stdout[-2000:]
    model = keras.models.load_model(run / "model.keras", compile=False)  # plain Keras, unsplit
    assert all(np.isfinite(w.numpy()).all() for w in model.weights)
    # And back: the unsplit checkpoint resumes 2 x 2.
    command = [sys.executable, "-m", "tfmp.launch", "--workers=2", "--", sys.executable, *APP]
    back = subprocess.run(
        [*command, "--steps=70", f"--model_dir={run}"], cwd=ROOT, env=env, text=True, capture_output=True
    )
    assert back.returncode == 0, back.stdout[-3000:] + back.stderr[-3000:]
    summaries = _summaries(back.stdout)
    assert _weights_digest(summaries[0]) == _weights_digest(summaries[1])
    assert (
        "70 steps (70 applied)" in summaries[0]
        and "from step 60" in json.load(open(run / "run_card.json"))["steps"]
    )
