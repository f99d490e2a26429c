"""`shm://<store_id>` (or `shm:///abs/dir`): several processes on one host, no server.

Layout under the store directory (default /dev/shm/specbus-<store_id>, i.e. RAM):

    .lock                         flock'd for every state change; holds the counters
                                  (resident bytes, samples, peak, cached bytes), int64s
    procs/<pid>-<start>.<handle>  one file per open handle (who is attached)
    samples/<sid>/g<gen>/<name>   a tensor's raw bytes; `.nbytes` = the sample's size
    samples/<sid>/.g<gen>.<pid>-<start>.<rand>.tmp/   a put in progress (same files)
    free/<nbytes>.<rand>          released tensor files kept for reuse (`recycle_bytes`)
    trash/<rand>                  removed outside the lock

A put reserves its bytes against the budget under the lock (so usage is global and a put
beyond the budget fails before writing), writes a tmp directory named after its writer,
then renames it into place under the lock: readers never see a half-written sample.

Writes copy once. Writing into fresh tmpfs pages runs at ~2 GB/s here, into already-allocated
ones at ~3.5 GB/s, so released files are recycled: a put renames a free file into its tmp
directory and overwrites it. Files of 1 MiB and more are written through this process's
mapping of the file, kept across puts (core/store/mapped.py: a recycled file is then written
at memcpy speed, where write() runs at ~0.7x); smaller ones with write(). The NaN/Inf screen
sums each ~1 MiB chunk right after copying it (core/store/chunked.py), so it costs no
second pass over memory; from 1 MiB per sample the screen worker sums chunks from the back
meanwhile (chunked.SharedScreen). The cache of free files is bounded (`recycle_bytes`, and resident +
cached never exceeds the budget), shown as `usage().cached_bytes`, and goes with the store. Reads copy once: `readinto` from the shared file straight into the tensor,
which lives in a per-process pool of pre-faulted memory (freed when the tensor dies) or, when
the pool is full, in fresh memory. A read then checks that the file it read is still the
sample's (same inode at the same path, unchanged times): a release that recycled the file
mid-read makes the read a FeatureMissing, never torn data.

GC policy (docs/store.md):
- a put whose writer died (pid gone or reused) is reclaimed by any `gc()`;
- `gc(live)`: complete samples whose id is not in `live` and older than `gc_grace_s` are
  reclaimed (`live` = every sample id that may still be consumed, known to the caller);
- the store lives while a process has it open: the last `close()` (or an `open` that finds
  every attached process dead) removes it, unless `keep_on_close`; every open also sweeps
  other stores whose attached processes are all dead (`sweep_abandoned`). Handles still open at
  interpreter exit are closed by an atexit hook; killed processes are noticed by the next
  open or gc.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import logging
import os
import shutil
import struct
import threading
import time
import uuid
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from specbus.core.config import StoreConfig
from specbus.core.contracts import FeatureSpec
from specbus.core.errors import (
    ConfigError,
    FeatureMissing,
    IntegrityError,
    StoreFull,
    StoreNoSpace,
)
from specbus.core.store import mapped, procs
from specbus.core.store.base import (
    DTYPES,
    RefLike,
    Screener,
    StoreBase,
    Stored,
    StoreUsage,
    check_crc,
    parse_key,
    prepare,
    sample_of,
    screen_all,
    specs_of,
    to_device,
)
from specbus.core.store.chunked import SharedScreen, copy_into, write_fd
from specbus.core.store.pool import BufferPool

log = logging.getLogger(__name__)

SHM_ROOT = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
# Errors that mean the filesystem has no room (blocks, inodes or quota) for what a put writes.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_STATS = struct.Struct("<qqqq")
# Samples with this many bytes of floating CPU tensors share their screen with the screen
# worker; smaller ones are summed by the put's thread alone (a handoff costs more).
SCREEN_HELP_MIN_BYTES = 1 << 20  # resident bytes, samples, peak bytes, cached bytes

_pool: BufferPool | None = None
_pool_lock = threading.Lock()
_open_handles: weakref.WeakSet[ShmStore] = weakref.WeakSet()


def _recv_pool(nbytes: int) -> BufferPool | None:
    global _pool
    if nbytes <= 0:
        return None
    with _pool_lock:
        if _pool is None:
            _pool = BufferPool(nbytes)
        return _pool


def store_dir(store_id: str) -> Path:
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


class _Locked:
    """Exclusive access to the store directory: a thread lock plus flock on `.lock`.

    The last closer deletes the directory, lock file included; a waiter that then gets the
    lock of the deleted file notices (inode changed) and retries on a fresh one.

    Re-entrant within a thread, and one per store directory per process (`_locked_for`):
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

    def __enter__(self) -> _Locked:
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

    def read(self) -> _Stats:
        data = os.pread(self.fd, _STATS.size, 0)
        return _Stats(*_STATS.unpack(data)) if len(data) == _STATS.size else _Stats()

    def write(self, st: _Stats) -> None:
        st.peak = max(st.peak, st.resident)
        os.pwrite(
            self.fd,
            _STATS.pack(max(st.resident, 0), max(st.count, 0), st.peak, max(st.cached, 0)),
            0,
        )


