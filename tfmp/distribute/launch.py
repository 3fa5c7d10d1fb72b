"""Start a MultiWorkerMirroredStrategy job: N local workers, or this host's worker of many.

    python -m tfmp.launch --workers=2 -- python -m apps.mnist --model_dir=/tmp/mnist
    python -m tfmp.launch --hosts=h1:2222,h2:2222 --task_index=0 -- python -m apps.mnist ...
    TF_CONFIG='{...}' python -m tfmp.launch -- python -m apps.mnist ...   # Kubeflow & co.

Local mode gives every worker its own TF_CONFIG on free localhost ports, its own share of the
GPUs (CUDA_VISIBLE_DEVICES) or CPU cores (affinity), a private TMPDIR, and prefixes its output
with `[worker i]`. When a worker fails, the others are stopped and the launcher exits with the
failing worker's code - or, with `--max_restarts=K`, restarts the whole group, which resumes
from the last checkpoint in the shared --model_dir (torchrun semantics: a failure costs only
the progress since that checkpoint). SIGTERM/SIGINT to the launcher is passed to the workers,
which save a checkpoint together and exit with EXIT_PREEMPTED.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from tfmp.distribute.cluster import parse_tf_config
from tfmp.errors import EXIT_PREEMPTED, EXIT_USAGE, UsageError

STARTUP_TIMEOUT_ENV = "TFMP_STARTUP_TIMEOUT"
# One name per launched group (kept across restarts), so the workers of an app started without
# --model_dir agree on the default run directory and a restarted group resumes it.
RUN_NAME_ENV = "TFMP_RUN_NAME"
# The launcher's own command line, for a worker's "how to resume" hint: re-running the worker's
# command alone would not start its peers.
LAUNCH_COMMAND_ENV = "TFMP_LAUNCH_COMMAND"
PREEMPTION_GRACE_SECONDS = 120  # for the other workers to finish the preemption checkpoint


def free_ports(count: int) -> list[int]:
    """Ports the OS reports free now (bound together so they differ)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("localhost", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def tf_config(workers: list[str], index: int) -> str:
    return json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})


def _gpu_count() -> int:
    # Not via TensorFlow: importing it here would cost seconds and claim the GPUs.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in listing.stdout.splitlines())


def device_shares(workers: int, devices_per_worker: int | None) -> list[dict]:
    """Per worker: {"gpus": [...]} or {"cpus": [...]}: disjoint shares of this host."""
    gpus = _gpu_count()
    if gpus:
        per_worker = devices_per_worker or max(gpus // workers, 1)
        if per_worker * workers > gpus:
            raise UsageError(
                f"--devices_per_worker={per_worker} x {workers} workers needs "
                f"{per_worker * workers} GPUs; this host has {gpus}"
            )
        return [{"gpus": list(range(i * per_worker, (i + 1) * per_worker))} for i in range(workers)]
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not cpus:
        return [{} for _ in range(workers)]
    per_worker = devices_per_worker or max(len(cpus) // workers, 1)
    # More workers than cores share cores round-robin: fine for tests, slow for training.
    return [
        {"cpus": [cpus[(i * per_worker + k) % len(cpus)] for k in range(per_worker)]} for i in range(workers)
    ]


class _Worker:
    def __init__(self, index: int, command: list[str], env: dict, cpus: list[int] | None):
        self.index = index

        def pin():  # runs in the child before exec
            if cpus:
                os.sched_setaffinity(0, cpus)

        self.process = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            preexec_fn=pin if cpus else None,
        )
        self.printer = threading.Thread(target=self._print, daemon=True)
        self.printer.start()

    def _print(self):
        for line in self.process.stdout:
            sys.stdout.write(f"[worker {self.index}] {line}")
            sys.stdout.flush()

    def poll(self):
        return self.process.poll()


def _wait(workers: list[_Worker], seconds: float) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline and any(worker.poll() is None for worker in workers):
        time.sleep(0.1)


def _stop(workers: list[_Worker]) -> None:
    # SIGKILL, not SIGTERM: SIGTERM means "checkpoint with your peers", and a peer is gone.
    # Nothing is lost beyond the last checkpoint; TMPDIR cleanup is the launcher's.
    for worker in workers:
        if worker.poll() is None:
            worker.process.kill()
    for worker in workers:
        worker.process.wait()
        worker.printer.join(timeout=5)


def run_local_group(
    command: list[str],
    num_workers: int,
    devices_per_worker: int | None = None,
    startup_timeout: int | None = None,
) -> tuple[int, bool]:
    """Runs one attempt of `num_workers` local workers.

    Returns (exit code, whether the launcher itself was told to stop).
    """
    shares = device_shares(num_workers, devices_per_worker)
    addresses = [f"localhost:{port}" for port in free_ports(num_workers)]
    scratch = tempfile.mkdtemp(prefix="tfmp-launch-")
    workers, forwarded = [], []

    def forward(signum, _frame):  # preemption notice: every worker checkpoints, then exits
        forwarded.append(signum)
        for worker in workers:
            if worker.poll() is None:
                worker.process.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for index, share in enumerate(shares):
            env = dict(
                os.environ,
                TF_CONFIG=tf_config(addresses, index),
                TMPDIR=os.path.join(scratch, f"worker{index}"),
                PYTHONUNBUFFERED="1",
            )
            os.makedirs(env["TMPDIR"])
            if "gpus" in share:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, share["gpus"]))
            if startup_timeout:
                env[STARTUP_TIMEOUT_ENV] = str(startup_timeout)
            workers.append(_Worker(index, command, env, share.get("cpus")))
        print(f"[launch] {num_workers} workers on {', '.join(addresses)}", flush=True)
        while True:
            codes = [worker.poll() for worker in workers]
            if all(code is not None for code in codes):
                return next((code for code in codes if code), 0), bool(forwarded)
            failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                index, code = failed[0]
                if code == EXIT_PREEMPTED or forwarded:
                    # A preemption: the other workers are saving the same checkpoint; let them.
                    _wait(workers, PREEMPTION_GRACE_SECONDS)
                    return code, bool(forwarded)
                print(f"[launch] worker {index} exited with {code}; stopping the others", flush=True)
                return code, False
            time.sleep(0.1)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _stop(workers)
        shutil.rmtree(scratch, ignore_errors=True)


