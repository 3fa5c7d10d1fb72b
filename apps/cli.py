"""How every app runs: absl flags, a quiet start, and user errors as one line instead of a traceback.

    from apps import cli          # first: it imports TensorFlow with its start-up lines held back
    ...
    if __name__ == "__main__":
        cli.run(main)

Exit status: 0 done, 2 user error (bad flag or value, impossible combination, unreachable
peer, corrupt checkpoint), 3 training diverged, 42 preempted or interrupted (checkpoint saved;
the message says the command that resumes), 130 interrupted before training started.
`--help` lists the app's own flags; `--helpfull` every flag, absl's and TensorFlow's too.
`--verbosity=0` (absl's flag) shows TensorFlow's INFO lines, its C++ start-up lines included.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import tempfile
import warnings

from absl import app, flags
from absl import logging as absl_logging

from tfmp.errors import EXIT_DIVERGED, EXIT_PREEMPTED, EXIT_USAGE, Preempted, TrainingDiverged, UsageError

FLAGS = flags.FLAGS
EXIT_INTERRUPTED = 130  # the shell's 128 + SIGINT
HELP_ARGUMENTS = ("--help", "-h", "-?", "--helpshort")


def _import_tensorflow_quietly() -> bytes:
    """Imports TensorFlow and probes for GPUs with file descriptor 2 redirected; returns what
    its C++ runtime printed there.

    Those lines (oneDNN's notice, "Could not find cuda drivers", and on a CPU-only host
    `E0000 ... failed call to cuInit: ... UNKNOWN ERROR (303)`) are written before absl's C++
    logging starts, so TF_CPP_MIN_LOG_LEVEL cannot hide them, and a new user reads the E line
    as a failure. `run` shows them again under --verbosity; an import that fails shows them at once.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's later C++ INFO/WARNING lines
    if "tensorflow" in sys.modules:  # imported by whoever imported this module (a test, a script)
        return b""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        failed = True
        try:
            # Imported here, not at the top: the redirection must come first.
            tensorflow = importlib.import_module("tensorflow")
            tensorflow.config.list_physical_devices("GPU")  # CUDA's probe happens here, once
            failed = False
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            held_back = captured.read()
            if failed:  # a broken install: everything TensorFlow said, then the traceback
                sys.stderr.write(held_back.decode(errors="replace"))
    return held_back


_HELD_BACK = _import_tensorflow_quietly()


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


def _parse_flags(argv):
    if any(argument in HELP_ARGUMENTS for argument in argv[1:]):
        _print_help(argv)
        sys.exit(0)
    for argument in argv[1:]:
        name, _, path = argument.partition("=")
        if name in ("--flagfile", "-flagfile") and not os.path.isfile(os.path.expanduser(path)):
            print(f"error: --flagfile={path}: no such file; give the path of a flags file", file=sys.stderr)
            sys.exit(EXIT_USAGE)
    try:
        return FLAGS(argv)
    except flags.Error as error:
        message = str(error).removeprefix("ERROR::").strip().replace("\n", " ")
        print(f"error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _quiet_tensorflow() -> None:
    # TF logs every all-reduce it plans and every checkpoint shard it writes at INFO (some of it
    # through absl, e.g. functional_saver's "Sharding callback duration"), and tf.data warns
    # about reading options inside tf.function, which tfmp's eval loop does by design. An app
    # shows tfmp's own lines; --verbosity=0 (absl's flag) brings the INFO lines back.
    if FLAGS["verbosity"].present:
        sys.stderr.write(_HELD_BACK.decode(errors="replace"))
        return
    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger("tensorflow").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message="To make it possible to preserve tf.data options")


def run(main, positional_arguments: bool = False) -> None:
    """absl's app.run; user errors are one line and exit 2, divergence 3, preemption 42.

    Training apps take flags only, so a stray word is an error; `positional_arguments=True`
    passes them on (apps.predict's image paths).
    """

    def guarded(argv):
        _quiet_tensorflow()
        if len(argv) > 1 and not positional_arguments:
            print(f"error: unexpected arguments {argv[1:]}; flags look like --name=value", file=sys.stderr)
            sys.exit(EXIT_USAGE)
        try:
            main(argv)
        except UsageError as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(EXIT_USAGE)
        except TrainingDiverged as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(EXIT_DIVERGED)
        except Preempted as error:
            print(f"preempted: {error}", file=sys.stderr)
            sys.exit(EXIT_PREEMPTED)
        except KeyboardInterrupt:
            # ^C inside the training loop saves a checkpoint (Preempted above); this is one
            # before it started or after it ended, with no step to lose.
            print("interrupted: stopped before training started or after it ended", file=sys.stderr)
            sys.exit(EXIT_INTERRUPTED)

    app.run(guarded, flags_parser=_parse_flags)
