"""`file:///abs/dir[?store_id=x]`: persistent features, one safetensors file per sample.

The store for recordings (W1) and for anything that must outlive its processes:
`samples/<sid>/g<gen>.safetensors` (standard safetensors, `core/store/stfile.py`) under a
flock'd directory whose counters bound the budget across processes. Puts are atomic (a tmp
file renamed into place; a writer killed mid-write leaves a tmp file that `gc`/`sweep`
remove), reads map the file zero-copy, headers and sizes (and CRCs, with `crc: true`) are
checked. Nothing is removed at close. Layout and guarantees in full: docs/store.md, "file://".
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import time
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
from specbus.core.store import procs, stfile
from specbus.core.store.base import (
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
from specbus.core.store.chunked import SharedScreen, write_fd
from specbus.core.store.shm_dir import Stats, locked_for

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
SCREEN_HELP_MIN_BYTES = 1 << 20  # as shm: smaller samples are screened by the put's thread


class FileStore(StoreBase):
    """Samples as safetensors files under `root` (see module doc); persists after close."""

    def __init__(self, cfg: StoreConfig, store_id: str, root: Path):
        self.cfg = cfg
        self.store_id = store_id
        self.root = Path(root)
        self.uri = f"file://{self.root}" + (
            f"?store_id={store_id}" if store_id != "default" else ""
        )
        self.root.mkdir(parents=True, exist_ok=True)
        self._samples = str(self.root / "samples")
        self._lock = locked_for(self.root)
        self._screener = Screener()

    # ---- paths ----------------------------------------------------------------------------

    def _path(self, sample_id: str, gen: int) -> str:
        return os.path.join(self._samples, sample_id, f"g{gen}{SUFFIX}")

    # ---- writing --------------------------------------------------------------------------

    def put(
        self, sample_id: str, tensors: Mapping[str, torch.Tensor], gen: int = 0
    ) -> dict[str, FeatureSpec]:
        """Write the sample's tensors as one safetensors file, atomically (see
        `FeatureStore.put`); `StoreFull` / `StoreNoSpace` beyond the budget or the disk."""
        self._check_open()
        kept, specs = prepare(
            self.store_id, sample_id, gen, tensors, crc=self.cfg.crc, screen=False
        )
        nbytes = sum(s.nbytes for s in specs.values())
        meta = {"format": "pt", "specbus": stfile.FORMAT, "sample_id": sample_id, "gen": str(gen)}
        for name, spec in specs.items():
            if spec.crc32 is not None:
                meta[f"crc32:{name}"] = str(spec.crc32)
        head, names = stfile.header_bytes(kept, meta)
        screen = self.cfg.screen_nonfinite
        on_device = {n for n, t in tensors.items() if t.device.type != "cpu"}
        shared = None
        if screen:
            shared = SharedScreen(sample_id, {n: kept[n] for n in names if n not in on_device})
            if shared.nbytes >= SCREEN_HELP_MIN_BYTES:
                self._screener.help(shared)
        sdir = os.path.join(self._samples, sample_id)
        tmp = os.path.join(
            sdir, f".g{gen}.{nbytes}.{procs.token()}.{os.urandom(4).hex()}.tmp"
        )  # the reservation is in the name: gc un-reserves a dead writer's put exactly
        try:
            with self._lock:
                st = self._lock.read()
                if st.resident + nbytes > self.cfg.budget_bytes:
                    raise StoreFull(
                        f"{self.uri}: putting sample {sample_id!r} ({nbytes} B) would exceed "
                        f"the budget ({st.resident} of {self.cfg.budget_bytes} B in use)"
                    )
                try:
                    os.makedirs(sdir, exist_ok=True)
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except OSError as e:
                    with contextlib.suppress(OSError):
                        os.rmdir(sdir)
                    if e.errno in _NO_SPACE:
                        raise self._no_space(sample_id, nbytes, e) from e
                    raise
                st.resident += nbytes
                st.count += 1
                self._lock.write(st)
        except BaseException:
            if shared is not None:
                shared.cancel()
            raise
        try:
            try:
                if screen:
                    screen_all(sample_id, {n: tensors[n] for n in on_device})
                _write_all(fd, head)
                for name in names:
                    here = screen and name not in on_device
                    write_fd(sample_id, name, kept[name], fd, screen=here, shared=shared)
                if shared is not None:
                    shared.finish()
            finally:
                os.close(fd)
        except BaseException as e:
            if shared is not None:
                shared.cancel()
            with self._lock:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                with contextlib.suppress(OSError):
                    os.rmdir(sdir)  # fails while other generations or puts remain
                st = self._lock.read()
                st.resident -= nbytes
                st.count -= 1
                self._lock.write(st)
            if isinstance(e, OSError) and e.errno in _NO_SPACE:
                raise self._no_space(sample_id, nbytes, e) from e
            raise
        with self._lock:
            st = self._lock.read()
            for g, path in self._generations(sample_id):
                if g > gen:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st.resident -= _data_bytes(path)
                    st.count -= 1
                    if g < gen:  # older generations go; the same key is replaced by the rename
                        os.unlink(path)
            os.rename(tmp, self._path(sample_id, gen))
            self._lock.write(st)
        return specs

    def _generations(self, sample_id: str) -> list[tuple[int, str]]:
        """(gen, path) of the complete files of a sample."""
        sdir = os.path.join(self._samples, sample_id)
        try:
            names = os.listdir(sdir)
        except FileNotFoundError:
            return []
        return [(g, os.path.join(sdir, n)) for n in names if (g := _gen_of(n)) >= 0]

    def _no_space(self, sample_id: str, nbytes: int, cause: OSError) -> StoreNoSpace:
        free = _free_bytes(self.root)
        return StoreNoSpace(
            f"{self.uri}: no space for sample {sample_id!r} ({nbytes} B) in {self.root}: "
            f"{free} B free: {cause.strerror}",
            directory=str(self.root),
            needed=nbytes,
            free=free,
        )

    def sync(self) -> None:
        """Flush every file of the store to stable storage (syncfs of its filesystem)."""
        fd = os.open(self.root, os.O_RDONLY)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if getattr(libc, "syncfs", None) is None or libc.syncfs(fd) != 0:
                os.sync()
        except OSError:
            os.sync()
        finally:
            os.close(fd)

    # ---- reading --------------------------------------------------------------------------

    def get(
        self, ref: RefLike, names: Iterable[str] | None = None, device=None
    ) -> dict[str, torch.Tensor]:
        """The tensors, mapped zero-copy from the sample's file (see `FeatureStore.get`);
        `FeatureMissing` / `IntegrityError`."""
        self._check_open()
        specs = specs_of(ref, names)
        if not specs:
            return {}
        sample_id, gen = sample_of(specs, self.store_id)
        buffer, entries, start = self._open(sample_id, gen, next(iter(specs.values())).key)
        out = {}
        for name, spec in specs.items():
            p = parse_key(spec.key, self.store_id)
            entry = entries.get(p.name)
            if entry is None:
                raise FeatureMissing(spec.key, "not in the sample's file")
            _check_entry(spec, entry)
            t = stfile.view(buffer, entry, start)
            check_crc(spec, t)
            out[name] = t
        return to_device(out, device)

    def _open(self, sample_id: str, gen: int, key: str):
        """(a private mapping of the sample's file, its entries, data start)."""
        path = self._path(sample_id, gen)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as e:
            raise FeatureMissing(key) from e
        try:
            size = os.fstat(fd).st_size
            entries, _, start = stfile.read_header(fd, size, where=path)
            buffer = mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size > start else b""
        finally:
            os.close(fd)
        return buffer, entries, start

    # ---- lifecycle ------------------------------------------------------------------------

    def release(self, ref: RefLike) -> None:
        """Remove one generation of a sample (see `FeatureStore.release`)."""
        sample_id, gen = sample_of(specs_of(ref), self.store_id)
        self._drop([Stored(sample_id, gen)], force=False)

    def adopt(self, ref: RefLike) -> None:
        """Verify a sample put by another handle: its file is there with the spec's sizes (see
        `FeatureStore.adopt`)."""
        specs = specs_of(ref)
        sample_id, gen = sample_of(specs, self.store_id)
        path = self._path(sample_id, gen)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as e:
            raise FeatureMissing(next(iter(specs.values())).key) from e
        try:
            entries, _, _ = stfile.read_header(fd, os.fstat(fd).st_size, where=path)
        finally:
            os.close(fd)
        for spec in specs.values():
            entry = entries.get(parse_key(spec.key).name)
            if entry is None:
                raise FeatureMissing(spec.key, "not in the sample's file")
            _check_entry(spec, entry)

    def gc(self, live: Iterable[str] | None = None, *, min_age_s: float | None = None) -> int:
        """Reclaim puts of dead writers and (with `live`) complete samples not in `live` older
        than the grace; recount the counters from the directory (repairs any drift)."""
        live = set(live) if live is not None else None
        grace = self.cfg.gc_grace_s if min_age_s is None else min_age_s
        now = time.time()
        freed = 0
        with self._lock:
            resident = count = 0
            for sid in _listdir(self._samples):
                sdir = os.path.join(self._samples, sid)
                for name in _listdir(sdir):
                    path = os.path.join(sdir, name)
                    if name.endswith(".tmp"):
                        nbytes, writer = _tmp_of(name)
                        orphan = not procs.alive(writer)
                    elif _gen_of(name) >= 0:
                        nbytes = _data_bytes(path)
                        orphan = (
                            live is not None and sid not in live and now - _mtime(path) >= grace
                        )
                    else:
                        continue
                    if orphan:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(path)
                        freed += nbytes
                    else:
                        resident += nbytes
                        count += 1
                with contextlib.suppress(OSError):
                    os.rmdir(sdir)
            st = self._lock.read()
            self._lock.write(Stats(resident, count, st.peak, 0))
        return freed

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An empty tensor (reads map the files; nothing to preallocate)."""
        return torch.empty(shape, dtype=dtype)

    def usage(self) -> StoreUsage:
        """Residency of the directory (bytes, samples, peak) and what its filesystem can hold."""
        with self._lock:
            st = self._lock.read()
        return StoreUsage(
            max(st.resident, 0),
            max(st.count, 0),
            st.peak,
            self.cfg.budget_bytes,
            capacity_bytes=_free_bytes(self.root) + max(st.resident, 0),
        )

    # ---- sweep / purge primitives (StoreBase) -------------------------------------------

    def _stored(self) -> list[Stored]:
        out = []
        for sid in _listdir(self._samples):
            out += [
                Stored(sid, g)
                for n in _listdir(os.path.join(self._samples, sid))
                if (g := _gen_of(n)) >= 0
            ]
        return out

    def _drop(self, stored: list[Stored], force: bool) -> int:
        freed = 0
        with self._lock:
            st = self._lock.read()
            for s in stored:
                path = self._path(s.sample_id, s.gen)
                try:
                    nbytes = _data_bytes(path)
                    os.unlink(path)
                except FileNotFoundError:
                    continue  # released or superseded since it was listed
                freed += nbytes
                st.resident -= nbytes
                st.count -= 1
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.dirname(path))
            self._lock.write(st)
        return freed

    def _reclaim_orphans(self) -> int:
        """Puts of dead writers (a producer killed mid-put), as gc() does."""
        return self.gc()

    def _purge_rest(self) -> int:
        """Puts in progress, any writer's; then recount."""
        freed = 0
        with self._lock:
            for sid in _listdir(self._samples):
                sdir = os.path.join(self._samples, sid)
                for name in _listdir(sdir):
                    if name.endswith(".tmp"):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(os.path.join(sdir, name))
                        freed += _tmp_of(name)[0]
                with contextlib.suppress(OSError):
                    os.rmdir(sdir)
        self.gc()
        return freed

    def _shutdown(self) -> None:
        self._screener.close()


def _check_entry(spec: FeatureSpec, entry: stfile.Entry) -> None:
    if entry.dtype != spec.dtype or entry.shape != tuple(spec.shape):
        raise IntegrityError(
            f"feature {spec.key!r}: stored {entry.dtype}{list(entry.shape)}, the spec says "
            f"{spec.dtype}{list(spec.shape)}"
        )
    if entry.nbytes != spec.nbytes:
        raise IntegrityError(
            f"feature {spec.key!r}: {entry.nbytes} bytes stored, the spec says {spec.nbytes}"
        )


def _write_all(fd: int, data: bytes) -> None:
    mv = memoryview(data)
    while mv:
        mv = mv[os.write(fd, mv) :]


def _data_bytes(path: str) -> int:
    """The tensor bytes of a complete file (FileNotFoundError if it is gone)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        prefix = os.pread(fd, 8, 0)
    finally:
        os.close(fd)
    return stfile.data_bytes(size, prefix) if len(prefix) == 8 else 0


def _gen_of(name: str) -> int:
    """The generation of `g<gen>.safetensors`; -1 for anything else."""
    if not (name.startswith("g") and name.endswith(SUFFIX)):
        return -1
    try:
        return int(name[1 : -len(SUFFIX)])
    except ValueError:
        return -1


def _tmp_of(name: str) -> tuple[int, str]:
    """(reserved bytes, writer token) of `.g<gen>.<nbytes>.<pid>-<start>.<rand>.tmp`."""
    parts = name.split(".")
    try:
        return int(parts[2]), parts[3]
    except (IndexError, ValueError):
        return 0, ""


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except FileNotFoundError:
        return time.time()


def _free_bytes(root: Path) -> int:
    try:
        v = os.statvfs(root)
    except OSError:
        return 0
    return v.f_bavail * v.f_frsize


def open_file(
    cfg: StoreConfig, store_id: str, path: str | None, query: dict[str, str]
) -> FileStore:
    """`file:///abs/dir[?store_id=x]` (`core.registry.STORES`); a query may set StoreConfig
    fields. Raises `ConfigError` without an absolute directory."""
    from specbus.core.store import query_options

    if path is None or not Path(path).is_absolute():
        raise ConfigError(
            f"store.uri {cfg.uri!r}: file:// needs an absolute directory (file:///abs/dir)"
        )
    return FileStore(query_options(cfg, query), store_id, Path(path))
