"""`mooncake://<store_id>?master=H:P&metadata=P2P&admin=H:P`: the Mooncake distributed store.

One hard-pinned Mooncake object per tensor, keyed `{store_id}/{sample_id}/g{gen}/{name}`,
written with `batch_put_from` and read with `batch_get_into` on registered memory (pooled:
core/store/pool.py); shape and dtype travel in the FeatureSpec, never on the wire. A short
read is an `IntegrityError`; error codes map to typed errors (-704 `FeatureMissing`, -800
`FeatureMissing`, -900 `StoreUnavailable`). The process's client is mooncake_client.py,
refused removes are retried by mooncake_releases.py, the master's admin view (usage, keys) is
mooncake_admin.py. The lessons behind each choice (segments, registration, read leases,
re-puts): docs/store.md.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import re
import time
import urllib.parse
import weakref
from collections.abc import Iterable, Mapping

import torch
from specbus.core.config import MooncakeConfig, StoreConfig
from specbus.core.contracts import FeatureSpec
from specbus.core.errors import (
    ConfigError,
    FeatureMissing,
    IntegrityError,
    StoreError,
    StoreFull,
)
from specbus.core.store.base import (
    RefLike,
    Screener,
    StoreBase,
    Stored,
    StoreUsage,
    as_feature,
    parse_key,
    prepare,
    sample_prefix,
    screen_all,
    specs_of,
    to_device,
)
from specbus.core.store.chunked import SharedScreen, copy_into, screen_whole
from specbus.core.store.mooncake_admin import MooncakeAdmin, admin_address
from specbus.core.store.mooncake_client import (
    OK,
    RPC_FAIL,
    SENTINEL,
    TRANSFER_FAIL,
    connect,
    disconnect,
    put_error,
    read_error,
    register,
)
from specbus.core.store.mooncake_releases import Releases

# In-place (TCP) puts of this many bytes of floating CPU tensors and more share their screen
# with the screen worker; smaller ones are summed by the put's thread alone (a handoff costs
# more than their sum).
SCREEN_HELP_MIN_BYTES = 1 << 20


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


class MooncakeStore(StoreBase):
    """A `FeatureStore` on the Mooncake cluster `mc` names (see the module doc); `cfg`'s
    budget is the master's refusal where the cluster is no larger (a segment sized to it),
    else checked against the whole cluster's allocated bytes. Raises `StoreUnavailable` when
    the master cannot be reached."""

    def __init__(self, cfg: StoreConfig, store_id: str, mc: MooncakeConfig):
        self.cfg = cfg
        self.mc = mc
        # sweep() and close() wait this long for refused removes: every read lease has
        # lapsed (or been overridden, as release does) by then
        self.settle_timeout_s = mc.force_release_after_s + 1.0
        self.store_id = store_id
        self.uri = mooncake_uri(store_id, mc)
        self._admin = MooncakeAdmin(mc, self.uri)
        self._conn = connect(mc)
        self._admin.check_budget(cfg.budget_bytes)
        self._client = self._conn.client
        self._pool = self._conn.pool
        self._replicate = self._conn.replicate
        self._in_place = mc.protocol == "tcp"
        self._peak = 0
        self._metrics_at = -1e9
        self._metrics_seen = self._put_since = self._capacity_seen = 0
        self._screener = Screener()
        self._gc_seen: dict[tuple[str, int], float] = {}
        self._releases = Releases(self._client, mc, self.uri)
        _open_handles.add(self)

    def _register(self, ptr: int, nbytes: int) -> None:
        register(self._client, ptr, nbytes)

    # ---- put -----------------------------------------------------------------------------

    def put(
        self, sample_id: str, tensors: Mapping[str, torch.Tensor], gen: int = 0
    ) -> dict[str, FeatureSpec]:
        """Put every tensor of the sample (see `FeatureStore.put`; the module doc for the transfer):
        `StoreFull` over the budget or a full segment, `StoreUnavailable` without a master or a
        store node; nothing of a failed put stays behind."""
        self._check_open()
        kept, specs = prepare(
            self.store_id, sample_id, gen, tensors, crc=self.cfg.crc, screen=False
        )
        nbytes = sum(s.nbytes for s in specs.values())
        allocated, capacity = self._allocated()
        # The store node's segment is the budget (`specbus store` sizes it so): the master's
        # refusal of a put that does not fit is the exact check, atomic across writers
        # (-200: StoreFull). Only a cluster larger than the budget needs this one, which
        # other writers' puts since the last sample can overshoot (docs/store.md, "Budget").
        if capacity > self.cfg.budget_bytes and allocated + nbytes > self.cfg.budget_bytes:
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
            self._releases.forget(keys)  # a pending remove must not delete the new value
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
            self._releases.discard(keys, {s.key: s.nbytes for s in specs.values()})
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

    def _allocated(self) -> tuple[int, int]:
        """(bytes in the store, the cluster's capacity) for the budget check: the master's
        counts, refreshed every `usage_refresh_s`, plus what this handle put since (an HTTP
        call per put would cost ~1 ms, a quarter of a 4 MB transfer)."""
        now = time.monotonic()
        if now - self._metrics_at >= self.mc.usage_refresh_s:
            self._metrics_seen, self._capacity_seen = self._admin.metrics()
            self._metrics_at, self._put_since = now, 0
        return self._metrics_seen + self._put_since, self._capacity_seen

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
                size = t.numel() * t.element_size() or SENTINEL
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
        capacity = self._admin.metrics()[1] if code not in (RPC_FAIL, TRANSFER_FAIL) else None
        raise put_error(key, code, self.mc.master, capacity)

    def _supersede(self, sample_id: str, gen: int, names: list[str]) -> None:
        """Remove generations < gen; leased ones go to the retry queue (so a stale ref ends
        in FeatureMissing), a regex sweep catches tensor names this put did not have."""
        old = [sample_prefix(self.store_id, sample_id, g) + n for g in range(gen) for n in names]
        self._releases.remove(old, self._admin.object_sizes(old))
        alts = "|".join(str(g) for g in range(gen))
        self._client.remove_by_regex(f"^{re.escape(f'{self.store_id}/{sample_id}/')}g({alts})/")

    # ---- get -----------------------------------------------------------------------------

    def get(
        self, ref: RefLike, names: Iterable[str] | None = None, device=None
    ) -> dict[str, torch.Tensor]:
        """Read the sample's tensors into pooled registered memory (see `FeatureStore.get`); Mooncake's
        error codes map to `FeatureMissing`, `StoreUnavailable`, `IntegrityError`."""
        self._check_open()
        specs = specs_of(ref, names)
        for spec in specs.values():
            parse_key(spec.key, self.store_id)
            if spec.key in self._releases:  # released or superseded here; still in the store
                raise FeatureMissing(spec.key, "released, remove pending")
        bufs: dict[str, torch.Tensor] = {}
        registered: list[int] = []
        try:
            for name, spec in specs.items():
                bufs[name], unpooled = self._recv(max(spec.nbytes, SENTINEL))
                if unpooled:
                    registered.append(bufs[name].data_ptr())
            self._read_into(specs, bufs)
        finally:
            for ptr in registered:
                self._client.unregister_buffer(ptr)
        return to_device({name: as_feature(spec, bufs[name]) for name, spec in specs.items()},
                         device)  # fmt: skip

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
        if code != (spec.nbytes or SENTINEL):
            raise read_error(spec, code, self.mc.master)

    # ---- release, adopt, gc ----------------------------------------------------------------

    def release(self, ref: RefLike) -> None:
        """Remove one generation of a sample; a remove refused under a read lease is retried in the
        background and forced later (mooncake_releases.py)."""
        specs = specs_of(ref)
        for spec in specs.values():
            parse_key(spec.key, self.store_id)
        self._releases.remove(
            [s.key for s in specs.values()], {s.key: s.nbytes for s in specs.values()}
        )
        self._metrics_at = -1e9  # the next budget check asks the master again

    def adopt(self, ref: RefLike) -> None:
        """Verify a sample another writer (e.g. an SGLang capture sink) put: every key exists
        with the spec's size. Uses the admin endpoint, which takes no read lease."""
        specs = specs_of(ref)
        sizes = self._admin.object_sizes([s.key for s in specs.values()])
        for spec in specs.values():
            size = sizes.get(spec.key)
            if size is None:
                raise FeatureMissing(spec.key)
            if size != (spec.nbytes or SENTINEL):
                raise IntegrityError(
                    f"feature {spec.key!r}: {size} bytes stored, the spec says {spec.nbytes}"
                )

    def gc(self, live: Iterable[str] | None = None, *, min_age_s: float | None = None) -> int:
        """Retry pending removes now; with `live`, remove every sample of this store whose id
        is not in `live` and that has been seen unlisted for `gc_grace_s` (Mooncake keeps no
        object age, so age counts from the first gc that saw it). Returns bytes freed."""
        before, _ = self._admin.metrics()
        self._releases.retry_due(time.monotonic(), everything=True)
        if live is not None:
            live = set(live)
            grace = self.cfg.gc_grace_s if min_age_s is None else min_age_s
            now = time.monotonic()
            groups: dict[tuple[str, int], list[str]] = {}
            for key in self._admin.list_keys(self.store_id):
                p = parse_key(key)
                groups.setdefault((p.sample_id, p.gen), []).append(key)
            self._gc_seen = {s: self._gc_seen.get(s, now) for s in groups if s[0] not in live}
            doomed = [
                k for s, first in self._gc_seen.items() if now - first >= grace for k in groups[s]
            ]
            self._releases.remove(doomed, self._admin.object_sizes(doomed))
        after, _ = self._admin.metrics()
        return max(before - after, 0)

    # ---- the store's view (master admin HTTP) ------------------------------------------------

    def usage(self) -> StoreUsage:
        """The whole cluster's allocated bytes and capacity (the master's view), this store's samples,
        and the bytes of releases still pending here."""
        allocated, capacity = self._admin.metrics()
        self._peak = max(self._peak, allocated)
        keys = self._admin.list_keys(self.store_id)
        samples = {(p.sample_id, p.gen) for p in map(parse_key, keys)}
        return StoreUsage(
            allocated, len(samples), self._peak, self.cfg.budget_bytes, capacity,
            self._releases.pending_bytes(),
        )  # fmt: skip

    # ---- sweep / purge / close primitives (StoreBase) ----------------------------------------

    def _stored(self) -> list[Stored]:
        groups: dict[tuple[str, int], list[str]] = {}
        for key in self._admin.list_keys(self.store_id):
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
        sizes = self._admin.object_sizes(keys)  # the admin endpoint takes no read lease
        freed = 0
        for i in range(0, len(keys), 1024):  # bounded RPCs
            chunk = keys[i : i + 1024]
            if not force:
                freed += self._releases.remove(chunk, sizes)
                continue
            self._releases.forget(chunk)
            codes = self._client.batch_remove(chunk, True)
            freed += sum(sizes.get(k, 0) for k, c in zip(chunk, codes, strict=True) if c == OK)
        self._metrics_at = -1e9  # the next budget check asks the master again
        return freed

    def _purge_rest(self) -> int:
        """Keys the listing did not show (a put finishing meanwhile) go by pattern, forced;
        nothing of this store stays pending here."""
        self._client.remove_by_regex(f"^{re.escape(self.store_id + '/')}", True)
        self._releases.clear()
        self._gc_seen.clear()
        return 0  # sizes unknown: the listed objects were counted by _drop

    def _settle(self, deadline: float) -> int:
        return self._releases.settle(deadline)

    def _shutdown(self) -> None:
        """Stop the retrier and let go of the client. Removes still refused are named in a
        warning: the next sweep(done) re-derives them from the trainer's record."""
        _open_handles.discard(self)
        self._releases.close()
        self._screener.close()
        disconnect(self._conn)


_open_handles: weakref.WeakSet[MooncakeStore] = weakref.WeakSet()


# Registered after mooncake_client's _close_connections (imported above), so it runs before it (atexit is last in, first out):
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
