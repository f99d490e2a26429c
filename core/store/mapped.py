"""A shm writer's mappings of store files, kept from one put to the next.

Writing 4-64 MB into a tmpfs file with write() runs at ~0.7x a memcpy here (the kernel looks
up every 4 KiB page); mapping the file afresh for each put (MAP_POPULATE) at ~0.6-0.8x; a copy
into pages this process already has mapped runs at memcpy speed. Released files are recycled
(renamed through `free/`, same inode), so a writer meets the same files again and again: this
cache keeps their mappings, keyed by inode, and a put becomes a memcpy.

Bounds (a mapping pins its file's pages even after every process unlinked the file):
- only files of at least `MIN_BYTES` are mapped (smaller ones are written with write()),
  at most `MAX_ENTRIES` of them and `max_bytes` in all; the least recently used go first
  (each mapping holds two file descriptors: ours, to see its link count, and mmap's own);
- each use checks the least recently used entry and drops it if its file was deleted, so a
  deleted file is released within a few puts; `sweep()` (at gc) drops the mappings of every
  deleted file, `clear()` (when the process's last handle on the store closes) all of them.
So at most `max_bytes` (the store's `recycle_bytes`) of deleted files stay pinned, briefly.
A mapping a put is copying into is never unmapped under it (`torch.frombuffer` would not
stop that): a dropped one is unmapped when that put is done.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch

MIN_BYTES = 1 << 20
MAX_ENTRIES = 128


@dataclass
class _Entry:
    fd: int
    size: int
    mm: mmap.mmap
    view: torch.Tensor | None  # flat uint8 over `mm`
    users: int = 0  # puts copying into it now: it is never unmapped under them
    dropped: bool = False  # out of the cache; unmapped when the last user is done


class MappedFiles:
    """This process's mappings of the store's files, kept across puts (bounded to `max_bytes`)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.users = 0  # store handles of this process sharing the cache (see `shared`)
        self._entries: OrderedDict[tuple[int, int], _Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def wants(self, nbytes: int) -> bool:
        """True when a file of `nbytes` is worth mapping (large enough, and room for it)."""
        return nbytes >= MIN_BYTES and nbytes <= self.max_bytes

    @contextlib.contextmanager
    def mapped(self, fd: int) -> Iterator[torch.Tensor]:
        """A flat uint8 view of the whole file open at `fd` (a regular file this process
        writes exclusively meanwhile), valid inside the `with`. Takes ownership of `fd`: the
        caller must not close it. (The view must not outlive the block: `torch.frombuffer`
        does not stop an mmap from being unmapped under it.)"""
        entry = self._acquire(fd)
        try:
            yield entry.view
        finally:
            with self._lock:
                entry.users -= 1
                if entry.dropped and not entry.users:
                    self._unmap(entry)

    def _acquire(self, fd: int) -> _Entry:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        with self._lock:
            self._drop_deleted_oldest()
            entry = self._entries.pop(key, None)
            if entry is not None and entry.size != st.st_size:  # truncated since: map again
                self._drop(entry)
                entry = None
            if entry is not None:
                os.close(fd)
            else:
                try:
                    mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
                except BaseException:
                    os.close(fd)
                    raise
                entry = _Entry(fd, st.st_size, mm, torch.frombuffer(mm, dtype=torch.uint8))
                self._bytes += entry.size
            entry.users += 1
            self._entries[key] = entry  # most recently used last
            while len(self._entries) > 1 and (
                len(self._entries) > MAX_ENTRIES or self._bytes > self.max_bytes
            ):
                self._drop(self._entries.popitem(last=False)[1])
            return entry

    def sweep(self) -> None:
        """Drop the mappings of every file that was deleted."""
        with self._lock:
            for key, entry in list(self._entries.items()):
                if not os.fstat(entry.fd).st_nlink:
                    del self._entries[key]
                    self._drop(entry)

    def clear(self) -> None:
        """Unmap everything."""
        with self._lock:
            while self._entries:
                self._drop(self._entries.popitem(last=False)[1])

    def _drop_deleted_oldest(self) -> None:
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if os.fstat(entry.fd).st_nlink:
                return
            del self._entries[key]
            self._drop(entry)

    def _drop(self, entry: _Entry) -> None:
        """Under the lock: an entry left the cache; unmap it unless a put is using it."""
        self._bytes -= entry.size
        entry.dropped = True
        if not entry.users:
            self._unmap(entry)

    def _unmap(self, entry: _Entry) -> None:
        entry.view = None
        entry.mm.close()
        os.close(entry.fd)


_shared: dict[str, MappedFiles] = {}
_shared_lock = threading.Lock()


def shared(root: str, max_bytes: int) -> MappedFiles:
    """The cache of one store directory, shared by this process's handles on it (a recycled
    file comes back to whichever handle puts next). Pair with `unshare` at close."""
    with _shared_lock:
        maps = _shared.get(root)
        if maps is None:
            maps = _shared[root] = MappedFiles(max_bytes)
        maps.max_bytes = max(maps.max_bytes, max_bytes)
        maps.users += 1
        return maps


def unshare(root: str, maps: MappedFiles) -> None:
    """A handle is done with the cache; the last one out unmaps everything."""
    with _shared_lock:
        maps.users -= 1
        if maps.users > 0:
            return
        if _shared.get(root) is maps:
            del _shared[root]
    maps.clear()
