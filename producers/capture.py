"""The capture worker: a member of the "producers" group turning PromptTasks into SampleRefs.

Loop: wait while the store or the trainers' lag is over budget (backpressure), lease up to
`capture_batch` tasks, capture them with the engine (leases kept alive), `store.put` each
sample, publish its SampleRef (awaited), then ack the tasks: a kill at any point loses
nothing. A failing task is retried alone, nak'd with a delay, and dead-lettered on its last
delivery. A put that meets a full store is tried again until the sample fits, the leases kept
alive (producers/backpressure.py): backpressure never spends a delivery. docs/architecture.md,
"Producers"; docs/store.md, "What producers and trainers do on each store error".
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass, field

import torch
from specbus.bus.lease import Lease, Leases
from specbus.bus.run import RunBus
from specbus.bus.subjects import PRODUCERS
from specbus.core.contracts import FeatureSpec, PromptTask, Provenance, SampleRef
from specbus.core.errors import CaptureError, StoreFull, StoreUnavailable
from specbus.core.store.retry import while_unavailable
from specbus.core.strategies.base import FeatureContract
from specbus.core.telemetry import extract_link, span
from specbus.producers.backpressure import REPORT_EVERY_S, GiveBack, RoomWait, trainers_lag

log = logging.getLogger("specbus.producer")


@dataclass
class CaptureStats:
    """What one capture worker did (counts, seconds, tokens). `dead_letters`: the tasks this
    worker dead-lettered itself; `run_dead_letters`: every dead letter of the run's TASKS
    (the broker's max-deliveries ones included), read from DEAD at the end (None: not read);
    `store_waits` / `store_wait_s`: puts that found the store full and waited for room."""

    tasks: int = 0
    samples: int = 0
    failures: int = 0
    dead_letters: int = 0
    run_dead_letters: int | None = None
    dead_reasons: dict[str, int] = field(default_factory=dict)
    backpressure_waits: int = 0
    store_waits: int = 0
    store_wait_s: float = 0.0
    capture_s: float = 0.0
    tokens: int = 0
    started: float = field(default_factory=time.perf_counter)

    def summary(self) -> str:
        """The line `specbus produce` ends with."""
        if self.run_dead_letters is None:
            dead = f"{self.dead_letters} dead letters (the run's unknown)"
        else:
            reasons = ", ".join(f"{n} {r}" for r, n in sorted(self.dead_reasons.items()))
            dead = (f"{self.run_dead_letters} dead letters in the run"
                    + (f" ({reasons})" if reasons else "")
                    + f", {self.dead_letters} by this producer")  # fmt: skip
        return (f"{self.samples} samples from {self.tasks} tasks, {self.failures} failures, "
                f"{dead}; waited for store room {self.store_waits} times "
                f"({self.store_wait_s:.1f}s), capture {self.capture_s:.1f}s")  # fmt: skip


def sample_id_of(task: PromptTask) -> str:
    """A sample is one task in one epoch; its recaptures share the id (new generation)."""
    return f"{task.task_id}-e{task.epoch}"


def _token_tensors(tasks: list[PromptTask]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    for task in tasks:
        if task.input_ids is None:
            raise CaptureError(
                f"task {task.task_id} has no input_ids (the feeder tokenises conversations)"
            )
    ids = [torch.tensor(t.input_ids, dtype=torch.long) for t in tasks]
    masks = [
        torch.tensor(
            t.loss_mask if t.loss_mask is not None else [1] * len(t.input_ids), dtype=torch.long
        )
        for t in tasks
    ]
    return ids, masks


def capture_isolated(
    engine, contract: FeatureContract, tasks: list[PromptTask], device=None
) -> list[dict[str, torch.Tensor] | Exception]:
    """Capture a batch; if it fails, capture its tasks one by one so only the poisoned fail.

    Returns one tensor dict or the exception per task, in order; tensors on `device` (None:
    the engine's default, host memory).
    """
    try:
        ids, masks = _token_tensors(tasks)
        return list(engine.capture(ids, masks, contract, device=device))
    except Exception as e:
        if len(tasks) == 1:
            return [e]
        log.warning("batch capture failed (%s); retrying %d tasks one by one", e, len(tasks))
        return [capture_isolated(engine, contract, [task], device)[0] for task in tasks]


async def settle_failure(run: RunBus, lease: Lease, error: Exception) -> bool:
    """A task failed to capture: nak it with a delay (`bus.nak_delay_s`), or dead-letter it
    (`capture_failed`, with the error) on its last delivery (`bus.max_deliver`).

    Returns True when it was dead-lettered.
    """
    bus_cfg = run.bus.cfg
    if lease.deliveries >= bus_cfg.max_deliver:
        log.warning("task seq %d failed on its last delivery, dead-lettering: %s", lease.seq, error)
        await run.dead_letter(lease, "capture_failed", f"{type(error).__name__}: {error}")
        return True
    log.info(
        "task seq %d capture failed (delivery %d), nak: %s", lease.seq, lease.deliveries, error
    )
    await lease.nak(bus_cfg.nak_delay_s)
    return False


class CaptureWorker:
    """One member of the run's "producers" group (`group`): captures `capture_batch` tasks at a
    time with `engine` into `store` and publishes a SampleRef per sample (see the module doc).
    `run()` returns when the trainers mark the run complete, on `stop()`, or (with
    `exit_when_idle`) when the feed is complete and no task is left anywhere. A full store is
    waited out for as long as it lasts, an unavailable one (a restarting store node) for up
    to `unavailable_give_up_s` per put, the batch's leases kept alive; then `run()` raises
    the `StoreUnavailable` (the batch's tasks not published go back). A stop or the end of
    training during a wait gives the tasks back."""

    def __init__(
        self,
        run: RunBus,
        group: Leases,
        engine,
        store,
        contract: FeatureContract,
        *,
        capture_batch: int,
        producer_id: str | None = None,
        exit_when_idle: bool = False,
        unavailable_give_up_s: float = 300.0,
    ):
        self.run_bus, self.group = run, group
        self.bus_cfg = run.bus.cfg
        self.engine, self.store, self.contract = engine, store, contract
        self.capture_batch = capture_batch
        self.producer_id = producer_id or f"{socket.gethostname()}-{os.getpid()}"
        self.exit_when_idle = exit_when_idle
        self.unavailable_give_up_s = unavailable_give_up_s
        self.stats = CaptureStats()
        self.report_every_s = REPORT_EVERY_S  # a wait for the store says what it waits for
        self._stop = asyncio.Event()
        self._polled_at = float("-inf")
        self._train_complete = False
        self._lag_bytes = 0

    def stop(self) -> None:
        """Ask `run()` to return after the batch in progress."""
        self._stop.set()

    # -- loop ----------------------------------------------------------------------------
    async def run(self) -> CaptureStats:
        """Capture until the run is marked trained, `stop()`, or (with `exit_when_idle`) nothing is
        left; returns the stats."""
        while not self._stop.is_set():
            await self._poll_broker()
            if self._train_complete:
                break
            if await self._over_budget():
                self.stats.backpressure_waits += 1
                await asyncio.sleep(0.05)
                continue
            leases = await self.group.fetch(self.capture_batch, self.bus_cfg.fetch_timeout_s)
            if leases:
                await self._capture(leases)
            elif self.exit_when_idle and await self._idle():
                break
        return self.stats

    async def _poll_broker(self, every_s: float = 0.25) -> None:
        """Refresh the run's train-complete marker and the trainers' lag, at most every
        `every_s` (two broker round trips; not one per capture batch)."""
        now = time.monotonic()
        if now - self._polled_at < every_s:
            return
        self._polled_at = now
        self._train_complete = await self.run_bus.kv.train_complete() is not None
        lag = await trainers_lag(self.run_bus)
        if lag is not None:  # else the last value stands
            self._lag_bytes = lag.bytes

    async def _over_budget(self) -> bool:
        """Backpressure: store residency (exact, every batch) or refs not yet consumed (bytes,
        as of the last broker poll) at 90 % of the budget, or of what the store can hold when
        that is less (a /dev/shm smaller than the budget)."""
        usage = await while_unavailable(self.store.usage, what="reading the store's usage",
                                        give_up_s=self.unavailable_give_up_s)  # fmt: skip
        budget = usage.budget_bytes
        if usage.capacity_bytes:
            budget = min(budget, usage.capacity_bytes)
        return usage.resident_bytes >= budget * 0.9 or self._lag_bytes >= budget * 0.9

    async def _idle(self) -> bool:
        """Nothing left for any producer: the producers' group drained, none in capture."""
        view = await self.run_bus.drained(PRODUCERS)
        return view.done and view.ack_pending == 0

    async def _capture(self, leases: list[Lease]) -> None:
        tasks: list[PromptTask] = [lease.record for lease in leases]
        t0 = time.perf_counter()
        # The batch's span continues its first task's trace and links every task's; the
        # SampleRefs' publish spans and the tasks' ack are its children.
        async with self.group.heartbeat(leases):
            with span("capture", parent=leases[0].headers,
                      links=[extract_link(lease.headers) for lease in leases],
                      attributes={"tasks": len(tasks), "producer": self.producer_id,
                                  "first_seq": leases[0].seq}) as current:  # fmt: skip
                results = await asyncio.to_thread(
                    capture_isolated, self.engine, self.contract, tasks
                )
                current.set_attribute("specbus.capture_s", time.perf_counter() - t0)
                self.stats.capture_s += time.perf_counter() - t0
                self.stats.tokens += sum(len(t.input_ids or ()) for t in tasks)
                done: list[Lease] = []
                ended: GiveBack | StoreUnavailable | None = None
                try:
                    for lease, result in zip(leases, results, strict=True):
                        if isinstance(result, Exception):
                            await self._failed(lease, result)
                        elif await self._publish(lease, result):
                            done.append(lease)
                except (GiveBack, StoreUnavailable) as e:  # what is published is done
                    ended = e
                if done:
                    with span("ack", attributes={"messages": len(done)}):
                        await self.group.ack_all(done)
                    self.stats.tasks += len(done)
                if ended is not None:
                    await self._give_back(leases, ended)

    async def _give_back(self, leases: list[Lease], why: GiveBack | StoreUnavailable) -> None:
        """The batch's tasks not settled go back at once: the producer stops (asked to, the
        run is trained, or the store stayed unavailable past its give-up: then raised)."""
        rest = [lease for lease in leases if lease.settled is None]
        await self.group.nak_all(rest, 0)
        if isinstance(why, GiveBack):
            log.info("%s: %d tasks go back", why, len(rest))
            self._stop.set()
            return
        log.error("the store stayed unavailable for store.unavailable_give_up_s=%.0fs; the "
                  "producer stops, %d tasks go back: %s", self.unavailable_give_up_s,
                  len(rest), why)  # fmt: skip
        raise why

    async def _interrupted(self) -> str | None:
        """Why a wait for the store must end (None: go on waiting)."""
        if self._stop.is_set():
            return "the producer is stopping"
        await self._poll_broker()
        return "the run is trained" if self._train_complete else None

    async def _put(self, sample_id: str, tensors: dict[str, torch.Tensor],
                   gen: int) -> dict[str, FeatureSpec]:  # fmt: skip
        """`store.put`, waiting for room while the store is full and for the store while it is
        unavailable (up to `unavailable_give_up_s`), the batch's leases kept alive by its
        heartbeat: the store's condition is not the task's, no delivery is spent on it.
        Raises `GiveBack` (a stop during the wait), `StoreUnavailable` (past the give-up), or
        what the put raises for the sample itself (NaN screen, integrity)."""
        wait: RoomWait | None = None
        try:
            while True:
                try:
                    return await while_unavailable(
                        lambda: self.store.put(sample_id, tensors, gen),
                        what=f"putting {sample_id}",
                        give_up_s=self.unavailable_give_up_s,
                    )
                except StoreFull as e:  # StoreNoSpace too: backpressure, nothing was written
                    if wait is None:
                        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
                        wait = RoomWait(f"sample {sample_id}", nbytes, store=self.store,
                                        run=self.run_bus, interrupted=self._interrupted,
                                        report_every_s=self.report_every_s)  # fmt: skip
                        self.stats.store_waits += 1
                    await wait.pause(e)
        finally:
            if wait is not None:
                self.stats.store_wait_s += wait.seconds
                wait.done()

    async def _publish(self, lease: Lease, tensors: dict[str, torch.Tensor]) -> bool:
        task: PromptTask = lease.record
        sample_id = sample_id_of(task)
        try:
            specs = await self._put(sample_id, tensors, task.generation)
        except (GiveBack, StoreUnavailable):
            raise  # the batch ends here (`_capture`)
        except Exception as e:  # NaN screen, integrity: a bad capture
            await self._failed(lease, e)
            return False
        ref = SampleRef(
            sample_id=sample_id,
            run_id=self.run_bus.run,
            task_id=task.task_id,
            task_seq=lease.seq,
            epoch=task.epoch,
            generation=task.generation,
            store_uri=self.store.uri,
            features=specs,
            nbytes=sum(s.nbytes for s in specs.values()),
            num_tokens=len(task.input_ids or ()),
            strategy=self.contract.strategy,
            target_fingerprint=self.engine.target_fingerprint,
            tokenizer_fingerprint=self.engine.tokenizer_fingerprint,
            provenance=Provenance(producer_id=self.producer_id, engine=self.engine.name),
        )
        await self.run_bus.publisher.publish(self.run_bus.names.samples, ref)
        self.stats.samples += 1
        return True

    async def _failed(self, lease: Lease, error: Exception) -> None:
        self.stats.failures += 1
        if await settle_failure(self.run_bus, lease, error):
            self.stats.dead_letters += 1
