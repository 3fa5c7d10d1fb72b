"""Resume and interruption: every app resumes from relative, absolute and `~` model dirs after
SIGTERM, ^C (SIGINT) and SIGKILL; a damaged state file, changed flags, a second signal and the
printed resume command each do what the user reads.

The three app tests form a Latin square (app x path form x signal), so each app, path form and
signal is covered once at the cost of three runs. Each first run is given far more steps than it
can take, so the signal always lands in training; the resume then asks for a few steps more
than the step the checkpoint state file names (what a resume reads; the newest ckpt file on
disk may be one a kill cut short).
"""

import json
import os
import shlex
import signal
import sys
import threading
import time

import keras
import pytest
import tensorflow as tf
from conftest import ROOT, finish, run_python, start_python

from apps import common
from tfmp.distribute.launch import LAUNCH_COMMAND_ENV
from tfmp.errors import EXIT_PREEMPTED, UsageError
from tfmp.training import checkpoint, loop
from tfmp.training.config import TrainConfig
from tfmp.training.run import check_same_run

NEVER_ENDS = "--steps=100000"  # the first runs stop by signal, never by finishing


def _wait_for_checkpoint(process, directory, timeout=600):
    """Waits until the state file in `directory` names a checkpoint (the bound is for a hang)."""
    deadline = time.time() + timeout
    while time.time() < deadline and process.poll() is None:
        if tf.train.latest_checkpoint(str(directory)):
            return
        time.sleep(0.2)
    process.kill()
    result = finish(process)
    raise AssertionError(f"no checkpoint in {directory}: {result.stderr[-3000:]}")


def _saved_step(directory) -> int:
    return int(tf.train.latest_checkpoint(str(directory)).rsplit("-", 1)[1])


def _assert_resumed(result, model_dir, saved, total):
    assert result.returncode == 0, result.stderr[-3000:]
    card = json.load(open(os.path.join(model_dir, "run_card.json")))
    assert card["steps"].endswith(f"from step {saved}")
    assert f" {total} steps ({total} applied)" in result.stdout
    assert _saved_step(os.path.join(model_dir, "checkpoints")) == total


