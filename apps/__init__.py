"""Command-line entry points: `python -m apps.classify`, `python -m apps.mnist`."""
