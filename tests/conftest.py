"""Test-session setup: two logical CPU devices, so MirroredStrategy runs in-process.

The split must happen before TensorFlow initialises, i.e. before any test touches a device.
"""

import json
import math
import os
import re
import struct
import subprocess
import sys
import time
import types
import zlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# --mixed and --precision=auto choose by the hardware rule, not by timing this host (whose speeds
# change from day to day): the tests and the apps they start make the same choice everywhere.
# tests/test_precision_probe.py measures on purpose.
os.environ["TFMP_PRECISION_PROBE"] = "off"
# XLA cells compile the same HLO faster, into slower code that tests of 1-3 steps do not notice:
# LLVM's optimisation passes off (the mirrored detector cell: 51 s -> 20 s), and XLA:CPU's
# older LLVM IR emitters in place of its MLIR fusion emitters (that cell again: 41-45 -> 29
# CPU-s). Inherited by every process the tests start; apps and apps.bench keep XLA's defaults.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + TEST_XLA_FLAGS).strip()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmp.distribute import strategies as distribute  # noqa: E402

distribute.split_cpu(2)
# In this process (not the apps the tests start), graphs run without Grappler's rewrites
# (constant folding, layout, fusions): they change no semantics the tests check, and optimising
# each test's freshly traced graphs costs more than the few steps run on them (the in-process
# tests: 12.2 -> 10.2 CPU-minutes). The apps a test starts keep Grappler, as users run them.
tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER_ERRORS = re.compile(r"heartbeat|UNAVAILABLE|Traceback", re.IGNORECASE)


@pytest.fixture(scope="session")
def mirrored():
    """MirroredStrategy over the two logical CPUs, as `--strategy=mirrored` builds it."""
    return distribute.get_strategy("mirrored", tf_config="")


@pytest.fixture(autouse=True)
def float32_global_policy():
    """Tests that change Keras' global policy must not leak it into the next test."""
    yield
    keras.mixed_precision.set_global_policy("float32")


def start_python(args, cwd=None, env=None):
    """Starts `python ARGS` in the project root the way a user would, without waiting: cases
    that each spend seconds starting TensorFlow and wait on nothing else run side by side."""
    full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=cwd or ROOT,
        env=full_env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def finish(process, timeout=600):
    """Waits for a `start_python` process; returns CompletedProcess (kills it on timeout)."""
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def run_python(args, cwd=None, timeout=600, env=None):
    """Runs `python ARGS` in the project root the way a user would; returns CompletedProcess."""
    return finish(start_python(args, cwd=cwd, env=env), timeout=timeout)


@pytest.fixture(scope="session")
def launched_workers(tmp_path_factory):
    """One `python -m tfmp.launch --workers=2` group running tests/mwms_worker.py, shared by the
    multi-worker cells of test_matrix, test_pipeline_2d, test_detect_app, test_faster_rcnn, test_fit,
    test_fit_conformance, test_fused_layer_norm and test_fused_norm: every check in one start of
    TensorFlow in two worker processes. `records[kind][worker]` lists that worker's JSON
    lines of that kind; tests assert `returncode == 0` (showing `tail`) before reading them."""
    out = tmp_path_factory.mktemp("launched_workers")
    result = run_python(
        ["-m", "tfmp.launch", "--workers=2", "--", sys.executable, os.path.join("tests", "mwms_worker.py")],
        env={"FIT_WORKER_OUT": str(out)},
        timeout=1500,
    )
    records = {}
    for line in result.stdout.splitlines():
        if line.startswith("[worker ") and "] {" in line:
            worker, text = line[len("[worker ") :].split("] ", 1)
            record = json.loads(text)
            records.setdefault(record["kind"], {}).setdefault(int(worker), []).append(record)
    return types.SimpleNamespace(
        returncode=result.returncode,
        output=result.stdout + result.stderr,
        tail=result.stdout[-3000:] + result.stderr[-3000:],
        records=records,
        out=out,
    )


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (setup.cfg runs `-n auto --dist=loadgroup`), which tests must share a
    pytest worker: the ones using the launched group (`launched_workers`, from four files), so
    it starts once; and a file's tests that use a fixture defined in that file (module-scoped
    runs, exports, bench outputs), so it is built once. Every other test goes to whichever
    worker is free, which keeps both cores busy to the end. Without xdist the marks do nothing."""
    for item in items:
        if "launched_workers" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("launched_workers"))
        elif any(hasattr(item.module, name) for name in item.fixturenames):
            item.add_marker(pytest.mark.xdist_group(item.path.stem))


def identical_detection_cells(launched_workers, kind: str, policies) -> dict:
    """The launched group's detection cells of `kind` (tests/mwms_detect_worker.py) as
    {(policy, xla): {worker: record}}, after checking what every cell must show: one record per
    worker for every policy x XLA off/on, 2 replicas, finite float32 weights and loss, no
    skipped step, and every model and optimizer variable identical on both workers."""
    assert launched_workers.returncode == 0, launched_workers.tail
    by_worker = launched_workers.records[kind]
    assert set(by_worker) == {0, 1}
    cells = {}
    for worker, records in by_worker.items():
        for record in records:
            cells.setdefault((record["policy"], record["xla"]), {})[worker] = record
    assert set(cells) == {(policy, xla) for policy in policies for xla in (False, True)}
    for (policy, xla), workers in cells.items():
        assert set(workers) == {0, 1}, (policy, xla)
        for record in workers.values():
            assert record["replicas"] == 2 and record["finite"] and record["float32"], record
            assert math.isfinite(record["loss"]) and record["nonfinite"] == 0, record
        assert workers[0]["checksum"] == workers[1]["checksum"], (policy, xla)
    return cells


def peer_errors_once_formed(launcher_output, markers, workers=2):
    """Lines of `python -m tfmp.launch` output ("[worker N] ..." in each worker's own order)
    that report a lost peer or a traceback, from each worker's first line containing one of
    `markers` (its strategy is up, so the group has formed) to its end, the shutdown included.
    Before that line a worker may retry reaching a peer that is still starting (gRPC
    UNAVAILABLE, "Connection refused" on a loaded machine): that is how a group forms."""
    found = []
    for worker in range(workers):
        prefix = f"[worker {worker}] "
        lines = [line for line in launcher_output.splitlines() if line.startswith(prefix)]
        starts = [index for index, line in enumerate(lines) if any(marker in line for marker in markers)]
        assert starts, f"worker {worker} never printed any of {markers}"
        found += [line for line in lines[starts[0] :] if PEER_ERRORS.search(line)]
    return found


def listening_ports(pid="self") -> set[int]:
    """The TCP ports with a listening socket in process `pid`'s network namespace (what
    `ss -ltn` lists there), from /proc/<pid>/net/tcp and tcp6: state 0A is LISTEN."""
    ports = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as rows:
            for row in list(rows)[1:]:
                local, state = row.split()[1], row.split()[3]
                if state == "0A":
                    ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


def workers_of(launcher: subprocess.Popen) -> list[int]:
    """The pids of the worker processes a running `python -m tfmp.launch` started."""
    with open(f"/proc/{launcher.pid}/task/{launcher.pid}/children") as children:
        return [int(pid) for pid in children.read().split()]


def wait_for_log_past(launcher: subprocess.Popen, metrics, step: int, timeout: float = 300) -> None:
    """Waits until the run's `metrics` (metrics.jsonl) logs a training step beyond `step`."""
    deadline = time.time() + timeout
    while time.time() < deadline and launcher.poll() is None:
        if metrics.exists():
            steps = [json.loads(line).get("step", 0) for line in metrics.read_text().splitlines() if line]
            if steps and max(steps) > step:
                return
        time.sleep(0.05)
    pytest.fail(f"training did not log past step {step} (launcher exit {launcher.poll()})")


