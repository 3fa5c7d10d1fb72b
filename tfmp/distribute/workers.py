"""One local worker process of a launched group, and what its exit status means.

    worker = workers.Worker(index, command, env, cpus=[0])   # started; output as "[worker i] ..."
    worker.release_held()      # called often: prints held lines older than HOLD_SECONDS
    worker.silence()           # the group is being stopped: drop what it still says
    workers.describe(-9)       # "killed by SIGKILL"
    stop = workers.StopSignals(); stop.install()   # the launcher's stop signals, passed on

A worker pinned to `cpus` runs there (its share of this host's cores). It dies with the
launcher: a launcher killed with SIGKILL cannot stop its workers, so the kernel does
(PR_SET_PDEATHSIG); they would otherwise train on alone, holding their ports and the run.

When one worker dies, its peers' collectives fail within milliseconds and TensorFlow's C++
runtime logs it (`E0000 ... ring_alg.cc:291] Aborting RingReduce with UNAVAILABLE ...` and a
few lines of gRPC detail), before the launcher can notice the death and stop them. So a
worker's C++ log lines, and whatever follows them, are held for HOLD_SECONDS before being
printed: if the group is stopped meanwhile they are dropped, as consequences of the death
the launcher reports.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time

HOLD_SECONDS = 1.0
PR_SET_PDEATHSIG = 1
# absl's C++ log prefix: severity letter, MMDD, time, thread, file:line]
_CPP_LOG_LINE = re.compile(r"^[EWF]\d{4} [\d:.]+ +\d+ [\w./-]+:\d+\] ")
# Looked up here, not in the forked child, where the dynamic loader's lock may be held.
_prctl = ctypes.CDLL(None).prctl if sys.platform.startswith("linux") else None


def describe(code: int) -> str:
    """A worker's exit status in words: "exited with 3", "killed by SIGKILL"."""
    if code >= 0:
        return f"exited with {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def exit_status(code: int) -> int:
    """The status a shell reports for `code`: a death by signal N is 128 + N, not Python's -N
    (whose `sys.exit(-N)` would exit 256 - N: 241 for SIGTERM)."""
    return 128 - code if code < 0 else code


class Worker:
    def __init__(self, index: int, command: list[str], env: dict, cpus: list[int] | None = None):
        self.index = index
        self._lock = threading.Lock()
        self._held: list[tuple[float, str]] = []
        self._silenced = False
        launcher = os.getpid()

        def prepare():  # runs in the child before exec
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != launcher:  # the launcher died before prctl took effect
                os._exit(128 + signal.SIGKILL)
            if cpus:
                os.sched_setaffinity(0, cpus)

        self.process = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            preexec_fn=prepare if _prctl else None,
        )
        self.printer = threading.Thread(target=self._print, daemon=True)
        self.printer.start()

    def _print(self):
        for line in self.process.stdout:
            with self._lock:
                if self._silenced:
                    continue
                if self._held or _CPP_LOG_LINE.match(line):
                    self._held.append((time.monotonic(), line))
                else:
                    _write(self.index, [line])

    def release_held(self, older_than: float = HOLD_SECONDS) -> None:
        """Prints the held lines once the first of them is `older_than` seconds old."""
        with self._lock:
            if self._held and not self._silenced and time.monotonic() - self._held[0][0] >= older_than:
                _write(self.index, [line for _, line in self._held])
                self._held.clear()

    def silence(self) -> None:
        with self._lock:
            self._silenced = True
            self._held.clear()

    def poll(self) -> int | None:
        return self.process.poll()


class StopSignals:
    """The stop signals the launcher got (SIGTERM, ^C, a closed terminal), passed on to its
    workers as SIGTERM: the preemption notice, on which every worker saves the same checkpoint
    and exits 42. A second signal is passed on too, and stops the workers at once.

    The handler only notes the signal; `forward` (called by the launcher's polling loop, every
    0.1 s) sends it, so a signal that arrives while a worker is being started reaches it too.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self):
        self.received: list[int] = []
        self.processes: list[subprocess.Popen] = []
        self._told: dict[int, int] = {}  # pid -> signals passed on to it
        self._previous = {}

    def install(self) -> None:
        self._previous = {signum: signal.signal(signum, self._note) for signum in self.SIGNALS}

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _note(self, signum, _frame) -> None:
        self.received.append(signum)

    @property
    def name(self) -> str:
        return signal.Signals(self.received[0]).name

    def forward(self) -> None:
        for process in self.processes:
            while process.poll() is None and self._told.get(process.pid, 0) < len(self.received):
                process.send_signal(signal.SIGTERM)
                self._told[process.pid] = self._told.get(process.pid, 0) + 1


def _write(index: int, lines: list[str]) -> None:
    sys.stdout.write("".join(f"[worker {index}] {line}" for line in lines))
    sys.stdout.flush()


def wait(workers: list[Worker], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(worker.poll() is None for worker in workers):
        for worker in workers:
            worker.release_held()
        time.sleep(0.1)


def stop(workers: list[Worker]) -> None:
    """Kills the workers still running and waits for them and their output."""
    # SIGKILL, not SIGTERM: SIGTERM means "checkpoint with your peers", and a peer is gone.
    # Nothing is lost beyond the last checkpoint; TMPDIR cleanup is the launcher's.
    for worker in workers:
        if worker.poll() is None:
            worker.process.kill()
    for worker in workers:
        worker.process.wait()
        worker.printer.join(timeout=5)
        worker.release_held(0.0)
