"""One run on one broker connection: what the processes of a run use of the bus.

`await declare(bus, cfg, run)` returns a `RunBus` (`open_run` for a run that must exist
already; bus/topology.py declares the broker objects): the run's names, its KV markers, a
publisher, joining a consumer group, lag and ack floor, replay, dead letters, repositioning, and
`drained(group)`: the one definition of "no more data can come to this group" that the
trainers' sources and the producers' idle check all use. Semantics: docs/bus.md.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from specbus.bus.connection import Bus
from specbus.bus.dead import DeadLetter, Delivery, count_dead, dead_letter, list_dead
from specbus.bus.lag import Lag, lag
from specbus.bus.lease import Leases
from specbus.bus.outage import ride
from specbus.bus.publisher import Ack, Publisher
from specbus.bus.replay import Stored, get, replay, reposition
from specbus.bus.subjects import PRODUCERS, TRAINERS, Group, Names
from specbus.bus.topology import RunKV, ensure_run, open_kv
from specbus.core.config import BusConfig
from specbus.core.contracts import Record
from specbus.core.source import Upstream


class RunBus:
    """The run `names.run` on the connection `bus` (declared: streams, consumers, KV exist).

    Every call rides through broker outages like the rest of `bus/` (`BrokerUnavailable`
    after `bus.outage_give_up_s`); other failures raise `BusError`s."""

    def __init__(self, bus: Bus, names: Names, kv: RunKV):
        self.bus, self.names, self.kv = bus, names, kv
        self._publisher: Publisher | None = None
        self._feed_count: int | None = None

    @property
    def run(self) -> str:
        """The run's name."""
        return self.names.run

    @property
    def publisher(self) -> Publisher:
        """This run's publisher (one per `RunBus`: dedup ids, windowed PubAcks)."""
        if self._publisher is None:
            self._publisher = Publisher(self.bus)
        return self._publisher

    async def join(self, group: Group, record_cls: type[Record] | None = None) -> Leases:
        """Become a member of the run's consumer `group` (see `bus.lease.Leases`)."""
        return await Leases.join(self.bus, self.run, group, record_cls)

    async def lag(self, group: Group = TRAINERS, *, scan: bool = False) -> Lag:
        """`group`'s published-and-not-consumed messages and bytes (see `bus.lag`)."""
        return await lag(self.bus, self.run, group, scan=scan)

    async def feed_complete(self) -> int | None:
        """The task count once the feeder marked the feed complete, else None (remembered
        once seen: the marker is never taken back)."""
        if self._feed_count is None:
            self._feed_count = await self.kv.feed_complete()
        return self._feed_count

    async def drained(self, group: Group) -> Upstream:
        """Whether more data can still be delivered to `group`; the one definition of end of
        data. Done when the feed is complete, no group upstream of `group` holds work (for the
        trainers: no task pending or in capture at the producers) and nothing is undelivered
        in `group`. `ack_pending` is `group`'s delivered-and-unacked count: the data is not
        over before every one of those is held by a member (a lost ack or a dead member's
        lease comes back). What a process holds itself (buffered deliveries, captures it will
        retry) is for its caller to add."""
        if await self.feed_complete() is None:
            return Upstream(False, waiting_for="the feeder (feed not complete)")
        if group == TRAINERS:
            upstream = await self.lag(PRODUCERS)
            if upstream.messages:
                idle = (
                    "; no producer is capturing: are they running?"
                    if not upstream.ack_pending
                    else ""
                )
                return Upstream(
                    False,
                    waiting_for=f"producers: {upstream.pending} tasks pending, "
                    f"{upstream.ack_pending} in capture{idle}",
                )
        mine = await self.lag(group)
        if mine.pending:
            what = "refs" if group == TRAINERS else "tasks"
            return Upstream(False, mine.ack_pending, f"{mine.pending} {what} not delivered yet")
        return Upstream(True, mine.ack_pending)

    async def dead_letter(self, item: Delivery, reason: str, detail: str = "") -> Ack | None:
        """Copy a delivery into the run's DEAD stream with `reason`, then terminate it (see
        `bus.dead.dead_letter`; idempotent for a lease)."""
        return await dead_letter(self.publisher, self.names, item, reason, detail)

    async def task(self, seq: int) -> Stored | None:
        """The TASKS message stored at `seq` (None once it is gone)."""
        return await get(self.bus, self.names.tasks_stream, seq)

    async def reposition(self, group: Group, start_seq: int) -> None:
        """Make `group` deliver from `start_seq` (resume = replay; see `bus.replay`)."""
        await reposition(self.bus, self.run, group, start_seq)

    async def ack_floor(self, group: Group) -> int:
        """The sequence of `group`'s stream up to which every message is acked (0: none yet):
        acked means trained, superseded or dead, nobody reads those again."""
        stream = self.names.stream_of(group)
        info = await ride(self.bus, f"reading the ack floor of {stream}/{group}",
                          lambda: self.bus.js.consumer_info(stream, group))  # fmt: skip
        return info.ack_floor.stream_seq if info.ack_floor else 0

    def replay(
        self, group: Group, start_seq: int = 1, *, end_seq: int | None = None
    ) -> AsyncIterator[Stored]:
        """The stored messages of `group`'s stream (TASKS for the producers, SAMPLES for the
        trainers) with `start_seq <= seq (<= end_seq)`, in order (see `bus.replay`)."""
        return replay(self.bus, self.names.stream_of(group), start_seq, end_seq=end_seq)

    async def sample(self, seq: int) -> Stored | None:
        """The SAMPLES message stored at `seq` (None once it is gone)."""
        return await get(self.bus, self.names.samples_stream, seq)

    async def dead_letters(self) -> list[DeadLetter]:
        """The run's dead letters, oldest first (see `bus.dead.list_dead`)."""
        return await list_dead(self.bus, self.run)

    async def count_dead(self, group: Group) -> dict[str, int]:
        """The run's dead letters from `group`'s stream (TASKS for the producers, SAMPLES for
        the trainers): `{"explicit": n, "max_deliveries": m}` (see `bus.dead.count_dead`)."""
        kind = self.names.kind_of_stream(self.names.stream_of(group))
        return (await count_dead(self.bus, self.run))[kind]


async def declare(bus: Bus, cfg: BusConfig | None, run: str) -> RunBus:
    """Declare the run's streams, consumers and KV bucket (idempotent: `bus.topology`) and
    return the run's facade. Raises `BusRejected` for an existing object the server cannot
    change in place, `BrokerUnavailable` after an outage of `bus.outage_give_up_s`."""
    return RunBus(bus, Names(run), await ensure_run(bus, cfg, run))


async def open_run(bus: Bus, run: str) -> RunBus | None:
    """The facade of a run that exists already (its KV bucket does), without declaring
    anything; None if there is no such run on this broker (a reader: a recording)."""
    kv = await open_kv(bus, run)
    return None if kv is None else RunBus(bus, Names(run), kv)
