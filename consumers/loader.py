"""The loader: leased items -> full lockstep windows, filtered against the ledger -> micro-batches.

One loader per trainer rank. On the bus loop it prefetches `need * (1 + prefetch)` items and
heartbeats their leases; `next_window()` returns a `Window` of exactly `micro_batch *
accumulation` items once every rank holds one (consumers/lockstep.py), after gathering the
candidates and filtering them against the ledger (`plan_round`); at the end of the data, one
ragged `Window` of what every rank still holds (fewer items, none on some ranks, weighted so
that the step is the mean over the samples it trains); then None (also on a stop or a spent
time budget, after giving back what it holds). `commit(window)` records, acks, then releases
(`release=False`: later, by `release`; a live source holds the tensors until `checkpointed()`,
after the next checkpoint). From a store every rank reads (`Source.shared_store`) the release
waits for the next lockstep exchange (or the checkpoint's barrier): past it every rank has
recorded the window, so a rank that finds a ref's tensors gone knows from its own ledger
whether it was trained (no recapture of a trained sample). It owns the `Ledger` (a
`Stateful`). docs/architecture.md, "Exactly once into the model" and "Lockstep".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specbus.consumers.ledger import Key, Ledger, plan_round
from specbus.consumers.lockstep import (
    Decision,
    Status,
    agree,
    broadcast_object,
    gather_objects,
    ragged_shape,
    rank,
)
from specbus.consumers.loop_thread import LoopThread
from specbus.core.errors import BrokerUnavailable, BusError
from specbus.core.source import Item, Source, Upstream
from specbus.core.telemetry import span

log = logging.getLogger("specbus.loader")


@dataclass
class Window:
    """One optimizer step's data on this rank: its items, their collated micro-batches, every rank's
    keys of the step (recorded at commit) and their store bytes, and how long the rank waited
    for it. `weights`: the factor on each micro-batch's loss (None: 1/len(micro_batches), a
    full window); a ragged last window sets them (0.0: a pad micro-step that only keeps the
    ranks' collectives in step, `lockstep.ragged_shape`), and may hold no item at all."""

    items: list[Item]
    micro_batches: list[Any]
    weights: list[float] | None = None
    keys: list[Key] = field(default_factory=list)  # every rank's items of this step
    nbytes: int = 0  # store bytes of every rank's items of this step (the same on every rank)
    wait_s: float = 0.0  # time next_window() blocked (data-wait)
    num_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_tokens = sum(i.num_tokens for i in self.items)


class Loader:
    """One trainer rank's loader over `source` (see the module doc): windows of `micro_batch *
    accumulation` items, `prefetch` windows ahead (0: one window in flight), heartbeats every
    `heartbeat_s`; `stop_after_s` ends the data after that long; `stop` (set by a signal) stops
    every rank at the next step; `hold_limit_bytes`: the source holds committed tensors until
    a checkpoint (live mode), and `checkpoint_due` says so once the windows committed since
    the last one hold this many store bytes (None: never); `equal_micro_steps`: every rank
    runs as many micro-steps in the ragged last step (a sharded draft: FSDP's forward and
    backward are collectives)."""

    def __init__(
        self,
        source: Source,
        loop: LoopThread,
        collate: Callable[[list[dict]], Any],
        *,
        micro_batch: int,
        accumulation: int,
        ledger: Ledger | None = None,
        prefetch: int = 1,
        heartbeat_s: float = 10.0,
        poll_s: float = 0.1,
        fetch_timeout_s: float = 1.0,
        stop_after_s: float | None = None,
        stop: threading.Event | None = None,
        report_wait_s: float = 30.0,
        hold_limit_bytes: int | None = None,
        equal_micro_steps: bool = False,
    ):
        self.source, self.loop, self.collate = source, loop, collate
        self.ledger = ledger if ledger is not None else Ledger()
        self.micro_batch, self.accumulation = micro_batch, accumulation
        self.need = micro_batch * accumulation
        self.capacity = self.need * (1 + prefetch)
        # A time budget ends the data for this rank; lockstep makes every rank stop together.
        self._deadline = time.monotonic() + stop_after_s if stop_after_s else None
        self.stop = stop if stop is not None else threading.Event()
        self.stopped = False  # next_window() returned None because a stop was asked for
        self.poll_s, self.fetch_timeout_s, self.heartbeat_s = poll_s, fetch_timeout_s, heartbeat_s
        self.report_wait_s = report_wait_s
        self.hold_limit_bytes = hold_limit_bytes
        self.equal_micro_steps = equal_micro_steps
        # store bytes of every rank's windows committed since the last `checkpointed()`, from
        # the lockstep gather: the same on every rank
        self.held_bytes = 0
        # giving back on a stop or at the end: the last pull's expiry, the naks, a flush
        self.give_back_s = fetch_timeout_s + 5.0
        self._ready: queue.Queue[Item] = queue.Queue()
        self._held: list[Item] = []  # taken from _ready, waiting for the window to fill
        self._parked: list[Item] = []  # duplicates of an item another rank trains this step
        self._leased_items: dict[int, Item] = {}
        # committed, not yet released (`commit(release=False)`): they still count in `capacity`
        self._unreleased: set[int] = set()
        # A source whose store other ranks read (`shared_store`) gets its releases after the
        # next lockstep exchange; one of its own rank's (colocated mem://) at once.
        self._defer_release = bool(getattr(source, "shared_store", False))
        self._release_next: list[Item] = []  # settled, freed after the next lockstep exchange
        self._retired: list = []  # keys this rank settled as trained on its own (gathered)
        self._lock = threading.Lock()
        self._upstream = Upstream(done=False)
        self._requeried = False
        self._closed = False
        self._error: BaseException | None = None
        self.stats = {"redeliveries": 0, "duplicates": 0}
        self._tasks = [loop.submit(self._prefetch()), loop.submit(self._heartbeat())]

    # -- Stateful: the ledger is the loader's position in the data ---------------------------
    def state_dict(self) -> dict[str, Any]:
        """The ledger's state: the loader's position in the data (a `Stateful`)."""
        return self.ledger.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the ledger from a checkpoint."""
        self.ledger.load_state_dict(state)

    # -- bus-loop side ---------------------------------------------------------------
    def _in_flight(self) -> int:
        with self._lock:
            return len(self._leased_items) + len(self._unreleased)

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
                    view = await self.source.upstream()
                    quiet = quiet + 1 if view.done else 0
                    self._upstream = view if quiet >= 2 else Upstream(False, view.ack_pending,
                                                                      view.waiting_for)  # fmt: skip
                    continue
                quiet = 0
                self._upstream = Upstream(done=False)
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
        failing_since: float | None = None
        while True:
            await asyncio.sleep(self.heartbeat_s)
            with self._lock:
                items = list(self._leased_items.values())
            if not items:
                continue
            try:
                await self.source.keepalive(items)
            except BrokerUnavailable as e:  # given up on the broker: the training thread ends
                self._error = e
                return
            except Exception as e:  # noqa: BLE001 - retried next beat; a lapse is tolerated
                if failing_since is None:
                    failing_since = time.monotonic()
                    log.warning(
                        "heartbeat of %d leases failed, retrying every %.1fs (a lease that "
                        "lapses meanwhile is redelivered and filtered): %s",
                        len(items), self.heartbeat_s, e,
                    )  # fmt: skip
                continue
            if failing_since is not None:
                log.warning("heartbeats back after %.1fs", time.monotonic() - failing_since)
                failing_since = None

    def _forget(self, items: list[Item], *, hold: bool = False) -> None:
        with self._lock:  # `hold`: committed, still in the store until `release`
            for item in items:
                self._leased_items.pop(id(item), None)
            self._unreleased.update(id(item) for item in items if hold)

    # -- training-thread side --------------------------------------------------------
    def has_window(self) -> bool:
        """This rank holds a full window (a hint; False: takes, maybe room `release` frees)."""
        return len(self._held) + self._ready.qsize() >= self.need

    def next_window(self) -> Window | None:
        """Block until every rank holds a full window of items not yet trained (returned), the
        data is over (the ragged window of what this rank still holds, then None), the time
        budget is spent (None) or a stop was asked for (None, `stopped` set)."""
        t0 = time.perf_counter()
        reported = t0
        while True:
            if self._error is not None:
                raise self._error
            self._drop_trained_held()
            deadline = time.perf_counter() + self.poll_s
            while len(self._held) < self.need:
                try:
                    item = self._ready.get(timeout=max(0.0, deadline - time.perf_counter()))
                except queue.Empty:
                    break
                if self.ledger.contains(*item.key):
                    self._settle_trained([item], alone=True)
                else:
                    self._held.append(item)
            out_of_time = self._deadline is not None and time.monotonic() >= self._deadline
            upstream = self._upstream
            if self.stop.is_set():
                status = Status.STOPPING
            elif out_of_time:  # ends like max_steps: what is held is given back, not trained
                status = Status.EXPIRED
            elif len(self._held) >= self.need:
                status = Status.FULL
            elif upstream.done and self._ready.empty():
                status = Status.ENDED
            else:
                status = Status.WAITING
            held = len(self._held) + self._ready.qsize()
            decision = agree(
                status, held, self.need,
                # an ended rank's view of the broker
                ack_pending=upstream.ack_pending if status == Status.ENDED else -1,
                unsettled=self.source.unsettled(),
            )  # fmt: skip
            self._release_settled()  # every rank is past its last commit
            if decision in (Decision.TRAIN, Decision.RAGGED):
                window = self._plan_window(ragged=decision is Decision.RAGGED)
                if window is not None:
                    window.wait_s = time.perf_counter() - t0
                    return window
            elif decision is Decision.REBALANCE:
                self._give_back_surplus()
            elif decision in (Decision.END, Decision.STOP):
                self.stopped = decision is Decision.STOP
                self.close()
                return None
            now = time.perf_counter()
            if now - reported >= self.report_wait_s:
                reported = now
                log.info(
                    "rank %d waiting for data for %.0fs: holding %d of %d%s",
                    rank(), now - t0, len(self._held), self.need,
                    f" ({upstream.waiting_for})" if upstream.waiting_for else "",
                )  # fmt: skip

    def _plan_window(self, *, ragged: bool = False) -> Window | None:
        """Every rank: gather the candidate windows, filter them against the ledger and each
        other (the same plan on every rank), settle what is already trained. Returns the
        window when every rank still has a full one, else None (the ranks go on filling);
        `ragged` (the end of the data): the ragged window of what is left, when any rank has
        anything left to train, else None (the next round ends)."""
        candidates = self._held[: self.need]
        retired, self._retired = self.source.drain_retired() + self._retired, []
        mine = ([i.key for i in candidates], [i.nbytes for i in candidates], retired)
        rows = gather_objects(mine)
        for _, _, retired in rows:
            self.ledger.retire(retired)
        plans = plan_round(self.ledger, [keys for keys, _, _ in rows])
        # duplicates settled by this round: their sequences (and tasks) are done, on every rank
        self.ledger.retire(keys[i] for (keys, _, _), p in zip(rows, plans, strict=True)
                           for i in p.trained)  # fmt: skip
        plan = plans[rank()]
        self._settle_trained([candidates[i] for i in plan.trained])
        self._parked.extend(candidates[i] for i in plan.parked)
        self._held = [candidates[i] for i in plan.keep] + self._held[self.need :]
        counts = [len(p.keep) for p in plans]
        if (sum(counts) == 0) if ragged else any(n < self.need for n in counts):
            return None
        mine = counts[rank()]
        items, self._held = self._held[:mine], self._held[mine:]
        kept = [(keys[i], sizes[i]) for (keys, sizes, _), p in zip(rows, plans, strict=True)
                for i in p.keep]  # fmt: skip
        window = Window(items=items, micro_batches=[], keys=[k for k, _ in kept],
                        nbytes=sum(n for _, n in kept))  # fmt: skip
        if not ragged:
            window.micro_batches = [
                self.collate([it.tensors for it in items[i : i + self.micro_batch]])
                for i in range(0, self.need, self.micro_batch)
            ]
            return window
        return self._ragged(window, counts)

    def _ragged(self, window: Window, counts: list[int]) -> Window:
        """The last step's window: this rank's micro-batches of what it kept (the last one
        short), their weights and, with `equal_micro_steps`, the zero-weight pads (a rank that
        kept nothing pads with a sample another rank trains in this step, broadcast)."""
        shape = ragged_shape(counts, rank(), self.micro_batch,
                             equal_micro_steps=self.equal_micro_steps)  # fmt: skip
        if rank() == 0:
            log.info(
                "end of data: a last ragged step trains the %d samples left (per rank: %s; a "
                "full step is %d per rank)", sum(counts), counts, self.need,
            )  # fmt: skip
        at, sample = 0, None
        for size in shape.sizes:
            window.micro_batches.append(
                self.collate([it.tensors for it in window.items[at : at + size]])
            )
            at += size
        if shape.template_from is not None:  # every rank takes part in the broadcast
            first = window.items[0].tensors if rank() == shape.template_from else None
            sample = broadcast_object(
                None if first is None else {k: v.detach().cpu() for k, v in first.items()},
                shape.template_from,
            )
        if shape.pads:
            pad = window.micro_batches[0] if window.micro_batches else self.collate([sample])
            window.micro_batches += [pad] * shape.pads
        window.weights = shape.weights
        return window

    def _drop_trained_held(self) -> None:
        """Items another rank trained since this rank took them: settle them before counting."""
        trained = [i for i in self._held if self.ledger.contains(*i.key)]
        self._held = [i for i in self._held if not self.ledger.contains(*i.key)]
        self._settle_trained(trained, alone=True)  # none: a no-op

    def _settle_trained(self, items: list[Item], *, alone: bool = False) -> None:
        """Already in the model: ack (the broker may have lost the first ack) and release,
        never train. A lost ack here only costs another redelivery, filtered again. `alone`:
        settled by this rank's own look (not by a round's plan): its keys go to the other
        ranks with the next gather, so every ledger retires the same sequences."""
        if not items:
            return
        if alone:
            self._retired.extend(i.key for i in items)
        self.stats["duplicates"] += len(items)
        log.info(
            "rank %d: %d delivered item(s) already trained, acked and released (seq %s)",
            rank(), len(items), ",".join(str(i.seq) for i in items[:8]),
        )  # fmt: skip
        self.loop.call(self.source.ack(items, confirm=False))
        self._forget(items)
        self._release_later(items)
        for item in items:
            item.tensors = {}

    def _give_back_surplus(self) -> None:
        """End of data with uneven ranks: keep one window, nak the rest, stop prefetching."""
        self.capacity = self.need
        while True:
            try:
                self._held.append(self._ready.get_nowait())
            except queue.Empty:
                break
        surplus, self._held = self._held[self.need :], self._held[: self.need]
        self._upstream = Upstream(done=False)
        self._requeried = True
        if surplus:
            self.loop.call(self.source.nak(surplus))
            self._forget(surplus)

    def commit(self, window: Window, *, release: bool = True) -> None:
        """After optimizer.step(): record the step's items (every rank's) in the ledger, ack
        this rank's (confirmed; an ack the broker does not confirm is logged, not fatal: the
        item comes back and is filtered), then free their tensors. Parked duplicates are
        settled by the next round, now that their originals are in (`release=False`: freed
        by `release(window)`, once the GPU is done with the step)."""
        self.ledger.record(window.keys)
        self.held_bytes += window.nbytes
        with span("ack", attributes={"messages": len(window.items)}):
            try:
                self._call_unless_stopped(self.source.ack(window.items), "confirming the acks")
            except BusError as e:
                # The ledger already holds them: an unconfirmed ack (the broker restarted and
                # lost its place, and answers no ack beyond it) only means a redelivery, filtered.
                log.warning("rank %d: %s; they will be redelivered and filtered", rank(), e)
        self._forget(window.items, hold=not release)
        if release:
            self.release(window)
        if self._parked:
            parked, self._parked = self._parked, []
            self._held[:0] = parked  # trained ones are settled by the next round's first look

    def release(self, window: Window) -> None:
        """Free a window committed with `release=False`, once the step that read it is done."""
        with self._lock:
            self._unreleased.difference_update(id(item) for item in window.items)
        self._release_later(window.items)
        for item in window.items:
            item.tensors = {}

    def _call_unless_stopped(
        self, coro, what: str, timeout_s: float | None = None, *, stoppable: bool = True
    ) -> bool:
        """Run `coro` on the bus loop and wait for it (its exception re-raised), but no longer
        once this rank is asked to stop (`stoppable`), nor past `timeout_s`: False then (given
        up: a confirmed ack through a broker outage, or giving back leases, is only a
        redelivery when dropped, which the ledger filters; the stop must reach its checkpoint
        before torchrun's shutdown timeout)."""
        future = self.loop.submit(coro)
        t0 = time.monotonic()
        while True:
            done, _ = concurrent.futures.wait([future], timeout=0.2)
            if done:
                future.result()
                return True
            waited = time.monotonic() - t0
            late = timeout_s is not None and waited >= timeout_s
            # a grace of 2 s: an ack the broker is about to answer is not worth a redelivery
            stopped = stoppable and self.stop.is_set() and waited >= 2.0
            if stopped or late:
                future.cancel()
                log.warning(
                    "rank %d: gave up %s (%s): the broker does not answer; what it did not get "
                    "comes again after its lease and is filtered", rank(), what,
                    "asked to stop" if stopped else f"after {timeout_s:.0f}s",
                )  # fmt: skip
                return False

    @property
    def checkpoint_due(self) -> bool:
        """The windows committed since the last checkpoint hold `hold_limit_bytes` (every rank
        answers the same): the trainer checkpoints now, so that the source frees them."""
        return self.hold_limit_bytes is not None and self.held_bytes >= self.hold_limit_bytes

    def _release_later(self, items: list[Item]) -> None:
        """Settled items: freed after the next lockstep exchange (a shared store), else now."""
        self._release_next.extend(items)
        if not self._defer_release:
            self._release_settled()

    def _release_settled(self) -> None:
        """Free what was committed or settled before the lockstep exchange (or barrier) just
        passed: every rank has recorded it (live: the source holds it until `checkpointed`)."""
        if not self._release_next:
            return
        items, self._release_next = self._release_next, []
        with span("release", attributes={"samples": len(items)}):
            self.source.release(items)

    def checkpointed(self) -> None:
        """A durable checkpoint holds every committed window: the ledger lets go of the ids
        it appended to the lineage file, and the source frees what its `release` held back
        (live mode). Every rank calls it after the checkpoint's barrier (a trainer without
        checkpoints after each commit: none will ever hold them)."""
        self._release_settled()
        self.ledger.flushed()
        self.source.checkpointed()
        self.held_bytes = 0

    def close(self) -> None:
        """Stop prefetching and give back everything still leased (nak, no delay), then
        every delivery not handed out. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for t in self._tasks:
            t.cancel()
        # Every leased item (held, parked, ready or in flight) is in _leased_items until settled.
        with self._lock:
            held = list(self._leased_items.values())
        self._held, self._parked = [], []
        self._ready = queue.Queue()
        self._release_settled()  # the ranks end or stop together, past their last commit
        # Bounded: during a broker outage the naks wait in the client and its flush waits for
        # the broker; a stop must still reach its checkpoint (the leases lapse and come back).
        try:
            if held:
                self._call_unless_stopped(self.source.nak(held), "giving back leases",
                                          self.give_back_s, stoppable=False)  # fmt: skip
                self._forget(held)  # their tensors stay in the store for the next lease holder
            self._call_unless_stopped(self.source.give_back(), "giving back leases",
                                      self.give_back_s, stoppable=False)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - a dead broker: the leases lapse and come back
            log.warning(
                "could not give back %d leases (they will be redelivered): %s", len(held), e
            )
