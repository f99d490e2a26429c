"""Publishing records to JetStream: dedup ids, trace headers, async PubAcks, safe retries.

Every message carries `Nats-Msg-Id` (the record's `msg_id`): a retry inside the duplicate
window is dropped by the broker (`Ack.duplicate`). `publish_many` sends windows of messages
and re-sends what got no PubAck with the same ids until the broker answered: stored exactly
once, or `BrokerUnavailable`; a refused publish raises `BusRejected` with the server's codes.
docs/bus.md, "Publishing".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import orjson
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError
from specbus.bus import headers as H
from specbus.bus.connection import Bus
from specbus.bus.outage import NoAnswer, ride
from specbus.core.contracts import Record
from specbus.core.errors import BusRejected, RecordError
from specbus.core.telemetry import span

log = logging.getLogger("specbus.bus")


@dataclass(frozen=True, slots=True)
class Ack:
    """The broker stored a message (or had it already: `duplicate`)."""

    stream: str
    seq: int
    duplicate: bool = False


class _Rejected(Exception):
    """The broker answered a publish with an error (not retryable): its `error` object."""

    def __init__(self, description: str, code: int | None = None, err_code: int | None = None):
        super().__init__(description)
        self.description, self.code, self.err_code = description, code, err_code


class _NoResponders(Exception):
    """A publish was answered "503 no responders": no stream listens on its subject, or
    JetStream is not serving it yet (a restart, a leader election)."""


def encode(record: Record) -> bytes:
    """The record's wire bytes (the same JSON `Record.to_bytes` writes, serialised in Rust);
    `RecordError(reason="oversize")` beyond its class's `max_bytes`."""
    data = record.__pydantic_serializer__.to_json(record)
    if len(data) > record.max_bytes:
        raise RecordError(
            f"{type(record).__name__} is {len(data)} bytes, over the {record.max_bytes}-byte limit",
            reason="oversize",
        )
    return data


def check_payload_sizes(bus: Bus, items: list[tuple[str, bytes, dict[str, str]]]) -> None:
    """`RecordError(reason="oversize")` if a message (payload and headers) is over the broker's
    `max_payload` (from its INFO): nothing of `items` is sent then. A broker that refuses what
    the record limits allow (a stock nats-server's 1 MiB) needs `max_payload` raised in its
    config; `specbus up` and the cluster set 8 MiB."""
    limit = bus.nc.max_payload
    for subject, payload, hdrs in items:
        size = len(payload) + sum(len(k) + len(v) + 4 for k, v in hdrs.items()) + 12
        if size > limit:
            raise RecordError(
                f"a message of {size} bytes to {subject} is over the broker's max_payload of "
                f"{limit} bytes: raise max_payload in the nats-server config (specbus up and "
                f"the cluster set 8 MiB)",
                reason="oversize",
            )


