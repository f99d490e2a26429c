"""`shm://<store_id>` (or `shm:///abs/dir`): several processes on one host, no server.

A put reserves its bytes against the budget under the store's lock (usage is global; a put
beyond the budget fails before writing), writes a tmp directory named after its writer and
renames it into place: readers never see a half-written sample. Reads copy once into a
pre-faulted pool and check the file was not recycled meanwhile (then `FeatureMissing`, never
torn data). The store lives while a process has it open. The directory and its lock:
shm_dir.py; file writes and the free-file cache: shm_files.py; gc and sweeps: shm_sweep.py.
docs/store.md ("shm://") has the layout, the measurements and the GC policy.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import shutil
import threading
import uuid
import weakref
from collections.abc import Iterable, Mapping
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
    RefLike,
    Screener,
    StoreBase,
    StoreUsage,
    as_feature,
    parse_key,
    prepare,
    sample_of,
    screen_all,
    specs_of,
    to_device,
)
from specbus.core.store.chunked import SharedScreen
from specbus.core.store.pool import BufferPool
from specbus.core.store.shm_dir import (  # noqa: F401  (SHM_ROOT, store_dir, sweep_abandoned: this module's API)
    SHM_ROOT,
    gen_of,
    locked_for,
    read_exact,
    rm,
    store_dir,
    sweep_abandoned,
    unchanged,
    write_text,
)
from specbus.core.store.shm_files import FreeFiles, check_space, no_space, space, write_file
from specbus.core.store.shm_sweep import ShmSweep

# Errors that mean the filesystem has no room (blocks, inodes or quota) for what a put writes.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
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


class ShmStore(ShmSweep, StoreBase):
    """A `FeatureStore` in a shared directory (see the module doc); `root` None:
    `SHM_ROOT/specbus-<store_id>`."""

    def __init__(self, cfg: StoreConfig, store_id: str, root: Path | None = None):
        self.cfg = cfg
        self.store_id = store_id
        self.root = root or store_dir(store_id)
        self.uri = f"shm://{store_id}" if root is None else f"shm://{self.root}?store_id={store_id}"
        self._lock = locked_for(self.root)
        self._samples = str(self.root / "samples")
        self._files = FreeFiles(self.root, cfg)
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
        check_space(self.root, self.cfg, self.store_id, st.resident + st.cached)

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
            trash = self._files.trim(st, 0)
            self._lock.write(st)
        for d in trash:
            rm(d)
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
                # Counted before its directory exists: a writer killed from here on has its
                # reservation counted until a gc recounts (as one killed mid-write does).
                st.resident += nbytes
                st.count += 1
                self._lock.write(st)
                try:
                    try:
                        os.mkdir(tmp)
                    except FileNotFoundError:  # the sample's first generation
                        os.makedirs(sdir, exist_ok=True)
                        os.mkdir(tmp)
                    write_text(os.path.join(tmp, ".nbytes"), str(nbytes))  # reservation, for gc
                except OSError as e:
                    shutil.rmtree(tmp, ignore_errors=True)
                    with contextlib.suppress(OSError):
                        os.rmdir(sdir)  # fails while other generations or puts remain
                    st.resident -= nbytes
                    st.count -= 1
                    self._lock.write(st)
                    if e.errno in _NO_SPACE:
                        raise no_space(
                            self.uri, self.root, self.cfg, self.store_id, sample_id, nbytes, e
                        ) from e
                    raise
                recycled = self._files.take(tmp, kept, st)
                trash += self._files.trim(st, self.cfg.budget_bytes - st.resident)
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
                write_file(
                    self._maps, sample_id, name, t, path, recycled.get(name), screen_here, shared
                )
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
                rm(d)
            if isinstance(e, OSError) and e.errno in _NO_SPACE:
                self._maps.sweep()  # deleted files this process maps still hold their pages
                raise no_space(
                    self.uri, self.root, self.cfg, self.store_id, sample_id, nbytes, e
                ) from e
            raise
        with self._lock:
            final = os.path.join(sdir, f"g{gen}")
            gone = [final] if os.path.exists(final) else []  # a re-put replaces the old value
            if gen > 0:  # older generations go
                gone += [
                    os.path.join(sdir, n)
                    for n in os.listdir(sdir)
                    if n.startswith("g") and gen_of(n) < gen
                ]
            st = self._lock.read()
            for d in gone:
                trash.append(self._files.retire(Path(d), st))
            os.rename(tmp, final)
            self._lock.write(st)
        for d in trash:
            rm(d)
        return specs

    # ---- reading -------------------------------------------------------------------------

    def get(
        self, ref: RefLike, names: Iterable[str] | None = None, device=None
    ) -> dict[str, torch.Tensor]:
        """The sample's tensors, read once into fresh (pooled) memory; `FeatureMissing` when released
        or recycled mid-read, `IntegrityError` for a short read or a CRC mismatch."""
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
                got = read_exact(fd, flat)
                if not unchanged(before, os.fstat(fd), path):
                    raise FeatureMissing(
                        spec.key, "released (and its file reused) while being read"
                    )
            finally:
                os.close(fd)
            if got != spec.nbytes:
                raise IntegrityError(
                    f"feature {spec.key!r}: short read, {got} of {spec.nbytes} bytes"
                )
            out[name] = as_feature(spec, flat)
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
        """Take one generation of a sample out of the store, recycling its files into the free cache
        (see `FeatureStore.release`)."""
        sample_id, gen = sample_of(specs_of(ref), self.store_id)
        sdir = self.root / "samples" / sample_id
        with self._lock:
            d = sdir / f"g{gen}"
            if not d.exists():
                return
            st = self._lock.read()
            trash = self._files.retire(d, st)
            self._lock.write(st)
            with contextlib.suppress(OSError):
                sdir.rmdir()  # fails while other generations or a put in progress remain
        rm(trash)

    def adopt(self, ref: RefLike) -> None:
        """Verify a sample another writer put: every file exists with the spec's size."""
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

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An empty tensor (a put copies any tensor once)."""
        return torch.empty(shape, dtype=dtype)  # a put copies (shm) or keeps (mem) any tensor

    def usage(self) -> StoreUsage:
        """`capacity_bytes`: what the store could hold now, its own files (resident and
        cached) plus the filesystem's free space; below `budget_bytes` the filesystem, not
        the budget, is the limit (puts beyond it raise StoreNoSpace)."""
        with self._lock:
            st = self._lock.read()
        try:
            free, _ = space(self.root)
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
