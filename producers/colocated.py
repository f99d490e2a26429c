"""The colocated source: a trainer rank that is its own producer.

It leases PromptTasks from the run's "producers" group, captures them with the rank's own
target engine into a `mem://` store, and hands them to the same loader, lockstep windows,
trainer and checkpoints as the disaggregated path; the tasks are acked at the optimizer
boundary (the TASKS sequence is the cursor). The loader runs it with `prefetch=0`, so the
capture of the next window starts only after the previous window was committed and its
tensors released: residency never exceeds one window, and long-sequence features never
overlap. No SAMPLES stream and no remote store are involved.

A task whose capture fails is nak'd with a delay or dead-lettered on its last delivery
(the same rule as the capture worker); a task the checkpoint already holds is acked and
skipped without being captured.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from bus.connection import Bus
from bus.lag import lag
from bus.lease import Leases
from bus.publisher import Publisher
from bus.subjects import PRODUCERS, Names
from bus.topology import RunKV
from consumers.source import GroupSettlement, Item
from core.config import BusConfig, RunConfig
from core.contracts import PromptTask
from core.errors import ConfigError
from core.islands import IslandPlan
from core.models.target import TargetInfo
from core.strategies.base import FeatureContract
from core.telemetry import tracer
from producers.capture import capture_isolated, sample_id_of, settle_failure


def validate_colocated(cfg: RunConfig, info: TargetInfo, world: int) -> IslandPlan:
    """Fail fast, by name, on a colocated setup that cannot work. Returns the island plan."""
    for key in ("sequence_parallel", "target_dp", "target_ep"):
        value = getattr(cfg.deployment, key)
        if value > 1:
            raise ConfigError(
                f"deployment.{key}={value} is not supported in colocated mode (use 1)"
            )
    context = cfg.target.context_length or info.max_position_embeddings
    if cfg.data.max_length > context:
        raise ConfigError(
            f"data.max_length={cfg.data.max_length} leaves no headroom in the target's context of {context} tokens"
        )
    plan = IslandPlan(world=world, tp=cfg.target.tp_size, micro_batch=cfg.training.micro_batch,
                      accumulation=cfg.training.accumulation)  # fmt: skip
    if cfg.target.tp_size > 1 and cfg.target.engine == "hf":
        raise ConfigError(
            f"target.tp_size={cfg.target.tp_size} needs a tensor-parallel engine; the hf engine runs tp_size=1"
        )
    need = plan.island_batch * cfg.data.max_length
    if cfg.target.max_total_tokens is not None and cfg.target.max_total_tokens < need:
        raise ConfigError(
            f"target.max_total_tokens={cfg.target.max_total_tokens} cannot hold one island batch "
            f"({plan.island_batch} samples x data.max_length {cfg.data.max_length} = {need} tokens)"
        )
    return plan


class ColocatedSource(GroupSettlement):
    def __init__(
        self,
        bus: Bus,
        run: str,
        group: Leases,
        kv: RunKV,
        engine,
        contract: FeatureContract,
        store,
        bus_cfg: BusConfig,
        *,
        skip: Callable[[int, str], bool] = lambda seq, sample_id: False,
        capture_device=None,
    ):
        self.bus, self.run, self.group, self.kv = bus, run, group, kv
        # On a GPU rank the features stay where the target computed them: the trainer reads
        # them from the mem:// store on the same device (no host round trip).
        self.capture_device = capture_device
        self.engine, self.contract, self.store, self.bus_cfg = engine, contract, store, bus_cfg
        self.names = Names(run)
        self.publisher = Publisher(bus)
        self.skip = skip
        self._retired: list[int] = []
        self._tracer = tracer("specbus.colocated")
        self.stats = {"capture_s": 0.0, "captured": 0, "dead_letters": 0, "skipped": 0}

    async def take(self, n: int, timeout_s: float) -> list[Item]:
        leases = []
        for lease in await self.group.fetch(n, timeout_s):
            if self.skip(lease.seq, sample_id_of(lease.record)):
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
            task: PromptTask = lease.record
            if isinstance(result, Exception):
                if await settle_failure(lease, result, self.publisher, self.names, self.bus_cfg):
                    self.stats["dead_letters"] += 1
                    self._retired.append(lease.seq)
                continue
            specs = self.store.put(sample_id_of(task), result, task.generation)
            items.append(
                Item(
                    seq=lease.seq,
                    sample_id=sample_id_of(task),
                    num_tokens=len(task.input_ids or ()),
                    lease=lease,
                    tensors=self.store.get(specs),
                    stored=specs,
                    redelivered=lease.deliveries > 1,
                )
            )
            self.stats["captured"] += 1
        return items

    async def upstream_done(self) -> bool:
        if self.group.buffered or await self.kv.feed_complete() is None:
            return False
        return (await lag(self.bus, self.run, PRODUCERS)).pending == 0

    def release(self, items: list[Item]) -> None:
        for item in items:
            self.store.release(item.stored)

    def usage(self):
        return self.store.usage()

    def drain_retired(self) -> list[int]:
        out, self._retired = self._retired, []
        return out

    def close(self) -> None:
        self.store.close()
