"""Lag of a consumer group: what is published and not yet consumed, in messages and bytes.

`lag(bus, run, group)`: `messages = num_pending + num_ack_pending` of the durable consumer,
exact; `bytes` the tensor bytes the lagging records name, sampled (default: an estimate, exact
for uniform refs) or scanned. The backpressure signal of producers and the live intake.
docs/bus.md, "Lag".
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass

import orjson
from specbus.bus.connection import Bus
from specbus.bus.outage import ride
from specbus.bus.replay import Stored, get, replay
from specbus.bus.subjects import TRAINERS, Group, Names
from specbus.core.errors import BusNotFound


@dataclass(frozen=True)
class Lag:
    """The lag of one consumer group (see the module doc); `first_unacked_seq`..`last_seq` is the
    unconsumed window."""

    group: str
    pending: int  # published, not yet delivered to any member
    ack_pending: int  # delivered, not acked yet
    messages: int  # pending + ack_pending
    bytes: int
    bytes_method: str  # "sampled" | "scan" | "empty"
    first_unacked_seq: int
    last_seq: int

    def as_dict(self) -> dict:
        """A JSON-able dict of the fields."""
        return asdict(self)


def _nbytes(stored: Stored) -> int | None:
    """The `nbytes` a stored record names (None for records without tensors or unreadable ones)."""
    try:
        value = orjson.loads(stored.data).get("nbytes")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return value if isinstance(value, int) else None


async def lag(
    bus: Bus, run: str, group: Group = TRAINERS, *, scan: bool = False, sample: int = 16
) -> Lag:
    """The lag of `group` in `run` (see module doc). Raises `BusError` if the group is not
    declared, `BrokerUnavailable` after an outage of `bus.outage_give_up_s`."""
    stream = Names(run).stream_of(group)
    try:
        info = await ride(
            bus, f"reading the lag of {stream}/{group}", lambda: bus.js.consumer_info(stream, group)
        )
    except BusNotFound as e:
        raise BusNotFound(f"consumer {stream}/{group} not found: is the run declared?",
                          code=e.code, err_code=e.err_code, stream=stream) from e  # fmt: skip
    pending, ack_pending = info.num_pending or 0, info.num_ack_pending or 0
    messages = pending + ack_pending
    lo = (info.ack_floor.stream_seq if info.ack_floor else 0) + 1
    hi = (info.delivered.stream_seq if info.delivered else 0) + pending
    if messages == 0 or hi < lo:
        return Lag(group, pending, ack_pending, messages, 0, "empty", lo, hi)
    if scan:
        total = 0
        async for stored in replay(bus, stream, lo, end_seq=hi):
            total += _nbytes(stored) or 0
        return Lag(group, pending, ack_pending, messages, total, "scan", lo, hi)
    count = min(sample, hi - lo + 1)
    seqs = sorted({lo + (hi - lo) * i // max(count - 1, 1) for i in range(count)})
    found = await asyncio.gather(*(get(bus, stream, s) for s in seqs))
    sizes = [n for n in (_nbytes(s) for s in found if s is not None) if n is not None]
    mean = sum(sizes) / len(sizes) if sizes else 0.0
    return Lag(
        group, pending, ack_pending, messages, int(round(mean * messages)), "sampled", lo, hi
    )
