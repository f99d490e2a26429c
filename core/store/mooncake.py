"""`mooncake://<store_id>?master=H:P&metadata=P2P&admin=H:P`: the Mooncake distributed store.

One hard-pinned Mooncake object per tensor, keyed `{store_id}/{sample_id}/g{gen}/{name}`,
written with `batch_put_from` and read with `batch_get_into` on registered memory: shape and
dtype travel in the FeatureSpec, never on the wire (no pickle, no header).

Lessons from the predecessor (seeds/003) applied here:
- Segments: this client contributes no segment memory (global_segment_size=0). Objects live
  in the segment of a store node process (`ops.services.mooncake_node`) that outlives
  producers; objects in a producer's own segment died with it.
- Registered buffers are pooled: one arena per client, registered once (RDMA rejects
  unregistered memory and pins pages at registration). Gets land in it and the tensors handed
  out are views of it, returned to the pool when they die (core/store/pool.py). Puts send
  `alloc()`'d tensors from it as they are. Other tensors: over TCP, registration is
  bookkeeping (~20 us, measured no slower than a pooled buffer), so the tensor is registered
  for that put and sent from its own memory; staging it would add a copy as long as a third
  of the transfer (a 64 MB copy ~12 ms against a ~35 ms loopback transfer) and, on 2 cores
  busy with TCP, no room to hide it. Over RDMA, and where Mooncake refuses the registration
  (memory overlapping another put's), tensors are staged through the pool, screened while
  copied (core/store/chunked.py).
- A short read (`get_into` returns fewer bytes than the spec) is an IntegrityError, never a
  tensor with an uninitialised tail.
- `remove` right after a read fails with -706 while the reader's lease lives (10 s default).
  Releases try once, then a background thread retries on a schedule and forces the remove
  after `force_release_after_s` (> the lease TTL). Existence probes (`is_exist`, `get_size`)
  take a lease too, so removes run first and probes never precede a remove.
- `put_from` on an existing key keeps the *old* value and `upsert_from` with another size
  leaks the old replica: a re-put force-removes existing keys first, then puts.
- `get` of a lost object must not hang or return empty bytes: every error code maps to a
  typed error (-704 FeatureMissing, -800 transfer failed -> FeatureMissing, -900 master
  unreachable -> StoreUnavailable), and Mooncake's RPCs are bounded (~4 s without a master).

The master's HTTP admin endpoint gives the store's view: allocated bytes (budget, usage) and
the key listing (gc). Budget and usage cover the whole Mooncake cluster (one per run).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from specbus.core.config import MooncakeConfig, StoreConfig
from specbus.core.contracts import FeatureSpec
from specbus.core.errors import (
    ConfigError,
    FeatureMissing,
    IntegrityError,
    StoreError,
    StoreFull,
    StoreUnavailable,
)
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
    sample_prefix,
    screen_all,
    specs_of,
    to_device,
)
from specbus.core.store.chunked import SharedScreen, copy_into, screen_whole
from specbus.core.store.pool import BufferPool

log = logging.getLogger(__name__)

# Mooncake error codes (mooncake-store/include/types.h)
OK = 0
NO_AVAILABLE_HANDLE = -200
BUFFER_TOO_SMALL = -600
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900

# An empty tensor is stored as a one-byte sentinel so that its absence is still detectable.
_SENTINEL = 1

# In-place (TCP) puts of this many bytes of floating CPU tensors and more share their screen
# with the screen worker; smaller ones are summed by the put's thread alone (a handoff costs
# more than their sum).
SCREEN_HELP_MIN_BYTES = 1 << 20


def metadata_address(metadata: str) -> str:
    """Our config says "P2P"; Mooncake spells the handshake mode "P2PHANDSHAKE"."""
    return "P2PHANDSHAKE" if metadata.upper() in ("P2P", "P2PHANDSHAKE") else metadata


def admin_address(mc: MooncakeConfig) -> str:
    return mc.admin or f"{mc.master.rsplit(':', 1)[0]}:9003"


def mooncake_uri(store_id: str, mc: MooncakeConfig) -> str:
    """The URI another process opens to reach the same store (connection in the query)."""
    query = urllib.parse.urlencode(
        {
            "master": mc.master,
            "metadata": mc.metadata,
            "admin": admin_address(mc),
            "protocol": mc.protocol,
        }
    )
    return f"mooncake://{store_id}?{query}"


@dataclass
class _Pending:
    nbytes: int
    first: float
    due: float
    attempts: int = 0


class MooncakeStore(StoreBase):
    def __init__(self, cfg: StoreConfig, store_id: str, mc: MooncakeConfig):
        self.cfg = cfg
        self.mc = mc
        # sweep() and close() wait this long for refused removes: every read lease has
        # lapsed (or been overridden, as release does) by then
        self.settle_timeout_s = mc.force_release_after_s + 1.0
        self.store_id = store_id
        self.uri = mooncake_uri(store_id, mc)
        self._admin = f"http://{admin_address(mc)}"
        self._conn = _connect(mc)
        self._client = self._conn.client
        self._pool = self._conn.pool
        self._replicate = self._conn.replicate
        self._in_place = mc.protocol == "tcp"
        self._peak = 0
        self._metrics_at = -1e9
        self._metrics_seen = self._put_since = 0
        self._screener = Screener()
        self._gc_seen: dict[tuple[str, int], float] = {}
        self._pending: dict[str, _Pending] = {}
        self._retried_bytes = 0  # bytes freed by retried removes, ever (sweep counts its share)
        self._cond = threading.Condition()  # over an RLock: re-entrant (close from a signal)
        self._closed = False  # the retrier stops
        self._retrier = threading.Thread(
            target=self._retry_loop, name="mooncake-release", daemon=True
        )
        self._retrier.start()
        _open_handles.add(self)

    def _register(self, ptr: int, nbytes: int) -> None:
        _register(self._client, ptr, nbytes)

    # ---- put -----------------------------------------------------------------------------

    def put(
        self, sample_id: str, tensors: Mapping[str, torch.Tensor], gen: int = 0
    ) -> dict[str, FeatureSpec]:
        self._check_open()
        kept, specs = prepare(
            self.store_id, sample_id, gen, tensors, crc=self.cfg.crc, screen=False
        )
        nbytes = sum(s.nbytes for s in specs.values())
        allocated = self._allocated()
        if allocated + nbytes > self.cfg.budget_bytes:
            raise StoreFull(
                f"{self.uri}: putting sample {sample_id!r} ({nbytes} B) would exceed the budget "
                f"({allocated} of {self.cfg.budget_bytes} B in use)"
            )
        keys = [s.key for s in specs.values()]
        screen = self.cfg.screen_nonfinite
        on_device = {n for n, t in tensors.items() if t.device.type != "cpu"}
        held: list[int] = []
        shared = None
        try:
            direct = self._hold_direct(kept, held)
            # Tensors on an accelerator are screened there, now (cheap). CPU tensors sent from
            # their own memory are screened beside the existence check and the transfer (both
            # release the GIL): the screen worker sums chunks while Mooncake sends, this
            # thread sums what is left after (chunked.SharedScreen). Staged ones are summed
            # chunk by chunk as they are copied (chunked.py). Screening beside the transfer
            # is safe because nobody reads these keys before put() returns (the SampleRef is
            # published after): a bad sample is removed, then refused, never seen.
            if screen:
                screen_all(sample_id, {n: tensors[n] for n in on_device})
                shared = SharedScreen(sample_id, {n: kept[n] for n in direct - on_device})
                if shared.nbytes >= SCREEN_HELP_MIN_BYTES:
                    self._screener.help(shared)
            with self._cond:  # a pending remove of these keys must not delete the new value
                for key in keys:
                    self._pending.pop(key, None)
            # Writing an existing key must replace it; put_from would keep the old bytes.
            exist = self._client.batch_is_exist(keys)
            existing = [k for k, e in zip(keys, exist, strict=True) if e == 1]
            if existing:
                self._client.batch_remove(existing, True)  # forced: is_exist took a read lease
            self._put_objects(sample_id, keys, kept, direct, screen, on_device | direct)
            if shared is not None:
                shared.finish()
        except BaseException:
            if shared is not None:
                shared.cancel()
            self._discard(keys, {s.key: s.nbytes for s in specs.values()})
            raise
        finally:
            for ptr in held:
                self._conn.unhold(ptr)
        self._put_since += nbytes
        if gen > 0:
            self._supersede(sample_id, gen, list(kept))
        self._peak = max(self._peak, allocated + nbytes)
        return specs

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An empty tensor in registered transfer memory: fill it (e.g. capture into it) and
        put it with no staging copy. Falls back to ordinary memory when the pool is full."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        off = self._pool.alloc(nbytes) if nbytes else None
        if off is None:
            return torch.empty(shape, dtype=dtype)
        return self._pool.tensor(off, nbytes).view(dtype).reshape(shape)

    def _allocated(self) -> int:
        """Bytes in the store for the budget check: the master's count, refreshed every
        `usage_refresh_s`, plus what this handle put since (an HTTP call per put would cost
        ~1 ms, a quarter of a 4 MB transfer)."""
        now = time.monotonic()
        if now - self._metrics_at >= self.mc.usage_refresh_s:
            self._metrics_seen, _ = self._metrics()
            self._metrics_at, self._put_since = now, 0
        return self._metrics_seen + self._put_since

    def _hold_direct(self, kept: Mapping[str, torch.Tensor], held: list[int]) -> set[str]:
        """Names of the tensors that go from their own memory, no staging copy: those in the
        pool (from `alloc`) and, over TCP, any other (registered for this put: over TCP that
        is bookkeeping, ~20 us, measured no slower than a pooled buffer; RDMA would pin pages,
        so there they are staged through the pool). Registered pointers go to `held`."""
        direct = set()
        for name, t in kept.items():
            size = t.numel() * t.element_size()
            if not size:
                continue
            if self._pool.contains(t.data_ptr(), size):
                direct.add(name)
            elif self._in_place and self._conn.hold(t.data_ptr(), size):
                held.append(t.data_ptr())
                direct.add(name)
        return direct

    def _put_objects(
        self,
        sample_id: str,
        keys: list[str],
        kept: Mapping[str, torch.Tensor],
        direct: set[str],
        screen: bool,
        screened_elsewhere: set[str],
    ) -> None:
        """Put every tensor: those in `direct` from their own memory, the others staged
        through pool chunks (screened while copied unless `screened_elsewhere`), in batches
        that fit the pool."""
        batch: list[tuple[str, int, int, int | None]] = []  # (key, ptr, size, staged offset)
        try:
            for key, (name, t) in zip(keys, kept.items(), strict=True):
                size = t.numel() * t.element_size() or _SENTINEL
                if name in direct:
                    batch.append((key, t.data_ptr(), size, None))
                    continue
                off = self._pool.alloc(size)
                if off is None and batch:
                    full, batch = batch, []
                    self._put_batch(full)
                    off = self._pool.alloc(size)
                screen_here = screen and name not in screened_elsewhere
                if off is None:  # larger than the whole pool: register this tensor once
                    if screen_here:
                        screen_whole(sample_id, name, t)
                    self._put_unpooled(key, t)
                    continue
                batch.append((key, self._pool.base + off, size, off))  # freed below on error
                if t.numel():
                    view = self._pool.view(off, size)
                    copy_into(sample_id, name, t, view, screen=screen_here)
            if batch:
                full, batch = batch, []
                self._put_batch(full)
        finally:
            for _, _, size, off in batch:
                if off is not None:
                    self._pool.free(off, size)

    def _put_batch(self, batch: list[tuple[str, int, int, int | None]]) -> None:
        try:
            codes = self._client.batch_put_from(
                [key for key, _, _, _ in batch],
                [ptr for _, ptr, _, _ in batch],
                [size for _, _, size, _ in batch],
                self._replicate,
            )
        finally:
            for _, _, size, off in batch:
                if off is not None:
                    self._pool.free(off, size)
        for (key, _, _, _), code in zip(batch, codes, strict=True):
            if code != OK:
                self._raise_put(key, code)

    def _put_unpooled(self, key: str, t: torch.Tensor) -> None:
        ptr, size = t.data_ptr(), t.numel() * t.element_size()
        self._register(ptr, size)
        try:
            code = self._client.put_from(key, ptr, size, self._replicate)
        finally:
            self._client.unregister_buffer(ptr)
        if code != OK:
            self._raise_put(key, code)

    def _raise_put(self, key: str, code: int):
        if code == RPC_FAIL:
            raise StoreUnavailable(
                f"put {key!r}: Mooncake master {self.mc.master} unreachable (code {code})"
            )
        if code == TRANSFER_FAIL:
            raise StoreUnavailable(f"put {key!r}: transfer to the store node failed (code {code})")
        _, capacity = self._metrics()
        if capacity == 0:
            raise StoreUnavailable(
                f"put {key!r}: no store node has a segment mounted (code {code})"
            )
        if code == NO_AVAILABLE_HANDLE:
            raise StoreFull(
                f"put {key!r}: the store node's segment ({capacity} B) is full (code {code})"
            )
        raise StoreError(f"put {key!r} failed with Mooncake code {code}")

    def _supersede(self, sample_id: str, gen: int, names: list[str]) -> None:
        """Remove generations < gen; leased ones go to the retry queue (so a stale ref ends
        in FeatureMissing), a regex sweep catches tensor names this put did not have."""
        old = [sample_prefix(self.store_id, sample_id, g) + n for g in range(gen) for n in names]
        self._remove(old, self._object_sizes(old))
        alts = "|".join(str(g) for g in range(gen))
        self._client.remove_by_regex(f"^{re.escape(f'{self.store_id}/{sample_id}/')}g({alts})/")

    # ---- get -----------------------------------------------------------------------------

    def get(
        self, ref: RefLike, names: Iterable[str] | None = None, device=None
    ) -> dict[str, torch.Tensor]:
        self._check_open()
        specs = specs_of(ref, names)
        for spec in specs.values():
            parse_key(spec.key, self.store_id)
            if spec.key in self._pending:  # released or superseded here; the store still holds it
                raise FeatureMissing(spec.key, "released, remove pending")
        bufs: dict[str, torch.Tensor] = {}
        registered: list[int] = []
        try:
            for name, spec in specs.items():
                bufs[name], unpooled = self._recv(max(spec.nbytes, _SENTINEL))
                if unpooled:
                    registered.append(bufs[name].data_ptr())
            self._read_into(specs, bufs)
        finally:
            for ptr in registered:
                self._client.unregister_buffer(ptr)
        out = {}
        for name, spec in specs.items():
            flat = bufs[name]
            dtype = DTYPES[spec.dtype]
            t = (
                flat.view(dtype).reshape(spec.shape)
                if spec.nbytes
                else torch.empty(spec.shape, dtype=dtype)
            )
            check_crc(spec, t)
            out[name] = t
        return to_device(out, device)

    def _read_into(self, specs: dict[str, FeatureSpec], bufs: dict[str, torch.Tensor]) -> None:
        todo = list(specs)
        for attempt in range(2):
            codes = self._client.batch_get_into(
                [specs[n].key for n in todo],
                [bufs[n].data_ptr() for n in todo],
                [bufs[n].numel() for n in todo],
            )
            failed = [n for n, c in zip(todo, codes, strict=True) if c == TRANSFER_FAIL]
            for name, code in zip(todo, codes, strict=True):
                if code != TRANSFER_FAIL or attempt == 1:
                    self._check_read(specs[name], code)
            if not failed:
                return
            todo = failed
            time.sleep(0.05)  # one retry: a transient transfer error is not a lost node

    def _recv(self, nbytes: int) -> tuple[torch.Tensor, bool]:
        """A receive buffer: a pooled view (no registration), else fresh memory registered
        for this one read (the flag says to unregister it)."""
        off = self._pool.alloc(nbytes)
        if off is not None:
            return self._pool.tensor(off, nbytes), False
        flat = torch.empty(nbytes, dtype=torch.uint8)
        self._register(flat.data_ptr(), nbytes)
        return flat, True

    def _check_read(self, spec: FeatureSpec, code: int) -> None:
        expected = spec.nbytes or _SENTINEL
        if code == expected:
            return
        if code == OBJECT_NOT_FOUND:
            raise FeatureMissing(spec.key)
        if code == TRANSFER_FAIL:
            raise FeatureMissing(spec.key, "transfer from the store node failed (node lost?)")
        if code == RPC_FAIL:
            raise StoreUnavailable(
                f"get {spec.key!r}: Mooncake master {self.mc.master} unreachable (code {code})"
            )
        if code == BUFFER_TOO_SMALL:
            raise IntegrityError(
                f"feature {spec.key!r}: the stored object is larger than the spec's {spec.nbytes} B"
            )
        if code >= 0:
            raise IntegrityError(f"feature {spec.key!r}: short read, {code} of {expected} bytes")
        raise StoreError(f"get {spec.key!r} failed with Mooncake code {code}")

    # ---- release, adopt, gc ----------------------------------------------------------------

    def release(self, ref: RefLike) -> None:
        specs = specs_of(ref)
        for spec in specs.values():
            parse_key(spec.key, self.store_id)
        self._remove([s.key for s in specs.values()], {s.key: s.nbytes for s in specs.values()})
        self._metrics_at = -1e9  # the next budget check asks the master again

    def _remove(self, keys: list[str], sizes: Mapping[str, int] | None = None) -> int:
        """Remove now; what the store refuses (read lease, master away) is retried later.
        Returns the bytes (as `sizes` says) of the keys removed now."""
        if not keys:
            return 0
        codes = self._client.batch_remove(keys, False)
        now = time.monotonic()
        freed = 0
        with self._cond:
            for key, code in zip(keys, codes, strict=True):
                if code == OK:
                    freed += (sizes or {}).get(key, 0)
                elif code != OBJECT_NOT_FOUND and key not in self._pending:
                    nbytes = (sizes or {}).get(key, 0)
                    self._pending[key] = _Pending(nbytes, now, now + self.mc.release_retry_s)
            self._cond.notify()
        return freed

    def _discard(self, keys: list[str], sizes: Mapping[str, int]) -> None:
        """Remove what a failed put wrote (no half-written or rejected sample stays behind),
        forced: nobody may hold a read lease on unpublished keys but this handle's own
        existence check. Keys the store will not remove now (master away) go to the retrier,
        due at once and forced, so their bytes still go."""
        try:
            codes = self._client.batch_remove(keys, True)
        except Exception:  # noqa: BLE001 - the put's own error is the one to raise; retried
            codes = [None] * len(keys)
        now = time.monotonic()
        with self._cond:
            for key, code in zip(keys, codes, strict=True):
                if code not in (OK, OBJECT_NOT_FOUND):
                    forced_from = now - self.mc.force_release_after_s
                    self._pending[key] = _Pending(sizes.get(key, 0), forced_from, now)
            self._cond.notify()

    def _retry_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._due():
                    wait = min(
                        (p.due for p in self._pending.values()), default=time.monotonic() + 3600
                    )
                    self._cond.wait(max(wait - time.monotonic(), 0.01))
                if self._closed:
                    return
            try:
                self._retry_due(time.monotonic())
            except Exception:  # noqa: BLE001 - a dead master must not kill the retrier; retried later
                time.sleep(self.mc.release_retry_s)

    def _due(self) -> bool:
        now = time.monotonic()
        return any(p.due <= now for p in self._pending.values())

    def _retry_due(self, now: float, everything: bool = False) -> None:
        """Retry the removes that are due (all with `everything`): gently, forced for those
        first refused `force_release_after_s` ago (every read lease has lapsed by then)."""
        with self._cond:
            due = {k: p for k, p in self._pending.items() if everything or p.due <= now}
        if not due:
            return
        force = [k for k, p in due.items() if now - p.first >= self.mc.force_release_after_s]
        gentle = [k for k in due if k not in set(force)]
        results = {}
        for keys, forced in ((gentle, False), (force, True)):
            if keys:
                results.update(zip(keys, self._client.batch_remove(keys, forced), strict=True))
        with self._cond:
            for key, code in results.items():
                p = self._pending.get(key)
                if p is None:
                    continue
                if code in (OK, OBJECT_NOT_FOUND):
                    del self._pending[key]
                    if code == OK:
                        self._retried_bytes += p.nbytes
                else:
                    p.attempts += 1
                    p.due = now + min(self.mc.release_retry_s * 2**p.attempts, 5.0)

    def adopt(self, ref: RefLike) -> None:
        """Verify a sample another writer (e.g. an SGLang capture sink) put: every key exists
        with the spec's size. Uses the admin endpoint, which takes no read lease."""
        specs = specs_of(ref)
        sizes = self._object_sizes([s.key for s in specs.values()])
        for spec in specs.values():
            size = sizes.get(spec.key)
            if size is None:
                raise FeatureMissing(spec.key)
            if size != (spec.nbytes or _SENTINEL):
                raise IntegrityError(
                    f"feature {spec.key!r}: {size} bytes stored, the spec says {spec.nbytes}"
                )

    def gc(self, live: Iterable[str] | None = None, *, min_age_s: float | None = None) -> int:
        """Retry pending removes now; with `live`, remove every sample of this store whose id
        is not in `live` and that has been seen unlisted for `gc_grace_s` (Mooncake keeps no
        object age, so age counts from the first gc that saw it). Returns bytes freed."""
        before, _ = self._metrics()
        self._retry_due(time.monotonic(), everything=True)
        if live is not None:
            live = set(live)
            grace = self.cfg.gc_grace_s if min_age_s is None else min_age_s
            now = time.monotonic()
            groups: dict[tuple[str, int], list[str]] = {}
            for key in self._list_keys():
                p = parse_key(key)
                groups.setdefault((p.sample_id, p.gen), []).append(key)
            self._gc_seen = {s: self._gc_seen.get(s, now) for s in groups if s[0] not in live}
            doomed = [
                k for s, first in self._gc_seen.items() if now - first >= grace for k in groups[s]
            ]
            sizes = self._object_sizes(doomed)
            self._remove(doomed, sizes)
        after, _ = self._metrics()
        return max(before - after, 0)

    # ---- the store's view (master admin HTTP) ------------------------------------------------

    def usage(self) -> StoreUsage:
        allocated, capacity = self._metrics()
        self._peak = max(self._peak, allocated)
        samples = {(p.sample_id, p.gen) for p in map(parse_key, self._list_keys())}
        with self._cond:
            pending = sum(p.nbytes for p in self._pending.values())
        return StoreUsage(
            allocated, len(samples), self._peak, self.cfg.budget_bytes, capacity, pending
        )

    def _http(self, path: str) -> str:
        try:
            with urllib.request.urlopen(self._admin + path, timeout=self.mc.http_timeout_s) as r:
                return r.read().decode()
        except (urllib.error.URLError, OSError) as e:
            raise StoreUnavailable(
                f"{self.uri}: Mooncake master admin {self._admin} unreachable: {e}"
            ) from e

    def _metrics(self) -> tuple[int, int]:
        """(allocated bytes, capacity bytes) of the Mooncake cluster, as the master sees it."""
        values = {}
        for line in self._http("/metrics").splitlines():
            name, _, value = line.partition(" ")
            if name in ("master_allocated_bytes", "master_total_capacity_bytes"):
                values[name] = int(float(value))
        return values.get("master_allocated_bytes", 0), values.get("master_total_capacity_bytes", 0)

    def _list_keys(self) -> list[str]:
        prefix = f"{self.store_id}/"
        return [k for k in self._http("/get_all_keys").splitlines() if k.startswith(prefix)]

    def _object_sizes(self, keys: list[str]) -> dict[str, int]:
        import json

        sizes = {}
        for i in range(0, len(keys), 64):  # bounded URL length
            chunk = keys[i : i + 64]
            q = urllib.parse.quote(",".join(chunk), safe=",/")
            data = json.loads(self._http(f"/batch_query_keys?keys={q}")).get("data") or {}
            for key, entry in data.items():
                if entry.get("ok") and entry.get("values"):
                    sizes[key] = int(entry["values"][0]["size_"])
        return sizes

    # ---- sweep / purge / close primitives (StoreBase) ----------------------------------------

    def _stored(self) -> list[Stored]:
        groups: dict[tuple[str, int], list[str]] = {}
        for key in self._list_keys():
            try:
                p = parse_key(key, self.store_id)
            except StoreError:
                continue  # not a key specbus wrote
            groups.setdefault((p.sample_id, p.gen), []).append(key)
        return [Stored(sid, gen, tuple(keys)) for (sid, gen), keys in groups.items()]

    def _drop(self, stored: list[Stored], force: bool) -> int:
        """Gently (`_remove`: refused keys go to the retrier, forced later as for a release),
        or forced at once (purge: the run is gone, no read lease protects anyone)."""
        keys = [k for s in stored for k in s.objects]
        sizes = self._object_sizes(keys)  # the admin endpoint takes no read lease
        freed = 0
        for i in range(0, len(keys), 1024):  # bounded RPCs
            chunk = keys[i : i + 1024]
            if not force:
                freed += self._remove(chunk, sizes)
                continue
            with self._cond:
                for key in chunk:
                    self._pending.pop(key, None)
            codes = self._client.batch_remove(chunk, True)
            freed += sum(sizes.get(k, 0) for k, c in zip(chunk, codes, strict=True) if c == OK)
        self._metrics_at = -1e9  # the next budget check asks the master again
        return freed

    def _purge_rest(self) -> int:
        """Keys the listing did not show (a put finishing meanwhile) go by pattern, forced;
        nothing of this store stays pending here."""
        self._client.remove_by_regex(f"^{re.escape(self.store_id + '/')}", True)
        with self._cond:
            self._pending.clear()
        self._gc_seen.clear()
        return 0  # sizes unknown: the listed objects were counted by _drop

    def _settle(self, deadline: float) -> int:
        """Retry every pending remove now, then every `release_retry_s / 2` (at most 0.25 s)
        until none is left or `deadline`. Gives up at once without a master (a TCP probe of
        at most 1 s): nothing can be freed there, and a restarted master holds none of these
        objects. Returns the bytes freed by retries meanwhile (the background retrier's too)."""
        with self._cond:
            before = self._retried_bytes
        while True:
            with self._cond:
                if not self._pending:
                    break
            try:
                _check_reachable(self.mc.master, 1.0)
                self._retry_due(time.monotonic(), everything=True)
            except Exception as e:  # noqa: BLE001 - master gone: nothing more can be freed
                log.warning("%s: cannot retry pending removes: %s", self.uri, e)
                break
            left = deadline - time.monotonic()
            with self._cond:
                if not self._pending or left <= 0:
                    break
            time.sleep(min(self.mc.release_retry_s / 2, 0.25, left))
        with self._cond:
            return self._retried_bytes - before

    def _shutdown(self) -> None:
        """Stop the retrier and let go of the client. Removes still refused are named in a
        warning: the next sweep(done) re-derives them from the trainer's record."""
        _open_handles.discard(self)
        with self._cond:
            left = list(self._pending.values())
            self._closed = True
            self._cond.notify_all()
        if left:
            log.warning(
                "%s: %d released object(s) (%d B) still refused at close (read lease or master "
                "away); the next sweep(done) of this store removes them",
                self.uri,
                len(left),
                sum(p.nbytes for p in left),
            )
        self._retrier.join(timeout=5)
        self._screener.close()
        _disconnect(self._conn)


