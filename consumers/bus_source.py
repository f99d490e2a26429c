"""The disaggregated source: SampleRefs leased from the trainers' group, tensors from the store.

`take(n)` fetches refs and returns `Item`s with their tensors; a ref already trained is acked
and skipped, one of another strategy/target/tokenizer is dead-lettered, one whose tensors are
gone triggers a recapture (its task republished with the next generation, the stale ref acked
as superseded), one the capture audit finds wrong is dead-lettered `capture_mismatch`
(core/audit.py: a sampled fraction recomputed by a reference forward, compared layer by layer). Retired sequences are reported by `drain_retired()`. docs/architecture.md,
"Tensors are a cache". `LiveSource` is the same for a live run's refs (docs/live.md): the
data never ends, a ref whose tensors are gone is dead-lettered (the capture was the data), so
a trained ref's tensors are held until a checkpoint covers it (`checkpointed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any

from specbus.bus.lease import Lease, Leases
from specbus.bus.run import RunBus
from specbus.bus.settlement import LeaseSettlement
from specbus.bus.subjects import TRAINERS
from specbus.core.audit import CaptureAudit
from specbus.core.config import StoreConfig
from specbus.core.contracts import PromptTask, SampleRef
from specbus.core.errors import (
    FeatureMissing,
    IntegrityError,
    RecordError,
    StoreError,
    StoreUnavailable,
)
from specbus.core.source import Item, Trained, Upstream
from specbus.core.store import open_store
from specbus.core.store.retry import while_unavailable
from specbus.core.telemetry import link_to_current, span

log = logging.getLogger("specbus.loader")


def _key(lease: Lease) -> tuple[int, str, int]:
    """The ledger key of a leased ref: (SAMPLES seq, sample id, the TASKS seq it came from)."""
    ref: SampleRef = lease.record
    return lease.seq, ref.sample_id, ref.task_seq


class BusSource(LeaseSettlement):
    """The disaggregated `core.source.Source`: `group` is this rank's member of the run's
    "trainers" group; refs of another strategy/target/tokenizer or missing a `features` name
    are dead-lettered; `trained` (the loader's ledger) skips refs already in the model; `store`
    (the run's section) opens the stores refs name and bounds the wait for an unavailable one
    (`store.unavailable_give_up_s`, the lease kept alive meanwhile)."""

    # Its tensors live in a store every rank reads: the loader frees them only after the next
    # lockstep exchange (every rank has recorded them by then; consumers/loader.py).
    shared_store = True

    def __init__(
        self,
        run: RunBus,
        group: Leases,
        *,
        strategy: str,
        features: tuple[str, ...],
        target_fingerprint: str | None = None,
        tokenizer_fingerprint: str | None = None,
        trained: Trained | None = None,
        store: StoreConfig | None = None,
        audit: CaptureAudit | None = None,
    ):
        self.runbus, self.bus, self.run, self.group = run, run.bus, run.run, group
        self.strategy, self.features = strategy, tuple(features)
        self.target_fingerprint, self.tokenizer_fingerprint = (
            target_fingerprint,
            tokenizer_fingerprint,
        )
        self.trained = trained
        self.audit = audit  # the capture audit (None: off)
        # refs' stores are opened with the run's store settings (crc, http token, pools)
        self.store_cfg = store if store is not None else StoreConfig()
        self._stores: dict[str, Any] = {}
        self._retired: list[tuple[int, str, int]] = []
        self._later: list[SampleRef] = []  # skipped refs whose keys the next release frees
        self._later_lock = threading.Lock()
        self.stats = {"recaptures": 0, "dead_letters": 0, "skipped": 0, "audited": 0,
                      "capture_mismatch": 0}  # fmt: skip

    # -- helpers -----------------------------------------------------------------------
    def _open(self, uri: str):
        return open_store(self.store_cfg.model_copy(update={"uri": uri}))

    def store(self, uri: str):
        """The store a ref's `store_uri` names, opened once (training thread)."""
        if uri not in self._stores:
            self._stores[uri] = self._open(uri)
        return self._stores[uri]

    async def _store(self, uri: str):
        """The store of `uri`, opened off the bus loop: opening one (a Mooncake client) can
        take seconds, during which the heartbeats of every held lease must go on."""
        if uri not in self._stores:
            store = await asyncio.to_thread(self._open, uri)
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
        await self.runbus.dead_letter(lease, reason, detail)
        self.stats["dead_letters"] += 1
        self._retired.append(_key(lease))

    async def _recapture(self, lease: Lease, why: Exception) -> None:
        ref: SampleRef = lease.record
        attrs = {"sample_id": ref.sample_id, "generation": ref.generation + 1, "why": str(why)}
        with span("recapture", attributes=attrs):  # the republished task carries it on
            await self._request_recapture(lease, ref, why)

    async def _request_recapture(self, lease: Lease, ref: SampleRef, why: Exception) -> None:
        stored = await self.runbus.task(ref.task_seq)
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
        await self.runbus.publisher.publish(self.runbus.names.tasks, again)
        # superseded: the ref and its task are settled (a copy of either, or a republish of
        # the task, is never recaptured again)
        self._retired.append(_key(lease))
        log.info(
            "recapture of %s requested (g%d -> g%d): %s",
            ref.sample_id,
            ref.generation,
            ref.generation + 1,
            why,
        )
        await lease.ack()  # superseded by the recapture: done, never trained
        self.stats["recaptures"] += 1

    # -- Source protocol -----------------------------------------------------------------
    async def take(self, n: int, timeout_s: float) -> list[Item]:
        """Up to `n` items with their tensors loaded (see the module doc for what is skipped,
        dead-lettered or recaptured); [] after `timeout_s` when nothing came."""
        items: list[Item] = []
        for lease in await self.group.fetch(n, timeout_s):
            # one `lease` span per ref, under the span that published it: the store read, and
            # a recapture or dead letter when it comes to that; the step follows from it
            with span("lease", parent=lease.headers,
                      attributes={"seq": lease.seq, "sample_id": lease.record.sample_id,
                                  "deliveries": lease.deliveries}):  # fmt: skip
                item = await self._take_one(lease)
            if item is not None:
                items.append(item)
        return items

    async def _release_skipped(self, ref: SampleRef) -> None:
        """The keys of a ref the ledger already holds, settled at take time: freed with the
        next `release` (after the loader's next lockstep exchange, when every rank's ledger
        holds the sample: a rank reading them meanwhile must not find them gone)."""
        with self._later_lock:
            self._later.append(ref)

    async def _take_one(self, lease: Lease) -> Item | None:
        """The item of one leased ref, or None when it was settled here instead."""
        ref: SampleRef = lease.record
        if self.trained is not None and self.trained.contains(*_key(lease)):
            await lease.ack()
            if self._problem(ref) is None:  # its keys (maybe another generation's)
                await self._release_skipped(ref)
            self.stats["skipped"] += 1
            self._retired.append(_key(lease))  # its sequence and task are settled
            return None
        problem = self._problem(ref)
        if problem:
            await self._dead(lease, "invalid", problem)
            return None
        try:
            store = await self._store(ref.store_uri)
            # a restarting store node: wait for it, the lease kept alive (no delivery spent)
            tensors = await while_unavailable(
                lambda store=store, ref=ref: store.get(ref, self.features),
                what=f"reading {ref.sample_id}",
                give_up_s=self.store_cfg.unavailable_give_up_s,
                keepalive=lease.in_progress,
            )
        except (FeatureMissing, IntegrityError) as e:
            if self.trained is not None and self.trained.contains(*_key(lease)):
                await lease.ack()  # trained (and released) by another rank meanwhile
                self.stats["skipped"] += 1
                self._retired.append(_key(lease))
            else:
                await self._recapture(lease, e)
            return None
        except StoreUnavailable as e:  # past store.unavailable_give_up_s: the rank stops
            # A nak would spend one of the ref's deliveries on the store's condition, and
            # every ref after it would meet the same store: stop loudly instead (the lease
            # goes back when the loader closes; a resume replays it).
            log.error("the store stayed unavailable for store.unavailable_give_up_s=%.0fs "
                      "reading %s: stopping (%s)", self.store_cfg.unavailable_give_up_s,
                      ref.sample_id, e)  # fmt: skip
            raise
        except StoreError as e:  # another failure of this read: counts toward max_deliver
            log.warning("store error on %s, nak: %s", ref.sample_id, e)
            await lease.nak(5.0)
            return None
        audited = self.audit is not None and self.audit.wants(
            ref.sample_id, ref.generation, ref.provenance.engine
        )
        if audited and not await self._audited(lease, ref, tensors):
            return None
        return Item(
            seq=lease.seq,
            sample_id=ref.sample_id,
            num_tokens=ref.num_tokens,
            lease=lease,
            tensors=tensors,
            links=[link_to_current()],
            redelivered=lease.deliveries > 1,
            stored=ref,
            nbytes=ref.nbytes,
            task_seq=ref.task_seq,
        )

    async def _audited(self, lease: Lease, ref: SampleRef, tensors) -> bool:
        """Audit one sample (the reference forward off the loop, its lease kept alive); False
        when it is wrong: dead-lettered `capture_mismatch` and its tensors released."""
        with span("audit", attributes={"sample_id": ref.sample_id}):
            work = asyncio.ensure_future(asyncio.to_thread(self.audit.check, tensors))
            while not work.done():
                await asyncio.wait({work}, timeout=5.0)
                if not work.done():
                    await lease.in_progress()
            result = work.result()
        if result is None:  # the audit turned itself off
            return True
        self.stats["audited"] += 1
        ok = result.ok
        if ok:
            self.audit.passed(ref.sample_id, ref.generation)
        else:
            self.stats["capture_mismatch"] += 1
            await self._dead(lease, "capture_mismatch",
                             f"{result.describe()} (engine {ref.provenance.engine}, producer "
                             f"{ref.provenance.producer_id})")  # fmt: skip
            with contextlib.suppress(StoreError):
                (await self._store(ref.store_uri)).release(ref)
        try:
            await self.runbus.kv.add_audit(self.audit.name, audited=1, mismatches=int(not ok))
        except Exception as e:  # noqa: BLE001 - the counts are for `specbus status`
            log.warning("could not record the audit counts: %s", e)
        return ok

    async def upstream(self) -> Upstream:
        """The trainers' group drained (`RunBus.drained`) and no delivery buffered here.
        (Checked after an empty `take`: nothing can come to this rank any more except a
        recapture, which makes the producers' lag non-zero again.)"""
        if self.group.buffered:
            return Upstream(False, waiting_for="deliveries buffered here")
        return await self.runbus.drained(TRAINERS)

    def release(self, items: list[Item]) -> None:
        """Free the items' tensors in their stores (after ack, and after the next lockstep
        exchange: `Loader`), and those of refs skipped at take time since the last call: a
        released ref that comes again (a resume's replay) is recaptured from its task."""
        with self._later_lock:
            later, self._later = self._later, []
        for item in items:
            self.store(item.stored.store_uri).release(item.stored)
        for ref in later:
            with contextlib.suppress(StoreError):
                self.store(ref.store_uri).release(ref)

    def checkpointed(self) -> None:
        """Nothing held back: `release` frees at once."""

    def usage(self):
        """The store's residency as this rank sees it (None before the first ref)."""
        return next(iter(self._stores.values())).usage() if self._stores else None

    def drain_retired(self) -> list[tuple[int, str, int]]:
        """Keys retired here (dead-lettered, superseded, skipped) since the last call."""
        out, self._retired = self._retired, []
        return out

    def close(self) -> None:
        """Close every store opened; the leases are the loader's to give back first."""
        for store in self._stores.values():
            store.close()


class LiveSource(BusSource):
    """The source of a live run (`deployment.mode: live`): SampleRefs the intake published
    from serving traffic. As `BusSource`, except that the data never ends (a stop signal,
    `training.max_steps` or `training.max_minutes` ends training), a ref whose tensors are
    gone is dead-lettered `lost` (a live capture has no task to capture again), and so the
    tensors of a trained ref are held in the store until a checkpoint covers it
    (`checkpointed`), not freed at its ack: a world killed after training it resumes from the
    checkpoint before, and the replay trains it again from the same tensors."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # trained refs whose tensors wait for a checkpoint, by key (duplicates hold one entry);
        # filled by the training thread (release) and the bus loop (take's skipped refs)
        self._held: dict[tuple[str, str, int], SampleRef] = {}
        self._held_lock = threading.Lock()

    def _hold(self, refs: list[SampleRef]) -> None:
        with self._held_lock:
            for ref in refs:
                self._held[(ref.store_uri, ref.sample_id, ref.generation)] = ref

    def release(self, items: list[Item]) -> None:
        """Hold the trained items' tensors until `checkpointed` (see the class doc)."""
        self._hold([item.stored for item in items])

    async def _release_skipped(self, ref: SampleRef) -> None:
        # A ref the ledger holds, delivered again: its keys are the sample's (generation 0),
        # which a rank may hold for a checkpoint that is not written yet.
        self._hold([ref])

    def checkpointed(self) -> None:
        """A durable checkpoint covers every ref held: free their tensors. A store that
        refuses is logged, not fatal: the sweep at the end of the run (or at a resume) frees
        what the checkpoint holds."""
        with self._held_lock:
            refs, self._held = list(self._held.values()), {}
        failed = 0
        for ref in refs:
            try:
                self.store(ref.store_uri).release(ref)
            except StoreError as e:
                failed += 1
                error = e
        if failed:
            log.warning("could not release %d of %d trained live samples covered by a "
                        "checkpoint (the run's sweep will): %s", failed, len(refs), error)  # fmt: skip

    def close(self) -> None:
        """Close the stores. Held tensors stay: no checkpoint covers them, so a resume trains
        them again (or, covered after all, its sweep frees them)."""
        if self._held:
            log.info("%d trained live samples not covered by a checkpoint keep their tensors "
                     "for a resume", len(self._held))  # fmt: skip
        super().close()

    async def _recapture(self, lease: Lease, why: Exception) -> None:
        await self._dead(lease, "lost", f"live capture's tensors unavailable: {why}")

    async def upstream(self) -> Upstream:
        """Never drained: more traffic can always come."""
        if self.group.buffered:
            return Upstream(False, waiting_for="deliveries buffered here")
        return Upstream(False, waiting_for="live traffic (captures from serving servers)")
