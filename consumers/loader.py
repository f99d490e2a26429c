"""The loader: leased items -> full lockstep windows -> collated micro-batches.

One loader per trainer rank. A prefetch task on the bus loop keeps up to
`need * (1 + prefetch)` items leased and their tensors loaded (prefetch=0: one window), and a
heartbeat task keeps every held lease alive while steps run. `next_window()` blocks until all
ranks agree (consumers/lockstep.py): it returns a `Window` of exactly
`micro_batch * accumulation` items, or None at the end of data, after nak'ing a partial
window (never trained). `commit(window)` acks the window's items after the optimizer step,
then releases their tensors.

Items the model already holds (the checkpoint's cursor or lineage has them, as after a resume
or a redelivery) are acked and skipped by the source, never trained twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from consumers.lockstep import Decision, Status, agree
from consumers.loop_thread import LoopThread
from consumers.source import Item, Source


@dataclass
class Window:
    items: list[Item]
    micro_batches: list[Any]
    wait_s: float = 0.0  # time next_window() blocked (data-wait)
    num_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_tokens = sum(i.num_tokens for i in self.items)


class Loader:
    def __init__(
        self,
        source: Source,
        loop: LoopThread,
        collate: Callable[[list[dict]], Any],
        *,
        micro_batch: int,
        accumulation: int,
        prefetch: int = 1,
        heartbeat_s: float = 10.0,
        poll_s: float = 0.1,
        fetch_timeout_s: float = 1.0,
        stop_after_s: float | None = None,
    ):
        self.source, self.loop, self.collate = source, loop, collate
        self.micro_batch, self.accumulation = micro_batch, accumulation
        self.need = micro_batch * accumulation
        self.capacity = self.need * (1 + prefetch)
        # A time budget ends the data for this rank; lockstep makes every rank stop together.
        self._deadline = time.monotonic() + stop_after_s if stop_after_s else None
        self.poll_s, self.fetch_timeout_s, self.heartbeat_s = poll_s, fetch_timeout_s, heartbeat_s
        self._ready: queue.Queue[Item] = queue.Queue()
        self._held: list[Item] = []  # taken from _ready, waiting for the window to fill
        self._leased_items: dict[int, Item] = {}
        self._lock = threading.Lock()
        self._upstream_done = False
        self._requeried = False
        self._error: BaseException | None = None
        self.stats = {"redeliveries": 0}
        self._tasks = [loop.submit(self._prefetch()), loop.submit(self._heartbeat())]

    # -- bus-loop side ---------------------------------------------------------------
    def _in_flight(self) -> int:
        with self._lock:
            return len(self._leased_items)

    async def _prefetch(self) -> None:
        quiet = 0
        try:
            while True:
                room = self.capacity - self._in_flight()
                if room <= 0:
                    await asyncio.sleep(0.005)
                    continue
                items = await self.source.take(room, self.fetch_timeout_s)
                if not items:
                    # The end needs two quiet rounds in a row: a delivery still in flight
                    # when upstream looked idle (no longer pending at the broker, not yet
                    # received here) lands in the second round's fetch.
                    if self._requeried:  # surplus was just given back: look again from scratch
                        quiet, self._requeried = 0, False
                    quiet = quiet + 1 if await self.source.upstream_done() else 0
                    self._upstream_done = quiet >= 2
                    continue
                quiet = 0
                self._upstream_done = False
                with self._lock:
                    for item in items:
                        self._leased_items[id(item)] = item
                for item in items:
                    self.stats["redeliveries"] += int(item.redelivered)
                    self._ready.put(item)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # surfaced to the training thread by next_window()
            self._error = e

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            with self._lock:
                items = list(self._leased_items.values())
            if items:
                # A lost heartbeat is retried next beat; a redelivery it causes is tolerated.
                with contextlib.suppress(Exception):
                    await self.source.keepalive(items)

    def _forget(self, items: list[Item]) -> None:
        with self._lock:
            for item in items:
                self._leased_items.pop(id(item), None)

    # -- training-thread side --------------------------------------------------------
    def next_window(self) -> Window | None:
        """Block until every rank holds a full window (returned) or the data is over (None)."""
        t0 = time.perf_counter()
        while True:
            if self._error is not None:
                raise self._error
            deadline = time.perf_counter() + self.poll_s
            while len(self._held) < self.need:
                try:
                    self._held.append(
                        self._ready.get(timeout=max(0.0, deadline - time.perf_counter()))
                    )
                except queue.Empty:
                    break
            out_of_time = self._deadline is not None and time.monotonic() >= self._deadline
            if out_of_time:
                status = Status.ENDED
            elif len(self._held) >= self.need:
                status = Status.FULL
            elif self._upstream_done and self._ready.empty():
                status = Status.ENDED
            else:
                status = Status.WAITING
            held = 0 if out_of_time else len(self._held) + self._ready.qsize()
            decision = agree(status, held, self.need)
            if decision is Decision.TRAIN:
                items, self._held = self._held[: self.need], self._held[self.need :]
                mbs = [
                    self.collate([it.tensors for it in items[i : i + self.micro_batch]])
                    for i in range(0, self.need, self.micro_batch)
                ]
                return Window(items=items, micro_batches=mbs, wait_s=time.perf_counter() - t0)
            if decision is Decision.REBALANCE:
                self._give_back_surplus()
            elif decision is Decision.END:
                self.close()
                return None

    def _give_back_surplus(self) -> None:
        """End of data with uneven ranks: keep one window, nak the rest, stop prefetching."""
        self.capacity = self.need
        while True:
            try:
                self._held.append(self._ready.get_nowait())
            except queue.Empty:
                break
        surplus, self._held = self._held[self.need :], self._held[: self.need]
        self._upstream_done = False
        self._requeried = True
        if surplus:
            self.loop.call(self.source.nak(surplus))
            self._forget(surplus)

    def commit(self, window: Window) -> None:
        """After optimizer.step(): ack the window's items, then free their tensors."""
        self.loop.call(self.source.ack(window.items))
        self._forget(window.items)
        self.source.release(window.items)
        for item in window.items:
            item.tensors = {}

    def close(self) -> None:
        """Stop prefetching and give back everything still leased (nak, no delay)."""
        for t in self._tasks:
            t.cancel()
        # Every leased item (held, ready or in flight) is in _leased_items until committed.
        with self._lock:
            held = list(self._leased_items.values())
        self._held = []
        self._ready = queue.Queue()
        if held:
            self.loop.call(self.source.nak(held))
            self._forget(held)  # their tensors stay in the store for the next lease holder
