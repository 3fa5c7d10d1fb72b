"""Which errors mean a write failed for a reason outside the program, and the one line that says so.

A full disk (ENOSPC), a full quota (EDQUOT), a read-only file system (EROFS), a denied permission
(EACCES, EPERM) and a process's file-size limit (EFBIG, `ulimit -f`) reach a run as Python's
`OSError` (with an errno) or as TensorFlow's `OpError` (whose message names the file and ends in
the C library's text for the errno, e.g. "...ckpt-8_temp/part-0...; No space left on device").
Writes into a run are wrapped so either becomes `tfmp.errors.WriteFailed`, which apps print as
one `error:` line (exit 4) instead of a traceback:

    with write_faults.guarded("saving the model", path), run_dir.atomic_path(path) as temporary:
        model.save(temporary)
    ...
    except WriteFailed as error:  # where the run knows its checkpoints: what a rerun resumes from
        saved_step, location = checkpoints.saved_step, checkpoints.location
        raise write_faults.with_resume(error, saved_step, location, command) from error.__cause__

Imports nothing heavy (TensorFlow's errors are recognised by their attributes), so `apps.cli`
can name a write fault from any app in one line.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re

from tfmp.errors import WriteFailed

# errno -> (what happened, what to do; {mount} and {directory} are filled in)
FIXES = {
    errno.ENOSPC: ("no space left on device", "free space on {mount}"),
    errno.EDQUOT: ("disk quota exceeded", "free space on {mount} or raise your quota there"),
    errno.EROFS: ("read-only file system", "remount {mount} read-write"),
    errno.EACCES: ("permission denied", "let this user write in {directory}"),
    errno.EPERM: (
        "operation not permitted",
        "let this user write in {directory} (its permissions, or an immutable attribute: lsattr)",
    ),
    errno.EFBIG: (
        "file too large for this process's file-size limit",
        "raise the limit (ulimit -f unlimited)",
    ),
}
# What only a write meets (a denied permission may be a read's): what apps.cli names for any app.
ONLY_WRITES = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})
_TEMPORARY_SUFFIX = re.compile(r"\.tempstate\d+$")  # TensorFlow's temporary name for a file it writes
_TEMPORARY_SIBLING = re.compile(r"^\.tmp-\d+-(.+)$")  # run_dir.atomic_path's, for the file it replaces


def fault_of(error: BaseException) -> tuple[int, str | None] | None:
    """(errno, the path it names or None) when `error` is a write fault, else None.

    An `OSError` carries both; a TensorFlow `OpError` (recognised by its `error_code` and
    `message`) names them in its message, as "<path>; <strerror>".
    """
    if isinstance(error, OSError):
        return (error.errno, error.filename) if error.errno in FIXES else None
    message = getattr(error, "message", None)
    if not isinstance(message, str) or not hasattr(error, "error_code"):
        return None
    for code in FIXES:
        text = os.strerror(code)
        if text in message:
            found = re.search(r"(?:^|\s)(/[^\n]*?)[;:,]?\s*" + re.escape(text), message)
            return code, _TEMPORARY_SUFFIX.sub("", found.group(1)) if found else None
    return None


def describe(error: BaseException, path: str | None = None, codes=frozenset(FIXES)) -> str | None:
    """The line `cannot write PATH (what happened); what to do` for a write fault, else None.

    `path` is what the caller was writing, used when the error names no file (without either the
    line says "a write failed" and points at where the command writes: Keras' `model.save` gives
    a bare `OSError(28)`). Only the errnos in `codes` count (`ONLY_WRITES` where the error may come
    from a read).
    """
    fault = fault_of(error)
    if fault is None or fault[0] not in codes:
        return None
    code, named = fault
    if not (named or path):
        reason, fix = FIXES[code]
        somewhere = "the file system this command writes to (its --model_dir or --output_dir)"
        return f"a write failed ({reason}); " + fix.format(mount=somewhere, directory=somewhere)
    target = os.path.abspath(str(named or path))
    sibling = _TEMPORARY_SIBLING.match(os.path.basename(target))
    if sibling:
        target = os.path.join(os.path.dirname(target), sibling.group(1))
    reason, fix = FIXES[code]
    directory = target if os.path.isdir(target) else os.path.dirname(target)
    return f"cannot write {target} ({reason}); " + fix.format(mount=mount_point(target), directory=directory)


def mount_point(path: str) -> str:
    """The mount point `path` is under: the longest one in /proc/self/mounts (a bind mount of a
    folder has its file system's device number, which `os.path.ismount` compares), or else the
    nearest ancestor `os.path.ismount` names."""
    path = os.path.realpath(path)
    try:
        with open("/proc/self/mounts", encoding="utf-8") as mounts:
            points = [line.split()[1] for line in mounts if len(line.split()) > 1]
    except OSError:
        points = []
    # /proc escapes a space in a mount point as \040 (and a tab, newline, backslash likewise).
    points = [re.sub(r"\\([0-7]{3})", lambda code: chr(int(code.group(1), 8)), point) for point in points]
    under = [point for point in points if path == point or path.startswith(point.rstrip("/") + "/")]
    if under:
        return max(under, key=len)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


@contextlib.contextmanager
def guarded(what: str, path: str):
    """Turns a write fault inside into `WriteFailed("WHAT: cannot write PATH (...); fix")`;
    any other error keeps its type and traceback (it is a bug, or another kind of failure)."""
    try:
        yield
    except Exception as error:
        message = describe(error, path)
        if message is None:
            raise
        raise WriteFailed(f"{what}: {message}") from error


def with_resume(
    error: WriteFailed, saved_step: int | None, location: str | None, command: str | None = None
) -> WriteFailed:
    """`error` with what a rerun does once the fault is fixed: resume from the checkpoint of
    `saved_step` in `location` (None: nothing saved yet), by `command` or the same command."""
    return WriteFailed(f"{error}, then {rerun(saved_step, location, command)}")


def rerun(saved_step: int | None, location: str | None, command: str | None = None) -> str:
    """ "run CMD: it resumes from the checkpoint of step N in DIR" (or: starts from step 0)."""
    if location is None:
        return "run it again (nothing is saved without a model_dir)"
    if saved_step is None:
        return f"run {_command(command)}: no checkpoint was saved yet, so it starts from step 0"
    return f"run {_command(command)}: it resumes from the checkpoint of step {saved_step} in {location}"


def then_rerun(error: WriteFailed, command: str | None = None) -> WriteFailed:
    """`error` (at a run's start, before anything was restored) with the command to run again."""
    return WriteFailed(f"{error}, then run {_command(command)}")


def _command(command: str | None) -> str:
    return command if command else "the same command again"