# ----------------------------------------------------------------------------- untrusted files
def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


FOLDER_COLOURS = {"cat": (255, 0, 0), "dog": (0, 255, 0), "emu": (0, 0, 255)}


def write_image_folder(folder, count, start=0):
    """A `folder:` dataset: `count` one-colour PNGs per class of FOLDER_COLOURS (class i's colour
    is channel i), of two sizes (resizing is needed), each file distinct, and one non-image file.
    The loader holds every 10th image of a class out for eval."""
    for name, colour in FOLDER_COLOURS.items():
        (folder / name).mkdir(parents=True, exist_ok=True)
        for index in range(start, start + count):
            height, width = (6, 9) if index % 2 else (10, 7)
            pixels = np.zeros((height, width, 3), np.uint8) + np.array(colour, np.uint8)
            pixels[0, 0] = index
            (folder / name / f"{index:03d}.png").write_bytes(tf.io.encode_png(pixels).numpy())
    (folder / "cat" / "notes.txt").write_text("not an image")
    return folder


def write_zero_png(path, width: int, height: int, cut: int = 0) -> int:
    """A valid greyscale PNG of zeros (IHDR, IDAT and every CRC and checksum correct): a
    decompression bomb, 20000x20000 in 390 kB. One deflate block is compressed and repeated after
    full flushes (each starts afresh, so the bytes repeat): 0.2 s instead of compressing 400 MB.
    `cut` bytes are removed from its end (a truncated file). Returns its size in bytes."""
    row = width + 1  # the filter byte, then one byte per pixel
    per_block = max(1, (1 << 22) // row)
    block = bytes(row * per_block)
    blocks, rest = divmod(height, per_block)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    repeated = deflate.compress(block) + deflate.flush(zlib.Z_FULL_FLUSH)
    tail = deflate.compress(bytes(row * rest)) + deflate.flush()
    adler = 1
    for _ in range(blocks):
        adler = zlib.adler32(block, adler)
    adler = zlib.adler32(bytes(row * rest), adler)
    stream = b"\x78\xda" + repeated * blocks + tail + adler.to_bytes(4, "big")
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", stream)
    png += _png_chunk(b"IEND", b"")
    png = png[: len(png) - cut]
    with open(path, "wb") as file:
        file.write(png)
    return len(png)


def save_spy_saved_model(path, marker, size: int = 8) -> None:
    """A SavedModel at `path` whose serving_default (float32 `images` [B, size, size, 3] ->
    `probabilities`) also writes the file `marker`: what any SavedModel's graph may do."""

    class Spy(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, size, size, 3], tf.float32, name="images")])
        def serve(self, images):
            tf.io.write_file(str(marker), "this ran with your permissions")
            return {"probabilities": tf.nn.softmax(tf.reduce_mean(images, axis=[1, 2]))}

    spy = Spy()
    tf.saved_model.save(spy, str(path), signatures={"serving_default": spy.serve})
