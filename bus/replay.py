"""Reading a stream back, and repositioning a durable consumer (resume = replay).

`replay(bus, stream, start_seq)` iterates stored messages by batched direct gets (no consumer
is created: a role may read a stream back without the right to create one, docs/cluster.md)
and survives an outage without skipping or repeating; `get`/`last` read one message;
`reposition(bus, run, group, start_seq)` resets a durable consumer in place to a sequence
(its old leases become void). docs/bus.md, "Replay and resume".
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import orjson
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy
from specbus.bus.connection import Bus
from specbus.bus.errors import status_error
from specbus.bus.outage import NoAnswer, ride
from specbus.bus.subjects import Group, Names
from specbus.bus.topology import consumer_config
from specbus.core.errors import BusNotFound, BusRejected

# Headers a direct get adds; they describe the storage, not the message.
_DIRECT_GET_HEADERS = (
    "Nats-Stream",
    "Nats-Sequence",
    "Nats-Time-Stamp",
    "Nats-Subject",
    "Nats-Last-Sequence",
    "Nats-Num-Pending",
)
# What one batch may carry (the server stops after the message that crosses it).
MAX_BATCH_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class Stored:
    """One stored message: its stream sequence, subject, payload and headers."""

    seq: int
    subject: str
    data: bytes
    headers: dict[str, str] = field(default_factory=dict)


def _stored(seq: int, subject: str, data: bytes | None, headers: dict | None) -> Stored:
    kept = {k: v for k, v in (headers or {}).items() if k not in _DIRECT_GET_HEADERS}
    return Stored(seq, subject or "", data or b"", kept)


async def replay(
    bus: Bus, stream: str, start_seq: int = 1, *, end_seq: int | None = None, batch: int = 512
) -> AsyncIterator[Stored]:
    """Stored messages of `stream` with `start_seq <= seq (<= end_seq)`, in order, up to the
    last one stored when the replay reaches the end. Raises `BusNotFound` when there is no
    such stream, `PermissionDenied` when the role may not read it."""
    reader = _DirectReader(bus, stream)
    next_seq = max(start_seq, 1)
    try:
        while end_seq is None or next_seq <= end_seq:
            want = batch if end_seq is None else min(batch, end_seq - next_seq + 1)
            got, more = await ride(
                bus,
                f"replaying {stream} from seq {next_seq}",
                lambda at=next_seq, n=want: reader.batch(at, n),
            )
            for stored in got:
                if stored.seq < next_seq:
                    continue
                if end_seq is not None and stored.seq > end_seq:
                    return
                next_seq = stored.seq + 1
                yield stored
            if got and more:
                continue
            # The answering server holds nothing after `next_seq`. In a cluster a replica may
            # answer a direct get while it catches up: the stream leader has the last word.
            stored = await _next_from_leader(bus, stream, next_seq)
            if stored is None or (end_seq is not None and stored.seq > end_seq):
                return
            next_seq = stored.seq + 1
            yield stored
    finally:
        await reader.close()


async def _next_from_leader(bus: Bus, stream: str, seq: int) -> Stored | None:
    """The first message at or after `seq`, as the stream leader has it (API get)."""
    try:
        raw = await ride(bus, f"reading {stream} from seq {seq}",
                         lambda: bus.js.get_msg(stream, seq, subject=">", next=True))  # fmt: skip
    except BusNotFound:
        return None
    return _stored(raw.seq or seq, raw.subject or "", raw.data, raw.headers)


class _DirectReader:
    """Batches of one stream by direct get (`$JS.API.DIRECT.GET.<stream>` with `batch`,
    nats-server >= 2.11): one inbox per replay, one request per batch; the answers of an
    earlier request (retried after no answer) are dropped."""

    def __init__(self, bus: Bus, stream: str):
        self.bus, self.stream = bus, stream
        self._subject = f"{bus.js._prefix}.DIRECT.GET.{stream}"
        self._inbox = ""
        self._sub = None
        self._rid = 0
        self._answers: asyncio.Queue[tuple[int, Msg]] = asyncio.Queue()

    async def _on_msg(self, msg: Msg) -> None:
        self._answers.put_nowait((int(msg.subject.rsplit(".", 1)[1]), msg))

    async def _answer(self, rid: int) -> Msg:
        while True:
            got, msg = await self._answers.get()
            if got == rid:
                return msg

    async def batch(self, seq: int, n: int) -> tuple[list[Stored], bool]:
        """Up to `n` stored messages from `seq` on, in order, and whether the answering
        server holds more after them. Raises `NoAnswer` (retried by `ride`) when no server
        answered, `BusNotFound` when there is no such stream."""
        if self._sub is None:
            self._inbox = self.bus.nc.new_inbox()
            self._sub = await self.bus.nc.subscribe(f"{self._inbox}.*", cb=self._on_msg)
        self._rid += 1
        rid = self._rid
        req = {"seq": seq, "batch": n, "max_bytes": MAX_BATCH_BYTES}
        await self.bus.nc.publish(self._subject, orjson.dumps(req), reply=f"{self._inbox}.{rid}")
        got: list[Stored] = []
        while True:
            try:  # the answers stream in: no answer for this long is a lost request
                msg = await asyncio.wait_for(self._answer(rid), self.bus.cfg.connect_timeout_s)
            except asyncio.TimeoutError:
                if got:  # the rest of the batch is lost: the caller asks again after `got`
                    return got, True
                raise NoAnswer(
                    f"no answer to a direct get of {self.stream} from seq {seq}"
                ) from None
            headers = msg.headers or {}
            if "Nats-Sequence" in headers:
                got.append(_stored(int(headers["Nats-Sequence"]), headers.get("Nats-Subject", ""),
                                   msg.data, headers))  # fmt: skip
                if "Nats-Num-Pending" not in headers:  # a server < 2.11 answers one, no batch
                    return got, True
                continue
            status, description = headers.get("Status", ""), headers.get("Description", "")
            if status == "204":  # end of batch
                return got, int(headers.get("Nats-Num-Pending") or 0) > 0
            if status == "404":  # nothing stored from `seq` on
                return got, False
            if status == "503":  # no responders: no such stream, or none serving it right now
                await ride(self.bus, f"reading {self.stream}",
                           lambda: self.bus.js.stream_info(self.stream))  # fmt: skip
                raise NoAnswer(f"no server serves direct gets of {self.stream} yet")
            raise status_error(f"direct get of {self.stream} from seq {seq}", status,
                               description, stream=self.stream)  # fmt: skip

    async def close(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None and self.bus.connected:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


async def get(bus: Bus, stream: str, seq: int) -> Stored | None:
    """The message stored at `seq` in `stream`; None if it was removed (limits, max_age)."""
    try:
        raw = await ride(
            bus, f"reading {stream} seq {seq}", lambda: bus.js.get_msg(stream, seq, direct=True)
        )
    except BusNotFound:
        return None
    return _stored(raw.seq or seq, raw.subject or "", raw.data, raw.headers)


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
    return _stored(raw.seq or 0, raw.subject or subject, raw.data, raw.headers)


async def reposition(bus: Bus, run: str, group: Group, start_seq: int) -> None:
    """Make the durable `group` deliver from `start_seq` on (see the module doc): reset in
    place (`$JS.API.CONSUMER.RESET.<stream>.<group>`, nats-server >= 2.14), which the role
    that leases from it may do without any right to create or delete a consumer. A missing
    group is created first, and one of an earlier specbus that cannot be reset that far back
    (created at a start sequence above `start_seq`) is recreated: both need the create and
    delete rights (`PermissionDenied` for a role without them, docs/cluster.md)."""
    names = Names(run)
    stream = names.stream_of(group)
    where = f"repositioning {stream}/{group} at seq {start_seq}"
    try:
        config = (await ride(bus, where, lambda: bus.js.consumer_info(stream, group))).config
    except BusNotFound:
        await _recreate(bus, stream, consumer_config(group, bus.cfg), where, delete=False)
    else:
        if config.deliver_policy not in (None, DeliverPolicy.ALL):
            await _recreate(bus, stream, config, where, delete=True)
    await _reset(bus, stream, group, max(start_seq, 1), where)


async def _reset(bus: Bus, stream: str, group: str, seq: int, where: str) -> None:
    subject = f"{bus.js._prefix}.CONSUMER.RESET.{stream}.{group}"
    timeout = bus.cfg.connect_timeout_s
    # The same sequence again: a retry after a lost answer is a no-op.
    msg = await ride(bus, where, lambda: bus.nc.request(subject, orjson.dumps({"seq": seq}),
                                                        timeout=timeout))  # fmt: skip
    error = orjson.loads(msg.data or b"{}").get("error")
    if error:
        raise BusRejected(f"{where}: {error.get('description')} (code {error.get('code')}, "
                          f"err_code {error.get('err_code')})", code=error.get("code"),
                          err_code=error.get("err_code"), description=error.get("description"),
                          stream=stream)  # fmt: skip


async def _recreate(bus: Bus, stream: str, config, where: str, *, delete: bool) -> None:
    """Create `config` afresh as a deliver-all durable (which a reset moves anywhere)."""
    if delete:  # a retry after a lost answer finds it deleted already: that is the goal
        with contextlib.suppress(BusNotFound):
            await ride(bus, where, lambda: bus.js.delete_consumer(stream, config.durable_name))
    config.deliver_policy, config.opt_start_seq = DeliverPolicy.ALL, None
    # Create-or-update with the same config: a retry after a lost answer is a no-op.
    await ride(bus, where, lambda: bus.js.add_consumer(stream, config))