def _preempted_line(result) -> str:
    assert result.returncode == EXIT_PREEMPTED, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("preempted: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


@pytest.mark.slow
def test_classify_relative_dir_resumes_after_sigterm_and_refuses_a_changed_model(tmp_path):
    args = ["-m", "apps.classify", "--model=lenet", "--dataset=digits", "--image_size=16"]
    args += ["--global_batch_size=16", "--checkpoint_every=5", "--log_every=5", "--model_dir=runs/r1"]
    checkpoints = tmp_path / "runs" / "r1" / "checkpoints"
    process = start_python([*args, NEVER_ENDS], cwd=tmp_path)
    _wait_for_checkpoint(process, checkpoints)
    process.send_signal(signal.SIGTERM)
    line = _preempted_line(finish(process))
    saved = _saved_step(checkpoints)
    assert line.startswith(
        f"preempted: SIGTERM on a worker: checkpoint saved at step {saved} in {checkpoints};"
    )
    assert line.endswith(shlex.join([sys.executable, *args, NEVER_ENDS]))  # it named a dir: as typed
    resumed = run_python([*args, f"--steps={saved + 3}"], cwd=tmp_path)
    _assert_resumed(resumed, tmp_path / "runs" / "r1", saved, saved + 3)

    flags = (tmp_path / "runs" / "r1" / "flags.txt").read_text()
    refused = run_python([*args, "--model=seed_cnn", f"--steps={saved + 6}"], cwd=tmp_path)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.splitlines() == [
        "error: runs/r1 was trained with --model=lenet, this command says --model=seed_cnn; resume with "
        "the run's flags (runs/r1/flags.txt) or use a fresh --model_dir"
    ]  # no tensor shapes, no TensorFlow warnings
    assert (tmp_path / "runs" / "r1" / "flags.txt").read_text() == flags
    assert _saved_step(checkpoints) == saved + 3


@pytest.mark.slow
def test_mnist_default_dir_resumes_by_the_printed_command_after_sigint(tmp_path):
    """No --model_dir: the default runs/<model>-<dataset>-<time> is new per run, so the printed
    command names it (absolute), and it resumes from another working directory."""
    args = ["-m", "apps.mnist", "--global_batch_size=16", "--checkpoint_every=5", "--log_every=5"]
    process = start_python([*args, NEVER_ENDS], cwd=tmp_path)
    deadline = time.time() + 600
    while not (tmp_path / "runs").is_dir() and time.time() < deadline and process.poll() is None:
        time.sleep(0.2)
    (model_dir,) = [tmp_path / "runs" / name for name in os.listdir(tmp_path / "runs")]
    _wait_for_checkpoint(process, model_dir / "checkpoints")
    process.send_signal(signal.SIGINT)
    line = _preempted_line(finish(process))
    saved = _saved_step(model_dir / "checkpoints")
    assert line.startswith(f"preempted: SIGINT on a worker: checkpoint saved at step {saved} in ")
    command = shlex.split(line.split("; resume with: ", 1)[1])
    assert command == [sys.executable, *args, NEVER_ENDS, f"--model_dir={model_dir}"]
    resumed = run_python([*command[1:], f"--steps={saved + 3}"], cwd=ROOT)  # a later --steps wins
    _assert_resumed(resumed, model_dir, saved, saved + 3)


@pytest.mark.slow
def test_detect_home_dir_from_a_flagfile_resumes_after_sigkill(tmp_path):
    """`--model_dir=~/det` in a flagfile: no shell expands it, the run does (no literal ~ dir)."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    flagfile = tmp_path / "detect.cfg"
    flagfile.write_text("--model_dir=~/det\n--image_size=32\n--global_batch_size=4\n--checkpoint_every=2\n")
    args = ["-m", "apps.detect", f"--flagfile={flagfile}", "--log_every=2"]
    checkpoints = home / "det" / "checkpoints"
    process = start_python([*args, NEVER_ENDS], cwd=work, env={"HOME": str(home)})
    _wait_for_checkpoint(process, checkpoints)
    process.send_signal(signal.SIGKILL)
    process.wait()
    finish(process)
    saved = _saved_step(checkpoints)
    resumed = run_python([*args, f"--steps={saved + 2}"], cwd=work, env={"HOME": str(home)})
    _assert_resumed(resumed, home / "det", saved, saved + 2)
    assert os.listdir(work) == []  # no literal "~" folder


def test_checkpoints_of_a_relative_dir_restore(tmp_path, monkeypatch):
    """TensorFlow joins the state file's names onto the directory already: not twice."""
    monkeypatch.chdir(tmp_path)
    weight = tf.Variable(1.0)
    saver = checkpoint.Checkpoints("runs/r1", True, 0, global_batch_size=8, weight=weight)
    weight.assign(5.0)
    saver.save(3)
    os.chdir(tmp_path / "runs")  # the absolute path was taken once: a later chdir moves nothing
    restored = tf.Variable(0.0)
    checkpoints = checkpoint.Checkpoints("../runs/r1", True, 0, global_batch_size=8, weight=restored)
    assert checkpoints.restore() == 3 and restored.numpy() == 5.0 and checkpoints.saved_step == 3


def _two_checkpoints(directory):
    weight = tf.Variable(0.0)
    saver = checkpoint.Checkpoints(str(directory), True, 0, global_batch_size=8, weight=weight)
    for step in (3, 6):
        weight.assign(float(step))
        saver.save(step)
    return directory / "checkpoints"


@pytest.mark.parametrize("state", ["garbage", ""])
def test_a_damaged_state_file_falls_back_to_the_files_on_disk(tmp_path, state):
    files = _two_checkpoints(tmp_path)
    (files / "checkpoint").write_text(state)
    (files / "ckpt-6.index").write_bytes(b"cut short")  # the newest file may be damaged too
    said, weight = [], tf.Variable(0.0)
    checkpoints = checkpoint.Checkpoints(
        str(tmp_path), True, 0, global_batch_size=8, say=said.append, weight=weight
    )
    assert checkpoints.restore() == 3 and weight.numpy() == 3.0
    assert f"checkpoint state file {files / 'checkpoint'} is damaged" in said[0]
    assert "skipped checkpoint" in said[1] and "ckpt-6" in said[1]
    checkpoints.save(4)  # a new state file; the damaged one is kept beside it
    assert (files / "checkpoint.damaged").read_text() == state
    assert tf.train.latest_checkpoint(str(files)).endswith("ckpt-4")


def test_a_damaged_state_file_with_no_readable_checkpoint_is_a_usage_error(tmp_path):
    files = _two_checkpoints(tmp_path)
    (files / "checkpoint").write_text("garbage")
    for step in (3, 6):
        (files / f"ckpt-{step}.index").write_bytes(b"garbage")
    checkpoints = checkpoint.Checkpoints(str(tmp_path), True, 0, say=lambda _: None, weight=tf.Variable(0.0))
    with pytest.raises(UsageError, match="no checkpoint in .* can be restored.*ckpt-6.*ckpt-3"):
        checkpoints.restore()


SAVED_FLAGS = "# resolved flags of: ...\n--model=seed_cnn\n--image_size=32\n--steps=6\n--strategy=auto\n"


def test_changed_flags_are_refused_naming_each_with_its_saved_value(tmp_path):
    (tmp_path / "flags.txt").write_text(SAVED_FLAGS)
    now = "--model=lenet\n--image_size=64\n--steps=60\n--strategy=mirrored\n--seed=1\n"
    with pytest.raises(UsageError) as error:
        check_same_run(str(tmp_path), "runs/r1", TrainConfig(), now)
    assert str(error.value) == (
        "runs/r1 was trained with --image_size=32, --model=seed_cnn, no --seed, this command says "
        "--image_size=64, --model=lenet, --seed=1; resume with the run's flags (runs/r1/flags.txt) "
        "or use a fresh --model_dir"
    )
    # More steps on another strategy: a resume may change those.
    check_same_run(str(tmp_path), "runs/r1", TrainConfig(), "--model=seed_cnn\n--image_size=32\n--steps=60\n")
    # A library call (no flags text) compares the config's values with the flags the run saved.
    config = TrainConfig.from_flat(model="lenet", image_size=32, steps=60, data_dir="/elsewhere")
    with pytest.raises(UsageError, match="trained with --model=seed_cnn, this command says --model=lenet;"):
        check_same_run(str(tmp_path), "runs/r1", config)


@pytest.mark.parametrize("saved", ["", "\x00\xff cut short", None], ids=["empty", "garbage", "missing"])
def test_a_run_with_checkpoints_but_no_readable_flags_is_refused(tmp_path, saved):
    """An empty, unreadable or missing flags.txt beside checkpoints tells nothing of what they
    were trained with: an app's resume (another --dataset, another --seed) is refused, not run."""
    if saved is not None:
        (tmp_path / "flags.txt").write_bytes(saved.encode("latin-1"))
    now = "--model=seed_cnn\n--dataset=digits\n--seed=7\n"
    state = "is missing" if saved is None else "is empty or unreadable"
    with pytest.raises(UsageError) as error:
        check_same_run(str(tmp_path), "runs/r1", TrainConfig(), now)
    assert str(error.value) == (
        f"runs/r1/flags.txt {state}, but runs/r1 holds checkpoints: nothing tells which flags they were "
        "trained with; write the run's flags back into it (--name=value lines, as `--flagfile=` reads) "
        "or use a fresh --model_dir"
    )
    if saved is None:  # a library call's run saves no flags.txt: it resumes without one
        check_same_run(str(tmp_path), "runs/r1", TrainConfig())


def test_resume_command_names_the_default_dir_and_the_launcher(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(LAUNCH_COMMAND_ENV, raising=False)
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "apps.classify", "--steps=9"])
    assert (
        common.resume_command("classify", "runs/r 1", had_model_dir=True)
        == "python -m apps.classify --steps=9"
    )
    assert common.resume_command("classify", "runs/r 1", had_model_dir=False) == (
        f"python -m apps.classify --steps=9 '--model_dir={tmp_path}/runs/r 1'"
    )
    # A launched worker names the launcher: its restart stamps a new default dir, hence the dir.
    launcher = "python -m tfmp.launch --workers=2 -- python -m apps.mnist --steps=9"
    monkeypatch.setenv(LAUNCH_COMMAND_ENV, launcher)
    command = shlex.split(common.resume_command("mnist", "runs/x", had_model_dir=False))
    worker = command[command.index("--") + 1 :]
    assert worker == ["python", "-m", "apps.mnist", "--steps=9", f"--model_dir={tmp_path}/runs/x"]
    assert common.resume_command("mnist", "runs/x", had_model_dir=True) == launcher


