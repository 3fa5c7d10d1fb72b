"""Start a MultiWorkerMirroredStrategy job: N local workers, or this host's worker of many.

    python -m tfmp.launch --workers=2 -- python -m apps.mnist --model_dir=/tmp/mnist
    python -m tfmp.launch --hosts=h1:2222,h2:2222 --task_index=0 -- python -m apps.mnist ...
    TF_CONFIG='{...}' python -m tfmp.launch -- python -m apps.mnist ...   # Kubeflow & co.

Local mode gives every worker its own TF_CONFIG on free localhost ports, its own share of the
GPUs (CUDA_VISIBLE_DEVICES) or CPU cores (affinity), a private TMPDIR, and prefixes its output
with `[worker i]`. When a worker fails, the others are stopped and the launcher exits with the
failing worker's code - or, with `--max_restarts=K`, restarts the whole group, which resumes
from the last checkpoint in the shared --model_dir (torchrun semantics: a failure costs only
the progress since that checkpoint). SIGTERM/SIGINT/SIGHUP to the launcher is passed to the
workers as SIGTERM, on which they save a checkpoint together and exit with EXIT_PREEMPTED.

Exit status: 0; a worker's own status when it said why (2 usage, 3 diverged, 4 write failed,
5 peer lost, 6 a data file failed to decode, 42 preempted, 130 interrupted), its `error:` line
said last by the launcher, once for all the workers that said the same; a worker's own status
with one `error:` line naming it and its last line when it said nothing (it could not start);
128 + N, with one `error:` or `interrupted:` line, when a worker died by signal N (137: SIGKILL,
out of memory) or the launcher's stop signal N ended workers before they could save (143:
SIGTERM, 130: ^C). More local workers than the host can run (`--max_workers_per_core` per core
without GPUs, one GPU each with them) are refused before any starts.

The local group runs in a network namespace of its own, loopback only (`--network`,
tfmp/distribute/netns.py): TensorFlow's gRPC servers have no authentication and bind every
interface, so on this host's network anyone who reaches their ports could run code as you.
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
import time

from tfmp.distribute import netns, scratch, workers
from tfmp.distribute.cluster import parse_tf_config
from tfmp.errors import EXIT_USAGE, UsageError

STARTUP_TIMEOUT_ENV = "TFMP_STARTUP_TIMEOUT"
# One name per launched group (kept across restarts), so the workers of an app started without
# --model_dir agree on the default run directory and a restarted group resumes it.
RUN_NAME_ENV = "TFMP_RUN_NAME"
# The launcher's own command line, for a worker's "how to resume" hint: re-running the worker's
# command alone would not start its peers.
LAUNCH_COMMAND_ENV = "TFMP_LAUNCH_COMMAND"
MAX_WORKERS_PER_CORE = 4  # as --cpu_replicas: a few more than cores still test; 1000 would not start
NETWORKS = ("auto", "private", "host")


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


def check_worker_count(num_workers: int, per_core: int = MAX_WORKERS_PER_CORE) -> None:
    """A UsageError for more local workers than this host can run: `per_core` per usable core on
    a CPU host (each worker is a whole TensorFlow process; 1000 would load the host until
    something kills it). With GPUs `device_shares` refuses more workers than GPUs."""
    if _gpu_count():
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if num_workers > per_core * cores:
        raise UsageError(
            f"--workers={num_workers} is more than this host can run: {per_core * cores} workers ({per_core} per "
            f"core on its {cores} core(s)); use at most one per core, e.g. --workers={cores}, or raise the limit "
            f"with --max_workers_per_core={-(-num_workers // cores)} if the host has the memory for them"
        )


def run_local_group(
    command: list[str],
    num_workers: int,
    devices_per_worker: int | None = None,
    startup_timeout: int | None = None,
    stop: workers.StopSignals | None = None,
    exposed: str | None = None,
) -> tuple[int | None, int | None, str | None]:
    """Runs one attempt of `num_workers` local workers.

    Returns (the index of the worker whose exit status it is, or None; that status; the message
    of the launcher's `error:` line, or None): status 0 when all succeeded, None when a stop
    signal came before all had started. `stop` holds the signals the launcher got; `exposed`
    says why the workers run on this host's network (None: they run in a private one), for a
    warning naming their ports.
    """
    stop = stop or workers.StopSignals()
    shares = device_shares(num_workers, devices_per_worker)
    ports = free_ports(num_workers)
    addresses = [f"localhost:{port}" for port in ports]
    folder = scratch.create()
    group: list[workers.Worker] = []
    try:
        for index, share in enumerate(shares):
            if stop.received:
                break
            env = dict(
                os.environ,
                TF_CONFIG=tf_config(addresses, index),
                TMPDIR=os.path.join(folder, f"worker{index}"),
                PYTHONUNBUFFERED="1",
            )
            os.makedirs(env["TMPDIR"])
            if "gpus" in share:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, share["gpus"]))
            if startup_timeout:
                env[STARTUP_TIMEOUT_ENV] = str(startup_timeout)
            group.append(workers.Worker(index, command, env, share.get("cpus")))
            stop.processes.append(group[-1].process)
        if len(group) < num_workers:
            return None, None, None  # told to stop while starting them: nothing trained yet
        where = (
            "a private network: unreachable from other hosts" if exposed is None else "this host's network"
        )
        print(f"[launch] {len(group)} workers on {', '.join(addresses)} ({where})", flush=True)
        if exposed is not None:
            print(
                f"warning: the workers' ports {', '.join(map(str, ports))} are open on every interface of "
                "this host, and TensorFlow's gRPC has no authentication: whoever reaches them runs "
                f"code as you ({exposed}); see docs/security.md",
                file=sys.stderr,
                flush=True,
            )
        index, code = workers.watch(group, stop)
    finally:
        workers.stop(group)  # after it, every line the workers printed has been read
        scratch.remove(folder)
    return index, code, workers.failure(group, index, code, command)


def launch_local(
    command: list[str],
    num_workers: int,
    max_restarts: int = 0,
    devices_per_worker: int | None = None,
    startup_timeout: int | None = None,
    exposed: str | None = None,
) -> int:
    """Runs the group, restarting it up to `max_restarts` times after a failure; returns the
    exit status for the launcher: 0, a worker's own code (it printed its line), 128 + N after
    a death by signal N or a stop signal N to the launcher (printing one line)."""
    os.environ.setdefault(RUN_NAME_ENV, time.strftime("%Y%m%d-%H%M%S"))
    stop = workers.StopSignals()
    stop.install()
    index, code, failure = None, None, None
    try:
        for attempt in range(max_restarts + 1):
            if stop.received:
                break
            index, code, failure = run_local_group(
                command, num_workers, devices_per_worker, startup_timeout, stop, exposed
            )
            if code == 0 or stop.received or attempt == max_restarts:
                break
            if failure:
                print(f"[launch] attempt {attempt + 1} failed: {failure}", flush=True)
            print(
                f"[launch] restart {attempt + 1}/{max_restarts}: resuming from the last checkpoint",
                flush=True,
            )
    finally:
        stop.restore()
    if stop.received and (code is None or code < 0):
        # No worker said what happened: killed by the SIGTERM before its handler was set.
        print(
            f"interrupted: {stop.name} stopped the launcher before the workers could save a checkpoint; "
            f"the last checkpoint in the run's model_dir is kept; {_resume_how()}",
            file=sys.stderr,
        )
        return 128 + stop.received[0]
    if code < 0:
        print(
            f"error: worker {index} was {workers.describe(code)} (out of memory? see `dmesg`); the other "
            f"workers were stopped; the last checkpoint in the run's model_dir is kept; {_resume_how()}",
            file=sys.stderr,
        )
    elif failure:
        print(f"{workers.ERROR_PREFIX}{failure}", file=sys.stderr)
    return workers.exit_status(code)


def _resume_how() -> str:
    command = os.environ.get(LAUNCH_COMMAND_ENV)
    return f"resume with: {command}" if command else "run the same command again to resume"


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
    at_least = {
        "workers": 0,
        "max_restarts": 0,
        "startup_timeout": 1,
        "devices_per_worker": 1,
        "max_workers_per_core": 1,
    }
    for name, low in at_least.items():
        value = getattr(options, name)
        if value is not None and value < low:
            raise UsageError(f"--{name}={value} must be >= {low}")
    if shutil.which(command[0]) is None:
        raise UsageError(
            f"worker command {command[0]!r} is not an executable file or on PATH; "
            "give the command to run after --, e.g. -- python -m apps.mnist"
        )


def _parser() -> _Parser:
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
        "--max_workers_per_core",
        type=int,
        default=MAX_WORKERS_PER_CORE,
        help="--workers on a host without GPUs: refused above this many per core (default %(default)s)",
    )
    parser.add_argument(
        "--startup_timeout",
        type=int,
        default=120,
        help="seconds a worker waits for its peers before it gives up",
    )
    parser.add_argument(
        "--network",
        choices=NETWORKS,
        default="auto",
        help="--workers only: `private` runs the workers in a network of their own (loopback only, "
        "unreachable from other hosts, no internet either), `host` on this host's network; "
        "`auto` (default): private where the OS allows it, else host with a warning",
    )
    return parser


def _network(choice: str) -> str | None:
    """Enters a private network for a local group when asked and possible; returns None if it
    did, else why the workers are exposed."""
    if choice == "host":
        return "--network=host"
    reason = netns.isolate()
    if reason and choice == "private":
        raise UsageError(
            f"--network=private: cannot give the workers a network of their own ({reason}); run as "
            "root, allow unprivileged user namespaces, or use --network=host (see docs/security.md)"
        )
    return reason


def _run_one(command: list[str], env: dict) -> int:
    """This host's one worker of a multi-host job: its exit status, stop signals passed on."""
    stop = workers.StopSignals()
    stop.install()
    try:
        process = subprocess.Popen(command, env=env)
        stop.processes.append(process)
        while process.poll() is None:
            stop.forward()
            time.sleep(0.1)
    finally:
        stop.restore()
    if process.returncode < 0:
        cause = f"{stop.name} stopped the launcher" if stop.received else "the worker was"
        print(
            f"{'interrupted' if stop.received else 'error'}: {cause} {workers.describe(process.returncode)} "
            f"before it could save a checkpoint; the last checkpoint is kept; {_resume_how()}",
            file=sys.stderr,
        )
        return 128 + stop.received[0] if stop.received else workers.exit_status(process.returncode)
    return process.returncode


class _Interrupted(Exception):
    """A stop signal before the launcher started any worker."""


def _interrupt(signum, _frame):
    raise _Interrupted(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupt)
    parser = _parser()
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    options, command = parser.parse_args(argv[:split]), argv[split + 1 :]  # --help: printed, exit 0
    if "--" not in argv:
        parser.error("give the worker command after --, e.g. -- python -m apps.mnist")
    if not command:
        parser.error("the worker command after -- is empty")
    os.environ[LAUNCH_COMMAND_ENV] = shlex.join([sys.executable, "-m", "tfmp.launch", *argv])
    try:
        _check_options(options, command)
        if options.workers:
            if options.hosts:
                raise UsageError("--workers starts local workers; --hosts names remote ones: give one")
            if options.task_index is not None:
                raise UsageError(
                    f"--task_index={options.task_index} is for --hosts (this host's worker of many); "
                    "--workers numbers its local workers itself: drop --task_index"
                )
            check_worker_count(options.workers, options.max_workers_per_core)
            return launch_local(
                command,
                options.workers,
                options.max_restarts,
                options.devices_per_worker,
                options.startup_timeout,
                exposed=_network(options.network),
            )
        if options.network == "private":
            raise UsageError(
                "--network=private is for --workers groups on one host; a multi-host job's workers "
                "must reach each other: admit only them with a firewall (see docs/security.md)"
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
        return _run_one(command, env)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (KeyboardInterrupt, _Interrupted) as interrupted:
        name = str(interrupted) or "SIGINT"
        print(f"interrupted: {name} before any worker started; nothing ran", file=sys.stderr)
        return 128 + signal.Signals[name]


if __name__ == "__main__":
    sys.exit(main())
