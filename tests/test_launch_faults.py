"""The launcher under real faults, with stand-in workers (plain Python, no TensorFlow: each test
takes about a second): the private network of a local group, stop signals to the launcher while
its workers start, a launcher killed with SIGKILL. tests/test_multi_worker.py does the same
with real training (a killed worker, a lost peer, the group's ports seen from the host).
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import ROOT, listening_ports, workers_of

from tfmp.distribute import netns, scratch

pytestmark = pytest.mark.slow

# A stand-in for TensorFlow's gRPC server: it listens on its TF_CONFIG port on every interface
# (0.0.0.0, as TensorFlow does whatever host TF_CONFIG names), says so, and waits to be stopped
# with Python's default SIGTERM disposition (as a worker still importing TensorFlow has).
LISTENER = (
    "import json, os, socket, time; "
    "config = json.loads(os.environ['TF_CONFIG']); "
    "port = int(config['cluster']['worker'][config['task']['index']].rsplit(':', 1)[1]); "
    "server = socket.socket(); server.bind(('0.0.0.0', port)); server.listen(); "
    "print('listening', port, flush=True); time.sleep(120)"
)


def _start(tmp_path, *launch_flags, worker=LISTENER):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tfmp.launch",
            "--workers=2",
            *launch_flags,
            "--",
            sys.executable,
            "-c",
            worker,
        ],
        cwd=ROOT,
        env=dict(os.environ, TMPDIR=str(tmp_path)),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _listening(launcher, count=2, timeout=60):
    """The ports the launched stand-ins listen on, once all `count` say so."""
    ports, deadline = [], time.monotonic() + timeout
    while len(ports) < count and time.monotonic() < deadline:
        line = launcher.stdout.readline()
        assert line, f"the launcher ended ({launcher.wait()}): {launcher.stderr.read()}"
        ports += [int(port) for port in re.findall(r"\] listening (\d+)", line)]
    return ports


def _reachable(host, port):
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _private_network_possible():
    """Whether this OS lets this user make a network namespace, asked of util-linux's unshare
    (not of tfmp): as root always on Linux; else where unprivileged user namespaces are allowed."""
    if os.getuid() == 0:
        return os.path.exists("/proc/self/ns/net")
    if shutil.which("unshare") is None:
        return False
    return (
        subprocess.run(["unshare", "--map-current-user", "--net", "true"], capture_output=True).returncode
        == 0
    )


def _host_addresses():
    """This host's own addresses: loopback and, where it has one, the one it reaches others by."""
    addresses = ["127.0.0.1"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent, only a route chosen
            addresses.append(probe.getsockname()[0])
        except OSError:
            pass
    return addresses


@pytest.mark.parametrize("network", ["auto", "host"])
def test_a_local_group_is_unreachable_from_the_host(tmp_path, network):
    """Done when of issue 30: during a 2-worker local launch, no worker's port is listening in
    the host's network (what `ss -ltn` shows) nor reachable at any of the host's addresses; the
    workers live in a network of their own. `--network=host` is the control: there the same
    ports are open on every interface, and one warning line names them."""
    launcher = _start(tmp_path, f"--network={network}")
    try:
        ports = _listening(launcher)
        pids = workers_of(launcher)
        exposed = network == "host"
        if not exposed and not _private_network_possible():
            pytest.skip("this OS allows no private network namespace here (see the launcher's warning)")
        assert all(netns.same_network_as(pid) == exposed for pid in pids)
        assert (set(ports) <= listening_ports()) == exposed
        assert set(ports) & listening_ports() == (set(ports) if exposed else set())
        for address in _host_addresses():
            assert all(_reachable(address, port) == exposed for port in ports), (address, ports)
        if not exposed:  # the workers reach each other inside their network
            assert set(ports) <= listening_ports(pids[0])
    finally:
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=30)
    warnings = [line for line in stderr.splitlines() if line.startswith("warning:")]
    if exposed:
        assert len(warnings) == 1 and all(str(port) in warnings[0] for port in ports), stderr
    else:
        assert not warnings, stderr


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_a_stop_signal_while_workers_start_is_one_line_and_128_plus_n(tmp_path, signum, code):
    """The launcher passes the signal on; workers still starting (importing TensorFlow, no
    handler yet) die of it. The launcher used to pass their -15 to sys.exit (exit 241, no word);
    now: the shell's 128 + N and one `interrupted:` line with the command that resumes."""
    launcher = _start(tmp_path)
    _listening(launcher)
    pids = workers_of(launcher)
    launcher.send_signal(signum)
    stdout, stderr = launcher.communicate(timeout=30)
    assert launcher.returncode == code, stdout + stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"interrupted: {signal.Signals(signum).name} "), stderr
    assert "resume with: " in lines[0] and "-m tfmp.launch --workers=2" in lines[0]
    assert "Traceback" not in stdout + stderr
    assert not any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in pids)
    assert not os.listdir(tmp_path)  # the scratch folder is removed


