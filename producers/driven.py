"""The driven capture worker: a "producers" group member whose target is a running SGLang server.

Same loop as `CaptureWorker` (backpressure, lease `capture_batch` tasks, heartbeats), but the
capture of each task is `engine.drive(seq, task)` (`engines/sglang_server.py`): the server's
capture layer stores the rows and the intake publishes the ref under the task's sample id
(`live/driven.py`). A task is acked only after the intake answered `accepted` or `duplicate`
for it, so:
- a producer killed before its ack: the task is redelivered, driven again under the same
  request id, and the intake's publish is dropped by the broker's dedup (or, when the earlier
  ref is already known, not driven at all);
- a server killed mid-request: the POST is retried with the same request id until the server
  is back (`target.server_give_up_s`);
- `ServerUnreachable` / `LayerNotApplied` stop the worker: the batch's tasks not yet answered
  are nak'd (never acked) and the error goes to the caller;
- `Shed` (the intake's 429/503: backpressure) is waited out, the lease kept alive, and the
  task driven again (producers/backpressure.py): no delivery is spent on it. So is a capture
  the intake never heard of while the run's store is at its budget (the server's sink drops
  a capture it cannot store); any other failure is a task failure (nak, dead letter on its
  last delivery), as for `CaptureWorker`.
"""

from __future__ import annotations

import asyncio
import logging

from specbus.bus.lease import Lease
from specbus.producers.backpressure import GiveBack, RoomWait
from specbus.producers.capture import CaptureWorker
from specbus.producers.engines.sglang_server import (
    LayerNotApplied,
    ServerUnreachable,
    Shed,
    Unheard,
)

log = logging.getLogger("specbus.producer")


class DrivenWorker(CaptureWorker):
    """`CaptureWorker` with a `sglang_server` engine and no store of its own (module doc);
    `store` is the run's (read for backpressure only)."""

    async def _capture(self, leases: list[Lease]) -> None:
        async with self.group.heartbeat(leases):
            results = await asyncio.gather(
                *(self._drive(lease) for lease in leases), return_exceptions=True
            )
            done, fatal = [], None
            for lease, result in zip(leases, results, strict=True):
                if not isinstance(result, BaseException):
                    done.append(lease)
                elif isinstance(result, (ServerUnreachable, LayerNotApplied)):
                    fatal = fatal or result
                    await lease.nak(self.bus_cfg.nak_delay_s)
                elif isinstance(result, GiveBack):  # a stop during a wait: not backpressure
                    log.info("task seq %d goes back: %s", lease.seq, result)
                    await lease.nak(0)
                    self._stop.set()
                elif isinstance(result, Exception):
                    await self._failed(lease, result)
                else:
                    raise result
            if done:
                await self.group.ack_all(done)
                self.stats.tasks += len(done)
                self.stats.samples += len(done)
                self.stats.tokens += sum(len(lease.record.input_ids or ()) for lease in done)
        if fatal is not None:
            raise fatal

    async def _drive(self, lease: Lease) -> dict:
        """`engine.drive` of one task, driven again while the intake sheds it (or, the run's
        store at its budget, never heard of it), the lease kept alive by the batch's
        heartbeat. Raises `GiveBack` on a stop during the wait, else what the drive raises."""
        wait: RoomWait | None = None
        try:
            while True:
                try:
                    return await asyncio.to_thread(self.engine.drive, lease.seq, lease.record)
                except Unheard as e:
                    if not await self._over_budget():
                        raise  # not for lack of room: a failure of this capture
                    error: Exception = e
                except Shed as e:
                    error = e
                if wait is None:
                    wait = RoomWait(f"task seq {lease.seq}", 0, store=self.store, run=self.run_bus,
                                    interrupted=self._interrupted,
                                    report_every_s=self.report_every_s)  # fmt: skip
                    self.stats.store_waits += 1
                await wait.pause(error)
        finally:
            if wait is not None:
                self.stats.store_wait_s += wait.seconds
                wait.done()
