"""How every app runs: absl flags, and user errors as one line instead of a traceback.

    if __name__ == "__main__":
        cli.run(main)

Exit status: 0 done, 2 user error (bad flag or value, impossible combination, unreachable
peer, corrupt checkpoint), 3 training diverged, 42 preempted (checkpoint saved).
"""

from __future__ import annotations

import logging
import sys
import warnings

from absl import app, flags
from absl import logging as absl_logging

from tfmp.errors import EXIT_DIVERGED, EXIT_PREEMPTED, EXIT_USAGE, Preempted, TrainingDiverged, UsageError

FLAGS = flags.FLAGS


def _parse_flags(argv):
    try:
        return FLAGS(argv)
    except flags.Error as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _quiet_tensorflow() -> None:
    # TF logs every all-reduce it plans and every checkpoint shard it writes at INFO (some of it
    # through absl, e.g. functional_saver's "Sharding callback duration"), and tf.data warns
    # about reading options inside tf.function, which tfmp's eval loop does by design. An app
    # shows tfmp's own lines; --verbosity=0 (absl's flag) brings the INFO lines back.
    if not FLAGS["verbosity"].present:
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

    app.run(guarded, flags_parser=_parse_flags)