class _Connection:
    """A Mooncake client and its registered buffer pool, shared by every store handle of this
    process that talks to the same cluster (one client, one pool, however many handles)."""

    def __init__(self, mc: MooncakeConfig):
        from mooncake.store import (
            MooncakeDistributedStore,
            ReplicateConfig,
        )  # lazy: optional dependency

        # The transfer engine's TCP listener honours this where the Mooncake version supports it.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", mc.local_hostname)
        _check_reachable(mc.master, mc.http_timeout_s)  # setup() against a dead master blocks ~90 s
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
            mc.buffer_bytes, register=lambda ptr, n: _register(self.client, ptr, n)
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
        with self._held_lock:
            entry = self._held[ptr]
            entry[1] -= 1
            if entry[1] == 0:
                del self._held[ptr]
                self.client.unregister_buffer(ptr)


_open_handles: weakref.WeakSet[MooncakeStore] = weakref.WeakSet()
_connections: dict[tuple, _Connection] = {}
_connections_lock = threading.Lock()


def _connect(mc: MooncakeConfig) -> _Connection:
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
            conn = _connections[key] = _Connection(mc)
        conn.handles += 1
        return conn


def _disconnect(conn: _Connection) -> None:
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


def _register(client, ptr: int, nbytes: int) -> None:
    rc = client.register_buffer(ptr, nbytes)
    if rc != 0:
        raise StoreError(
            f"registering {nbytes} B of transfer buffer with Mooncake failed with code {rc}"
        )


