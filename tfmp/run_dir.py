"""Every file name inside a run directory, and reading a finished run's flags back.

A run directory (`--model_dir`, default `runs/<model>-<dataset>-<time>`) holds:

    flags.txt          the resolved flags, `--name=value` per line (what `apps.* --flagfile=` reads)
    run_card.json      every setting that decides speed and numerics (printed at start too)
    metrics.jsonl      one JSON object per log point: step, split, loss, accuracy, lr, ...
    checkpoints/       tf.train checkpoints (model, optimizer, loss scale, step, global batch)
    model.keras        the trained model, saved by the chief at the end
    export/<precision>/   what `apps.export` writes (see `tfmp.serving.export`)
    precision_report.json what `--diagnose_precision` measured (see `tfmp.precision.doctor`)

This module imports nothing heavy, so the launcher and `apps.predict` can read a run cheaply:

    from tfmp import run_dir
    flags = run_dir.read_flags("runs/seed_cnn-shapes-20261201-101500")   # {"model": "seed_cnn", ...}
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
import zipfile

from tfmp.errors import UsageError

FLAGS_FILE = "flags.txt"
RUN_CARD_FILE = "run_card.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINT_DIR = "checkpoints"
MODEL_FILE = "model.keras"
EXPORT_DIR = "export"
EXPORT_METADATA_FILE = "export.json"  # inside each export/<precision>/ directory
PRECISION_REPORT_FILE = "precision_report.json"


def writable_dir(path: str, flag: str = "--model_dir") -> str:
    """`path` with `~` expanded, made absolute, checked to be a directory this process can write.

    Nothing is created: the nearest existing ancestor is probed with a temporary directory that
    is removed at once, so a read-only or missing mount fails here, before a run writes anything.
    A UsageError names the flag, the value and the fix.
    """
    if not path:
        raise UsageError(f"{flag} is empty; name a directory")
    resolved = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(resolved) and not os.path.isdir(resolved):
        raise UsageError(f"{flag}={path} is a file, not a directory; name a directory (new or existing)")
    ancestor = resolved
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise UsageError(f"{flag}={path}: {ancestor} is a file, not a directory; name another path")
    try:
        with tempfile.TemporaryDirectory(prefix=".tfmp-write-probe-", dir=ancestor):
            pass
    except OSError as error:
        reasons = {errno.EROFS: "read-only file system", errno.EACCES: "permission denied"}
        reason = reasons.get(error.errno, "not writable")
        raise UsageError(
            f"{flag}={path}: cannot write in {ancestor} ({reason}); name a writable directory"
        ) from None
    return resolved


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
