"""Who the workers of a multi-worker job are, without importing TensorFlow.

    config = cluster.parse_tf_config(os.environ.get("TF_CONFIG"))   # validated, or UsageError
    cluster.rendezvous(config, timeout=120)                           # every peer is up

The launcher uses this module too, so it starts in milliseconds and never touches a GPU.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import re
import socket
import threading
import time

from tfmp.errors import UsageError

TASK_TYPES = ("chief", "worker", "ps", "evaluator")
_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """A validated TF_CONFIG."""

    cluster: dict[str, list[str]]
    task_type: str
    task_index: int

    @property
    def num_workers(self) -> int:
        return len(self.cluster.get("chief", [])) + len(self.cluster.get("worker", []))

    @property
    def is_chief(self) -> bool:
        # Without an explicit chief, worker 0 plays the chief (TensorFlow's convention).
        if "chief" in self.cluster:
            return self.task_type == "chief"
        return self.task_type == "worker" and self.task_index == 0

    @property
    def address(self) -> str:
        return self.cluster[self.task_type][self.task_index]


def parse_tf_config(raw: str | None) -> ClusterConfig | None:
    """Validates TF_CONFIG before TensorFlow reads it: TF hangs or crashes on most mistakes."""
    if not raw or not raw.strip():
        return None
    fix = 'expected {"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": 0}}'
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as error:
        raise UsageError(f"TF_CONFIG is not valid JSON ({error.msg} at char {error.pos}); {fix}") from None
    if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
        raise UsageError(f"TF_CONFIG has no 'cluster' object; {fix}")
    cluster = config["cluster"]
    for task_type, addresses in cluster.items():
        if task_type not in TASK_TYPES:
            raise UsageError(
                f"TF_CONFIG cluster has unknown task type {task_type!r}; use {', '.join(TASK_TYPES)}"
            )
        if not isinstance(addresses, list) or not addresses:
            raise UsageError(f"TF_CONFIG cluster[{task_type!r}] must be a non-empty list of host:port")
        for address in addresses:
            match = _ADDRESS.match(str(address))
            if not match or not 0 < int(match.group(2)) < 65536:
                raise UsageError(
                    f"TF_CONFIG cluster[{task_type!r}] has {address!r}, not host:port with a port in 1-65535"
                )
    if len(cluster.get("chief", [])) > 1:
        raise UsageError(f"TF_CONFIG names {len(cluster['chief'])} chiefs; at most one is allowed")
    if "chief" not in cluster and "worker" not in cluster:
        raise UsageError(f"TF_CONFIG cluster has neither 'chief' nor 'worker' tasks; {fix}")
    task = config.get("task")
    if not isinstance(task, dict) or "type" not in task or "index" not in task:
        raise UsageError(f"TF_CONFIG has no 'task' with 'type' and 'index'; {fix}")
    task_type, task_index = task["type"], task["index"]
    if task_type not in cluster:
        raise UsageError(f"TF_CONFIG task type {task_type!r} is not in the cluster ({', '.join(cluster)})")
    if not isinstance(task_index, int) or not 0 <= task_index < len(cluster[task_type]):
        raise UsageError(
            f"TF_CONFIG task index {task_index!r} is out of range for "
            f"{len(cluster[task_type])} {task_type} task(s); use 0.."
            f"{len(cluster[task_type]) - 1}"
        )
    all_addresses = [a for addresses in cluster.values() for a in addresses]
    if len(set(all_addresses)) != len(all_addresses):
        raise UsageError("TF_CONFIG lists the same host:port twice; every task needs its own port")
    return ClusterConfig({k: list(v) for k, v in cluster.items()}, task_type, task_index)


def rendezvous(cluster: ClusterConfig, timeout: float) -> None:
    """Waits until every peer accepts a TCP connection on its TF_CONFIG port, or fails naming
    the ones that never did.

    TensorFlow itself waits up to an hour for a missing peer, blocked in C++ where Python can't
    interrupt it. So each worker first listens on its own port with a plain socket and dials
    every peer; once all answered it closes the socket and TensorFlow binds the port. A slower
    peer still dialling then reaches TensorFlow's server instead, which counts as well.
    """
    listener = _listen(cluster.address)
    listener.settimeout(0.2)
    done = threading.Event()

    def answer():  # accept and drop: the peer only needs to see that we are up
        while not done.is_set():
            try:
                listener.accept()[0].close()
            except OSError:
                continue

    answering = threading.Thread(target=answer, daemon=True)
    answering.start()
    waiting = set(_peers(cluster))
    deadline = time.monotonic() + timeout
    try:
        while waiting and time.monotonic() < deadline:
            waiting = {address for address in waiting if not _reachable(address)}
            if waiting:
                time.sleep(0.2)
    finally:
        done.set()
        answering.join()
        listener.close()
    if waiting:
        raise UsageError(
            f"worker {cluster.task_type}:{cluster.task_index} ({cluster.address}) could not reach "
            f"{', '.join(sorted(waiting))} within {timeout:g} s; start every worker, check the "
            "addresses and firewalls, or raise --startup_timeout"
        )


def _listen(address: str) -> socket.socket:
    """A socket listening on `address`'s own host only, not on every interface: `localhost` is
    loopback, a name the address of this host it resolves to. A name that does not resolve yet
    (a pod's DNS record can lag its start) or names no address of this host (NAT, a service's
    virtual IP) falls back to every interface: peers must still reach us, and this listener
    only accepts and drops connections (TensorFlow's own server, which runs code, binds every
    interface anyway: docs/security.md)."""
    host, _, port = address.rpartition(":")
    family, bind_host = _own_address(host.strip("[]"))
    listener = socket.socket(family)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        try:
            listener.bind((bind_host, int(port)))
        except OSError as error:
            if error.errno != errno.EADDRNOTAVAIL:
                raise
            listener.bind(("", int(port)))
    except OSError as error:
        listener.close()
        raise UsageError(
            f"this worker's port {address} is not free ({error.strerror}); "
            "pick another port in TF_CONFIG or stop what holds it"
        ) from None
    listener.listen(64)
    return listener


def _own_address(host: str) -> tuple[socket.AddressFamily, str]:
    """(family, address) to bind for TF_CONFIG's `host`; ("", every interface) if it does not resolve."""
    if host == "localhost":
        return socket.AF_INET, "127.0.0.1"
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return (socket.AF_INET6 if ":" in host else socket.AF_INET), ""
    found.sort(key=lambda entry: entry[0] != socket.AF_INET)  # IPv4 first; a dialling peer tries each
    family, _, _, _, sockaddr = found[0]
    return family, sockaddr[0]


def _peers(cluster: ClusterConfig) -> list[str]:
    own = cluster.address
    return [a for job in ("chief", "worker") for a in cluster.cluster.get(job, []) if a != own]


def _reachable(address: str, timeout: float = 2.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False