def _check_reachable(address: str, timeout_s: float) -> None:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as e:
        raise StoreUnavailable(f"Mooncake master {address!r} is not reachable: {e}") from e


# Registered after _close_connections, so it runs before it (atexit is last in, first out):
# a handle still open at a normal exit (or a SystemExit from a signal handler) flushes its
# refused removes, bounded as close() is, while its client is still connected.
@atexit.register
def _close_open_handles() -> None:
    for store in list(_open_handles):
        with contextlib.suppress(Exception):  # best effort at interpreter exit
            store.close()


def open_mooncake(
    cfg: StoreConfig, store_id: str, path: str | None, query: dict[str, str]
) -> MooncakeStore:
    """`mooncake://<store_id>?master=H:P&metadata=P2P&admin=H:P&protocol=tcp`
    (`core.registry.STORES`): the query overrides `cfg.mooncake`. Raises `ConfigError` for an
    option that is not a MooncakeConfig field."""
    unknown = set(query) - set(MooncakeConfig.model_fields)
    if unknown:
        raise ConfigError(f"store.uri {cfg.uri!r}: unknown mooncake option(s) {sorted(unknown)}")
    mc = MooncakeConfig.model_validate({**cfg.mooncake.model_dump(), **query})
    return MooncakeStore(cfg, store_id, mc)
