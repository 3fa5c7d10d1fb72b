"""One writer per run, whole files, and every write fault as one line (issue 30), each caused for real.

Everything here runs as root (CI too), so a permission bit stops no write: the faults are a
tiny tmpfs filled up (ENOSPC), a read-only bind mount (EROFS), a process file-size limit
(RLIMIT_FSIZE, EFBIG; Python ignores SIGXFSZ, so the write fails instead of killing the process)
and kill -9. Tests that need `mount` skip, saying so, where it is not permitted.
"""

import hashlib
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import ROOT, finish, run_python, start_python

import tfmp
from tfmp import run_dir
from tfmp.errors import EXIT_PREEMPTED, EXIT_USAGE, EXIT_WRITE_FAILED, UsageError, WriteFailed
from tfmp.training import checkpoint
from tfmp.training.reporting import Reporter

CLASSIFY = ["-m", "apps.classify", "--model=lenet", "--dataset=digits", "--image_size=16"]
CLASSIFY += ["--global_batch_size=8", "--checkpoint_every=2", "--log_every=2"]
CHECKPOINT_BYTES = 680_000  # one lenet checkpoint at 16x16 with Adam's slots (677 KB), for the sizes below


def _mount(args, skip_reason):
    result = subprocess.run(["mount", *args], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"{skip_reason}: mount {' '.join(args)} failed: {result.stderr.strip()}")


