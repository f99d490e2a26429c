"""gc, sweep and purge of a `shm://` store (the `StoreBase` primitives), and abandoned stores.

GC policy (docs/store.md): a put whose writer died is reclaimed by any `gc()`; `gc(live)`
also reclaims complete samples not in `live` older than `gc_grace_s`; counters are recounted
from the directory. A store every attached process left without closing is removed at the
next open.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

from specbus.core.store import procs
from specbus.core.store.base import Stored
from specbus.core.store.shm_dir import Stats, free_entries, gen_of, mtime_of, nbytes_of, rm


class ShmSweep:
    """Mixin of `ShmStore`: its maintenance (see the module doc). Uses the store's `root`,
    `cfg`, `_lock`, `_samples`, `_files`, `_maps` and `_reaped`."""

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
                    nbytes = nbytes_of(d)
                    if d.name.endswith(".tmp"):
                        orphan = not procs.alive(d.name.split(".")[2])
                    else:
                        age = now - mtime_of(d / ".nbytes", d)
                        orphan = live is not None and sdir.name not in live and age >= grace
                    if orphan:
                        freed += nbytes
                        trash.append(self._files.to_trash(d))
                    else:
                        resident += nbytes
                        count += 1
                with contextlib.suppress(OSError):
                    sdir.rmdir()
            st = self._lock.read()
            old_resident = st.resident
            free_dir = self.root / "free"
            cached = sum(n for n, _ in free_entries(str(free_dir))) if free_dir.exists() else 0
            self._lock.write(Stats(resident, count, st.peak, cached))
            if (self.root / "trash").exists():
                trash += list((self.root / "trash").iterdir())
        for d in trash:
            rm(d)
        self._maps.sweep()  # this process's mappings of files deleted, by now too
        return max(freed, old_resident - resident)

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
            out += [Stored(sid, gen_of(n)) for n in names if n.startswith("g") and gen_of(n) >= 0]
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
                nbytes = nbytes_of(d)
                freed += nbytes
                if force:
                    st.resident -= nbytes
                    st.count -= 1
                    trash.append(self._files.to_trash(d))
                else:
                    trash.append(self._files.retire(d, st))
                with contextlib.suppress(OSError):
                    sdir.rmdir()
            self._lock.write(st)
        for d in trash:
            rm(d)
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
                        freed += nbytes_of(d)
                        trash.append(self._files.to_trash(d))
                with contextlib.suppress(OSError):
                    sdir.rmdir()
            st = self._lock.read()
            freed += st.cached
            trash += self._files.trim(st, 0)
            self._lock.write(st)
            if (self.root / "trash").exists():
                trash += [d for d in (self.root / "trash").iterdir() if d not in trash]
        for d in trash:
            rm(d)
        self.gc()  # recount (and drop this process's mappings of deleted files)
        return freed

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
        self._lock.write(Stats())