def common_headers(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """`extra` plus the current trace context: the same for every message of one call."""
    hdrs = dict(extra) if extra else {}
    H.inject_trace(hdrs)
    return hdrs


def _publish_span(subject: str, count: int):
    return span(
        "publish",
        attributes={
            "messaging.system": "nats",
            "messaging.destination.name": subject,
            "messaging.batch.message_count": count,
        },
        component="specbus.bus",
    )


def msg_id_of(record: Record, msg_id: str | None = None) -> str:
    """The dedup id of `record`: `msg_id` if given, else the record's own; `RecordError` when it has
    none."""
    if msg_id is None:
        msg_id = getattr(record, "msg_id", None)
        if msg_id is None:
            raise RecordError(
                f"{type(record).__name__} has no msg_id: pass one explicitly", reason="invalid"
            )
    return msg_id


class Publisher:
    """Publishes records (or raw payloads) and awaits their PubAcks. One per connection is enough."""

    def __init__(self, bus: Bus, *, window: int | None = None, ack_timeout_s: float | None = None):
        self.bus = bus
        self.window = window or bus.cfg.publish_window
        self.ack_timeout_s = ack_timeout_s or max(bus.cfg.connect_timeout_s, 2.0)
        self._prefix = ""
        self._sub = None
        self._token = 0
        self._pending: dict[str, asyncio.Future] = {}

    async def _start(self) -> None:
        if self._sub is None:
            inbox = self.bus.nc.new_inbox()
            self._prefix = inbox + "."
            self._sub = await self.bus.nc.subscribe(inbox + ".*", cb=self._on_ack)

    async def _on_ack(self, msg: Msg) -> None:
        fut = self._pending.pop(msg.subject[len(self._prefix) :], None)
        if fut is None or fut.done():
            return  # a late PubAck of a message already re-sent
        if msg.headers and msg.headers.get("Status") == "503":
            fut.set_exception(_NoResponders())
            return
        try:
            resp = orjson.loads(msg.data)
        except orjson.JSONDecodeError:
            fut.set_exception(_Rejected(f"unreadable PubAck {msg.data[:80]!r}"))
            return
        err = resp.get("error")
        if err:
            fut.set_exception(
                _Rejected(str(err.get("description", err)), err.get("code"), err.get("err_code"))
            )
        else:
            fut.set_result(Ack(resp["stream"], resp["seq"], bool(resp.get("duplicate", False))))

    async def _send_window(
        self, batch: list[tuple[str, bytes, dict[str, str]]]
    ) -> list[asyncio.Future]:
        loop = asyncio.get_running_loop()
        publish = self.bus.nc.publish
        futs = []
        for subject, payload, hdrs in batch:
            self._token += 1
            token = str(self._token)
            fut = loop.create_future()
            self._pending[token] = fut
            futs.append(fut)
            try:
                await publish(subject, payload, reply=self._prefix + token, headers=hdrs)
            except Exception as e:  # disconnected with a full buffer: re-sent on the next attempt
                log.debug("publish to %s failed: %s", subject, e)
                fut.cancel()
        return futs

    async def _await_acks(self, futs: list[asyncio.Future], reconnects: int) -> None:
        """Until all PubAcks came, `ack_timeout_s` passed, or the connection was re-established
        (a PubAck of a message sent before a reconnect may never come: re-send at once)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ack_timeout_s
        pending = {f for f in futs if not f.done()}
        while pending and self.bus.reconnects == reconnects:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            _, pending = await asyncio.wait(pending, timeout=min(remaining, 0.25))

    async def publish_payloads(self, items: list[tuple[str, bytes, dict[str, str]]]) -> list[Ack]:
        """Publish (subject, payload, headers) triples; headers must hold `Nats-Msg-Id`.
        `RecordError(reason="oversize")` before anything is sent if one is over the broker's
        `max_payload` (`check_payload_sizes`)."""
        check_payload_sizes(self.bus, items)
        await self._start()
        acks: list[Ack | None] = [None] * len(items)
        for start in range(0, len(items), self.window):
            todo = list(range(start, min(start + self.window, len(items))))

            async def attempt(todo: list[int] = todo) -> None:
                reconnects = self.bus.reconnects
                futs = await self._send_window([items[i] for i in todo])
                await self._await_acks(futs, reconnects)
                missing, unserved = [], set()
                for i, fut in zip(todo, futs, strict=True):
                    if fut.cancelled() or not fut.done():
                        fut.cancel()
                        missing.append(i)
                    elif isinstance(fut.exception(), _NoResponders):
                        missing.append(i)
                        unserved.add(items[i][0])
                    elif isinstance(rejected := fut.exception(), _Rejected):
                        raise BusRejected(
                            f"publish to {items[i][0]} rejected: {rejected.description} "
                            f"(code {rejected.code}, err_code {rejected.err_code})",
                            code=rejected.code, err_code=rejected.err_code,
                            description=rejected.description,
                        )  # fmt: skip
                    else:
                        acks[i] = fut.result()
                self._pending = {t: f for t, f in self._pending.items() if not f.done()}
                for subject in unserved:
                    await self._stream_of(subject)  # BusError if no stream listens on it
                if missing:
                    todo[:] = missing  # the next attempt re-sends these, with the same ids
                    raise NoAnswer(f"{len(missing)} of {len(futs)} PubAcks missing")

            await ride(self.bus, f"publishing {len(todo)} messages to {items[start][0]}", attempt)
        return acks  # type: ignore[return-value]

    async def _stream_of(self, subject: str) -> str:
        """The stream listening on `subject`; `BusRejected` if none (JetStream answers this
        while a publish to it is still refused: the refusal is then transient)."""
        try:  # inside `publish_payloads`' ride: a transient failure retries the attempt
            return await self.bus.js.find_stream_name_by_subject(subject)
        except NotFoundError as e:
            raise BusRejected(
                f"publish to {subject} rejected: no stream listens on the subject (503 no responders)",
                code=503,
            ) from e

    async def publish_many(
        self, subject: str, records: Iterable[Record], *, headers: Mapping[str, str] | None = None
    ) -> list[Ack]:
        """Publish records to `subject` (ids from `record.msg_id`); one `Ack` per record, in
        order. One `publish` span; every message carries its trace context."""
        records = list(records)
        with _publish_span(subject, len(records)):
            common = common_headers(headers)
            items = [(subject, encode(r), {**common, H.MSG_ID: msg_id_of(r)}) for r in records]
            acks = await self.publish_payloads(items)
        dups = sum(a.duplicate for a in acks)
        if dups:
            log.debug("%d of %d publishes to %s were duplicates", dups, len(acks), subject)
        return acks

    async def publish(
        self,
        subject: str,
        record: Record,
        msg_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Ack:
        """Publish one record and await its PubAck (`duplicate=True` if the broker had it),
        in a `publish` span whose trace context the message carries."""
        with _publish_span(subject, 1):
            item = (
                subject,
                encode(record),
                {**common_headers(headers), H.MSG_ID: msg_id_of(record, msg_id)},
            )
            return (await self.publish_payloads([item]))[0]

    async def close(self) -> None:
        """Unsubscribe from the PubAck inbox; PubAcks still in flight are dropped."""
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
