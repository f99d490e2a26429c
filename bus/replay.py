"""Reading a stream back, and repositioning a durable consumer (resume = replay).

- `replay(bus, stream, start_seq)` iterates stored messages from `start_seq` through an
  ephemeral, ack-less, memory-backed consumer: the durable groups ("producers", "trainers")
  are untouched. It stops at the end of the stream as seen by the last delivery (or at
  `end_seq`) instead of waiting for new messages.
- `get(bus, stream, seq)` reads one message by sequence (direct get), None if it is gone.
- `reposition(bus, run, group, start_seq)` makes a durable consumer deliver from `start_seq`:
  it is deleted and recreated with `DeliverPolicy.BY_START_SEQUENCE`, keeping its ack_wait,
  max_deliver and max_ack_pending. Call it while no member is working (a trainer world
  restarting from a checkpoint): leases of the old consumer become void, acks to them are
  ignored, and members must `Leases.join` again.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from bus.connection import Bus
from bus.pull import Puller
from bus.subjects import Group, Names
from bus.topology import consumer_config
from core.errors import BusError

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
    name = f"replay-{uuid.uuid4().hex[:12]}"
    config = ConsumerConfig(
        name=name,
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE if start_seq > 1 else DeliverPolicy.ALL,
        opt_start_seq=start_seq if start_seq > 1 else None,
        ack_policy=AckPolicy.NONE,
        inactive_threshold=60.0,
        mem_storage=True,
        num_replicas=1,
    )
    try:
        await bus.js.add_consumer(stream, config)
    except NotFoundError as e:
        raise BusError(f"cannot replay {stream}: no such stream") from e
    puller = Puller(bus, stream, name)
    try:
        while True:
            msgs = await puller.fetch(batch, bus.cfg.fetch_timeout_s, wait=False)
            if not msgs:
                return
            for msg in msgs:
                seq, pending = _seq_and_pending(msg.reply)
                if end_seq is not None and seq > end_seq:
                    return
                yield Stored(seq, msg.subject, msg.data, dict(msg.headers or {}))
                if pending == 0 or (end_seq is not None and seq >= end_seq):
                    return
    finally:
        await puller.stop()
        with contextlib.suppress(Exception):  # else it expires after inactive_threshold
            await bus.js.delete_consumer(stream, name)


async def get(bus: Bus, stream: str, seq: int) -> Stored | None:
    """The message stored at `seq` in `stream`; None if it was removed (limits, max_age)."""
    try:
        raw = await bus.js.get_msg(stream, seq, direct=True)
    except NotFoundError:
        return None
    except Exception as e:
        raise BusError(f"cannot read {stream} seq {seq}: {e}") from e
    headers = {k: v for k, v in (raw.headers or {}).items() if k not in _DIRECT_GET_HEADERS}
    return Stored(raw.seq or seq, raw.subject or "", raw.data or b"", headers)


async def last(bus: Bus, stream: str, subject: str) -> Stored | None:
    """The last message stored on `subject` in `stream`; None if there is none."""
    try:
        raw = await bus.js.get_last_msg(stream, subject)
    except NotFoundError:
        return None
    except Exception as e:
        raise BusError(f"cannot read the last message of {stream} on {subject}: {e}") from e
    headers = {k: v for k, v in (raw.headers or {}).items() if k not in _DIRECT_GET_HEADERS}
    return Stored(raw.seq or 0, raw.subject or subject, raw.data or b"", headers)


async def reposition(bus: Bus, run: str, group: Group, start_seq: int) -> None:
    """Recreate the durable `group` so its next delivery is `start_seq` (see module doc)."""
    names = Names(run)
    stream = names.stream_of(group)
    try:
        config = (await bus.js.consumer_info(stream, group)).config
        await bus.js.delete_consumer(stream, group)
    except NotFoundError:
        config = consumer_config(group, bus.cfg)
    config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE if start_seq > 1 else DeliverPolicy.ALL
    config.opt_start_seq = start_seq if start_seq > 1 else None
    try:
        await bus.js.add_consumer(stream, config)
    except Exception as e:
        raise BusError(f"cannot reposition {stream}/{group} at seq {start_seq}: {e}") from e