class _Stops:
    """Records what `_StopSignals` would exit with; unblocks the main thread's dequeue."""

    def __init__(self, queue=None):
        self.calls, self.done, self.queue = [], threading.Event(), queue

    def __call__(self, code):
        self.calls.append(code)
        self.done.set()
        if self.queue is not None:
            self.queue.close(cancel_pending_enqueues=True)


def _wait_until(condition):
    deadline = time.time() + 60  # a bound for a broken handler, not a timing assertion
    while not condition() and time.time() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_second_signal_stops_at_once_while_a_step_hangs(capfd):
    """The main thread sits in a TensorFlow op that never returns (a hung step): SIGTERM is
    noted; a SIGINT within the second is the same request (a terminal's ^C reaches a launched
    worker directly and as the launcher's SIGTERM); one later (the user's ^C after `timeout`'s
    SIGTERM) stops the process with a line naming what a resume starts from."""
    queue = tf.queue.FIFOQueue(1, tf.float32)
    stops, now = _Stops(queue), [100.0]
    clause = "a resume starts from the checkpoint of step 40 in /r/checkpoints; resume with: python -m apps.x"
    notice = loop._StopSignals(
        (signal.SIGTERM, signal.SIGINT), lambda: clause, True, exit=stops, clock=lambda: now[0]
    )
    notice.trained = True

    def signals():
        for signum, seen, later in (
            (signal.SIGTERM, 1, 0.5),
            (signal.SIGINT, 2, 1.0),
            (signal.SIGINT, 3, 0),
        ):
            os.kill(os.getpid(), signum)
            if not _wait_until(lambda: notice.seen == seen) or stops.calls:
                break
            now[0] += later
        if not stops.done.wait(60):
            queue.close(cancel_pending_enqueues=True)

    sender = threading.Thread(target=signals)
    try:
        sender.start()
        with pytest.raises(tf.errors.OutOfRangeError):
            queue.dequeue()  # blocks until the second signal's exit closes the queue
        sender.join()
    finally:
        notice.restore()
    assert notice.seen == 3 and stops.calls == [128 + signal.SIGINT]
    assert capfd.readouterr().err.splitlines()[-1] == (
        f"interrupted: a second SIGINT, stopped at once without saving; {clause}"
    )


