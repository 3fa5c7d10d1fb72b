"""The launcher's scratch folders: `$TMPDIR/tfmp-launch-*`, which hold its workers' TMPDIRs.

    folder = scratch.create()   # first removes the folders of launchers that died (kill -9)
    ...
    scratch.remove(folder)      # the launcher's own, at its end

A launcher killed with SIGKILL cannot remove its folder, so each folder names its owner: a file
with the launcher's pid and the time that process started (a pid alone is reused). The next
launch removes every folder whose owner is gone, and leaves alone the ones of launchers still
running and folders without an owner file (being created this instant, or not tfmp's).
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

from tfmp import run_dir

PREFIX = "tfmp-launch-"
OWNER_FILE = "launcher.pid"


def create() -> str:
    """A new scratch folder owned by this process, after removing the ones of dead launchers."""
    remove_orphans()
    folder = tempfile.mkdtemp(prefix=PREFIX)
    run_dir.write_text_atomic(os.path.join(folder, OWNER_FILE), _identity(os.getpid()))
    return folder


def remove(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def remove_orphans(parent: str | None = None) -> list[str]:
    """Removes the scratch folders in `parent` (default: the temporary directory) whose launcher
    is no longer running; returns their paths."""
    removed = []
    for folder in sorted(glob.glob(os.path.join(parent or tempfile.gettempdir(), PREFIX + "*"))):
        try:
            with open(os.path.join(folder, OWNER_FILE)) as file:
                pid_text, _, started = file.read().partition(" ")
            pid = int(pid_text)
        except (OSError, ValueError):
            continue  # no owner yet, or not a folder of ours
        if _identity(pid) != f"{pid} {started}":
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _identity(pid: int) -> str:
    """ "<pid> <start time>" of a running process (start time in clock ticks since boot, from
    /proc/<pid>/stat), or "" when no such process runs."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
            fields = file.read().rsplit(")", 1)[1].split()
        return f"{pid} {fields[19]}"  # field 22, starttime
    except FileNotFoundError:
        return ""
    except OSError:  # no /proc (not Linux): whether the pid runs at all
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return ""
        except PermissionError:
            pass
        return f"{pid} -"
