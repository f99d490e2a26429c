"""The directory of a `shm://` store: its layout, lock and counters, and file helpers.

Layout (docs/store.md has the essay):

    .lock                         flock'd for every state change; holds the counters
                                  (resident bytes, samples, peak, cached bytes), int64s
    procs/<pid>-<start>.<handle>  one file per open handle (who is attached)
    samples/<sid>/g<gen>/<name>   a tensor's raw bytes; `.nbytes` = the sample's size
    samples/<sid>/.g<gen>.<pid>-<start>.<rand>.tmp/   a put in progress (same files)
    free/<nbytes>.<rand>          released tensor files kept for reuse (`recycle_bytes`)
    trash/<rand>                  removed outside the lock

`sweep_abandoned` removes stores every attached process of which is dead.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import struct
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from specbus.core.store import procs

SHM_ROOT = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
STATS = struct.Struct("<qqqq")  # resident bytes, samples, peak bytes, cached bytes


def store_dir(store_id: str) -> Path:
    """The default directory of store `store_id` under `SHM_ROOT`."""
    return SHM_ROOT / f"specbus-{store_id}"


def sweep_abandoned(exclude: Path | None = None) -> list[Path]:
    """Remove every `specbus-*` store under SHM_ROOT whose attached processes are all dead
    (a killed run nobody reopens would otherwise hold its RAM until reboot), except stores
    opened with `keep_on_close`. Runs at each shm open; returns what it removed."""
    removed = []
    for root in SHM_ROOT.glob("specbus-*"):
        if root == exclude or (root / ".keep").exists() or not (root / "procs").is_dir():
            continue
        try:
            fd = os.open(root / ".lock", os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # busy: someone is using it
            if os.stat(root / ".lock").st_ino != os.fstat(fd).st_ino:
                continue
            if any(procs.alive(f.name.split(".")[0]) for f in (root / "procs").iterdir()):
                continue
            shutil.rmtree(root, ignore_errors=True)
            removed.append(root)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


class Locked:
    """Exclusive access to the store directory: a thread lock plus flock on `.lock`.

    The last closer deletes the directory, lock file included; a waiter that then gets the
    lock of the deleted file notices (inode changed) and retries on a fresh one.

    Re-entrant within a thread, and one per store directory per process (`locked_for`):
    flock belongs to an open file description, so a second flock on a fresh descriptor from
    the thread (or process) that holds the first waits for itself forever. That is what a
    signal handler calling close() in the middle of a put would do.
    """

    def __init__(self, root: Path):
        self.root = root
        self.path = str(root / ".lock")
        self.tlock = threading.RLock()
        self.fd = -1
        self.depth = 0  # nesting of the thread holding `tlock`

    def __enter__(self) -> Locked:
        self.tlock.acquire()
        if self.depth:
            self.depth += 1
            return self
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            except FileNotFoundError:  # no store directory (yet, or removed by a last closer)
                self.root.mkdir(parents=True, exist_ok=True)
                continue
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                self.depth = 1
                return self
            os.close(fd)

    def __exit__(self, *exc) -> None:
        self.depth -= 1
        if not self.depth:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1
        self.tlock.release()

    def read(self) -> Stats:
        """The store's counters (under the lock)."""
        data = os.pread(self.fd, STATS.size, 0)
        return Stats(*STATS.unpack(data)) if len(data) == STATS.size else Stats()

    def write(self, st: Stats) -> None:
        """Write the counters (under the lock); the peak follows the resident bytes."""
        st.peak = max(st.peak, st.resident)
        os.pwrite(
            self.fd,
            STATS.pack(max(st.resident, 0), max(st.count, 0), st.peak, max(st.cached, 0)),
            0,
        )


_lockers: weakref.WeakValueDictionary[str, Locked] = weakref.WeakValueDictionary()
_lockers_lock = threading.Lock()


def locked_for(root: Path) -> Locked:
    """The one `Locked` of a store directory in this process (shared by its handles)."""
    with _lockers_lock:
        locked = _lockers.get(str(root))
        if locked is None:
            locked = _lockers[str(root)] = Locked(root)
        return locked


@dataclass
class Stats:
    """The store's counters: resident bytes, samples, peak bytes, cached free-file bytes."""

    resident: int = 0
    count: int = 0
    peak: int = 0
    cached: int = 0


def nbytes_of(d: Path) -> int:
    """Bytes of a sample directory (its `.nbytes`, else the sum of its files)."""
    try:
        return int((d / ".nbytes").read_text())
    except (FileNotFoundError, ValueError):
        return sum(
            f.stat().st_size for f in d.iterdir() if f.is_file() and not f.name.startswith(".")
        )


def write_text(path: str, text: str) -> None:
    """Write a small file (no fsync: tmpfs)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def read_exact(fd: int, out: torch.Tensor) -> int:
    """`readv` into `out` until it is full or the file ends; the bytes read."""
    mv = memoryview(out.numpy()).cast("B") if out.numel() else memoryview(bytearray())
    got = 0
    while got < len(mv):
        n = os.readv(fd, [mv[got:]])
        if n == 0:
            break
        got += n
    return got


def rm(path: str | Path) -> None:
    """Delete a trash entry: a sample directory, or a single file (a trimmed cache file,
    which rmtree would refuse and leave holding its space)."""
    try:
        os.unlink(path)
    except IsADirectoryError:
        shutil.rmtree(path, ignore_errors=True)
    except OSError:
        pass  # gone already


def reserve(fd: int, nbytes: int) -> None:
    """Allocate a file's blocks (and set its size): ENOSPC now rather than SIGBUS later."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None:  # not Linux: no reservation; tmpfs-like filesystems are Linux's
        os.ftruncate(fd, nbytes)
        return
    fallocate(fd, 0, nbytes)


def size_text(nbytes: int) -> str:
    """A byte count for people (KiB, MiB, GiB)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes} B"


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem under `path`."""
    path = path.resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def free_entries(free_dir: str) -> list[tuple[int, str]]:
    """(size, name) of the cached free files (the size is in the name: no stat)."""
    return parse_free(os.listdir(free_dir))


def parse_free(names: Iterable[str]) -> list[tuple[int, str]]:
    """(size, name) of free-file names (the size is in the name)."""
    out = []
    for name in names:
        size, _, _ = name.partition(".")
        if size.isdigit():
            out.append((int(size), name))
    return out


def unchanged(before: os.stat_result, after: os.stat_result, path: Path) -> bool:
    """The file read is still the sample's: same inode at `path`, same size and times. A
    release renames the file away (recycled files are overwritten only after that), so if
    `path` still holds this inode after the read, nothing overwrote what was read."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    same = (before.st_size, before.st_mtime_ns, before.st_ctime_ns)
    return (
        now.st_ino == before.st_ino
        and (after.st_size, after.st_mtime_ns, after.st_ctime_ns) == same
    )


def gen_of(name: str) -> int:
    """The generation of a `g<gen>` directory name (-1 for another name)."""
    try:
        return int(name[1:])
    except ValueError:
        return -1


def mtime_of(path: Path, fallback: Path) -> float:
    """`path`'s modification time, else `fallback`'s (a put still in progress)."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return fallback.stat().st_mtime
