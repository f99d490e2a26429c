"""The colocated source: a trainer rank that is its own producer.

It leases PromptTasks from the run's "producers" group, captures them with the rank's own
target engine into a `mem://` store, and hands them to the same loader, lockstep windows,
trainer and checkpoints as the disaggregated path; the tasks are acked at the optimizer
boundary (the TASKS sequence is the cursor). The loader runs it with
`prefetch=deployment.colocated_prefetch`: with the default 0 the capture of the next window
starts only after the previous window was committed and its tensors released (residency never
exceeds one window, long-sequence features never overlap); with 1 the next window is
captured while the step runs (two windows resident). No SAMPLES stream and no remote store
are involved.

A task whose capture fails is nak'd with a delay or dead-lettered on its last delivery
(the same rule as the capture worker); a task the checkpoint already holds is acked and
skipped without being captured.

Target-TP islands (`target.tp_size = tp > 1`, `core/islands.py`): the island's ranks run one
sharded target, so they must capture the same tasks in the same order.
- Only the island leader leases: per take it fetches up to `tp * n` tasks, captures the
  largest multiple of `tp` of them and keeps the rest leased for its next take (a nak would
  count toward `max_deliver`). It sends the batch (each task's reply subject, record bytes and
  headers) to its peers over the island's gloo group, even an empty one (then with its view of
  the end of data), so every island rank's take returns in step.
- Every island rank captures the whole batch on its island worker thread (FIFO, one job per
  leader message, independent of the bus loop's tasks: a take cancelled at the end of data
  cannot leave a peer alone in a collective). Poison isolation (`capture_isolated`) is
  deterministic, so all ranks see the same failures.
- Settlement: failures are settled once, by the leader (nak with delay / dead letter). The
  good captures are cut into `tp` equal contiguous slices; peer `i` keeps slice `i` in its
  `mem://` store and adopts those leases (`Leases.adopt`: it heartbeats and acks them through
  its own connection); the leader hands the peers' leases over (`Leases.hand_over`). A
  remainder of good captures beyond a multiple of `tp` goes back to the leader's kept leases
  (captured again next take). Equal slices keep every rank's loader room, and so its number
  of takes, the same as its leader's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from specbus.bus.lease import Lease, Leases, parse_record
from specbus.bus.run import RunBus
from specbus.bus.settlement import LeaseSettlement
from specbus.bus.subjects import PRODUCERS
from specbus.core.contracts import PromptTask
from specbus.core.islands import IslandPlan
from specbus.core.source import Item, Trained, Upstream
from specbus.core.strategies.base import FeatureContract
from specbus.core.telemetry import tracer
from specbus.producers.capture import capture_isolated, sample_id_of, settle_failure

log = logging.getLogger("specbus.colocated")


@dataclass
class Island:
    """This rank's place in its target-TP island: the TP mesh its engine shards over and the
    gloo group its leader sends tasks on (None for both when tp == 1)."""

    plan: IslandPlan
    rank: int
    tp_mesh: Any = None
    group: Any = None

    @property
    def tp(self) -> int:
        return self.plan.tp

    @property
    def leader(self) -> int:
        return self.plan.leader_of(self.rank)

    @property
    def is_leader(self) -> bool:
        return self.plan.is_leader(self.rank)

    @property
    def peer(self) -> int:
        """This rank's index in its island (0 = the leader)."""
        return self.rank - self.leader


def join_island(plan: IslandPlan, rank: int, device_type: str) -> Island:
    """Build the island groups. Every rank calls it at the same point (groups are matched by
    creation order): per island, a TP group (the default backend: NCCL on GPU, gloo on CPU)
    as the engine's 1-D mesh, and a gloo group for the leader's task messages (small,
    host-side, off the GPU streams). The TP group is always a new one, never the default
    group (a DeviceMesh over the whole world would reuse it): the capture thread's
    collectives must not interleave with the training thread's."""
    if plan.tp == 1:
        return Island(plan, rank)
    from torch.distributed.device_mesh import DeviceMesh

    tp_groups = [dist.new_group(plan.ranks_of(i)) for i in range(plan.num_islands)]
    task_groups = [
        dist.new_group(plan.ranks_of(i), backend="gloo") for i in range(plan.num_islands)
    ]
    island = plan.island_of(rank)
    mesh = DeviceMesh.from_group(tp_groups[island], device_type, mesh_dim_names=("tp",))
    return Island(plan, rank, mesh, task_groups[island])


