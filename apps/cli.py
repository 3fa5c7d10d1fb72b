"""How every app runs: absl flags, a quiet start, and user errors as one line instead of a traceback.

    from apps import cli          # first: TensorFlow's C++ start-up lines are held back from here
    ...
    if __name__ == "__main__":
        cli.run(main)

Exit status: 0 done, 2 user error (bad flag or value, impossible combination, unreachable
peer, corrupt checkpoint), 3 training diverged, 4 a write failed mid-run (disk full, permission),
5 a peer worker was lost mid-run, 6 a data file failed to decode mid-run (named), 42 preempted
or interrupted (checkpoint saved; the message says the command that resumes), 130 interrupted
before training started.
`--help` lists the app's own flags; `--helpfull` every flag, absl's and TensorFlow's too.
`--verbosity=0` (absl's flag) shows TensorFlow's INFO lines, its C++ start-up lines included.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import tempfile
import warnings

from absl import app, flags
from absl import logging as absl_logging

from tfmp import write_faults
from tfmp.errors import (
    EXIT_CORRUPT_INPUT,
    EXIT_DIVERGED,
    EXIT_PEER_LOST,
    EXIT_PREEMPTED,
    EXIT_USAGE,
    EXIT_WRITE_FAILED,
    CorruptInput,
    PeerLost,
    Preempted,
    TrainingDiverged,
    UsageError,
    WriteFailed,
)

FLAGS = flags.FLAGS
EXIT_INTERRUPTED = 130  # the shell's 128 + SIGINT
HELP_ARGUMENTS = ("--help", "-h", "-?", "--helpshort")


class _HeldBackStart:
    """Holds back what is written to file descriptor 2 while an app imports its modules.

    TensorFlow's C++ runtime prints its start-up lines there (oneDNN's notice, "Could not find
    cuda drivers", and on a CPU-only host `E0000 ... failed call to cuInit: ... UNKNOWN ERROR
    (303)`) before absl's C++ logging starts, so TF_CPP_MIN_LOG_LEVEL cannot hide them, and a
    new user reads the E line as a failure. `release` ends the hold once the flags are parsed:
    the lines are shown under --verbosity, dropped otherwise. A start that dies before that
    (a broken install) shows everything at exit, its traceback included.
    """

    def __init__(self):
        self.saved, self.captured = None, None
        # Only an app started as `python -m apps.NAME` (apps/__init__.py imports this module
        # before the app's own imports), and only before TensorFlow is imported.
        command = getattr(sys, "orig_argv", [])
        started_as_app = any(
            flag == "-m" and module.startswith("apps.") for flag, module in zip(command, command[1:])
        )
        if not started_as_app or "tensorflow" in sys.modules:
            return
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's later C++ INFO/WARNING lines
        sys.stderr.flush()
        self.captured = tempfile.TemporaryFile()
        self.saved = os.dup(2)
        os.dup2(self.captured.fileno(), 2)
        atexit.register(self.release, True)
        # ^C while the modules import: one line, not a KeyboardInterrupt traceback from deep
        # inside TensorFlow's import; `run` hands SIGINT back to Python before `main`.
        signal.signal(signal.SIGINT, self._interrupted)

    def _interrupted(self, signum, frame):
        self.release(show=False, probe=False)
        print("interrupted: stopped while starting; nothing was written", file=sys.stderr, flush=True)
        os._exit(EXIT_INTERRUPTED)

    def release(self, show: bool, probe: bool = True) -> None:
        if self.saved is None:
            return
        config = getattr(sys.modules.get("tensorflow"), "config", None)  # None: not (fully) imported
        if config is not None and probe:  # CUDA's probe, and its cuInit line, happen here
            config.list_physical_devices("GPU")
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.saved = None
        self.captured.seek(0)
        if show:
            sys.stderr.write(self.captured.read().decode(errors="replace"))
            sys.stderr.flush()
        self.captured.close()


_START = _HeldBackStart()


def _print_help(argv) -> None:
    """The app's docstring and its own flags (the shared training flags, then the app's)."""
    main_module = sys.modules["__main__"]
    print((main_module.__doc__ or "").strip() + "\n")
    for module in ("apps.common", sys.argv[0]):
        text = FLAGS.module_help(module) if FLAGS.get_flags_for_module(module) else ""
        if text:
            print(
                "flags:" if module == sys.argv[0] else "shared flags:",
                text.strip().split("\n", 1)[1],
                sep="\n",
            )
    print(
        "\nalso: --flagfile=FILE (flags from a file, one per line), --verbosity=0 (TensorFlow's INFO "
        "lines), --helpfull (every flag, absl's and TensorFlow's too)"
    )


def _fail(message: str) -> None:
    _START.release(show=False)  # only the error line, not TensorFlow's start-up
    print(f"error: {message}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def _parse_flags(argv):
    if any(argument in HELP_ARGUMENTS for argument in argv[1:]):
        _START.release(show=False)
        _print_help(argv)
        sys.exit(0)
    for argument in argv[1:]:
        name, _, path = argument.partition("=")
        if name in ("--flagfile", "-flagfile") and not os.path.isfile(os.path.expanduser(path)):
            _fail(f"--flagfile={path}: no such file; give the path of a flags file")
    try:
        return FLAGS(argv)
    except flags.Error as error:
        _fail(str(error).removeprefix("ERROR::").strip().replace("\n", " "))


def _quiet_tensorflow() -> None:
    # TF logs every all-reduce it plans and every checkpoint shard it writes at INFO (some of it
    # through absl, e.g. functional_saver's "Sharding callback duration"), and tf.data warns
    # about reading options inside tf.function, which tfmp's eval loop does by design. An app
    # shows tfmp's own lines; --verbosity=0 (absl's flag) brings the INFO lines back.
    _START.release(show=FLAGS["verbosity"].present)
    if FLAGS["verbosity"].present:
        return
    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger("tensorflow").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message="To make it possible to preserve tf.data options")


# tfmp's own faults: how each is printed (one line) and the exit status it ends with.
_ONE_LINE = {
    UsageError: ("error", EXIT_USAGE),
    TrainingDiverged: ("error", EXIT_DIVERGED),
    Preempted: ("preempted", EXIT_PREEMPTED),
    WriteFailed: ("error", EXIT_WRITE_FAILED),
    PeerLost: ("error", EXIT_PEER_LOST),
    CorruptInput: ("error", EXIT_CORRUPT_INPUT),
}
_ONE_LINE_ERRORS = tuple(_ONE_LINE)


def run(main, positional_arguments: bool = False) -> None:
    """absl's app.run; user errors are one line and exit 2, divergence 3, preemption 42.

    Training apps take flags only, so a stray word is an error; `positional_arguments=True`
    passes them on (apps.predict's image paths).
    """

    def guarded(argv):
        signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt from here on
        _quiet_tensorflow()
        if len(argv) > 1 and not positional_arguments:
            print(f"error: unexpected arguments {argv[1:]}; flags look like --name=value", file=sys.stderr)
            sys.exit(EXIT_USAGE)
        try:
            main(argv)
        except _ONE_LINE_ERRORS as error:
            prefix, code = next(way for kind, way in _ONE_LINE.items() if isinstance(error, kind))
            print(f"{prefix}: {error}", file=sys.stderr)
            sys.exit(code)
        except KeyboardInterrupt:
            # ^C inside the training loop saves a checkpoint (Preempted above); this is one
            # before it started or after it ended, with no step to lose.
            print("interrupted: stopped before training started or after it ended", file=sys.stderr)
            sys.exit(EXIT_INTERRUPTED)
        except Exception as error:
            # A full disk, a read-only file system, ... naming a file, in an app that did not
            # say what it was writing (e.g. apps.export): still one line. Anything else is a bug.
            line = write_faults.describe(error, codes=write_faults.ONLY_WRITES)
            if line is None:
                raise
            print(f"error: {line}, then run the same command again", file=sys.stderr)
            sys.exit(EXIT_WRITE_FAILED)

    app.run(guarded, flags_parser=_parse_flags)
