"""The files of a `shm://` store: writing a tensor's file, the cache of free files, space.

Writes copy once, into this process's mapping of the file when it is large (mapped.py), with
write() otherwise, screening each chunk as it is copied (chunked.py). Released files are kept
for reuse (`recycle_bytes`): writing into already-allocated tmpfs pages is ~1.75x faster than
into fresh ones. Every byte is reserved before it is written, so a full filesystem is
`StoreNoSpace`, never a SIGBUS. docs/store.md has the measurements.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch
from specbus.core.config import StoreConfig
from specbus.core.errors import StoreNoSpace
from specbus.core.store.chunked import SharedScreen, copy_into, write_fd
from specbus.core.store.mapped import MappedFiles
from specbus.core.store.shm_dir import (
    Stats,
    free_entries,
    mount_point,
    nbytes_of,
    parse_free,
    reserve,
    size_text,
)

log = logging.getLogger("specbus.core.store.shm")


def write_file(
    maps: MappedFiles,
    sample_id: str,
    name: str,
    t: torch.Tensor,
    path: str,
    recycled: bool | None,
    screen: bool,
    shared: SharedScreen | None,
) -> None:
    """Write a tensor's file at `path`: into this process's mapping of it when it is large enough
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
            reserve(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
    if maps.wants(nbytes):
        with maps.mapped(fd) as dst:  # takes fd
            copy_into(sample_id, name, t, dst, screen=screen, shared=shared)
        return
    try:
        write_fd(sample_id, name, t, fd, screen=screen, shared=shared)
    finally:
        os.close(fd)


class FreeFiles:
    """The cache of released tensor files of the store at `root` (`free/<nbytes>.<rand>`),
    bounded by `cfg.recycle_bytes` and, with the resident bytes, by `cfg.budget_bytes`.
    Every method that takes `st` runs under the store's lock and updates its counters."""

    def __init__(self, root: Path, cfg: StoreConfig):
        self.root, self.cfg = root, cfg
        self.free_dir = str(root / "free")

    def take(self, tmp: str, tensors: Mapping[str, torch.Tensor], st: Stats) -> dict[str, bool]:
        """Under the lock: move free files into `tmp` as the tensors' files. Returns, by
        tensor name, whether the file's blocks all exist already (False: grown, with holes)."""
        free_dir = self.free_dir
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
                free = sorted(parse_free(names))  # (size, name), smallest first
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

    def retire(self, d: Path, st: Stats) -> Path:
        """Under the lock: take a sample directory out of the store, recycling its tensor
        files into the free cache while it has room; return what is left, in the trash."""
        st.resident -= nbytes_of(d)
        st.count -= 1
        cap = min(self.cfg.recycle_bytes, self.cfg.budget_bytes - max(st.resident, 0))
        free_dir = self.root / "free"
        for f in d.iterdir():
            size = f.stat().st_size
            if f.name.startswith(".") or size == 0 or size > cap:
                continue
            if st.cached + size > cap:
                # keep larger files: reusing one that must grow allocates pages again
                smaller = [e for e in sorted(free_entries(str(free_dir))) if e[0] < size]
                while smaller and st.cached + size > cap:
                    n, gname = smaller.pop(0)
                    os.unlink(free_dir / gname)
                    st.cached -= n
                if st.cached + size > cap:
                    continue
            free_dir.mkdir(exist_ok=True)
            os.rename(f, free_dir / f"{size}.{uuid.uuid4().hex[:12]}")  # (a rename sets ctime)
            st.cached += size
        return self.to_trash(d)

    def trim(self, st: Stats, room: int) -> list[Path]:
        """Under the lock: move free files to the trash until the cache fits in `room`."""
        out = []
        free_dir = self.free_dir
        if st.cached <= room or not os.path.isdir(free_dir):
            return out
        for size, fname in sorted(free_entries(free_dir), reverse=True):
            if st.cached <= room:
                break
            st.cached -= size
            out.append(self.to_trash(Path(free_dir, fname)))
        return out

    def to_trash(self, d: Path) -> Path:
        """Move `d` into the store's trash (deleted outside the lock); its new path."""
        (self.root / "trash").mkdir(exist_ok=True)
        dest = self.root / "trash" / uuid.uuid4().hex
        os.rename(d, dest)
        return dest


def space(root: Path) -> tuple[int, int]:
    """(free, total) bytes of the filesystem under `root`."""
    v = os.statvfs(root)
    return v.f_bavail * v.f_frsize, v.f_blocks * v.f_frsize


def check_space(root: Path, cfg: StoreConfig, store_id: str, held: int) -> None:
    """At open: warn when the budget is more than the filesystem can hold (its free space
    plus what this store holds already). Puts still work until the filesystem is full;
    then they fail with StoreNoSpace (a StoreFull: producers back off), never SIGBUS."""
    free, total = space(root)
    room = free + held
    if cfg.budget_bytes <= room:
        return
    log.warning(
        "shm store %s: store.budget_bytes is %s but the filesystem there (%s in all) has "
        "room for %s; puts beyond that fail with StoreNoSpace. Set store.budget_bytes to "
        "at most %d, enlarge the filesystem (Docker: --shm-size=2g; or mount -o "
        "remount,size=2g %s) or put the store in a larger directory "
        "(store.uri=shm:///path/to/dir?store_id=%s)",
        root,
        size_text(cfg.budget_bytes),
        size_text(total),
        size_text(room),
        room,
        mount_point(root),
        store_id,
    )


def no_space(
    uri: str,
    root: Path,
    cfg: StoreConfig,
    store_id: str,
    sample_id: str,
    nbytes: int,
    cause: OSError,
) -> StoreNoSpace:
    """The typed error for a put the filesystem had no room for (after its cleanup)."""
    try:
        free, total = space(root)
    except OSError:
        free = total = -1
    return StoreNoSpace(
        f"{uri}: no space for sample {sample_id!r} ({nbytes} B) in {root}: the "
        f"filesystem has {free} B free ({size_text(total)} in all; the store's budget is "
        f"{size_text(cfg.budget_bytes)}): {cause.strerror}. Lower store.budget_bytes "
        f"below what the filesystem holds, enlarge it (Docker: --shm-size) or use a "
        f"larger directory (shm:///path?store_id={store_id})",
        directory=str(root),
        needed=nbytes,
        free=free,
    )
