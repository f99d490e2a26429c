"""Waiting out backpressure with the task's lease kept alive: no delivery is spent on it.

A producer whose put meets a full store (`StoreFull`, `StoreNoSpace`), or whose driven capture
the intake sheds (429/503), holds a task that is fine: the store is not. Giving the task back
(a nak) would spend one of its `bus.max_deliver` deliveries, and a task that met a full store
that often was dead-lettered and never trained (issue 33). So the producer keeps the lease
alive (its batch heartbeat sends `in_progress`) and tries again, with backoff, until the
sample is taken. `RoomWait` is one such wait: it sleeps between tries, ends it when the
producer is stopping or the run is trained (`GiveBack`: the task goes back, a stop is not
backpressure), and says what it waits for at most every `report_every_s` (store residency
against the budget, the trainers' refs pending and in training, their ack floor), with a
WARNING when the trainers hold every ref and ack none: a budget smaller than what the
trainers hold while they wait for a full window cannot drain by itself (docs/store.md,
"Backpressure").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from specbus.bus.lag import Lag
from specbus.bus.run import RunBus
from specbus.bus.subjects import TRAINERS
from specbus.core.errors import BusNotFound

log = logging.getLogger("specbus.producer")

REPORT_EVERY_S = 30.0


async def trainers_lag(run: RunBus) -> Lag | None:
    """The trainers' lag, or None while their consumer does not exist: a resuming trainer
    world repositions it (deletes and recreates it, `bus.replay.reposition`), and a producer
    reading the lag in that moment must not fail (a chaos trial's producer did: "consumer
    .../trainers not found")."""
    try:
        return await run.lag(TRAINERS)
    except BusNotFound:
        return None


class GiveBack(Exception):
    """A wait ended without the sample being taken: the producer is stopping or the run is
    trained. The caller gives its task back (a stop, not backpressure)."""


class RoomWait:
    """One wait for room for `what` (a sample of `nbytes`, 0 if unknown) in `store`.

    `interrupted()` returns why the wait must end (stop asked, run trained) or None; it may
    poll the broker. `pause(error)` sleeps until the next try (0.05 s doubling to 0.5 s),
    raising `GiveBack` when interrupted; `done()` ends the wait. `waits` counts how many
    pauses there were, `seconds` how long the wait lasted."""

    def __init__(
        self,
        what: str,
        nbytes: int,
        *,
        store,
        run: RunBus | None,
        interrupted: Callable[[], Awaitable[str | None]],
        report_every_s: float = REPORT_EVERY_S,
    ):
        self.what, self.nbytes = what, nbytes
        self.store, self.run, self.interrupted = store, run, interrupted
        self.report_every_s = report_every_s
        self.started = self._reported = time.monotonic()
        self.waits = 0
        self._delay = 0.05
        self._floor: int | None = None  # the trainers' ack floor at the last report

    @property
    def seconds(self) -> float:
        """How long this wait has lasted."""
        return time.monotonic() - self.started

    async def pause(self, error: Exception) -> None:
        """Before the next try: end the wait if interrupted (`GiveBack`), report if due,
        sleep."""
        self.waits += 1
        why = await self.interrupted()
        if why is not None:
            raise GiveBack(f"{why} while waiting {self.seconds:.1f}s for room for {self.what}")
        now = time.monotonic()
        if now - self._reported >= self.report_every_s:
            self._reported = now
            await self._report(error)
        await asyncio.sleep(self._delay)
        self._delay = min(self._delay * 2, 0.5)

    def done(self) -> None:
        """The sample was taken; a wait that was reported says how long it took."""
        if self._floor is not None or self.seconds >= self.report_every_s:
            log.info("room for %s after %.1fs (%d tries)", self.what, self.seconds, self.waits)

    async def _report(self, error: Exception) -> None:
        try:
            usage = await asyncio.to_thread(self.store.usage)
            held = (
                f"the store holds {usage.resident_bytes} of its {usage.budget_bytes} B budget"
                + (f" (capacity {usage.capacity_bytes} B)" if usage.capacity_bytes else "")
            )
        except Exception as e:  # noqa: BLE001 - a progress line must not end the wait
            held = f"store usage unknown ({e})"
        lag = await trainers_lag(self.run) if self.run is not None else None
        trainers = ""
        if lag is not None:
            floor = lag.first_unacked_seq - 1
            trainers = (f"; trainers: {lag.pending} refs pending, {lag.ack_pending} being "
                        f"trained, ack floor {floor}")  # fmt: skip
            stuck = self._floor == floor and lag.pending == 0 and lag.ack_pending > 0
            self._floor = floor
            if stuck:
                log.warning(
                    "still no room for %s after %.0fs, and the trainers hold all %d refs in "
                    "the store without acking one for %.0fs: if they wait for a full window, "
                    "the store cannot drain by itself. Its budget must hold what every rank "
                    "holds while one waits, up to ((world - 1) x (1 + prefetch) + 1) x "
                    "micro_batch x accumulation samples: raise store.budget_bytes (%s)",
                    self.what, self.seconds, lag.ack_pending, self.report_every_s, held,
                )  # fmt: skip
                return
        log.info("waiting %.0fs for room for %s (%d B): %s; %s%s", self.seconds, self.what,
                 self.nbytes, error, held, trainers)  # fmt: skip
