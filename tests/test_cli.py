"""What every app prints before it works: its own flags for --help, and no TensorFlow C++
start-up lines (`E0000 ... failed call to cuInit` on a CPU-only host) unless --verbosity asks.

The processes start without TF_CPP_MIN_LOG_LEVEL (conftest's `start_python` sets it), as a
user's shell would.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow  # each case starts TensorFlow in a new process

CPP_LOG_LINE = re.compile(r"^[IWEF]\d{4} |absl::InitializeLog|cuInit", re.MULTILINE)

# app -> texts its --help must show: the shared flags, the app's own, and its docstring
HELP = {
    "classify": ["--model: Model builder:", "--model_dir", "--precision", "python -m apps.classify --mixed"],
    "mnist": ["--model_dir", "--strategy", "The parallelism article's example"],
    "detect": [
        "--model: Detector: retinanet_tiny,",
        "faster_rcnn_tiny",
        "--dataset: Detection dataset: shapes | coco:<path>",
        "--predict",
        "--score_threshold",
    ],
    "export": ["--model_dir: Training run dir", "--formats", "--precision: Compute precision"],
    "predict": ["--model: Run dir, export dir", "--top_k", "--batch_size"],
    "bench": ["--models", "--precisions", "--min_repeat_seconds"],
}


def _start(args, tmp_path):
    env = {name: value for name, value in os.environ.items() if name != "TF_CPP_MIN_LOG_LEVEL"}
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=tmp_path,
        env=dict(env, PYTHONPATH=ROOT),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """Every app's --help, a short training run, and a verbose user error, side by side."""
    tmp_path = tmp_path_factory.mktemp("cli")
    processes = {app: _start(["-m", f"apps.{app}", "--help"], tmp_path) for app in HELP}
    processes["train"] = _start(["-m", "apps.classify", "--steps=2", "--model_dir=run"], tmp_path)
    processes["verbose"] = _start(["-m", "apps.classify", "--model=nope", "--verbosity=0"], tmp_path)
    return {
        name: (*process.communicate(timeout=600), process.returncode) for name, process in processes.items()
    }


@pytest.mark.parametrize("app", HELP)
def test_help_lists_the_apps_flags_and_starts_quietly(started, app):
    stdout, stderr, returncode = started[app]
    assert returncode == 0 and stderr == "", stderr[-2000:]
    text = " ".join(stdout.split())
    for expected in HELP[app]:
        assert expected in text, stdout[-3000:]
    assert "--helpfull" in text and "tensor_tracer" not in text  # absl's and TF's flags stay out


def test_a_training_run_prints_no_tensorflow_start_up_lines(started):
    stdout, stderr, returncode = started["train"]
    assert returncode == 0, stderr[-3000:]
    assert not CPP_LOG_LINE.search(stderr), stderr[-3000:]
    assert "tfmp summary:" in stdout


def test_verbosity_shows_them_again(started):
    _, stderr, returncode = started["verbose"]
    assert returncode == 2 and "error: unknown model 'nope'" in stderr
    assert CPP_LOG_LINE.search(stderr), stderr[-3000:]


def test_interrupt_while_starting_is_one_line_and_writes_nothing(tmp_path):
    """^C while the app imports TensorFlow (a second in; the import takes several): exit 130,
    one line, no KeyboardInterrupt traceback from inside the import, no run directory."""
    process = _start(["-m", "apps.classify", "--steps=2", "--model_dir=run"], tmp_path)
    time.sleep(1.0)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-3000:]
    assert stderr.strip() == "interrupted: stopped while starting; nothing was written", stderr[-3000:]
    assert not (tmp_path / "run").exists()