def test_a_signal_before_the_first_step_stops_at_once_and_after_it_asks_for_a_checkpoint(capfd):
    previous = signal.getsignal(signal.SIGINT)
    stops = _Stops()
    notice = loop._StopSignals((signal.SIGTERM, signal.SIGINT), lambda: "no checkpoint", True, exit=stops)
    try:
        os.kill(os.getpid(), signal.SIGINT)  # one worker, nothing trained yet: nothing to save
        assert stops.done.wait(60) and stops.calls == [EXIT_PREEMPTED] and not notice.received
        assert "preempted: SIGINT before the first step finished" in capfd.readouterr().err
        notice.trained = True
        os.kill(os.getpid(), signal.SIGTERM)
        assert _wait_until(lambda: notice.received) and notice.name == "SIGTERM"
        assert stops.calls == [EXIT_PREEMPTED]  # noted: the loop saves, then raises Preempted
    finally:
        notice.restore()
    assert signal.getsignal(signal.SIGINT) is previous


def _dropout_model(seed: int):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((3,))
    return keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dropout(0.5, seed=seed)(inputs)))


def test_the_seed_generators_states_are_saved_and_a_checkpoint_without_them_still_restores(tmp_path):
    """A Dropout's seed generator state is no part of the model's object graph: checkpoints hold
    it beside, so a resume draws the masks the run would have; one written before they did
    restores all the rest and says the seed generators start afresh."""
    model = _dropout_model(1)
    model(tf.ones((4, 3)), training=True)  # one draw: the state moves
    saver = checkpoint.Checkpoints(str(tmp_path / "new"), True, 0, global_batch_size=8, model=model)
    saver.save(2)
    older = tf.train.Checkpoint(model=model, step=saver.step, global_batch_size=saver.batch)
    tf.train.CheckpointManager(older, str(tmp_path / "old" / "checkpoints"), 3).save(checkpoint_number=2)
    for run, said_anything in (("new", False), ("old", True)):
        said, restored = [], _dropout_model(2)
        checkpoints = checkpoint.Checkpoints(
            str(tmp_path / run), True, 0, global_batch_size=8, say=said.append, model=restored
        )
        assert checkpoints.restore() == 2
        for mine, saved in zip(restored.get_weights(), model.get_weights()):
            assert (mine == saved).all()
        [state] = [v for v in restored.variables if "seed_generator" in v.path]
        [original] = [v for v in model.variables if "seed_generator" in v.path]
        assert (state.numpy() == original.numpy()).all() != said_anything
        assert bool(said) == said_anything and (not said or "start afresh" in said[0])
