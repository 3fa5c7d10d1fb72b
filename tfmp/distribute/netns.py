"""A private network for a local worker group: only loopback, reachable from no other host.

    reason = netns.isolate()   # None: this process and its children now live in a new network
                               # namespace with only `lo` (up); else why that was not possible

TensorFlow's gRPC server binds every interface (`0.0.0.0:<port>`, whatever host TF_CONFIG
names) with no authentication: anyone who reaches a worker's port can run code as the training
user (docs/security.md). The workers of `python -m tfmp.launch --workers=N` only talk to each
other over localhost, so the launcher moves itself, before it starts any worker, into a network
namespace of its own whose only interface is loopback: the workers inherit it, and from the
host (or any other host) their ports do not exist.

Linux only. As root, `unshare(CLONE_NEWNET)`; as another user, together with a user namespace
that maps the user to itself (so files keep their owner), where the kernel allows unprivileged
user namespaces. Python 3.11 has no `os.unshare`, so libc's is called through ctypes. The whole
procedure is first tried in a forked child: a namespace entered whose loopback then cannot be
brought up (a kernel that gives unprivileged namespaces no capabilities) would leave the
workers unable to reach each other, with no way back.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = "16sh22x"  # struct ifreq on Linux: the interface name, then ifr_flags in a 24-byte union


def isolate() -> str | None:
    """Moves this process into a new network namespace with loopback up.

    Returns None on success, else a short reason (the process is then unchanged). Call it
    before the process starts a thread: a namespace is per thread, and a user namespace can
    only be entered by a single-threaded process.
    """
    if not hasattr(os, "fork") or not os.path.exists("/proc/self/ns/net"):
        return "this OS has no network namespaces"
    threads = len(os.listdir("/proc/self/task"))
    if threads > 1:
        return f"the launcher already runs {threads} threads"
    reason = _try_in_child()
    if reason is None:
        reason = _enter()  # the child proved it works; this cannot fail halfway in practice
    return reason


def _try_in_child() -> str | None:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: try, report, and leave without running any Python cleanup
        os.close(read_end)
        reason = "the trial failed unexpectedly"
        try:
            reason = _enter() or ""
        finally:
            os.write(write_end, reason.encode())
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as report:
        reason = report.read().decode()
    os.waitpid(pid, 0)
    return reason or None


def _enter() -> str | None:
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNET if uid == 0 else CLONE_NEWUSER | CLONE_NEWNET
    libc = ctypes.CDLL(None, use_errno=True)  # this process's own symbols: libc's unshare
    if libc.unshare(ctypes.c_int(flags)) != 0:
        code = ctypes.get_errno()
        what = "unprivileged user namespaces are disabled" if code in (errno.EPERM, errno.EINVAL) else ""
        return f"unshare: {os.strerror(code)}" + (f" ({what})" if uid and what else "")
    try:
        if uid != 0:
            # setgroups must be denied before an unprivileged process may write its gid_map.
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{uid} {uid} 1")
            _write("/proc/self/gid_map", f"{gid} {gid} 1")
        _loopback_up()
    except OSError as error:
        return f"bringing up loopback: {error.strerror}"
    return None


def _write(path: str, text: str) -> None:
    with open(path, "w") as file:
        file.write(text)


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack(_IFREQ, b"lo", 0)
        flags = struct.unpack(_IFREQ, fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | IFF_UP))


def same_network_as(pid: int) -> bool:
    """Whether process `pid` shares this process's network namespace (for tests and checks)."""
    return os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net")
