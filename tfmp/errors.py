"""The one exception type for mistakes a user can fix.

Library code raises `UsageError` for bad input (unknown names, impossible combinations,
malformed TF_CONFIG, indivisible batch sizes). Apps catch it, print its one-line message and
exit with status 2 - no traceback, nothing written. Anything else is a bug and keeps its
traceback.
"""


class UsageError(ValueError):
    """A user-fixable error; the message names the bad value and the fix."""


def unknown(kind: str, value: str, choices) -> UsageError:
    """`unknown model 'resnet9'; choose one of: lenet, mnist_mlp, ...`."""
    return UsageError(f"unknown {kind} {value!r}; choose one of: {', '.join(sorted(choices))}")


def spelt(name: str, value, as_flag: bool) -> str:
    """How a message names a value: `--name=value` for a flag's, `name value` (repr) for an
    argument's, so a library check and an app's flag share one message."""
    return f"--{name}={value}" if as_flag else f"{name} {value!r}"


class TrainingDiverged(RuntimeError):
    """Training stopped on non-finite numbers (exit status 3): the loss or gradients where no
    loss scaler can skip the step, or float16 loss scaling that keeps skipping (its scale below 1,
    or too many steps in a row). The model keeps the weights of the step before; rerunning the
    same command would stop the same way, so the message names the fix."""


class NonFiniteInput(TrainingDiverged):
    """The training data itself held NaN or inf at the named step (exit status 3, as its base):
    the data needs fixing, not the learning rate or the loss scale."""


class CorruptInput(RuntimeError):
    """A data file failed to decode mid-run (exit status 6): damaged inside, where the check before
    the run, which reads each file's ends, cannot see it. The message names the file, and the
    checkpoint a rerun resumes from once the file is removed or repaired."""


class WriteFailed(RuntimeError):
    """A write into the run failed mid-run (disk full, permission denied, read-only file system,
    file-size limit): the message names the path and the fix; what was already saved is whole
    (files are renamed into place) and the same command resumes from the last checkpoint (exit 4)."""


class PeerLost(RuntimeError):
    """Another worker of a multi-worker job stopped answering mid-run (exit 5); the message names
    it and the command that resumes from the last checkpoint."""


EXIT_USAGE, EXIT_DIVERGED, EXIT_WRITE_FAILED, EXIT_PEER_LOST, EXIT_CORRUPT_INPUT = 2, 3, 4, 5, 6
EXIT_PREEMPTED = 42  # as tf.distribute's PreemptionCheckpointHandler: "checkpoint saved, restart me"


class Preempted(RuntimeError):
    """SIGTERM reached a worker: every worker saved the same checkpoint and stops (exit 42)."""
