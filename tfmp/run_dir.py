"""Every file name inside a run directory, and reading a finished run's flags back.

A run directory (`--model_dir`, default `runs/<model>-<dataset>-<time>`) holds:

    flags.txt          the resolved flags, `--name=value` per line (what `apps.* --flagfile=` reads)
    run_card.json      every setting that decides speed and numerics (printed at start too)
    metrics.jsonl      one JSON object per log point: step, split, loss, accuracy, lr, ...
    checkpoints/       tf.train checkpoints (model, optimizer, loss scale, step, global batch)
    model.keras        the trained model, saved by the chief at the end
    run.lock           held (flock) by the run writing here; names its host and PID (see `lock`);
                       removed when the run ends (a killed run's stays, unlocked: the next run takes it)
    export/<precision>/   what `apps.export` writes (see `tfmp.serving.export`)
    precision_report.json what `--diagnose_precision` measured (see `tfmp.precision.doctor`)

This module imports nothing heavy, so the launcher and `apps.predict` can read a run cheaply:

    from tfmp import run_dir
    flags = run_dir.read_flags("runs/seed_cnn-shapes-20261201-101500")   # {"model": "seed_cnn", ...}
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import tempfile
import time
import zipfile

from tfmp import write_faults
from tfmp.errors import UsageError, WriteFailed

FLAGS_FILE = "flags.txt"
RUN_CARD_FILE = "run_card.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINT_DIR = "checkpoints"
MODEL_FILE = "model.keras"
EXPORT_DIR = "export"
EXPORT_METADATA_FILE = "export.json"  # inside each export/<precision>/ directory
PRECISION_REPORT_FILE = "precision_report.json"
LOCK_FILE = "run.lock"
TEMPORARY_PREFIX = ".tmp-"  # atomic_path's temporary siblings: .tmp-<pid>-<name>


def writable_dir(path: str, flag: str = "--model_dir") -> str:
    """`path` with `~` expanded, made absolute, checked to be a directory this process can write.

    Nothing is created: the nearest existing ancestor is probed with a temporary directory that
    is removed at once, so a read-only or missing mount fails here, before a run writes anything.
    A UsageError names the flag, the value and the fix (a file, a dangling or looping symlink on
    the way, a read-only or forbidden place); a full file system is `WriteFailed` (exit 4).
    """
    if not path:
        raise UsageError(f"{flag} is empty; name a directory")
    resolved = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(resolved) and not os.path.isdir(resolved):
        raise UsageError(f"{flag}={path} is a file, not a directory; name a directory (new or existing)")
    ancestor = resolved
    while not os.path.exists(ancestor):
        _refuse_broken_link(ancestor, path, flag)
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise UsageError(f"{flag}={path}: {ancestor} is a file, not a directory; name another path")
    try:
        with tempfile.TemporaryDirectory(prefix=".tfmp-write-probe-", dir=ancestor):
            pass
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):  # not the path's fault: the disk's
            line = write_faults.describe(
                OSError(error.errno, error.strerror), ancestor
            )  # not the probe's name
            raise WriteFailed(f"{flag}={path}: {line}, then run the same command again") from None
        reasons = {errno.EROFS: "read-only file system", errno.EACCES: "permission denied"}
        reason = reasons.get(error.errno, "not writable")
        raise UsageError(
            f"{flag}={path}: cannot write in {ancestor} ({reason}); name a writable directory"
        ) from None
    return resolved


def _refuse_broken_link(candidate: str, path: str, flag: str) -> None:
    """A UsageError if `candidate` (which does not exist) is a symlink: a dangling one names a
    missing target, a looping one none; either way os.makedirs could not make the directory."""
    if not os.path.islink(candidate):
        return
    try:
        os.stat(candidate)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UsageError(
                f"{flag}={path}: {candidate} is a symlink loop; remove it or name another directory"
            ) from None
    target = os.path.join(os.path.dirname(candidate), os.readlink(candidate))
    raise UsageError(
        f"{flag}={path}: {candidate} is a symlink to {target}, which does not exist; "
        "create the target directory or name another path"
    )


@contextlib.contextmanager
def atomic_path(path: str):
    """Yields a temporary sibling of the file `path` to write; on success it is synced and renamed onto
    `path`, so a reader (or a kill -9 mid-write) sees the old file whole or the new one whole.

        with run_dir.atomic_path(os.path.join(model_dir, run_dir.MODEL_FILE)) as temporary:
            model.save(temporary)

    The sibling keeps `path`'s extension (Keras checks `.keras`) and starts with `.tmp-`, so a
    leftover from a killed writer is recognisable and removed at the next start. On an error it is removed
    and the error propagates; `path` is untouched.
    """
    directory, name = os.path.split(os.path.abspath(path))
    temporary = os.path.join(directory, f".tmp-{os.getpid()}-{name}")
    try:
        yield temporary
        with open(temporary, "rb") as file:  # the bytes reach the disk before the name does
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise
    _fsync_directory(directory)


def write_text_atomic(path: str, text: str) -> None:
    """`path` holds `text` whole, or keeps what it held (see `atomic_path`)."""
    with atomic_path(path) as temporary, open(temporary, "w", encoding="utf-8") as file:
        file.write(text)


def _fsync_directory(directory: str) -> None:
    # The rename itself is durable only once the directory entry is on disk.
    with contextlib.suppress(OSError):
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


@dataclasses.dataclass
class RunLock:
    """The lock a run holds on its directory (see `lock`); `release()` ends it."""

    path: str
    descriptor: int
    made: list[str]  # the directories `lock` created, deepest first

    def release(self) -> None:
        """Removes run.lock (the run no longer lives) and unlocks; a directory `lock` made is removed
        again if the run wrote nothing else in it."""
        if self.descriptor < 0:
            return
        # Removed while still locked: a run that opened the file meanwhile finds it gone once it
        # gets the lock, and locks a new one (`lock`'s loop).
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)
        if self.made and not os.listdir(self.made[0]):
            for directory in self.made:
                with contextlib.suppress(OSError):
                    os.rmdir(directory)
        os.close(self.descriptor)
        self.descriptor = -1


def lock(model_dir: str, shown_dir: str, flag: str = "--model_dir") -> RunLock:
    """Makes `model_dir` (absolute) if needed and locks it for this process: one writer per run.

    `flock` on `model_dir/run.lock`, which then holds this process's host, PID and start time;
    the OS releases it when the process ends however it ends (kill -9 included), so a stale
    file never blocks. Another run holding it is a UsageError naming its host and PID.
    `shown_dir` is the directory as the user spelt it, for the message.
    """
    made, ancestor = [], model_dir
    while not os.path.isdir(ancestor):
        made.append(ancestor)
        ancestor = os.path.dirname(ancestor)
    while True:
        os.makedirs(model_dir, exist_ok=True)
        path = os.path.join(model_dir, LOCK_FILE)
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                logging.getLogger(__name__).warning(
                    "cannot lock %s: this file system has no locks (%s); make sure no other run writes "
                    "into %s while this one does",
                    path,
                    error.strerror,
                    shown_dir,
                )
                break
            if error.errno not in (errno.EAGAIN, errno.EACCES):  # EACCES: what some systems say
                os.close(descriptor)
                raise
            holder = os.pread(descriptor, 512, 0).decode(errors="replace").strip()
            os.close(descriptor)
            raise UsageError(
                f"{flag}={shown_dir} is in use by another run "
                f"({holder or 'it has not written its host and PID yet'}); "
                "wait for it to end or stop it, or use another directory"
            ) from None
        if os.path.exists(path) and os.path.samestat(os.stat(path), os.fstat(descriptor)):
            break
        os.close(descriptor)  # locked a file its holder removed on release: lock the new one
    held = RunLock(path, descriptor, made)
    try:
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        holder = f"host {socket.gethostname()}, PID {os.getpid()}, since {started}\n".encode()
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, holder, 0)
    except BaseException:
        held.release()
        raise
    return held


def remove_leftovers(model_dir: str) -> list[str]:
    """Removes what killed or failed writers left in a run directory; returns the paths removed.

    `.tmp-<pid>-<name>` siblings (see `atomic_path`) of a process no longer alive, in the run
    directory and its checkpoints/, and TensorFlow's `checkpoints/ckpt-N_temp/` folders (a save
    cut short). Only the run holding the lock calls it: no other process writes checkpoints here.
    """
    removed = []
    for directory in (model_dir, os.path.join(model_dir, CHECKPOINT_DIR)):
        names = os.listdir(directory) if os.path.isdir(directory) else []
        for name in names:
            path = os.path.join(directory, name)
            if name.startswith(TEMPORARY_PREFIX) and not _writer_alive(name):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
                removed.append(path)
            elif directory != model_dir and name.startswith("ckpt-") and name.endswith("_temp"):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def _writer_alive(temporary_name: str) -> bool:
    """Whether the process named by `.tmp-<pid>-...` still runs on this host (and is not this one)."""
    pid = temporary_name[len(TEMPORARY_PREFIX) :].split("-", 1)[0]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_run_dir(path: str) -> bool:
    """Whether `path` looks like a tfmp training run (it has the resolved flags)."""
    return os.path.isfile(os.path.join(path, FLAGS_FILE))


def read_flags(path: str, required: bool = False) -> dict[str, str]:
    """The `--name=value` lines of a run's flags.txt as a dict of strings ({} if there is none).

    With `required=True` a directory without flags.txt is a UsageError naming it.
    """
    flags_path = os.path.join(path, FLAGS_FILE)
    if not os.path.isfile(flags_path):
        if required:
            raise UsageError(
                f"{path!r} is not a tfmp run directory (no {FLAGS_FILE}); pass the --model_dir of a "
                "finished training run"
            )
        return {}
    flags = {}
    with open(flags_path, encoding="utf-8") as file:
        for line in file:
            name, equals, value = line.strip().partition("=")
            if name.startswith("--") and equals:
                flags[name[2:]] = value
    return flags


def read_run_card(path: str) -> dict:
    """The run card a run wrote at its start ({} if there is none)."""
    card_path = os.path.join(path, RUN_CARD_FILE)
    if not os.path.isfile(card_path):
        return {}
    with open(card_path, encoding="utf-8") as file:
        return json.load(file)


def model_path(path: str) -> str:
    """The run's saved model; a UsageError if the run has not finished (no model.keras yet)."""
    saved = os.path.join(path, MODEL_FILE)
    if not os.path.isfile(saved):
        raise UsageError(f"run {path!r} has no {MODEL_FILE} (unfinished run?); train it to the end first")
    check_keras_file(saved)
    return saved


def check_keras_file(path: str) -> None:
    """A UsageError unless `path` is a whole `.keras` archive (a zip with its config), so a truncated
    or overwritten file is named as such instead of Keras' "File not found" for a file that exists."""
    try:
        with zipfile.ZipFile(path) as archive:
            complete = "config.json" in archive.namelist()
    except (zipfile.BadZipFile, OSError):
        complete = False
    if not complete:
        raise UsageError(
            f"{path!r} is not a complete .keras file (truncated, overwritten or another format); "
            "save the model again, e.g. train the run to its end"
        )
