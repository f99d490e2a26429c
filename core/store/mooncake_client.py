"""The Mooncake client of this process: one connection per cluster, shared by store handles.

`connect(mc)` returns the process's `Connection` to the cluster `mc` names (a
`MooncakeDistributedStore` set up with no segment of its own, and its registered buffer pool),
creating it on first use; `disconnect` keeps the most recently idle one for the next handle.
Mooncake is imported here, lazily (an optional dependency). Error codes are Mooncake's
(mooncake-store/include/types.h). docs/store.md has the lessons behind each choice.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import socket
import threading

from specbus.core.config import MooncakeConfig
from specbus.core.contracts import FeatureSpec
from specbus.core.errors import (
    FeatureMissing,
    IntegrityError,
    StoreError,
    StoreFull,
    StoreUnavailable,
)
from specbus.core.store.pool import BufferPool

# Mooncake error codes (mooncake-store/include/types.h)
OK = 0
NO_AVAILABLE_HANDLE = -200
BUFFER_TOO_SMALL = -600
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900

# An empty tensor is stored as a one-byte sentinel so that its absence is still detectable.
SENTINEL = 1


NATIVE_LOG_ENV = ("MC_LOG_LEVEL", "MC_LOG_DIR", "GLOG_minloglevel", "GLOG_v")
_GLOG_MINLOGLEVEL = "_ZN3fLI17FLAGS_minloglevelE"  # glog's `FLAGS_minloglevel` (an int)


def quiet_native_log() -> bool:
    """Silence the Mooncake client's own glog lines in this process (its INFO/WARNING/ERROR
    lines went to stderr, between our log lines and test output): its failures reach us as
    error codes, raised as typed errors naming the code. The wheel's glog reads no GLOG_*
    variable, so this sets its `FLAGS_minloglevel` to FATAL in the loaded library; processes
    started from here are not affected (the store services log to their own files). Left
    alone when the user sets one of `NATIVE_LOG_ENV` (`MC_LOG_LEVEL=INFO` brings the lines
    back). Returns whether it was silenced."""
    if any(os.environ.get(name) for name in NATIVE_LOG_ENV):
        return False
    try:
        with open("/proc/self/maps") as maps:
            libs = {line.split()[-1] for line in maps if "libglog" in line.rsplit("/", 1)[-1]}
        for lib in libs:
            ctypes.c_int.in_dll(ctypes.CDLL(lib), _GLOG_MINLOGLEVEL).value = 3
    except (OSError, ValueError):  # another platform or build: its lines stay
        return False
    return bool(libs)


def metadata_address(metadata: str) -> str:
    """Our config says "P2P"; Mooncake spells the handshake mode "P2PHANDSHAKE"."""
    return "P2PHANDSHAKE" if metadata.upper() in ("P2P", "P2PHANDSHAKE") else metadata


class Connection:
    """A Mooncake client and its registered buffer pool, shared by every store handle of this
    process that talks to the same cluster (one client, one pool, however many handles).
    Raises `StoreUnavailable` when the master cannot be reached or the setup fails."""

    def __init__(self, mc: MooncakeConfig):
        from mooncake.store import (
            MooncakeDistributedStore,
            ReplicateConfig,
        )  # lazy: optional dependency

        quiet_native_log()
        # The transfer engine's TCP listener honours this where the Mooncake version supports
        # it (the engine reads only the environment); set once, never overriding the user's.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", mc.local_hostname)
        check_reachable(mc.master, mc.http_timeout_s)  # setup() against a dead master blocks ~90 s
        self.client = MooncakeDistributedStore()
        rc = self.client.setup(
            mc.local_hostname,
            metadata_address(mc.metadata),
            0,  # no segment here: objects live in the store node, which outlives this process
            mc.client_buffer_bytes,
            mc.protocol,
            mc.device,
            mc.master,
        )
        if rc != 0:
            raise StoreUnavailable(
                f"Mooncake client setup against {mc.master} failed with code {rc}"
            )
        self.replicate = ReplicateConfig()
        self.replicate.with_hard_pin = (
            True  # never evicted: the budget, not eviction, bounds memory
        )
        self.pool = BufferPool(
            mc.buffer_bytes, register=lambda ptr, n: register(self.client, ptr, n)
        )
        self.handles = 0
        self._held: dict[int, list[int]] = {}  # ptr -> [size, puts using it]
        self._held_lock = threading.Lock()

    def hold(self, ptr: int, nbytes: int) -> bool:
        """Register caller memory for the length of a put; concurrent puts of one tensor share
        the registration. False when Mooncake refuses it (it overlaps another registered
        region): the caller stages the tensor instead."""
        with self._held_lock:
            entry = self._held.get(ptr)
            if entry is not None:
                if entry[0] != nbytes:
                    return False
                entry[1] += 1
                return True
            if self.client.register_buffer(ptr, nbytes) != 0:
                return False
            self._held[ptr] = [nbytes, 1]
            return True

    def unhold(self, ptr: int) -> None:
        """Drop one put's hold of a registration (unregistered by the last)."""
        with self._held_lock:
            entry = self._held[ptr]
            entry[1] -= 1
            if entry[1] == 0:
                del self._held[ptr]
                self.client.unregister_buffer(ptr)