_lockers: weakref.WeakValueDictionary[str, _Locked] = weakref.WeakValueDictionary()
_lockers_lock = threading.Lock()


def _locked_for(root: Path) -> _Locked:
    """The one `_Locked` of a store directory in this process (shared by its handles)."""
    with _lockers_lock:
        locked = _lockers.get(str(root))
        if locked is None:
            locked = _lockers[str(root)] = _Locked(root)
        return locked


@dataclass
class _Stats:
    resident: int = 0
    count: int = 0
    peak: int = 0
    cached: int = 0


def _nbytes_of(d: Path) -> int:
    try:
        return int((d / ".nbytes").read_text())
    except (FileNotFoundError, ValueError):
        return sum(
            f.stat().st_size for f in d.iterdir() if f.is_file() and not f.name.startswith(".")
        )


def _write_text(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _read_exact(fd: int, out: torch.Tensor) -> int:
    mv = memoryview(out.numpy()).cast("B") if out.numel() else memoryview(bytearray())
    got = 0
    while got < len(mv):
        n = os.readv(fd, [mv[got:]])
        if n == 0:
            break
        got += n
    return got


class ShmStore(StoreBase):
    def __init__(self, cfg: StoreConfig, store_id: str, root: Path | None = None):
        self.cfg = cfg
        self.store_id = store_id
        self.root = root or store_dir(store_id)
        self.uri = f"shm://{store_id}" if root is None else f"shm://{self.root}?store_id={store_id}"
        self._lock = _locked_for(self.root)
        self._samples = str(self.root / "samples")
        self._free = str(self.root / "free")
        self._maps = mapped.shared(str(self.root), cfg.recycle_bytes)
        self._handle = f"{procs.token()}.{uuid.uuid4().hex[:8]}"
        self._screener = Screener()
        self._pid = os.getpid()
        self._reaped = 0  # bytes of an abandoned store removed at open (counted by purge)
        with self._lock:
            self._reap_if_abandoned()
            (self.root / "procs").mkdir(exist_ok=True)
            (self.root / "procs" / self._handle).touch()
            if cfg.keep_on_close:
                (self.root / ".keep").touch()  # sweep_abandoned leaves this store alone
            st = self._lock.read()
        _open_handles.add(self)
        if root is None:
            sweep_abandoned(exclude=self.root)
        self._check_space(st.resident + st.cached)

    # ---- space ---------------------------------------------------------------------------

    def _space(self) -> tuple[int, int]:
        """(free, total) bytes of the filesystem under the store directory."""
        v = os.statvfs(self.root)
        return v.f_bavail * v.f_frsize, v.f_blocks * v.f_frsize

    def _check_space(self, held: int) -> None:
        """At open: warn when the budget is more than the filesystem can hold (its free space
        plus what this store holds already). Puts still work until the filesystem is full;
        then they fail with StoreNoSpace (a StoreFull: producers back off), never SIGBUS."""
        free, total = self._space()
        room = free + held
        if self.cfg.budget_bytes <= room:
            return
        log.warning(
            "shm store %s: store.budget_bytes is %s but the filesystem there (%s in all) has "
            "room for %s; puts beyond that fail with StoreNoSpace. Set store.budget_bytes to "
            "at most %d, enlarge the filesystem (Docker: --shm-size=2g; or mount -o "
            "remount,size=2g %s) or put the store in a larger directory "
            "(store.uri=shm:///path/to/dir?store_id=%s)",
            self.root,
            _size(self.cfg.budget_bytes),
            _size(total),
            _size(room),
            room,
            _mount_point(self.root),
            self.store_id,
        )

    def _no_space(self, sample_id: str, nbytes: int, cause: OSError) -> StoreNoSpace:
        """The typed error for a put the filesystem had no room for (after its cleanup)."""
        try:
            free, total = self._space()
        except OSError:
            free = total = -1
        return StoreNoSpace(
            f"{self.uri}: no space for sample {sample_id!r} ({nbytes} B) in {self.root}: the "
            f"filesystem has {free} B free ({_size(total)} in all; the store's budget is "
            f"{_size(self.cfg.budget_bytes)}): {cause.strerror}. Lower store.budget_bytes "
            f"below what the filesystem holds, enlarge it (Docker: --shm-size) or use a "
            f"larger directory (shm:///path?store_id={self.store_id})",
            directory=str(self.root),
            needed=nbytes,
            free=free,
        )

    # ---- writing -------------------------------------------------------------------------

    def put(
        self, sample_id: str, tensors: Mapping[str, torch.Tensor], gen: int = 0
    ) -> dict[str, FeatureSpec]:
        """Every byte a put writes is reserved in the filesystem first (`posix_fallocate`,
        or files recycled whole), so a full filesystem is a StoreNoSpace with nothing of the
        put left behind, never a SIGBUS from a write through a mapping. Cached free files
        hold space too: when the filesystem is full they are dropped and the put tried once
        more."""
        self._check_open()
        try:
            return self._put(sample_id, tensors, gen)
        except StoreNoSpace:
            if not self._drop_cache():
                raise
        return self._put(sample_id, tensors, gen)

    def _drop_cache(self) -> int:
        """Delete every cached free file (and this process's mappings of them); bytes."""
        trash = []
        with self._lock:
            st = self._lock.read()
            dropped = st.cached
            trash = self._trim_cache(st, 0)
            self._lock.write(st)
        for d in trash:
            _rm(d)
        self._maps.sweep()  # a mapping would keep a deleted file's pages
        return dropped

    def _put(
        self, sample_id: str, tensors: Mapping[str, torch.Tensor], gen: int
    ) -> dict[str, FeatureSpec]:
        kept, specs = prepare(
            self.store_id,
            sample_id,
            gen,
            tensors,
            crc=self.cfg.crc,
            screen=False,
        )
        nbytes = sum(s.nbytes for s in specs.values())
        # The NaN/Inf screen: tensors on an accelerator there (cheap); CPU tensors chunk by
        # chunk as they are copied (chunked.py), shared with the screen worker when the
        # sample is large enough (it sums chunks from the back while this thread copies;
        # chunked.SharedScreen). A bad sample never leaves its tmp dir.
        screen = self.cfg.screen_nonfinite
        on_device = {n: t for n, t in tensors.items() if t.device.type != "cpu"}
        shared = None
        if screen:
            shared = SharedScreen(sample_id, {n: t for n, t in kept.items() if n not in on_device})
            if shared.nbytes >= SCREEN_HELP_MIN_BYTES:
                self._screener.help(shared)
        # string paths, not pathlib, on this path: pathlib cost ~100 us per put (a 4 MB put
        # takes ~1 ms)
        sdir = os.path.join(self._samples, sample_id)
        tmp = os.path.join(sdir, f".g{gen}.{procs.token()}.{os.urandom(4).hex()}.tmp")
        trash = []
        try:
            with self._lock:
                st = self._lock.read()
                if st.resident + nbytes > self.cfg.budget_bytes:
                    raise StoreFull(
                        f"{self.uri}: putting sample {sample_id!r} ({nbytes} B) would exceed "
                        f"the budget ({st.resident} of {self.cfg.budget_bytes} B in use)"
                    )
                try:
                    try:
                        os.mkdir(tmp)
                    except FileNotFoundError:  # the sample's first generation
                        os.makedirs(sdir, exist_ok=True)
                        os.mkdir(tmp)
                    _write_text(os.path.join(tmp, ".nbytes"), str(nbytes))  # reservation, for gc
                except OSError as e:
                    shutil.rmtree(tmp, ignore_errors=True)
                    with contextlib.suppress(OSError):
                        os.rmdir(sdir)  # fails while other generations or puts remain
                    if e.errno in _NO_SPACE:
                        raise self._no_space(sample_id, nbytes, e) from e
                    raise
                recycled = self._take_free(tmp, kept, st)
                st.resident += nbytes
                st.count += 1
                trash += self._trim_cache(st, self.cfg.budget_bytes - st.resident)
                self._lock.write(st)
        except BaseException:
            if shared is not None:
                shared.cancel()
            raise
        try:
            if screen:
                screen_all(sample_id, on_device)
            for name, t in kept.items():
                path = os.path.join(tmp, name)
                screen_here = screen and name not in on_device
                self._write(sample_id, name, t, path, recycled.get(name), screen_here, shared)
            if shared is not None:
                shared.finish()
        except BaseException as e:
            if shared is not None:
                shared.cancel()
            with self._lock:
                shutil.rmtree(tmp, ignore_errors=True)
                with contextlib.suppress(OSError):
                    os.rmdir(sdir)  # fails while other generations or puts remain
                st = self._lock.read()
                st.resident -= nbytes
                st.count -= 1
                self._lock.write(st)
            for d in trash:
                _rm(d)
            if isinstance(e, OSError) and e.errno in _NO_SPACE:
                self._maps.sweep()  # deleted files this process maps still hold their pages
                raise self._no_space(sample_id, nbytes, e) from e
            raise
        with self._lock:
            final = os.path.join(sdir, f"g{gen}")
            gone = [final] if os.path.exists(final) else []  # a re-put replaces the old value
            if gen > 0:  # older generations go
                gone += [
                    os.path.join(sdir, n)
                    for n in os.listdir(sdir)
                    if n.startswith("g") and _gen_of(n) < gen
                ]
            st = self._lock.read()
            for d in gone:
                trash.append(self._retire(Path(d), st))
            os.rename(tmp, final)
            self._lock.write(st)
        for d in trash:
            _rm(d)
        return specs

    def _write(
        self,
        sample_id: str,
        name: str,
        t: torch.Tensor,
        path: str,
        recycled: bool | None,
        screen: bool,
        shared: SharedScreen | None,
    ) -> None:
        """Write a tensor's file: into this process's mapping of it when it is large enough
        (a recycled file is usually mapped already: a plain memcpy, see mapped.py), else with
        write(). Either way the NaN/Inf screen sums each chunk just copied (chunked.py).

        `recycled`: None for a new file, True for a recycled one whose blocks all exist
        (it was written whole before), False for one grown by truncate (holes). Blocks are
        reserved before anything is written: a store in the mapping of a file whose hole
        the filesystem cannot fill is a SIGBUS that kills the process (measured: a 4 MiB
        tmpfs, a 8 MiB put, exit 135); the reservation turns it into ENOSPC here."""
        nbytes = t.numel() * t.element_size()
        if recycled is not None:
            fd = os.open(path, os.O_RDWR)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        if not recycled and nbytes:
            try:
                _reserve(fd, nbytes)
            except BaseException:
                os.close(fd)
                raise
        if self._maps.wants(nbytes):
            with self._maps.mapped(fd) as dst:  # takes fd
                copy_into(sample_id, name, t, dst, screen=screen, shared=shared)
            return
        try:
            write_fd(sample_id, name, t, fd, screen=screen, shared=shared)
        finally:
            os.close(fd)

    def _take_free(
        self, tmp: str, tensors: Mapping[str, torch.Tensor], st: _Stats
    ) -> dict[str, bool]:
        """Under the lock: move free files into `tmp` as the tensors' files. Returns, by
        tensor name, whether the file's blocks all exist already (False: grown, with holes)."""
        free_dir = self._free
        if not st.cached:
            return {}
        try:
            names = os.listdir(free_dir)
        except FileNotFoundError:
            return {}
        taken = {}
        for name, t in sorted(
            tensors.items(), key=lambda kv: -kv[1].numel() * kv[1].element_size()
        ):
            if not names:
                break
            need = t.numel() * t.element_size()
            exact = f"{need}."  # the usual case (samples of one shape): no parse, no sort
            fname = next((n for n in names if n.startswith(exact)), None)
            size = need
            if fname is None:
                free = sorted(_parse_free(names))  # (size, name), smallest first
                if not free:
                    break
                # the smallest that fits, else the largest (it grows)
                size, fname = next(((sz, n) for sz, n in free if sz >= need), free[-1])
            names.remove(fname)
            dest = os.path.join(tmp, name)
            os.rename(os.path.join(free_dir, fname), dest)
            if size != need:
                os.truncate(dest, need)
            st.cached -= size
            taken[name] = size >= need
        return taken

    def _retire(self, d: Path, st: _Stats) -> Path:
        """Under the lock: take a sample directory out of the store, recycling its tensor
        files into the free cache while it has room; return what is left, in the trash."""
        st.resident -= _nbytes_of(d)
        st.count -= 1
        cap = min(self.cfg.recycle_bytes, self.cfg.budget_bytes - max(st.resident, 0))
        free_dir = self.root / "free"
        for f in d.iterdir():
            size = f.stat().st_size
            if f.name.startswith(".") or size == 0 or size > cap:
                continue
            if st.cached + size > cap:
                # keep larger files: reusing one that must grow allocates pages again
                smaller = [e for e in sorted(_free_entries(str(free_dir))) if e[0] < size]
                while smaller and st.cached + size > cap:
                    n, gname = smaller.pop(0)
                    os.unlink(free_dir / gname)
                    st.cached -= n
                if st.cached + size > cap:
                    continue
            free_dir.mkdir(exist_ok=True)
            os.rename(f, free_dir / f"{size}.{uuid.uuid4().hex[:12]}")  # (a rename sets ctime)
            st.cached += size
        return self._to_trash(d)

    def _trim_cache(self, st: _Stats, room: int) -> list[Path]:
        """Under the lock: move free files to the trash until the cache fits in `room`."""
        out = []
        free_dir = self._free
        if st.cached <= room or not os.path.isdir(free_dir):
            return out
        for size, fname in sorted(_free_entries(free_dir), reverse=True):
            if st.cached <= room:
                break
            st.cached -= size
            out.append(self._to_trash(Path(free_dir, fname)))
        return out

    def _to_trash(self, d: Path) -> Path:
        (self.root / "trash").mkdir(exist_ok=True)
        dest = self.root / "trash" / uuid.uuid4().hex
        os.rename(d, dest)
        return dest

    # ---- reading -------------------------------------------------------------------------

    def get(
        self, ref: RefLike, names: Iterable[str] | None = None, device=None
    ) -> dict[str, torch.Tensor]:
        self._check_open()
        out = {}
        for name, spec in specs_of(ref, names).items():
            p = parse_key(spec.key, self.store_id)
            path = self.root / "samples" / p.sample_id / f"g{p.gen}" / p.name
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError as e:
                raise FeatureMissing(spec.key) from e
            try:
                before = os.fstat(fd)
                if before.st_size != spec.nbytes:
                    raise IntegrityError(
                        f"feature {spec.key!r}: {before.st_size} bytes stored, the spec says {spec.nbytes} (short read)"
                    )
                flat = self._recv(spec.nbytes)
                got = _read_exact(fd, flat)
                if not _unchanged(before, os.fstat(fd), path):
                    raise FeatureMissing(
                        spec.key, "released (and its file reused) while being read"
                    )
            finally:
                os.close(fd)
            if got != spec.nbytes:
                raise IntegrityError(
                    f"feature {spec.key!r}: short read, {got} of {spec.nbytes} bytes"
                )
            t = (
                flat.view(DTYPES[spec.dtype]).reshape(spec.shape)
                if spec.nbytes
                else torch.empty(spec.shape, dtype=DTYPES[spec.dtype])
            )
            check_crc(spec, t)
            out[name] = t
        return to_device(out, device)

    def _recv(self, nbytes: int) -> torch.Tensor:
        pool = _recv_pool(self.cfg.pool_bytes)
        if pool is not None and nbytes:
            off = pool.alloc(nbytes)
            if off is not None:
                return pool.tensor(off, nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    # ---- lifecycle -----------------------------------------------------------------------

    def release(self, ref: RefLike) -> None:
        sample_id, gen = sample_of(specs_of(ref), self.store_id)
        sdir = self.root / "samples" / sample_id
        with self._lock:
            d = sdir / f"g{gen}"
            if not d.exists():
                return
            st = self._lock.read()
            trash = self._retire(d, st)
            self._lock.write(st)
            with contextlib.suppress(OSError):
                sdir.rmdir()  # fails while other generations or a put in progress remain
        _rm(trash)

    def adopt(self, ref: RefLike) -> None:
        for spec in specs_of(ref).values():
            p = parse_key(spec.key, self.store_id)
            path = self.root / "samples" / p.sample_id / f"g{p.gen}" / p.name
            try:
                size = path.stat().st_size
            except FileNotFoundError as e:
                raise FeatureMissing(spec.key) from e
            if size != spec.nbytes:
                raise IntegrityError(
                    f"feature {spec.key!r}: {size} bytes stored, the spec says {spec.nbytes}"
                )

    def gc(self, live: Iterable[str] | None = None, *, min_age_s: float | None = None) -> int:
        """Reclaim puts of dead writers, trash, and (with `live`) unconsumable samples.

        Also recomputes the counters from the directory, repairing any drift left by a
        process killed between a file operation and its counter update. The free-file cache
        stays (bounded, reused by puts; it goes with the store).
        """
        live = set(live) if live is not None else None
        grace = self.cfg.gc_grace_s if min_age_s is None else min_age_s
        now = time.time()
        freed = 0
        trash = []
        with self._lock:
            resident = count = 0
            samples = self.root / "samples"
            for sdir in list(samples.iterdir()) if samples.exists() else []:
                for d in list(sdir.iterdir()):
                    nbytes = _nbytes_of(d)
                    if d.name.endswith(".tmp"):
                        orphan = not procs.alive(d.name.split(".")[2])
                    else:
                        age = now - _mtime(d / ".nbytes", d)
                        orphan = live is not None and sdir.name not in live and age >= grace
                    if orphan:
                        freed += nbytes
                        trash.append(self._to_trash(d))
                    else:
                        resident += nbytes
                        count += 1
                with contextlib.suppress(OSError):
                    sdir.rmdir()
            st = self._lock.read()
            old_resident = st.resident
            free_dir = self.root / "free"
            cached = sum(n for n, _ in _free_entries(str(free_dir))) if free_dir.exists() else 0
            self._lock.write(_Stats(resident, count, st.peak, cached))
            if (self.root / "trash").exists():
                trash += list((self.root / "trash").iterdir())
        for d in trash:
            _rm(d)
        self._maps.sweep()  # this process's mappings of files deleted, by now too
        return max(freed, old_resident - resident)

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)  # a put copies (shm) or keeps (mem) any tensor

    def usage(self) -> StoreUsage:
        """`capacity_bytes`: what the store could hold now, its own files (resident and
        cached) plus the filesystem's free space; below `budget_bytes` the filesystem, not
        the budget, is the limit (puts beyond it raise StoreNoSpace)."""
        with self._lock:
            st = self._lock.read()
        try:
            free, _ = self._space()
        except OSError:  # the directory went (a purge, the last close elsewhere)
            free = 0
        return StoreUsage(
            st.resident,
            st.count,
            st.peak,
            self.cfg.budget_bytes,
            capacity_bytes=st.resident + st.cached + free,
            cached_bytes=st.cached,
        )

    # ---- sweep / purge primitives (StoreBase) ----------------------------------------------

    def _stored(self) -> list[Stored]:
        out = []
        try:
            sids = os.listdir(self._samples)
        except FileNotFoundError:
            return out
        for sid in sids:
            try:
                names = os.listdir(os.path.join(self._samples, sid))
            except FileNotFoundError:  # released meanwhile
                continue
            out += [Stored(sid, _gen_of(n)) for n in names if n.startswith("g") and _gen_of(n) >= 0]
        return out

    def _drop(self, stored: list[Stored], force: bool) -> int:
        """Removes are never refused here (a reader mid-read of a removed file gets
        FeatureMissing, see get). A sweep recycles the files as a release does; a purge
        (`force`) deletes them, the cache goes too (`_purge_rest`)."""
        freed = 0
        trash = []
        with self._lock:
            st = self._lock.read()
            for s in stored:
                sdir = Path(self._samples, s.sample_id)
                d = sdir / f"g{s.gen}"
                if not d.is_dir():
                    continue  # released or superseded since it was listed
                nbytes = _nbytes_of(d)
                freed += nbytes
                if force:
                    st.resident -= nbytes
                    st.count -= 1
                    trash.append(self._to_trash(d))
                else:
                    trash.append(self._retire(d, st))
                with contextlib.suppress(OSError):
                    sdir.rmdir()
            self._lock.write(st)
        for d in trash:
            _rm(d)
        return freed

    def _reclaim_orphans(self) -> int:
        """Puts of dead writers (a producer killed mid-put) and trash, as gc() does."""
        return self.gc()

    def _purge_rest(self) -> int:
        """Puts in progress (any writer's), the free-file cache and the trash go; the
        counters are recounted from what is left (nothing, unless a put landed meanwhile)."""
        freed, self._reaped = self._reaped, 0
        trash = []
        with self._lock:
            samples = Path(self._samples)
            for sdir in list(samples.iterdir()) if samples.exists() else []:
                for d in list(sdir.iterdir()):
                    if d.name.endswith(".tmp"):
                        freed += _nbytes_of(d)
                        trash.append(self._to_trash(d))
                with contextlib.suppress(OSError):
                    sdir.rmdir()
            st = self._lock.read()
            freed += st.cached
            trash += self._trim_cache(st, 0)
            self._lock.write(st)
            if (self.root / "trash").exists():
                trash += [d for d in (self.root / "trash").iterdir() if d not in trash]
        for d in trash:
            _rm(d)
        self.gc()  # recount (and drop this process's mappings of deleted files)
        return freed

    def _shutdown(self) -> None:
        _open_handles.discard(self)
        self._screener.close()
        mapped.unshare(str(self.root), self._maps)
        if os.getpid() != self._pid:
            return  # a forked child's copy of the handle: the parent still holds the store
        with self._lock:
            (self.root / "procs" / self._handle).unlink(missing_ok=True)
            if not self.cfg.keep_on_close and not self._live_handles():
                shutil.rmtree(self.root, ignore_errors=True)  # the last one out removes the store

    def _live_handles(self) -> list[str]:
        """Prune handles of dead processes; return the live ones."""
        pdir = self.root / "procs"
        live = []
        for f in list(pdir.iterdir()) if pdir.exists() else []:
            if procs.alive(f.name.split(".")[0]):
                live.append(f.name)
            else:
                f.unlink(missing_ok=True)
        return live

    def _reap_if_abandoned(self) -> None:
        """At open: a store every attached process left without closing (killed) is removed."""
        if self.cfg.keep_on_close or self._live_handles():
            return
        st = self._lock.read()
        self._reaped = max(st.resident, 0) + max(st.cached, 0)
        for sub in ("samples", "free", "trash"):
            shutil.rmtree(self.root / sub, ignore_errors=True)
        self._lock.write(_Stats())


def _rm(path: str | Path) -> None:
    """Delete a trash entry: a sample directory, or a single file (a trimmed cache file,
    which rmtree would refuse and leave holding its space)."""
    try:
        os.unlink(path)
    except IsADirectoryError:
        shutil.rmtree(path, ignore_errors=True)
    except OSError:
        pass  # gone already


def _reserve(fd: int, nbytes: int) -> None:
    """Allocate a file's blocks (and set its size): ENOSPC now rather than SIGBUS later."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None:  # not Linux: no reservation; tmpfs-like filesystems are Linux's
        os.ftruncate(fd, nbytes)
        return
    fallocate(fd, 0, nbytes)


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes} B"


def _mount_point(path: Path) -> Path:
    path = path.resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def _free_entries(free_dir: str) -> list[tuple[int, str]]:
    """(size, name) of the cached free files (the size is in the name: no stat)."""
    return _parse_free(os.listdir(free_dir))


def _parse_free(names: Iterable[str]) -> list[tuple[int, str]]:
    out = []
    for name in names:
        size, _, _ = name.partition(".")
        if size.isdigit():
            out.append((int(size), name))
    return out


def _unchanged(before: os.stat_result, after: os.stat_result, path: Path) -> bool:
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


def _gen_of(name: str) -> int:
    try:
        return int(name[1:])
    except ValueError:
        return -1


def _mtime(path: Path, fallback: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return fallback.stat().st_mtime


@atexit.register
def _close_open_handles() -> None:
    for store in list(_open_handles):
        with contextlib.suppress(Exception):  # best effort at interpreter exit
            store.close()


def open_shm(cfg: StoreConfig, store_id: str, path: str | None, query: dict[str, str]) -> ShmStore:
    """`shm://<store_id>` or `shm:///abs/dir?store_id=x` (`core.registry.STORES`); a query may
    set StoreConfig fields. Raises `ConfigError` for a relative directory."""
    from specbus.core.store import query_options

    if path is not None and not Path(path).is_absolute():
        raise ConfigError(f"store.uri {cfg.uri!r}: a shm directory must be absolute")
    return ShmStore(query_options(cfg, query), store_id, Path(path) if path else None)
