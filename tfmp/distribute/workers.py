"""The local worker processes of a launched group: output, signals, exit statuses, what failed.

    worker = workers.Worker(index, command, env, cpus=[0])   # started; output as "[worker i] ..."
    worker.release_held()      # called often: prints held lines older than HOLD_SECONDS
    worker.silence()           # the group is being stopped: drop what it still says
    worker.error, worker.last_line   # its own `error: ...` line (held back), the last line it printed
    workers.describe(-9)       # "killed by SIGKILL"
    stop = workers.StopSignals(); stop.install()   # the launcher's stop signals, passed on
    index, code = workers.watch(group, stop)       # until done: the worker whose status it is
    workers.failure(group, index, code, command)   # the launcher's one `error:` message, or None

A worker pinned to `cpus` runs there (its share of this host's cores). It dies with the
launcher: a launcher killed with SIGKILL cannot stop its workers, so the kernel does
(PR_SET_PDEATHSIG); they would otherwise train on alone, holding their ports and the run.

When one worker dies, its peers' collectives fail within milliseconds and TensorFlow's C++
runtime logs it (`E0000 ... ring_alg.cc:291] Aborting RingReduce with UNAVAILABLE ...` and a
few lines of gRPC detail), before the launcher can notice the death and stop them. So a
worker's C++ log lines, and whatever follows them, are held for HOLD_SECONDS before being
printed: if the group is stopped meanwhile they are dropped, as consequences of the death
the launcher reports.

A worker's own one-line error (`error: ...`, what every tfmp app ends on) is held back too: the
launcher ends on one `error:` line, saying the message once for all the workers that said it.
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

from tfmp.errors import EXIT_PEER_LOST, EXIT_PREEMPTED, EXIT_USAGE

HOLD_SECONDS = 1.0
ERROR_PREFIX = "error: "
PREEMPTION_GRACE_SECONDS = 120  # for the other workers to finish the preemption checkpoint
USAGE_GRACE_SECONDS = 10  # for the other workers to say their usage error (the same, as a rule)
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


def dies_with_this_process(cpus: list[int] | None = None):
    """A `preexec_fn` for a child that must not outlive this process: the kernel sends it SIGKILL
    when this process dies, even by SIGKILL (PR_SET_PDEATHSIG), and it exits at once if this
    process died before that took effect; `cpus` pins it. None where Linux's prctl is missing."""
    if _prctl is None:
        return None
    parent = os.getpid()

    def prepare():  # runs in the child, between fork and exec
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(128 + signal.SIGKILL)
        if cpus:
            os.sched_setaffinity(0, cpus)

    return prepare


class Worker:
    def __init__(self, index: int, command: list[str], env: dict, cpus: list[int] | None = None):
        self.index = index
        self._lock = threading.Lock()
        self._held: list[tuple[float, str]] = []
        self._silenced = False
        self.error: str | None = None  # the message of its `error: ...` line, not printed
        self.last_line: str | None = None  # the last non-empty line it printed
        self.process = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            preexec_fn=dies_with_this_process(cpus),
        )
        self.printer = threading.Thread(target=self._print, daemon=True)
        self.printer.start()

    def _print(self):
        for line in self.process.stdout:
            with self._lock:
                if line.startswith(ERROR_PREFIX):  # the launcher says it, once for every worker
                    self.error = line[len(ERROR_PREFIX) :].strip()
                    continue
                if self._silenced:
                    continue
                if line.strip():
                    self.last_line = line.strip()
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
        if worker.error and worker.process.returncode == 0:  # said, yet succeeded: shown as said
            _write(worker.index, [ERROR_PREFIX + worker.error + "\n"])


def _root_cause(failed: list[tuple[int, int]]) -> tuple[int, int]:
    """The failure to report among workers seen failed in the same poll: a worker that lost its
    peer (exit 5) only reports a consequence of the peer's failure."""
    return next((item for item in failed if item[1] != EXIT_PEER_LOST), failed[0])


def failure(group: list[Worker], index: int | None, code: int | None, command: list[str]) -> str | None:
    """The launcher's `error:` message for worker `index` that exited with `code` > 0 (not 42):
    its own error line once, naming every worker that said the same; or, when it said none (it
    could not start, or crashed), its exit status and last line. None for anything else."""
    if index is None or not code or code < 0 or code == EXIT_PREEMPTED:
        return None
    failed = group[index]
    if failed.error is None:
        said = (
            f" without an error line (its last line: {failed.last_line})"
            if failed.last_line
            else ", printing nothing"
        )
        hint = "see its output above"
        if failed.last_line and "No module named" in failed.last_line:
            hint = f"is tfmp installed for {command[0]}, the program the worker command runs?"
        return f"worker {index} exited with {code}{said}: {hint}; the other workers were stopped"
    said = [worker.index for worker in group if worker.error == failed.error and worker.poll() == code]
    for worker in group:  # a different message of its own (not a lost peer's): shown, not dropped
        if worker.error and worker.error != failed.error and worker.poll() not in (EXIT_PEER_LOST, None):
            print(f"[worker {worker.index}] {ERROR_PREFIX}{worker.error}", flush=True)
    who = f"worker {said[0]}" if len(said) == 1 else "workers " + ", ".join(map(str, said))
    return f"{failed.error} ({who})"


def watch(group: list[Worker], stop: StopSignals) -> tuple[int | None, int]:
    """Polls the group until it is done: (the index of the worker whose exit status it is, or None;
    that status), 0 when all succeeded. A failed worker's peers are silenced (what they say now
    is about the lost peer), after letting them end on their own where they will say the same."""
    while True:
        stop.forward()
        codes = [worker.poll() for worker in group]
        for worker in group:
            worker.release_held()
        failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
        if stop.received and (failed or all(code is not None for code in codes)):
            # Told to stop: the workers are saving the same checkpoint, or dying before their
            # first step; let them all end, then report a worker's own line over a death.
            wait(group, PREEMPTION_GRACE_SECONDS)
            codes = [worker.poll() for worker in group]
            failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
            failed.sort(key=lambda item: item[1] < 0)
            return failed[0] if failed else (None, 0)
        if failed:
            index, code = _root_cause(failed)
            if code == EXIT_PREEMPTED:  # a worker's own preemption notice: its peers save too
                wait(group, PREEMPTION_GRACE_SECONDS)
                return index, code
            if code == EXIT_USAGE:  # its peers run the same checks: let them say theirs too
                wait(group, USAGE_GRACE_SECONDS)
            for worker in group:
                if worker.index != index:
                    worker.silence()  # what they say now is about the lost peer
            # "exited with -9 (killed by SIGKILL)": the returncode as Popen gives it, and in words.
            what = f"exited with {code}" + (f" ({describe(code)})" if code < 0 else "")
            print(f"[launch] worker {index} {what}; stopping the others", flush=True)
            return index, code
        if all(code is not None for code in codes):
            return None, 0
        time.sleep(0.1)
