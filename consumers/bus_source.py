"""The disaggregated source: SampleRefs leased from the trainers' group, tensors from the store.

`take(n)` fetches up to `n` refs and, for each:
- already in the model (the ledger holds it: a replay after a resume, a redelivery) -> acked
  and released, skipped (an early skip that saves the store read; the loader's filter after
  the lockstep gather is what guarantees exactly once);
- of another strategy, target or tokenizer, or missing a feature the strategy needs ->
  dead-lettered with the reason (the run goes on);
- tensors missing or corrupt in the store (released after an earlier ack, a dead store node,
  a failed CRC) -> a recapture: the task is read back from TASKS by the ref's `task_seq` and
  republished with the next generation (its dedup id makes concurrent requests one), and the
  stale ref is acked as superseded; if the task is gone too, the ref is dead-lettered;
- otherwise returned as an `Item` with its tensors and a trace link to its capture.
Refs retired here (superseded, dead) are reported by `drain_retired()` so the cursor can pass
them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from specbus.bus.connection import Bus
from specbus.bus.dead import dead_letter
from specbus.bus.lag import lag
from specbus.bus.lease import Lease, Leases
from specbus.bus.publisher import Publisher
from specbus.bus.replay import get as get_stored
from specbus.bus.subjects import PRODUCERS, TRAINERS, Names
from specbus.bus.topology import RunKV
from specbus.consumers.source import GroupSettlement, Item, Trained, Upstream
from specbus.core.contracts import PromptTask, SampleRef
from specbus.core.errors import FeatureMissing, IntegrityError, RecordError, StoreError
from specbus.core.store import open_store
from specbus.core.telemetry import extract_link

log = logging.getLogger("specbus.loader")


class BusSource(GroupSettlement):
    def __init__(
        self,
        bus: Bus,
        run: str,
        group: Leases,
        kv: RunKV,
        *,
        strategy: str,
        features: tuple[str, ...],
        target_fingerprint: str | None = None,
        tokenizer_fingerprint: str | None = None,
        trained: Trained | None = None,
        open_store_fn: Callable[[str], Any] = open_store,
        live: bool = False,
    ):
        self.bus, self.run, self.group, self.kv = bus, run, group, kv
        self.names = Names(run)
        self.publisher = Publisher(bus)
        self.strategy, self.features = strategy, tuple(features)
        self.target_fingerprint, self.tokenizer_fingerprint = (
            target_fingerprint,
            tokenizer_fingerprint,
        )
        self.trained = trained
        self._open_store_fn = open_store_fn
        self._stores: dict[str, Any] = {}
        self._retired: list[int] = []
        self._feed_count: int | None = None
        self.live = live  # refs from the live intake: no feed-complete, no recapture
        self.stats = {"recaptures": 0, "dead_letters": 0, "skipped": 0}

    # -- helpers -----------------------------------------------------------------------
    def store(self, uri: str):
        if uri not in self._stores:
            self._stores[uri] = self._open_store_fn(uri)
        return self._stores[uri]

    async def _store(self, uri: str):
        """The store of `uri`, opened off the bus loop: opening one (a Mooncake client) can
        take seconds, during which the heartbeats of every held lease must go on."""
        if uri not in self._stores:
            store = await asyncio.to_thread(self._open_store_fn, uri)
            self._stores.setdefault(uri, store)
        return self._stores[uri]

    def _problem(self, ref: SampleRef) -> str | None:
        if ref.run_id != self.run:
            return f"ref of run {ref.run_id!r} on run {self.run!r}"
        if ref.strategy != self.strategy:
            return f"ref strategy {ref.strategy!r} != trainer strategy {self.strategy!r}"
        if self.target_fingerprint and ref.target_fingerprint != self.target_fingerprint:
            return f"target fingerprint {ref.target_fingerprint} != run target {self.target_fingerprint}"
        if self.tokenizer_fingerprint and ref.tokenizer_fingerprint != self.tokenizer_fingerprint:
            return f"tokenizer fingerprint {ref.tokenizer_fingerprint} != run tokenizer {self.tokenizer_fingerprint}"
        missing = set(self.features) - set(ref.features)
        if missing:
            return f"ref lacks features {sorted(missing)}"
        return None

    async def _dead(self, lease: Lease, reason: str, detail: str) -> None:
        log.warning("dead-lettering sample seq %d: %s: %s", lease.seq, reason, detail)
        await dead_letter(self.publisher, self.names, lease, reason, detail)
        self.stats["dead_letters"] += 1
        self._retired.append(lease.seq)

    async def _recapture(self, lease: Lease, why: Exception) -> None:
        ref: SampleRef = lease.record
        if self.live:  # a live capture has no task to capture again: its tensors were the data
            await self._dead(lease, "lost", f"live capture's tensors unavailable: {why}")
            return
        stored = await get_stored(self.bus, self.names.tasks_stream, ref.task_seq)
        if stored is None:
            await self._dead(
                lease,
                "lost",
                f"tensors unavailable ({why}) and task seq {ref.task_seq} is gone from TASKS",
            )
            return
        try:
            task = PromptTask.from_bytes(stored.data)
        except RecordError as e:
            await self._dead(
                lease, "lost", f"tensors unavailable and task seq {ref.task_seq} unreadable: {e}"
            )
            return
        again = task.model_copy(update={"generation": ref.generation + 1, "source": "recapture"})
        await self.publisher.publish(self.names.tasks, again)
        log.info(
            "recapture of %s requested (g%d -> g%d): %s",
            ref.sample_id,
            ref.generation,
            ref.generation + 1,
            why,
        )
        await lease.ack()  # superseded by the recapture: done, never trained
        self.stats["recaptures"] += 1
        self._retired.append(lease.seq)

    # -- Source protocol -----------------------------------------------------------------
    async def take(self, n: int, timeout_s: float) -> list[Item]:
        items: list[Item] = []
        for lease in await self.group.fetch(n, timeout_s):
            ref: SampleRef = lease.record
            if self.trained is not None and self.trained.contains(lease.seq, ref.sample_id):
                await lease.ack()
                self.stats["skipped"] += 1
                if self._problem(ref) is None:  # its keys (maybe another generation's)
                    with contextlib.suppress(StoreError):
                        (await self._store(ref.store_uri)).release(ref)
                continue
            problem = self._problem(ref)
            if problem:
                await self._dead(lease, "invalid", problem)
                continue
            try:
                store = await self._store(ref.store_uri)
                tensors = await asyncio.to_thread(store.get, ref, self.features)
            except (FeatureMissing, IntegrityError) as e:
                if self.trained is not None and self.trained.contains(lease.seq, ref.sample_id):
                    await lease.ack()  # trained (and released) by another rank meanwhile
                    self.stats["skipped"] += 1
                else:
                    await self._recapture(lease, e)
                continue
            except StoreError as e:  # store unreachable: give it back, try later
                log.warning("store error on %s, nak: %s", ref.sample_id, e)
                await lease.nak(1.0)
                continue
            items.append(
                Item(
                    seq=lease.seq,
                    sample_id=ref.sample_id,
                    num_tokens=ref.num_tokens,
                    lease=lease,
                    tensors=tensors,
                    links=[extract_link(lease.headers)],
                    redelivered=lease.deliveries > 1,
                    stored=ref,
                )
            )
        return items

    async def upstream(self) -> Upstream:
        """Done when the feed is complete, no task is pending or in work at the producers, no
        ref is undelivered and none is buffered here. (Checked after an empty `take`: nothing
        can come to this rank any more except a recapture, which makes the producers' lag
        non-zero again.) `ack_pending` is the trainers' delivered-and-unacked count."""
        if self.group.buffered:
            return Upstream(False, waiting_for="deliveries buffered here")
        if self.live:  # live traffic never ends: a stop, max_steps or max_minutes ends training
            return Upstream(False, waiting_for="live traffic (captures from serving servers)")
        if self._feed_count is None:
            self._feed_count = await self.kv.feed_complete()
            if self._feed_count is None:
                return Upstream(False, waiting_for="the feeder (feed not complete)")
        upstream = await lag(self.bus, self.run, PRODUCERS)
        if upstream.messages:
            idle = (
                "; no producer is capturing: are they running?" if not upstream.ack_pending else ""
            )
            return Upstream(
                False,
                waiting_for=f"producers: {upstream.pending} tasks pending, "
                f"{upstream.ack_pending} in capture{idle}",
            )
        mine = await lag(self.bus, self.run, TRAINERS)
        if mine.pending:
            return Upstream(False, mine.ack_pending, f"{mine.pending} refs not delivered yet")
        return Upstream(True, mine.ack_pending)

    def release(self, items: list[Item]) -> None:
        for item in items:
            self.store(item.stored.store_uri).release(item.stored)

    def usage(self):
        """The store's residency as this rank sees it (None before the first ref)."""
        return next(iter(self._stores.values())).usage() if self._stores else None

    def drain_retired(self) -> list[int]:
        out, self._retired = self._retired, []
        return out

    def close(self) -> None:
        for store in self._stores.values():
            store.close()