@pytest.fixture
def mounts():
    """`mounts.tmpfs(dir, size)` and `mounts.read_only(source, dir)`, all unmounted afterwards."""
    made = []

    class Mounts:
        @staticmethod
        def tmpfs(directory, size):
            directory.mkdir(parents=True, exist_ok=True)
            _mount(["-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], "needs a tmpfs mount")
            made.append(directory)

        @staticmethod
        def resize(directory, size):
            _mount(["-o", f"remount,size={size}", str(directory)], "needs a tmpfs remount")

        @staticmethod
        def read_only(source, directory):
            directory.mkdir(parents=True, exist_ok=True)
            _mount(["--bind", str(source), str(directory)], "needs a bind mount")
            made.append(directory)
            _mount(["-o", "remount,bind,ro", str(directory)], "needs a read-only bind mount")

    yield Mounts
    for directory in reversed(made):
        subprocess.run(["umount", "-l", str(directory)], capture_output=True)


def _with_file_size_limit(limit):
    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return limited


def _run_limited(args, limit, cwd):
    """`python ARGS` under a file-size limit of `limit` bytes (its writes past it fail with EFBIG)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=_with_file_size_limit(limit),
    )


def _error_line(result, code) -> str:
    assert result.returncode == code, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    return lines[0]


def _leftovers(model_dir) -> list[str]:
    found = []
    for directory, folders, files in os.walk(model_dir):
        found += [name for name in folders + files if name.startswith(".tmp-") or name.endswith("_temp")]
    return found


def _digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.mark.slow
def test_a_full_disk_then_a_file_size_limit_are_one_line_each_and_the_same_command_resumes(tmp_path, mounts):
    """A 2 MiB tmpfs holds three checkpoints; the fourth save fails (ENOSPC). After growing it the
    same command resumes from the last whole checkpoint to the end; under a 100 KB file-size limit
    the same command (a finished run: no step, only the model's save) fails on model.keras,
    which stays the previous whole file. Beside the first run, one under a 500-byte limit fails
    on its first file, flags.txt, and leaves no directory behind, and apps.export onto a full
    disk (an app that does not name what it writes) says so in one line too."""
    disk, small = tmp_path / "disk", tmp_path / "small"
    mounts.tmpfs(disk, "2m")
    mounts.tmpfs(small, "64k")
    command = [*CLASSIFY, "--steps=12", f"--model_dir={disk / 'run'}"]
    full = start_python(command, cwd=tmp_path)
    export = start_python(
        ["-m", "apps.export", f"--model_dir={_finished_run(tmp_path)}", f"--output_dir={small}"]
    )
    fresh = tmp_path / "fresh"
    at_start = _run_limited([*CLASSIFY, "--steps=2", f"--model_dir={fresh}"], 500, cwd=tmp_path)
    full, export = finish(full), finish(export)

    # apps.export's TFLite check prints TensorFlow Lite's own warnings first, as on success.
    assert export.returncode == EXIT_WRITE_FAILED and "Traceback" not in export.stderr, export.stderr[-3000:]
    errors = [line for line in export.stderr.splitlines() if line.startswith("error: ")]
    assert errors == export.stderr.strip().splitlines()[-1:]  # Keras' save names no file: where to look
    assert errors[0] == (
        "error: a write failed (no space left on device); free space on the file system this command writes "
        "to (its --model_dir or --output_dir), then run the same command again"
    )

    line = _error_line(full, EXIT_WRITE_FAILED)
    checkpoints = disk / "run" / "checkpoints"
    assert line.startswith("error: saving the checkpoint of step 8: cannot write ")
    assert f"(no space left on device); free space on {disk}, then run " in line
    assert line.endswith(f": it resumes from the checkpoint of step 6 in {checkpoints}")
    assert tf.train.latest_checkpoint(str(checkpoints)).endswith("ckpt-6")
    assert _leftovers(disk / "run") == []
    lines = (disk / "run" / "metrics.jsonl").read_text().splitlines()
    assert lines and all(json.loads(line)["step"] <= 8 for line in lines)

    start_line = _error_line(at_start, EXIT_WRITE_FAILED)
    assert start_line.startswith(
        f"error: writing the run's flags: cannot write {fresh / 'flags.txt'} (file too large"
    )
    assert "then run " in start_line and "no checkpoint was saved yet, so it starts from step 0" in start_line
    assert not fresh.exists()  # no empty flags.txt or metrics.jsonl: the directory it made is gone

    mounts.resize(disk, "8m")
    resumed = run_python(command, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((disk / "run" / "run_card.json").read_text())["steps"].endswith("from step 6")
    assert " 12 steps (12 applied)" in resumed.stdout
    assert _leftovers(disk / "run") == []
    model = disk / "run" / "model.keras"
    before = _digest(model)

    limited = _run_limited(command, 100_000, cwd=tmp_path)
    line = _error_line(limited, EXIT_WRITE_FAILED)
    assert line.startswith(
        f"error: saving the model: cannot write {model} (file too large for this process's"
    )
    assert line.endswith(f": it resumes from the checkpoint of step 12 in {checkpoints}")
    assert _digest(model) == before and _leftovers(disk / "run") == []
    run_dir.check_keras_file(str(model))


@pytest.mark.slow
def test_a_second_run_on_a_held_dir_is_refused_naming_the_holder(tmp_path):
    """While one app trains in a directory, a second app there and tfmp.fit there each refuse
    with one line naming the first's host and PID, and write nothing into it."""
    model_dir = tmp_path / "run"
    first = start_python([*CLASSIFY, "--steps=100000", f"--model_dir={model_dir}"], cwd=tmp_path)
    deadline = time.time() + 300
    while not (model_dir / "metrics.jsonl").exists() and time.time() < deadline and first.poll() is None:
        time.sleep(0.1)
    try:
        holder = f"host {socket.gethostname()}, PID {first.pid}, since "
        second = run_python([*CLASSIFY, "--steps=4", f"--model_dir={model_dir}"], cwd=tmp_path)
        line = _error_line(second, EXIT_USAGE)
        assert line.startswith(f"error: --model_dir={model_dir} is in use by another run ({holder}")
        assert line.endswith("; wait for it to end or stop it, or use another directory")
        with pytest.raises(
            UsageError, match=re.escape(f"model_dir={model_dir} is in use by another run ({holder}")
        ):
            tfmp.fit(_tiny_model(), _tiny_data(), model_dir=str(model_dir), verbose=0)
        flags = (model_dir / "flags.txt").read_text()
    finally:
        first.send_signal(signal.SIGTERM)
        stopped = finish(first)
    assert stopped.returncode == EXIT_PREEMPTED, stopped.stderr[-3000:]
    assert f"--model_dir={model_dir}\n" in flags and "--steps=100000\n" in flags
    steps = [json.loads(line)["step"] for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps)  # one run's records only, not two runs' interleaved


def _finished_run(tmp_path):
    """A run directory as a finished tiny classifier run leaves it (flags.txt, model.keras)."""
    run = tmp_path / "finished"
    run.mkdir()
    images = keras.Input((16, 16, 3))
    model = keras.Model(images, keras.layers.Dense(3, "softmax")(keras.layers.Flatten()(images)))
    model.save(run / run_dir.MODEL_FILE)
    (run / run_dir.FLAGS_FILE).write_text("--model=seed_cnn\n--dataset=shapes\n--image_size=16\n")
    return run


def _tiny_model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _tiny_data():
    features = np.zeros((8, 4), np.float32)
    return tf.data.Dataset.from_tensor_slices((features, np.arange(8) % 3)).batch(4)


def test_the_lock_names_its_holder_and_ends_with_it(tmp_path):
    """A child process holds the lock until it is killed (-9): the OS releases it, and the file's
    stale text blocks nothing."""
    model_dir = tmp_path / "a" / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from tfmp import run_dir; run_dir.lock(sys.argv[1], 'runs/x'); "
            "print('held', flush=True); time.sleep(600)",
            str(model_dir),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(UsageError) as refused:
            run_dir.lock(str(model_dir), "runs/x")
        assert str(refused.value).startswith(
            f"--model_dir=runs/x is in use by another run (host {socket.gethostname()}, PID {holder.pid}, since "
        )
    finally:
        holder.kill()
        holder.wait()
    held = run_dir.lock(str(model_dir), "runs/x")
    assert (
        (model_dir / "run.lock").read_text().startswith(f"host {socket.gethostname()}, PID {os.getpid()}, ")
    )
    held.release()
    assert not (model_dir / "run.lock").exists() and model_dir.is_dir()  # the lock goes, the directory stays

    made = tmp_path / "new" / "run"
    run_dir.lock(str(made), "new/run").release()  # nothing else written: what it made is removed
    assert not (tmp_path / "new").exists()


def test_kill_9_during_an_atomic_write_leaves_the_previous_file_whole(tmp_path):
    """A writer killed half way through model.keras leaves the previous file byte for byte and a
    `.tmp-<pid>-model.keras` that the next start removes (its writer is dead)."""
    model = tmp_path / "model.keras"
    model.write_bytes(b"the previous whole model")
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from tfmp import run_dir\n"
            "with run_dir.atomic_path(sys.argv[1]) as temporary:\n"
            "    file = open(temporary, 'wb'); file.write(b'half of a new mod'); file.flush()\n"
            "    print('writing', flush=True); time.sleep(600)\n",
            str(model),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout.readline() == "writing\n"
    writer.kill()
    writer.wait()
    assert model.read_bytes() == b"the previous whole model"
    temporary = tmp_path / f".tmp-{writer.pid}-model.keras"
    assert temporary.read_bytes() == b"half of a new mod"
    (tmp_path / "checkpoints" / "ckpt-8_temp").mkdir(parents=True)
    alive = tmp_path / f".tmp-{os.getppid()}-flags.txt"  # a live process's write in progress: kept
    alive.write_text("")
    removed = run_dir.remove_leftovers(str(tmp_path))
    assert sorted(removed) == sorted([str(tmp_path / "checkpoints" / "ckpt-8_temp"), str(temporary)])
    assert alive.exists() and not temporary.exists()


def test_writes_into_a_read_only_file_system_raise_one_line_naming_the_mount(tmp_path, mounts):
    """The run card, a checkpoint and metrics.jsonl, each into a read-only bind mount."""
    source, mounted = tmp_path / "source", tmp_path / "ro"
    source.mkdir()
    mounts.read_only(source, mounted)
    expected = f"(read-only file system); remount {mounted} read-write"
    reporter = Reporter(str(mounted), verbose=False)
    with pytest.raises(WriteFailed) as failed:
        reporter.run_card({"model": "x"})
    assert str(failed.value) == f"writing the run card: cannot write {mounted / 'run_card.json'} {expected}"
    with pytest.raises(WriteFailed, match=f"^logging step 3: cannot write {mounted / 'metrics.jsonl'} "):
        reporter.scalars(3, "train", {"loss": 1.0})
    reporter.close(failing=True)
    saver = checkpoint.Checkpoints(str(mounted), True, 0, global_batch_size=8, weight=tf.Variable(1.0))
    with pytest.raises(WriteFailed) as failed:
        saver.save(4)
    assert str(failed.value).startswith(f"saving the checkpoint of step 4: cannot write {mounted}")
    assert str(failed.value).endswith(expected) and saver.saved_step is None
    assert os.listdir(source) == []


def test_a_full_disk_under_tensorboard_is_one_line_and_a_cut_record_is_dropped(tmp_path, mounts):
    """The TensorBoard writer on a full tmpfs (metrics.jsonl's record fits in the page it has);
    the record a fault cut short is dropped when a run next appends: every line stays one object."""
    disk = tmp_path / "disk"
    mounts.tmpfs(disk, "64k")
    (disk / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo')  # a record cut short
    with open(disk / "filler", "wb", buffering=0) as filler, pytest.raises(OSError):
        while True:
            filler.write(b"x" * 4096)
    reporter = Reporter(str(disk), verbose=False)
    with pytest.raises(WriteFailed) as failed:
        reporter.scalars(3, "train", {"loss": 1.0})
    assert str(failed.value).startswith(f"logging step 3: cannot write {disk / 'tensorboard' / 'train'}")
    assert str(failed.value).endswith(f"(no space left on device); free space on {disk}")
    reporter.close(failing=True)
    os.remove(disk / "filler")
    reporter = Reporter(str(disk), verbose=False)
    reporter.scalars(4, "train", {"loss": 1.0})
    reporter.close()
    records = [json.loads(line) for line in (disk / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 3, 4]


class _FillTheDisk(keras.callbacks.Callback):
    """At the end of the first epoch (its checkpoint saved), fills the file system `path` is on."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            with open(self.path, "wb", buffering=0) as filler, pytest.raises(OSError):
                while True:
                    filler.write(b"x" * 4096)


def test_tfmp_fit_on_a_disk_that_fills_mid_run_names_the_checkpoint_it_resumes_from(tmp_path, mounts):
    disk = tmp_path / "disk"
    mounts.tmpfs(disk, "512k")
    model_dir = disk / "run"
    with pytest.raises(WriteFailed) as failed:
        tfmp.fit(
            _tiny_model(),
            _tiny_data(),
            epochs=2,
            verbose=0,
            model_dir=str(model_dir),
            callbacks=[_FillTheDisk(disk / "filler")],
        )
    message = str(failed.value)
    assert message.startswith(f"saving the checkpoint of step 4: cannot write {model_dir / 'checkpoints'}")
    assert message.endswith(
        f"(no space left on device); free space on {disk}, then run tfmp.fit again with the same "
        f"model_dir: it resumes from the checkpoint of step 2 in {model_dir / 'checkpoints'}"
    )
    assert _leftovers(model_dir) == []
    os.remove(disk / "filler")
    tfmp.fit(_tiny_model(), _tiny_data(), epochs=2, verbose=0, model_dir=str(model_dir))
    assert json.loads((model_dir / "run_card.json").read_text())["steps"].endswith("from step 2")


@pytest.fixture
def immutable(tmp_path):
    """A directory even root cannot write in (`chattr +i`, ext4/xfs/btrfs); skips elsewhere."""
    directory = tmp_path / "immutable"
    directory.mkdir()
    result = subprocess.run(["chattr", "+i", str(directory)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"needs chattr +i (root on ext4, xfs or btrfs): {result.stderr.strip()}")
    yield directory
    subprocess.run(["chattr", "-i", str(directory)], check=True)


def test_writes_into_an_immutable_directory_raise_one_line_naming_it(immutable):
    """Operation not permitted (EPERM): what root meets where a permission stops a write."""
    expected = f"(operation not permitted); let this user write in {immutable} (its permissions, or an"
    with pytest.raises(WriteFailed) as failed:
        Reporter(str(immutable), verbose=False).run_card({"model": "x"})
    assert str(failed.value).startswith(
        f"writing the run card: cannot write {immutable / 'run_card.json'} {expected}"
    )
    saver = checkpoint.Checkpoints(str(immutable), True, 0, global_batch_size=8, weight=tf.Variable(1.0))
    with pytest.raises(WriteFailed) as failed:
        saver.save(4)
    assert str(failed.value).startswith(
        f"saving the checkpoint of step 4: cannot write {immutable / 'checkpoints'}"
    )
    assert "(operation not permitted)" in str(failed.value)
    assert os.listdir(immutable) == []


def test_a_file_system_out_of_inodes_at_the_start_is_a_write_fault_not_a_usage_error(tmp_path, mounts):
    """A new run directory on a full file system (here: no inode left for a directory) is refused
    before anything is built, as the disk's fault (exit 4), not the path's (exit 2)."""
    disk = tmp_path / "disk"
    mounts.tmpfs(disk, "64k,nr_inodes=2")  # the root directory and one more
    (disk / "only").mkdir()
    with pytest.raises(WriteFailed) as failed:
        run_dir.writable_dir(str(disk / "run"))
    assert str(failed.value) == (
        f"--model_dir={disk / 'run'}: cannot write {disk} (no space left on device); free space on {disk}, "
        "then run the same command again"
    )
