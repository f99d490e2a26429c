"""Reading a stream back, and repositioning a durable consumer (resume = replay).

`replay(bus, stream, start_seq)` iterates stored messages through an ephemeral, ack-less
consumer (the durable groups are untouched) and survives an outage without skipping or
repeating; `get`/`last` read one message; `reposition(bus, run, group, start_seq)` recreates a
durable consumer at a sequence (its old leases become void). docs/bus.md, "Replay and resume".
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from specbus.bus.connection import Bus
from specbus.bus.outage import NoAnswer, ride
from specbus.bus.pull import Puller
from specbus.bus.subjects import Group, Names
from specbus.bus.topology import consumer_config
from specbus.core.errors import BusNotFound

# Headers a direct get adds; they describe the storage, not the message.
_DIRECT_GET_HEADERS = (
    "Nats-Stream",
    "Nats-Sequence",
    "Nats-Time-Stamp",
    "Nats-Subject",
    "Nats-Last-Sequence",
    "Nats-Num-Pending",
)


@dataclass(frozen=True, slots=True)
class Stored:
    """One stored message: its stream sequence, subject, payload and headers."""

    seq: int
    subject: str
    data: bytes
    headers: dict[str, str] = field(default_factory=dict)


def _seq_and_pending(reply: str) -> tuple[int, int]:
    t = reply.split(".")
    if len(t) == 9:  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
        return int(t[5]), int(t[8])
    return int(t[7]), int(t[10])


async def replay(
    bus: Bus, stream: str, start_seq: int = 1, *, end_seq: int | None = None, batch: int = 512
) -> AsyncIterator[Stored]:
    """Stored messages of `stream` with `start_seq <= seq (<= end_seq)`, in order."""
    cursor = _ReplayCursor(bus, stream, start_seq)
    try:
        while True:
            msgs = await ride(
                bus, f"replaying {stream} from seq {cursor.next_seq}", lambda: cursor.pull(batch)
            )
            if not msgs:
                return
            for msg in msgs:
                seq, pending = _seq_and_pending(msg.reply)
                if seq < cursor.next_seq:
                    continue  # a late delivery of a request re-sent after an outage
                if end_seq is not None and seq > end_seq:
                    return
                cursor.next_seq = seq + 1
                yield Stored(seq, msg.subject, msg.data, dict(msg.headers or {}))
                if pending == 0 or (end_seq is not None and seq >= end_seq):
                    return
    finally:
        await cursor.close()


class _ReplayCursor:
    """An ephemeral, ack-less, memory-backed consumer reading `stream` from `next_seq`;
    recreated from `next_seq` when the broker lost it (a restart)."""

    def __init__(self, bus: Bus, stream: str, next_seq: int):
        self.bus, self.stream, self.next_seq = bus, stream, next_seq
        self.name = ""
        self.puller: Puller | None = None

    async def _create(self) -> None:
        await self.close()
        name = f"replay-{uuid.uuid4().hex[:12]}"
        start = self.next_seq
        config = ConsumerConfig(
            name=name,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if start > 1 else DeliverPolicy.ALL,
            opt_start_seq=start if start > 1 else None,
            ack_policy=AckPolicy.NONE,
            inactive_threshold=60.0,
            mem_storage=True,
            num_replicas=1,
        )
        try:
            await self.bus.js.add_consumer(self.stream, config)
        except NotFoundError as e:
            raise BusNotFound(f"cannot replay {self.stream}: no such stream", code=404,
                              stream=self.stream) from e  # fmt: skip
        self.name, self.puller = name, Puller(self.bus, self.stream, name)

    async def pull(self, batch: int) -> list:
        """The next deliveries; `[]` only when the server said there are none (the end).
        Raises `NoAnswer` (retried by `ride`) when it did not answer."""
        if self.puller is None:
            await self._create()
        assert self.puller is not None
        msgs = await self.puller.fetch(batch, self.bus.cfg.fetch_timeout_s, wait=False)
        if msgs or (self.puller.answered and not self.puller.unavailable):
            return msgs
        if self.puller.unavailable:  # 503: the consumer is gone (a restart lost it)
            await self.close()
        raise NoAnswer(f"no answer to a pull from {self.stream} replay")

    async def close(self) -> None:
        puller, name, self.puller = self.puller, self.name, None
        if puller is None:
            return
        await puller.stop()
        if self.bus.connected:  # else it expires after inactive_threshold
            with contextlib.suppress(Exception):
                await self.bus.js.delete_consumer(self.stream, name)


async def get(bus: Bus, stream: str, seq: int) -> Stored | None:
    """The message stored at `seq` in `stream`; None if it was removed (limits, max_age)."""
    try:
        raw = await ride(
            bus, f"reading {stream} seq {seq}", lambda: bus.js.get_msg(stream, seq, direct=True)
        )
    except BusNotFound:
        return None
    headers = {k: v for k, v in (raw.headers or {}).items() if k not in _DIRECT_GET_HEADERS}
    return Stored(raw.seq or seq, raw.subject or "", raw.data or b"", headers)


async def last(bus: Bus, stream: str, subject: str) -> Stored | None:
    """The last message stored on `subject` in `stream`; None if there is none."""
    try:
        raw = await ride(
            bus,
            f"reading the last message of {stream} on {subject}",
            lambda: bus.js.get_last_msg(stream, subject),
        )
    except BusNotFound:
        return None
    headers = {k: v for k, v in (raw.headers or {}).items() if k not in _DIRECT_GET_HEADERS}
    return Stored(raw.seq or 0, raw.subject or subject, raw.data or b"", headers)


async def reposition(bus: Bus, run: str, group: Group, start_seq: int) -> None:
    """Recreate the durable `group` so its next delivery is `start_seq` (see module doc)."""
    names = Names(run)
    stream = names.stream_of(group)
    where = f"repositioning {stream}/{group} at seq {start_seq}"
    try:
        config = (await ride(bus, where, lambda: bus.js.consumer_info(stream, group))).config
    except BusNotFound:
        config = consumer_config(group, bus.cfg)
    else:
        # A retry after a lost answer finds it deleted already: that is the goal.
        with contextlib.suppress(BusNotFound):
            await ride(bus, where, lambda: bus.js.delete_consumer(stream, group))
    config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE if start_seq > 1 else DeliverPolicy.ALL
    config.opt_start_seq = start_seq if start_seq > 1 else None
    # Create-or-update with the same config: a retry after a lost answer is a no-op.
    await ride(bus, where, lambda: bus.js.add_consumer(stream, config))
