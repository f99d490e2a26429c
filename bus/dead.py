"""Dead letters: what the consumer groups gave up on, with the reason and the original.

`dead_letter(...)` copies a delivery into the run's DEAD stream (reason, detail and source in
`Specbus-*` headers, dedup id `dead:<stream>:<seq>`) and terminates it; the server's
max-deliveries and termination advisories land there too. `list_dead` reads DEAD back, one
`DeadLetter` per dead message; `count_dead` only counts them, per source stream, from one
stream-info request (what the producers' and trainers' summaries say). docs/bus.md, "Dead
letters".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import orjson
from nats.aio.msg import Msg
from opentelemetry import trace
from specbus.bus import headers as H
from specbus.bus.connection import Bus
from specbus.bus.outage import ride, send
from specbus.bus.replay import Stored, get, replay
from specbus.bus.subjects import ADVISORY_MAX_DELIVERIES, ADVISORY_TERMINATED, Names
from specbus.core.telemetry import span

if TYPE_CHECKING:
    from specbus.bus.publisher import Ack, Publisher

MAX_DELIVERIES = "max_deliveries"
EXPLICIT = "explicit"


class Delivery(Protocol):
    """What dead-lettering needs of a delivered message (a `bus.lease.Lease` is one)."""

    msg: Msg
    stream: str
    consumer: str
    seq: int
    deliveries: int


async def dead_letter(
    publisher: Publisher, names: Names, item: Delivery, reason: str, detail: str = ""
) -> Ack | None:
    """Copy `item` into DEAD with `reason`, then terminate it (no more redeliveries).

    A `Lease` is marked settled first; one that was already settled is left alone (returns
    None), so dead-lettering is idempotent like every settlement.
    """
    mark = getattr(item, "mark_settled", None)
    if mark is not None and not mark("term"):
        return None
    reason = H.one_line(reason) or "unspecified"
    # A `dead_letter` span under the current one (a trainer's lease), else under the span that
    # published the message; the copy in DEAD carries the dead_letter span's context.
    current = trace.get_current_span().get_span_context().is_valid
    with span("dead_letter", parent=None if current else (item.msg.headers or {}),
              attributes={"reason": reason, "stream": item.stream, "seq": item.seq,
                          "deliveries": item.deliveries}, component="specbus.bus"):  # fmt: skip
        kind = names.kind_of_stream(item.stream)
        hdrs = {k: v for k, v in (item.msg.headers or {}).items() if k != H.MSG_ID}
        original_id = (item.msg.headers or {}).get(H.MSG_ID)
        if original_id:
            hdrs["Specbus-Source-Msg-Id"] = original_id
        hdrs.update(
            {
                H.MSG_ID: f"dead:{item.stream}:{item.seq}",
                H.DEAD_REASON: reason,
                H.SOURCE_STREAM: item.stream,
                H.SOURCE_SEQ: str(item.seq),
                H.SOURCE_SUBJECT: item.msg.subject,
                H.DELIVERIES: str(item.deliveries),
                H.CONSUMER: item.consumer,
            }
        )
        if detail:
            hdrs[H.DEAD_DETAIL] = H.one_line(detail)
        H.inject_trace(hdrs)
        ack = (await publisher.publish_payloads([(names.dead(kind), item.msg.data, hdrs)]))[0]
        await send(
            publisher.bus,
            item.msg.reply,
            b"+TERM " + reason.encode(),
            what=f"terminating {item.stream} seq {item.seq}",
        )
    return ack


@dataclass(frozen=True)
class DeadLetter:
    """One dead message. `data` is the original payload (None if no longer stored)."""

    dead_seq: int  # sequence in the DEAD stream
    kind: str  # "explicit" | "max_deliveries" | "terminated"
    reason: str
    stream: str
    seq: int
    consumer: str
    deliveries: int
    data: bytes | None
    headers: dict[str, str] = field(default_factory=dict)
    detail: str = ""
    subject: str = ""


def _explicit(entry: Stored) -> DeadLetter:
    h = entry.headers
    return DeadLetter(
        dead_seq=entry.seq,
        kind="explicit",
        reason=h.get(H.DEAD_REASON, "unspecified"),
        stream=h.get(H.SOURCE_STREAM, ""),
        seq=int(h.get(H.SOURCE_SEQ, 0)),
        consumer=h.get(H.CONSUMER, ""),
        deliveries=int(h.get(H.DELIVERIES, 0)),
        data=entry.data,
        headers={
            k: v
            for k, v in h.items()
            if not k.startswith(("Specbus-Dead-", "Specbus-Source-", "Nats-"))
        },
        detail=h.get(H.DEAD_DETAIL, ""),
        subject=h.get(H.SOURCE_SUBJECT, ""),
    )


async def _from_advisory(bus: Bus, entry: Stored) -> DeadLetter:
    adv = orjson.loads(entry.data)
    stream, seq = adv.get("stream", ""), int(adv.get("stream_seq", 0))
    original = await get(bus, stream, seq) if stream and seq else None
    if entry.subject.startswith(ADVISORY_MAX_DELIVERIES):
        kind, reason = MAX_DELIVERIES, MAX_DELIVERIES
        detail = f"not acked after {adv.get('deliveries')} deliveries"
    else:
        kind, reason, detail = "terminated", adv.get("reason") or "terminated", ""
    if original is None:
        detail = (detail + "; " if detail else "") + f"original no longer stored in {stream}"
    return DeadLetter(
        dead_seq=entry.seq,
        kind=kind,
        reason=reason,
        stream=stream,
        seq=seq,
        consumer=adv.get("consumer", ""),
        deliveries=int(adv.get("deliveries", 0)),
        data=None if original is None else original.data,
        headers={} if original is None else original.headers,
        detail=detail,
        subject="" if original is None else original.subject,
    )


async def list_dead(bus: Bus, run: str, *, limit: int | None = None) -> list[DeadLetter]:
    """The run's dead letters, oldest first (the last `limit` if given)."""
    names = Names(run)
    entries: list[DeadLetter] = []
    explicit: set[tuple[str, int]] = set()
    async for entry in replay(bus, names.dead_stream):
        if entry.subject.startswith((ADVISORY_MAX_DELIVERIES, ADVISORY_TERMINATED)):
            dl = await _from_advisory(bus, entry)
            if dl.kind == "terminated" and (dl.stream, dl.seq) in explicit:
                continue
        else:
            dl = _explicit(entry)
            explicit.add((dl.stream, dl.seq))
        entries.append(dl)
    return entries if limit is None else entries[-limit:]