def _alive(pid):
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def test_a_killed_worker_is_named_with_128_plus_n_and_its_peer_is_quiet(tmp_path):
    """A worker killed (SIGKILL: the OOM killer) without a word: the launcher stops the other
    and says which worker died of what, exit 137; the other's output after the death is dropped."""
    launcher = _start(tmp_path)
    _listening(launcher)
    os.kill(workers_of(launcher)[1], signal.SIGKILL)
    stdout, stderr = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + signal.SIGKILL, stdout + stderr
    assert "[launch] worker 1 exited with -9 (killed by SIGKILL); stopping the others" in stdout
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: worker 1 was killed by SIGKILL"), stderr


def test_a_killed_launcher_takes_its_workers_and_its_scratch_folder_goes_at_the_next_start(tmp_path):
    """kill -9 on the launcher: its workers die with it (they would train on alone, holding the
    run and their ports); its scratch folder stays, and the next launch removes it, leaving alone
    the folder of a launcher that still runs (this test process plays one)."""
    launcher = _start(tmp_path)
    _listening(launcher)
    pids = workers_of(launcher)
    launcher.kill()
    launcher.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in pids)
    left = os.listdir(tmp_path)
    assert len(left) == 1 and left[0].startswith(scratch.PREFIX)
    live = tmp_path / f"{scratch.PREFIX}live"
    live.mkdir()
    (live / scratch.OWNER_FILE).write_text(scratch._identity(os.getpid()))
    unowned = tmp_path / f"{scratch.PREFIX}unowned"  # being created this instant, or not tfmp's
    unowned.mkdir()
    again = _start(tmp_path, worker="pass")
    stdout, stderr = again.communicate(timeout=60)
    assert again.returncode == 0, stdout + stderr
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, unowned.name])


@pytest.mark.skipif(
    os.getuid() != 0 or not os.path.exists("/usr/bin/python3"), reason="needs root to be another user"
)
def test_an_unprivileged_user_gets_a_private_network_too(tmp_path):
    """Not as root: a user namespace mapping the user to itself, then the network one. Run as
    `nobody` with the system Python (this module alone, no tfmp install needed)."""
    server_check = (
        "import os, socket, sys; sys.path.insert(0, sys.argv[1]); import netns; "
        "reason = netns.isolate()\n"
        "if reason: print(reason); sys.exit()\n"
        "server = socket.socket(); server.bind(('127.0.0.1', 0)); server.listen()\n"
        "socket.create_connection(server.getsockname(), timeout=2).close()\n"
        "print('private', os.getuid(), sorted(line.split(':')[0].strip() for line in list(open('/proc/net/dev'))[2:]))"
    )
    result = subprocess.run(
        ["/usr/bin/python3", "-c", server_check, os.path.join(ROOT, "tfmp", "distribute")],
        user=65534,
        group=65534,
        extra_groups=[],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    if not result.stdout.startswith("private"):
        pytest.skip(f"this kernel refuses unprivileged user namespaces: {result.stdout.strip()}")
    # Its own uid kept, only loopback, and loopback is up (the connection above worked).
    assert result.stdout.split(maxsplit=2)[1:] == ["65534", "['lo']\n"], result.stdout