def launch_local(
    command: list[str],
    num_workers: int,
    max_restarts: int = 0,
    devices_per_worker: int | None = None,
    startup_timeout: int | None = None,
) -> int:
    """Runs the group, restarting it up to `max_restarts` times after a failure."""
    os.environ.setdefault(RUN_NAME_ENV, time.strftime("%Y%m%d-%H%M%S"))
    for attempt in range(max_restarts + 1):
        code, stopped = run_local_group(command, num_workers, devices_per_worker, startup_timeout)
        if code == 0 or stopped or attempt == max_restarts:
            return code
        print(f"[launch] restart {attempt + 1}/{max_restarts}: resuming from the last checkpoint", flush=True)
    return code


def host_tf_config(hosts: str, task_index: int) -> str:
    """TF_CONFIG for this host's worker of `--hosts=h1:port,h2:port`, validated."""
    workers = [h.strip() for h in hosts.split(",") if h.strip()]
    if not 0 <= task_index < len(workers):
        raise UsageError(
            f"--task_index={task_index} is out of range for {len(workers)} hosts; use 0..{len(workers) - 1}"
        )
    raw = tf_config(workers, task_index)
    parse_tf_config(raw)
    return raw


class _Parser(argparse.ArgumentParser):
    """argparse with tfmp's user-error format: one `error:` line, exit 2 (not usage + error)."""

    def error(self, message):
        print(f"error: {message}; see python -m tfmp.launch --help", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _check_options(options: argparse.Namespace, command: list[str]) -> None:
    """Numbers that must be positive (or zero where zero means "default"), and a command that exists."""
    at_least = {"workers": 0, "max_restarts": 0, "startup_timeout": 1, "devices_per_worker": 1}
    for name, low in at_least.items():
        value = getattr(options, name)
        if value is not None and value < low:
            raise UsageError(f"--{name}={value} must be >= {low}")
    if shutil.which(command[0]) is None:
        raise UsageError(
            f"worker command {command[0]!r} is not an executable file or on PATH; "
            "give the command to run after --, e.g. -- python -m apps.mnist"
        )


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(
        prog="python -m tfmp.launch",
        description=__doc__.split("\n")[0],
        usage="%(prog)s [options] -- COMMAND ...",
    )
    parser.add_argument("--workers", type=int, default=0, help="local worker processes to start")
    parser.add_argument("--hosts", default="", help="host:port of every worker, same on every host")
    parser.add_argument("--task_index", type=int, default=None, help="this host's index in --hosts")
    parser.add_argument(
        "--devices_per_worker",
        type=int,
        default=None,
        help="GPUs (or CPU cores) per local worker; default: an equal share",
    )
    parser.add_argument("--max_restarts", type=int, default=0, help="group restarts after a failure")
    parser.add_argument(
        "--startup_timeout",
        type=int,
        default=120,
        help="seconds a worker waits for its peers before it gives up",
    )
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        parser.error("give the worker command after --, e.g. -- python -m apps.mnist")
    split = argv.index("--")
    options, command = parser.parse_args(argv[:split]), argv[split + 1 :]
    if not command:
        parser.error("the worker command after -- is empty")
    os.environ[LAUNCH_COMMAND_ENV] = shlex.join([sys.executable, "-m", "tfmp.launch", *argv])
    try:
        _check_options(options, command)
        if options.workers:
            if options.hosts:
                raise UsageError("--workers starts local workers; --hosts names remote ones: give one")
            return launch_local(
                command,
                options.workers,
                options.max_restarts,
                options.devices_per_worker,
                options.startup_timeout,
            )
        env = dict(os.environ)
        if options.hosts:
            if options.task_index is None:
                raise UsageError("--hosts needs --task_index (this host's position in the list)")
            env["TF_CONFIG"] = host_tf_config(options.hosts, options.task_index)
        elif parse_tf_config(env.get("TF_CONFIG")) is None:
            raise UsageError(
                "nothing to launch: give --workers=N, --hosts=... --task_index=i, or set TF_CONFIG"
            )
        parse_tf_config(env["TF_CONFIG"])
        env[STARTUP_TIMEOUT_ENV] = str(options.startup_timeout)
        return subprocess.run(command, env=env).returncode
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
