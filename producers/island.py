"""Target-TP islands: the ranks of one island run one sharded target on the same tasks.

`join_island` builds, on every rank at the same point, the island's TP group (the engine's
1-D mesh) and the gloo group its leader sends task batches on; `IslandWorker` runs, on every
island rank, one capture per leader message in order (the sharded forward's collectives
match). The planning (who trains what) is core/islands.py; the take protocol (leader fetches,
slices, hands leases over) is `ColocatedSource`'s. docs/architecture.md, "Target-TP islands".
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from specbus.bus.lease import parse_record
from specbus.core.contracts import PromptTask
from specbus.core.islands import IslandPlan


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
        """The island's TP width."""
        return self.plan.tp

    @property
    def leader(self) -> int:
        """The island leader's global rank."""
        return self.plan.leader_of(self.rank)

    @property
    def is_leader(self) -> bool:
        """True on the island's leader."""
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


class IslandWorker(threading.Thread):
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
        """Capture one batch per leader message, in order, until the closing message or a failure (sent
        to the bus loop)."""
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
