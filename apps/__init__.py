"""The command-line apps: `python -m apps.classify`, `apps.mnist`, `apps.detect`, `apps.export`,
`apps.predict`, `apps.bench` (each module's docstring says how to run it)."""

# First, before any app imports TensorFlow: apps.cli holds back TensorFlow's C++ start-up lines.
from apps import cli  # noqa: F401
