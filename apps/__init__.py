"""The command-line apps: `python -m apps.classify`, `apps.mnist`, `apps.detect`, `apps.export`,
`apps.predict`, `apps.bench` (each module's docstring says how to run it)."""

import os
import signal
import sys


def _interrupted_while_starting(signum, frame):
    print("interrupted: stopped while starting; nothing was written", file=sys.stderr, flush=True)
    os._exit(130)  # the shell's 128 + SIGINT, as apps.cli.EXIT_INTERRUPTED


# ^C before apps.cli takes over (importing absl and tfmp takes a while on a busy host) is one
# line and exit 130, not a KeyboardInterrupt traceback from inside an import; only in an app's
# own process (`python -m apps.NAME`), never in one that merely imports apps.
_command = getattr(sys, "orig_argv", [])
if any(flag == "-m" and module.startswith("apps.") for flag, module in zip(_command, _command[1:])):
    signal.signal(signal.SIGINT, _interrupted_while_starting)

# Then, before any app imports TensorFlow: apps.cli holds back TensorFlow's C++ start-up lines.
from apps import cli  # noqa: E402, F401
