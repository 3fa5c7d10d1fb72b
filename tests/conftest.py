"""Test-session setup: two logical CPU devices, so MirroredStrategy runs in-process.

The split must happen before TensorFlow initialises, i.e. before any test touches a device.
"""

import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402

from tfmp.distribute import strategies as distribute  # noqa: E402

distribute.split_cpu(2)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def mirrored():
    """MirroredStrategy over the two logical CPUs, as `--strategy=mirrored` builds it."""
    return distribute.get_strategy("mirrored", tf_config="")


@pytest.fixture(autouse=True)
def float32_global_policy():
    """Tests that change Keras' global policy must not leak it into the next test."""
    yield
    keras.mixed_precision.set_global_policy("float32")


def run_python(args, cwd=None, timeout=600, env=None):
    """Runs `python ARGS` in the project root the way a user would; returns CompletedProcess."""
    full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd or ROOT,
        env=full_env,
        text=True,
        capture_output=True,
        timeout=timeout,
    )