class _IslandWorker(threading.Thread):
    """One job per leader message, in order, on every island rank: the leader broadcasts the
    message, peers receive it, then every rank captures the batch (the sharded forward's
    collectives match). Results go to the bus loop's queue as `(message, results)`; an error
    (a dead island rank) as the exception. `None` is the closing message."""

    def __init__(self, island: Island, capture, loop: asyncio.AbstractEventLoop, device):
        super().__init__(name=f"specbus-island-r{island.rank}", daemon=True)
        self.island, self.capture, self.loop, self.device = island, capture, loop, device
        self.results: asyncio.Queue = asyncio.Queue()
        self._jobs: list = []
        self._ready = threading.Condition()

    def submit(self, message: dict | None) -> None:
        """Leader only: queue a message (None closes the island)."""
        with self._ready:
            self._jobs.append(message)
            self._ready.notify()

    def _next(self) -> dict | None:
        if self.island.is_leader:
            with self._ready:
                self._ready.wait_for(lambda: self._jobs)
                message = self._jobs.pop(0)
        else:
            message = None
        box = [message]
        dist.broadcast_object_list(box, src=self.island.leader, group=self.island.group)
        return box[0]

    def run(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            try:
                message = self._next()
                if message is None:
                    return
                tasks = [parse_record(PromptTask, data) for _, data, _ in message["tasks"]]
                results = self.capture(tasks) if tasks else []
                out: Any = (message, results)
            except BaseException as e:  # surfaced by the next take on the bus loop
                out = e
            self.loop.call_soon_threadsafe(self.results.put_nowait, out)
            if isinstance(out, BaseException):
                return


class ColocatedSource(LeaseSettlement):
    """The colocated `core.source.Source`: `group` is this rank's member of the run's
    "producers" group; tasks are captured with `engine` into `store` (a `mem://` one);
    `trained` (the loader's ledger) skips tasks already in the model; `island` is this rank's
    target-TP island (None or tp == 1: none)."""

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
    ):
        self.runbus, self.bus, self.run, self.group = run, run.bus, run.run, group
        # On a GPU rank the features stay where the target computed them: the trainer reads
        # them from the mem:// store on the same device (no host round trip).
        self.capture_device = capture_device
        self.engine, self.contract, self.store = engine, contract, store
        self.bus_cfg = run.bus.cfg
        self.trained = trained
        self._retired: list[int] = []
        self._tracer = tracer("specbus.colocated")
        self.stats = {"capture_s": 0.0, "captured": 0, "dead_letters": 0, "skipped": 0}
        self.island = island if island is not None and island.tp > 1 else None
        self._worker: _IslandWorker | None = None
        self._beat = None  # leader: the heartbeat of everything it holds
        self._kept: list[Lease] = []  # leader: leased, not captured yet (beyond a multiple of tp)
        self._upstream = Upstream(False)  # island: the leader's view, as of the last take
        # Tasks this source nak'd after a failed capture -> when to stop waiting for them. A
        # nak'd task waiting out its delay is ack-pending, not pending, at the broker: without
        # this, the run could end before its next delivery (and its dead letter).
        self._retrying: dict[int, float] = {}

    async def take(self, n: int, timeout_s: float) -> list[Item]:
        if self.island is not None:
            return await self._take_island(n, timeout_s)
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
        with self._tracer.start_as_current_span("capture") as span:
            span.set_attribute("specbus.tasks", len(tasks))
            results = await asyncio.to_thread(
                capture_isolated, self.engine, self.contract, tasks, self.capture_device
            )
        self.stats["capture_s"] += loop.time() - t0
        items = []
        for lease, result in zip(leases, results, strict=True):
            if isinstance(result, Exception):
                await self._failed(lease, result)
                continue
            items.append(self._stored_item(lease, result))
            self.stats["captured"] += 1
        return items

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
        with self._tracer.start_as_current_span("capture") as span:
            span.set_attribute("specbus.tasks", len(tasks))
            return capture_isolated(self.engine, self.contract, tasks, self.capture_device)

    async def _take_island(self, n: int, timeout_s: float) -> list[Item]:
        island = self.island
        if self._worker is None:
            self._worker = _IslandWorker(
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
            batch, self._kept = self._kept[:usable], self._kept[usable:]
            message = {"tasks": [(x.msg.reply, x.msg.data, x.msg.headers) for x in batch]}
            if not batch:
                view = await self._upstream_view()
                message["upstream"] = (view.done, view.ack_pending, view.waiting_for)
            self._worker.submit(message)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        out = await self._worker.results.get()
        if isinstance(out, BaseException):
            raise out
        message, results = out
        if not message["tasks"]:
            self._upstream = Upstream(*message["upstream"])
            return []
        self._upstream = Upstream(False)
        self.stats["capture_s"] += loop.time() - t0
        good = [i for i, r in enumerate(results) if not isinstance(r, Exception)]
        per_peer = len(good) // island.tp
        mine = good[island.peer * per_peer : (island.peer + 1) * per_peer]
        if island.is_leader:
            failed = [(i, r) for i, r in enumerate(results) if isinstance(r, Exception)]
            for i, error in failed:  # settled once, here: every island rank saw the same
                await self._failed(batch[i], error)
            self._kept = [batch[i] for i in good[per_peer * island.tp :]] + self._kept
            theirs = set(good[: per_peer * island.tp]) - set(mine)
            self.group.hand_over(batch[i] for i in sorted(theirs))
            leases = {i: batch[i] for i in mine}
        else:
            leases = {i: self.group.adopt(*message["tasks"][i]) for i in mine}
        items = [self._stored_item(leases[i], results[i]) for i in mine]
        self.stats["captured"] += len(items)
        return items

    async def upstream(self) -> Upstream:
        if self.island is not None:  # the leader's view, as of the last take (same on all)
            return self._upstream
        return await self._upstream_view()

    async def _upstream_view(self) -> Upstream:
        now = asyncio.get_running_loop().time()
        self._retrying = {seq: due for seq, due in self._retrying.items() if due > now}
        if self._retrying:
            return Upstream(False, waiting_for=f"{len(self._retrying)} failed captures to retry")
        if self.group.buffered:
            return Upstream(False, waiting_for="deliveries buffered here")
        return await self.runbus.drained(PRODUCERS)

    def release(self, items: list[Item]) -> None:
        for item in items:
            self.store.release(item.stored)

    def usage(self):
        return self.store.usage()

    def drain_retired(self) -> list[int]:
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
        if self._beat is not None:
            await self._beat.__aexit__(None, None, None)
            self._beat = None
        await super().give_back()

    def close(self) -> None:
        self.store.close()
