"""Dataset spec strings and the argument checks every `load()` makes first.

    kind, argument = parse("tfds:mnist", builtins=("shapes",), with_argument=("tfds",),
                           what="dataset", choices=["shapes", "tfds:<name>"])
    size = image_size(None, default=32, low=8, high=1024)
    check_counts(global_batch_size=256, skip_examples=0)

A spec is ``kind`` (a built-in) or ``kind:argument`` (a path or a TFDS name). Every bad value
is a `UsageError` naming the value and the fix.
"""

from __future__ import annotations

from tfmp.errors import UsageError, unknown

SPLITS = ("train", "eval")


def parse(spec, *, builtins, with_argument, what: str, choices) -> tuple[str, str]:
    """(kind, argument) of a spec; `unknown` lists `choices` for anything else."""
    kind, _, argument = spec.partition(":") if isinstance(spec, str) else (repr(spec), "", "")
    if (kind in builtins and not argument) or (kind in with_argument and argument):
        return kind, argument
    raise unknown(what, spec, choices)


def check_split(split) -> None:
    if split not in SPLITS:
        raise unknown("split", split, SPLITS)


def image_size(value, *, default, low: int, high: int, what: str = "image_size", hint: str = ""):
    """`value` checked to be an integer in [low, high]; `default` when None."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not (low <= value <= high):
        raise UsageError(f"bad {what} {value!r}; use an integer from {low} to {high}{hint}")
    return value


def check_counts(global_batch_size, skip_examples) -> None:
    """A positive global batch size and a non-negative number of examples to skip."""
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise UsageError(f"bad global_batch_size {global_batch_size!r}; use a positive integer")
    if isinstance(skip_examples, bool) or not isinstance(skip_examples, int) or skip_examples < 0:
        raise UsageError(f"bad skip_examples {skip_examples!r}; use an integer >= 0")