_connections: dict[tuple, Connection] = {}
_connections_lock = threading.Lock()


def connect(mc: MooncakeConfig) -> Connection:
    """This process's connection to the cluster `mc` names (one per master, protocol, device,
    host and pool size), counted as used by one more handle."""
    key = (
        mc.master,
        metadata_address(mc.metadata),
        mc.protocol,
        mc.device,
        mc.local_hostname,
        mc.buffer_bytes,
    )
    with _connections_lock:
        conn = _connections.get(key)
        if conn is None:
            conn = _connections[key] = Connection(mc)
        conn.handles += 1
        return conn


def disconnect(conn: Connection) -> None:
    """Keep the most recently idle client connected (closing one takes ~1 s inside Mooncake
    and the next handle on the same cluster reuses it); close any other idle one."""
    with _connections_lock:
        conn.handles -= 1
        idle = [k for k, c in _connections.items() if c.handles == 0 and c is not conn]
        doomed = [_connections.pop(k) for k in idle]
    for c in doomed:
        c.client.close()  # its pool lives on while tensors still use it (see pool.py)


@atexit.register
def _close_connections() -> None:
    with _connections_lock:
        for conn in _connections.values():
            conn.client.close()
        _connections.clear()


def register(client, ptr: int, nbytes: int) -> None:
    """Register transfer memory with `client`; `StoreError` if Mooncake refuses."""
    rc = client.register_buffer(ptr, nbytes)
    if rc != 0:
        raise StoreError(
            f"registering {nbytes} B of transfer buffer with Mooncake failed with code {rc}"
        )


def check_reachable(address: str, timeout_s: float) -> None:
    """`StoreUnavailable` unless a TCP connection to `address` (host:port) opens in time."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as e:
        raise StoreUnavailable(f"Mooncake master {address!r} is not reachable: {e}") from e


def put_error(key: str, code: int, master: str, capacity: int | None) -> StoreError:
    """The typed error of a refused put of `key` (`capacity`: the cluster's segment bytes,
    None when the code says the master or the transfer failed)."""
    if code == RPC_FAIL:
        return StoreUnavailable(f"put {key!r}: Mooncake master {master} unreachable (code {code})")
    if code == TRANSFER_FAIL:
        return StoreUnavailable(f"put {key!r}: transfer to the store node failed (code {code})")
    if capacity == 0:
        return StoreUnavailable(f"put {key!r}: no store node has a segment mounted (code {code})")
    if code == NO_AVAILABLE_HANDLE:
        return StoreFull(
            f"put {key!r}: the store node's segment ({capacity} B) is full (code {code})"
        )
    return StoreError(f"put {key!r} failed with Mooncake code {code}")


def read_error(spec: FeatureSpec, code: int, master: str) -> StoreError:
    """The typed error of a read of `spec` that returned `code` instead of its size: a lost
    object or node is `FeatureMissing` (recapture), a master away `StoreUnavailable` (retry
    later), a size mismatch `IntegrityError`."""
    expected = spec.nbytes or SENTINEL
    if code == OBJECT_NOT_FOUND:
        return FeatureMissing(spec.key)
    if code == TRANSFER_FAIL:
        return FeatureMissing(spec.key, "transfer from the store node failed (node lost?)")
    if code == RPC_FAIL:
        return StoreUnavailable(
            f"get {spec.key!r}: Mooncake master {master} unreachable (code {code})"
        )
    if code == BUFFER_TOO_SMALL:
        return IntegrityError(
            f"feature {spec.key!r}: the stored object is larger than the spec's {spec.nbytes} B"
        )
    if code >= 0:
        return IntegrityError(f"feature {spec.key!r}: short read, {code} of {expected} bytes")
    return StoreError(f"get {spec.key!r} failed with Mooncake code {code}")