async def count_dead(bus: Bus, run: str) -> dict[str, dict[str, int]]:
    """The run's dead letters per source kind ("tasks", "samples"), each split into
    `explicit` (dead-lettered by a producer or trainer, with a reason) and `max_deliveries`
    (the broker gave up on a delivery: its advisory). One stream-info request with
    per-subject counts: every role of the run may make it (no consumer is created), and it
    counts what `list_dead` lists (a termination advisory repeats an explicit dead letter)."""
    names = Names(run)
    stream = names.dead_stream
    info = await ride(bus, f"counting the dead letters in {stream}",
                      lambda: bus.js.stream_info(stream, subjects_filter=">"))  # fmt: skip
    out = {kind: {EXPLICIT: 0, MAX_DELIVERIES: 0} for kind in ("tasks", "samples")}
    kinds = {names.tasks_stream: "tasks", names.samples_stream: "samples"}
    for subject, n in (info.state.subjects or {}).items():
        for kind in out:
            if subject == names.dead(kind):
                out[kind][EXPLICIT] += n
        if subject.startswith(ADVISORY_MAX_DELIVERIES + "."):
            source = subject[len(ADVISORY_MAX_DELIVERIES) + 1 :].rsplit(".", 1)[0]
            if source in kinds:  # ...MAX_DELIVERIES.<stream>.<consumer>
                out[kinds[source]][MAX_DELIVERIES] += n
    return out
