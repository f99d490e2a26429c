"""The colocated source: a trainer rank that is its own producer (`deployment.mode: colocated`).

It leases PromptTasks from the run's "producers" group, captures them with the rank's own
engine into a `mem://` store and hands them to the same loader, trainer and checkpoints as the
disaggregated path; tasks are acked at the optimizer boundary. A failed capture is nak'd with
a delay or dead-lettered on its last delivery (as by the capture worker); a task the ledger
holds is acked without capture. A capture that does not fit in the rank's store (its budget)
waits, leased and kept alive, until the loader releases a trained window (no delivery is
spent on it); a budget that cannot hold one window is refused with `StoreFull`. On a GPU rank the capture runs on a CUDA stream of its own,
so with `deployment.colocated_prefetch=1` the next window's prefill overlaps the step. With
target-TP islands (producers/island.py) the island leader leases and every island rank
captures the same batch, keeping its slice. The full semantics (residency, prefetch,
islands): docs/architecture.md, "Colocated" and "Target-TP islands".
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import nullcontext

import torch
from specbus.bus.lease import Lease, Leases
from specbus.bus.run import RunBus
from specbus.bus.settlement import LeaseSettlement
from specbus.bus.subjects import PRODUCERS
from specbus.core.contracts import PromptTask
from specbus.core.errors import StoreFull
from specbus.core.source import Item, Trained, Upstream
from specbus.core.strategies.base import FeatureContract
from specbus.core.telemetry import extract_link, link_to_current, span
from specbus.producers.capture import capture_isolated, sample_id_of, settle_failure
from specbus.producers.island import Island, IslandWorker

log = logging.getLogger("specbus.colocated")


class ColocatedSource(LeaseSettlement):
    """The colocated `core.source.Source`: `group` is this rank's member of the run's
    "producers" group; tasks are captured with `engine` into `store` (a `mem://` one);
    `trained` (the loader's ledger) skips tasks already in the model; `island` is this rank's
    target-TP island (None or tp == 1: none); `window`: the samples of one optimizer step
    on this rank (micro_batch x accumulation), what the store must be able to hold."""

    def __init__(
        self,
        run: RunBus,
        group: Leases,
        engine,
        contract: FeatureContract,
        store,
        *,
        trained: Trained | None = None,
        capture_device=None,
        island: Island | None = None,
        window: int = 1,
    ):
        self.runbus, self.bus, self.run, self.group = run, run.bus, run.run, group
        # On a GPU rank the features stay where the target computed them: the trainer reads
        # them from the mem:// store on the same device (no host round trip).
        self.capture_device = capture_device
        self.engine, self.contract, self.store = engine, contract, store
        self.bus_cfg = run.bus.cfg
        self.trained = trained
        self._retired: list[int] = []
        self.stats = {"capture_s": 0.0, "captured": 0, "dead_letters": 0, "skipped": 0}
        self.island = island if island is not None and island.tp > 1 else None
        self._worker: IslandWorker | None = None
        self._beat = None  # leader: the heartbeat of everything it holds
        self._kept: list[Lease] = []  # leader: leased, not captured yet (beyond a multiple of tp)
        self._upstream = Upstream(False)  # island: the leader's view, as of the last take
        # Tasks this source nak'd after a failed capture -> when to stop waiting for them. A
        # nak'd task waiting out its delay is ack-pending, not pending, at the broker: without
        # this, the run could end before its next delivery (and its dead letter).
        self._retrying: dict[int, float] = {}
        self._stream = None  # CUDA: the capture stream (see _capture_on_stream)
        # Captured tasks waiting for room in the store (lease, features, trace link), kept
        # leased by `_room_beat` until the loader releases a trained window.
        self.window = window
        self._stashed: list[tuple[Lease, dict, object]] = []
        self._room_beat = None
        self._stashed_since = self._reported = 0.0

    def _capture_on_stream(self, tasks: list[PromptTask]) -> list:
        """Capture on a stream of its own on a GPU rank, so that with
        `deployment.colocated_prefetch` the next window's prefill runs beside the training
        step's kernels instead of queued between them on the default stream. The features are
        complete when this returns (the thread waits for the stream), and are marked as used
        by the training thread's stream, so their memory is not reused before it is done."""
        device = self.capture_device
        if device is None or torch.device(device).type != "cuda":
            return capture_isolated(self.engine, self.contract, tasks, device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        with torch.cuda.stream(self._stream):
            results = capture_isolated(self.engine, self.contract, tasks, device)
        consumer = torch.cuda.default_stream(device)
        for result in results:
            if isinstance(result, dict):
                for t in result.values():
                    if t.is_cuda:
                        t.record_stream(consumer)
        self._stream.synchronize()
        return results

    def _on_capture_stream(self):
        """The store's put/get checks (a NaN screen) run on the capture stream: a sync there
        does not wait for the training step queued on the default stream."""
        return torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()

    async def take(self, n: int, timeout_s: float) -> list[Item]:
        """Lease and capture up to `n` tasks, stored in this rank's `mem://` store (an island's leader
        leases for the island; see the module doc); [] after `timeout_s` when nothing came."""
        if self.island is not None:
            return await self._take_island(n, timeout_s)
        if self._stashed:  # captures waiting for room come first, and no new lease meanwhile
            items = await self._unstash()
            if not items:
                await asyncio.sleep(timeout_s)
            return items
        leases = []
        for lease in await self.group.fetch(n, timeout_s):
            self._retrying.pop(lease.seq, None)
            if self._trained(lease):
                await lease.ack()
                self.stats["skipped"] += 1
            else:
                leases.append(lease)
        if not leases:
            return []
        tasks: list[PromptTask] = [lease.record for lease in leases]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with span("capture", parent=leases[0].headers,
                  links=[extract_link(lease.headers) for lease in leases],
                  attributes={"tasks": len(tasks), "first_seq": leases[0].seq}):  # fmt: skip
            results = await asyncio.to_thread(self._capture_on_stream, tasks)
            link = link_to_current()  # the step that trains them follows from this capture
        self.stats["capture_s"] += loop.time() - t0
        for lease, result in zip(leases, results, strict=True):
            if isinstance(result, Exception):
                await self._failed(lease, result)
            else:
                self._stashed.append((lease, result, link))
                self.stats["captured"] += 1
        return await self._unstash()

    async def _unstash(self) -> list[Item]:
        """Store the captures waiting for room, in order, until one does not fit (it waits,
        leased and kept alive, for the loader to release a trained window: a full store is
        not the task's failure). Raises `StoreFull` when the store cannot hold one window."""
        items = []
        while self._stashed:
            lease, features, link = self._stashed[0]
            try:
                with self._on_capture_stream():
                    item = self._stored_item(lease, features)
            except StoreFull as e:
                await self._wait_for_room(e)
                break
            self._stashed.pop(0)
            item.links.append(link)
            items.append(item)
        if not self._stashed and self._stashed_since:
            log.info("room in the rank's store after %.1fs", time.monotonic() - self._stashed_since)
            self._stashed_since = 0.0
        return items

    async def _wait_for_room(self, error: StoreFull) -> None:
        usage = self.store.usage()
        if usage.num_samples < self.window:  # the loader can never hold a whole window
            raise StoreFull(
                f"store.budget_bytes={usage.budget_bytes} cannot hold one window of "
                f"{self.window} samples on this rank (it holds {usage.num_samples}, "
                f"{usage.resident_bytes} B, and the next does not fit: {error}); raise "
                "store.budget_bytes"
            ) from error
        now = time.monotonic()
        if not self._stashed_since:
            self._stashed_since = self._reported = now
            if self._room_beat is None:  # every lease this member holds, stashed ones too
                self._room_beat = await self.group.heartbeat().__aenter__()
        elif now - self._reported >= 30:
            self._reported = now
            log.info("%d captured tasks wait %.0fs for room in the rank's store (%d of %d B, "
                     "%d samples): %s", len(self._stashed), now - self._stashed_since,
                     usage.resident_bytes, usage.budget_bytes, usage.num_samples, error)  # fmt: skip

    def _trained(self, lease: Lease) -> bool:
        return self.trained is not None and self.trained.contains(
            lease.seq, sample_id_of(lease.record)
        )

    def _stored_item(self, lease: Lease, features: dict) -> Item:
        """Put a task's features into the store; the loader's item for them."""
        task: PromptTask = lease.record
        specs = self.store.put(sample_id_of(task), features, task.generation)
        return Item(
            seq=lease.seq,
            sample_id=sample_id_of(task),
            num_tokens=len(task.input_ids or ()),
            lease=lease,
            tensors=self.store.get(specs),
            stored=specs,
            redelivered=lease.deliveries > 1,
        )

    async def _failed(self, lease: Lease, error: Exception) -> None:
        if await settle_failure(self.runbus, lease, error):
            self.stats["dead_letters"] += 1
            self._retired.append(lease.seq)
        else:  # nak'd with a delay: the data is not over before it comes back (see upstream)
            due = asyncio.get_running_loop().time() + self.bus_cfg.nak_delay_s
            self._retrying[lease.seq] = due + self.bus_cfg.ack_wait_s

    # -- target-TP islands (see the module doc) -------------------------------------------
    def _capture(self, tasks: list[PromptTask]) -> list:
        with span("capture", attributes={"tasks": len(tasks)}):
            return capture_isolated(self.engine, self.contract, tasks, self.capture_device)

    async def _take_island(self, n: int, timeout_s: float) -> list[Item]:
        island = self.island
        if self._worker is None:
            self._worker = IslandWorker(
                island, self._capture, asyncio.get_running_loop(), self.capture_device
            )
            self._worker.start()
            if island.is_leader:  # every lease it holds (kept ones too), until close
                self._beat = self.group.heartbeat()
                await self._beat.__aenter__()
        batch: list[Lease] = []
        if island.is_leader:
            for lease in await self.group.fetch(max(island.tp * n - len(self._kept), 0), timeout_s):
                self._retrying.pop(lease.seq, None)
                if self._trained(lease):
                    await lease.ack()
                    self.stats["skipped"] += 1
                else:
                    self._kept.append(lease)
            usable = len(self._kept) // island.tp * island.tp
            view, last = None, False
            if not usable and self._kept:
                # Fewer than tp tasks left: once nothing more can come, they are the island's
                # last batch, cut unevenly (the loader's ragged last step trains them).
                view = await self._upstream_view()
                last = view.done
                usable = len(self._kept) if last else 0
            batch, self._kept = self._kept[:usable], self._kept[usable:]
            message = {"tasks": [(x.msg.reply, x.msg.data, x.msg.headers) for x in batch],
                       "last": last}  # fmt: skip
            if not batch or last:
                view = view or await self._upstream_view()
                message["upstream"] = (view.done, view.ack_pending, view.waiting_for)
            self._worker.submit(message)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        if island.is_leader:  # the result of the message just sent: settled with `batch`
            out = await self._worker.results.get()
        else:
            # A peer does not wait for ever: a leader whose window is full takes no more (it
            # sends nothing) until the ranks train, which may need this peer to conclude the
            # end from the last view it sent. The message comes with a later take. (Polled:
            # a get cancelled by a timeout could drop the result it was handed.)
            deadline = t0 + timeout_s
            while self._worker.results.empty():
                if loop.time() >= deadline:
                    return []
                await asyncio.sleep(0.01)
            out = self._worker.results.get_nowait()
        if isinstance(out, BaseException):
            raise out
        message, results = out
        # the leader's end-of-data view rides on empty batches and on the last one
        self._upstream = (
            Upstream(*message["upstream"]) if "upstream" in message else Upstream(False)
        )
        if not message["tasks"]:
            return []
        self.stats["capture_s"] += loop.time() - t0
        good = [i for i, r in enumerate(results) if not isinstance(r, Exception)]
        # peer p takes good[cuts[p]:cuts[p + 1]]: equal slices (the rest kept for the next
        # take), or, for the last batch (fewer than tp), all of it, one each from the leader
        # on (a single one lands on the leader, which had room: one a full peer gives back
        # at the end comes to rest there)
        tp = island.tp
        if message.get("last"):
            cuts = [-(-len(good) * p // tp) for p in range(tp + 1)]
        else:
            cuts = [len(good) // tp * p for p in range(tp + 1)]
        mine = good[cuts[island.peer] : cuts[island.peer + 1]]
        if island.is_leader:
            failed = [(i, r) for i, r in enumerate(results) if isinstance(r, Exception)]
            for i, error in failed:  # settled once, here: every island rank saw the same
                await self._failed(batch[i], error)
            self._kept = [batch[i] for i in good[cuts[-1] :]] + self._kept
            theirs = set(good[: cuts[-1]]) - set(mine)
            self.group.hand_over(batch[i] for i in sorted(theirs))
            leases = {i: batch[i] for i in mine}
        else:
            leases = {i: self.group.adopt(*message["tasks"][i]) for i in mine}
        items = [self._stored_item(leases[i], results[i]) for i in mine]
        self.stats["captured"] += len(items)
        return items

    async def upstream(self) -> Upstream:
        """The producers' group drained (`RunBus.drained`), nothing buffered here and no failed capture
        to retry; an island's ranks share the leader's view."""
        if self.island is not None:  # the leader's view, as of the last take (same on all)
            return self._upstream
        return await self._upstream_view()

    async def _upstream_view(self) -> Upstream:
        if self._stashed:
            return Upstream(False, waiting_for=f"{len(self._stashed)} captured tasks waiting "
                            "for room in this rank's store")  # fmt: skip
        now = asyncio.get_running_loop().time()
        self._retrying = {seq: due for seq, due in self._retrying.items() if due > now}
        if self._retrying:
            return Upstream(False, waiting_for=f"{len(self._retrying)} failed captures to retry")
        if self.group.buffered:
            return Upstream(False, waiting_for="deliveries buffered here")
        return await self.runbus.drained(PRODUCERS)

    def release(self, items: list[Item]) -> None:
        """Free the items' tensors in this rank's store."""
        for item in items:
            self.store.release(item.stored)

    def checkpointed(self) -> None:
        """Nothing held back: a released task is captured again if it comes back."""

    def usage(self):
        """This rank's store residency."""
        return self.store.usage()

    def drain_retired(self) -> list[int]:
        """Sequences dead-lettered here since the last call."""
        out, self._retired = self._retired, []
        return out

    async def give_back(self) -> None:
        """Island: the leader closes the island (its peers' workers stop after the jobs
        before), then everything still held is given back (kept tasks, batches no take
        consumed)."""
        worker = self._worker
        if worker is not None:
            if self.island.is_leader:
                worker.submit(None)
            await asyncio.to_thread(worker.join, 120)
            if worker.is_alive():
                log.warning("island worker of rank %d did not stop", self.island.rank)
        for beat in (self._beat, self._room_beat):
            if beat is not None:
                await beat.__aexit__(None, None, None)
        self._beat = self._room_beat = None
        self._stashed.clear()  # still leased: given back below
        await super().give_back()

    def close(self) -> None:
        """Close this rank's store (the engine is the caller's)."""
        self.store.close()
