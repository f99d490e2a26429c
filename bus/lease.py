"""Leases: one member of a consumer group ("producers" on TASKS, "trainers" on SAMPLES).

    group = await Leases.join(bus, run, "trainers")          # SampleRef records
    leases = await group.fetch(8)                            # parsed, valid records only
    async with group.heartbeat(leases):                      # long work keeps them leased
        ...
    await group.ack_all(leases)                              # optimizer boundary: confirmed acks

Guarantees (the broker's, surfaced here):
- A fetched message is leased to this member for the consumer's `ack_wait`; unless acked,
  nak'd, termed or kept alive (`in_progress`, `heartbeat`), it is redelivered to a member of
  the group (maybe another one) after that. Delivery is at-least-once.
- `fetch(n)` asks for at most the remaining ack credit: `max_ack_pending` of the consumer
  minus the leases this member holds unsettled. With no credit left it returns `[]`
  immediately instead of waiting out its timeout for credit only its own acks can free.
  (Other members share the same credit; the broker never delivers beyond it.)
- Records that fail to parse (`RecordError`: garbage bytes, another schema version, a tensor
  inside, oversize, invalid fields) never reach the caller: they are dead-lettered with the
  reason (`bus.dead`) and terminated, and the fetch goes on with the next messages.
- Settling (ack / nak / term) is idempotent: the first settlement wins, later ones are no-ops.
  `ack_all(confirm=True)` waits for the server to confirm every ack (double ack); a plain
  `ack()` is fire-and-forget (the server may lose it if it dies within ~0.1 s; the message is
  then redelivered, which consumers must tolerate anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable

import orjson
from nats.aio.msg import Msg
from opentelemetry.context import Context

from bus import headers as H
from bus.connection import Bus
from bus.dead import dead_letter
from bus.publisher import Publisher
from bus.pull import Puller
from bus.subjects import PRODUCERS, TRAINERS, Group, Names
from core.contracts import MAX_RECORD_BYTES, PromptTask, Record, SampleRef
from core.errors import BusError, ConfigError, RecordError

log = logging.getLogger("specbus.bus")

RECORD_OF_GROUP: dict[str, type[Record]] = {PRODUCERS: PromptTask, TRAINERS: SampleRef}
_ACK = b"+ACK"
_NAK = b"-NAK"
_WPI = b"+WPI"


def parse_record(cls: type[Record], data: bytes) -> Record:
    """`cls.from_bytes(data)`, with the validation done once on the happy path.

    Raises `RecordError` with the same reasons as `Record.from_bytes` (oversize, garbage,
    schema, invalid): a failure is re-run through `from_bytes` to classify it.
    """
    if len(data) > MAX_RECORD_BYTES:
        return cls.from_bytes(data)  # raises oversize
    try:
        return cls.model_validate_json(data)
    except Exception:
        return cls.from_bytes(data)


class Lease:
    """One delivered, parsed record leased to this member, and how to settle it."""

    __slots__ = ("record", "msg", "stream", "consumer", "seq", "deliveries", "_group", "settled")

    def __init__(
        self,
        record: Record,
        msg: Msg,
        stream: str,
        consumer: str,
        seq: int,
        deliveries: int,
        group: Leases,
    ):
        self.record = record
        self.msg = msg
        self.stream = stream
        self.consumer = consumer
        self.seq = seq  # stream sequence: the replay/resume cursor and a stable identity
        self.deliveries = deliveries  # 1 on first delivery
        self._group = group
        self.settled: str | None = None  # "ack" | "nak" | "term" once settled

    @property
    def headers(self) -> dict[str, str]:
        return self.msg.headers or {}

    @property
    def nbytes(self) -> int:
        """Tensor bytes the record names (0 for records without tensors)."""
        return int(getattr(self.record, "nbytes", 0) or 0)

    def trace_context(self) -> Context:
        """The producer's OpenTelemetry context (link a consumer span to it)."""
        return H.extract_trace(self.msg.headers)

    def mark_settled(self, how: str) -> bool:
        """Record the settlement; False if it was already settled (then do nothing)."""
        if self.settled is not None:
            return False
        self.settled = how
        self._group._release(self)
        return True

    async def ack(self) -> None:
        """Done with it (fire-and-forget; `Leases.ack_all(confirm=True)` to be sure)."""
        if self.mark_settled("ack"):
            await self._group.bus.nc.publish(self.msg.reply, _ACK)

    async def nak(self, delay_s: float | None = None) -> None:
        """Not done: redeliver (after `delay_s`, default `bus.nak_delay_s`; 0 for at once)."""
        if not self.mark_settled("nak"):
            return
        delay_s = self._group.cfg.nak_delay_s if delay_s is None else delay_s
        payload = _NAK + (
            b" " + orjson.dumps({"delay": int(delay_s * 1e9)}) if delay_s > 0 else b""
        )
        await self._group.bus.nc.publish(self.msg.reply, payload)

    async def term(self, reason: str, detail: str = "") -> None:
        """Poison: never redeliver; a copy goes to DEAD with `reason` (see `bus.dead`)."""
        await dead_letter(self._group.publisher, self._group.names, self, reason, detail)

    async def in_progress(self) -> None:
        """Still working on it: restart the `ack_wait` clock (any number of times)."""
        if self.settled is None:
            await self._group.bus.nc.publish(self.msg.reply, _WPI)


def _ack_metadata(reply: str) -> tuple[str, str, int, int]:
    """(stream, consumer, deliveries, stream seq) from a `$JS.ACK...` reply subject."""
    t = reply.split(".")
    if len(t) == 9:  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
        return t[2], t[3], int(t[4]), int(t[5])
    if len(t) >= 11:  # $JS.ACK.<domain>.<acchash>.<stream>.<consumer>.<delivered>.<sseq>...
        return t[4], t[5], int(t[6]), int(t[7])
    raise BusError(f"not a JetStream delivery (reply subject {reply!r})")


class Leases:
    """A member of a durable consumer group; see the module doc for the guarantees."""

    def __init__(
        self,
        bus: Bus,
        names: Names,
        group: Group,
        record_cls: type[Record],
        max_ack_pending: int,
        ack_wait_s: float,
    ):
        self.bus = bus
        self.cfg = bus.cfg
        self.names = names
        self.group = group
        self.stream = names.stream_of(group)
        self.record_cls = record_cls
        self.max_ack_pending = max_ack_pending
        self.ack_wait_s = ack_wait_s
        self.publisher = Publisher(bus)  # dead letters
        self._puller = Puller(bus, self.stream, group)
        self._held: set[Lease] = set()
        self.dead_lettered = 0

    @classmethod
    async def join(
        cls, bus: Bus, run: str, group: Group, record_cls: type[Record] | None = None
    ) -> Leases:
        """Bind to the run's durable consumer `group` (declared by `bus.topology.declare`).

        Raises `BusError` if the consumer does not exist.
        """
        names = Names(run)
        stream = names.stream_of(group)
        if record_cls is None:
            record_cls = RECORD_OF_GROUP.get(group)
            if record_cls is None:
                raise ConfigError(f"no record class for consumer group {group!r}")
        try:
            info = await bus.js.consumer_info(stream, group)
        except Exception as e:
            raise BusError(
                f"consumer {stream}/{group} not found: declare the run's topology first ({e})"
            ) from e
        self = cls(
            bus,
            names,
            group,
            record_cls,
            info.config.max_ack_pending or 1 << 30,
            info.config.ack_wait or 30.0,
        )
        await self._puller.start()
        return self

    # -- credit
    @property
    def buffered(self) -> int:
        """Deliveries received for this member and not yet handed out by `fetch`."""
        return self._puller.buffered

    @property
    def outstanding(self) -> int:
        """Leases handed out and not settled, plus deliveries buffered for the next fetch."""
        return len(self._held) + self._puller.buffered

    @property
    def credit(self) -> int:
        return max(0, self.max_ack_pending - self.outstanding)

    @property
    def held(self) -> frozenset[Lease]:
        return frozenset(self._held)

    def _release(self, lease: Lease) -> None:
        self._held.discard(lease)

    # -- fetch
    async def fetch(self, n: int, timeout_s: float | None = None) -> list[Lease]:
        """Up to `n` valid leases (see the module doc). Returns `[]` on timeout or no credit."""
        timeout_s = self.cfg.fetch_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        out: list[Lease] = []
        while True:
            # Buffered deliveries are already ours: hand them out even when credit is spent.
            want = min(n - len(out), max(self.max_ack_pending - len(self._held), 0))
            if want <= 0:
                return out
            remaining = deadline - time.monotonic()
            msgs = await self._puller.fetch(want, max(remaining, 0.001))
            bad: list[tuple[Lease, RecordError]] = []
            record_cls, held = self.record_cls, self._held
            for msg in msgs:
                stream, consumer, deliveries, seq = _ack_metadata(msg.reply)
                try:
                    record = parse_record(record_cls, msg.data)
                except RecordError as e:
                    bad.append((Lease(None, msg, stream, consumer, seq, deliveries, self), e))  # type: ignore[arg-type]
                    continue
                lease = Lease(record, msg, stream, consumer, seq, deliveries, self)
                held.add(lease)
                out.append(lease)
            for probe, e in bad:
                self.dead_lettered += 1
                log.warning(
                    "dead-lettering %s seq %d: %s (%s)", probe.stream, probe.seq, e.reason, e
                )
                await dead_letter(self.publisher, self.names, probe, e.reason, str(e))
            # Only bad records came back: keep going while time is left.
            if out or not bad or time.monotonic() >= deadline:
                return out

    # -- leases settled by another member's process (target-TP islands)
    def hand_over(self, leases: Iterable[Lease]) -> list[tuple[str, bytes, dict | None]]:
        """Give unsettled leases to another process: they leave this member's registry and
        credit without being settled. Returns `(reply subject, record bytes, headers)` per lease, what
        the other process passes to `adopt`. The broker cannot tell: any connection settles a
        delivery by publishing to its reply subject."""
        out = []
        for lease in leases:
            if lease.settled is not None:
                raise BusError(f"lease seq {lease.seq} is already settled ({lease.settled})")
            self._held.discard(lease)
            out.append((lease.msg.reply, lease.msg.data, lease.msg.headers))
        return out

    def adopt(self, reply: str, data: bytes, headers: dict | None = None) -> Lease:
        """The lease another process handed over (see `hand_over`), settled through this
        member's connection from now on. Raises `BusError` for a reply subject that is not a
        delivery of this group, `RecordError` for a record that does not parse."""
        stream, consumer, deliveries, seq = _ack_metadata(reply)
        if (stream, consumer) != (self.stream, self.group):
            raise BusError(f"lease {reply!r} is not a delivery of {self.stream}/{self.group}")
        msg = Msg(self.bus.nc, subject=self.stream, reply=reply, data=data, headers=headers)
        lease = Lease(parse_record(self.record_cls, data), msg, stream, consumer, seq,
                      deliveries, self)  # fmt: skip
        self._held.add(lease)
        return lease

    # -- windows
    async def ack_all(
        self, leases: Iterable[Lease], *, confirm: bool = True, timeout_s: float | None = None
    ) -> int:
        """Ack a whole optimizer window; returns how many were acked by this call.

        With `confirm`, every ack is a request the server answers once the consumer applied
        it (sent together, one round trip for the window). Raises `BusError` if any is not
        confirmed within `timeout_s` (those may be redelivered: the caller's step is already
        applied, so it must treat a redelivery of them as a duplicate).
        """
        todo = [lease for lease in leases if lease.mark_settled("ack")]
        if not todo:
            return 0
        nc = self.bus.nc
        if not confirm:
            for lease in todo:
                await nc.publish(lease.msg.reply, _ACK)
            return len(todo)
        timeout_s = self.cfg.connect_timeout_s if timeout_s is None else timeout_s
        results = await asyncio.gather(
            *(nc.request(lease.msg.reply, _ACK, timeout=timeout_s) for lease in todo),
            return_exceptions=True,
        )
        failed = [
            (lease.seq, r)
            for lease, r in zip(todo, results, strict=True)
            if isinstance(r, BaseException)
        ]
        if failed:
            seq, err = failed[0]
            raise BusError(
                f"{len(failed)} of {len(todo)} acks on {self.stream} not confirmed (first: seq {seq}: {type(err).__name__} {err})"
            )
        return len(todo)

    async def nak_all(self, leases: Iterable[Lease], delay_s: float | None = None) -> None:
        for lease in leases:
            await lease.nak(delay_s)

    def heartbeat(
        self, leases: Iterable[Lease] | None = None, interval_s: float | None = None
    ) -> Heartbeat:
        """An async context manager sending `in_progress` for `leases` (default: every lease
        this member holds) every `interval_s` (default `bus.heartbeat_s`, at most a third of
        the consumer's `ack_wait`), until exit. Settled leases are skipped."""
        if interval_s is None:
            interval_s = min(self.cfg.heartbeat_s, self.ack_wait_s / 3)
        return Heartbeat(self, None if leases is None else list(leases), interval_s)

    async def close(self, *, nak_held: bool = True) -> None:
        """Stop pulling. Deliveries never handed out are nak'd (redelivered at once); so are
        unsettled leases, unless `nak_held=False` (then they expire after `ack_wait`)."""
        for msg in await self._puller.stop():
            await self.bus.nc.publish(msg.reply, _NAK)
        if nak_held:
            for lease in list(self._held):
                await lease.nak(0)


class Heartbeat:
    """Keeps leases alive while a block of long work runs (see `Leases.heartbeat`)."""

    def __init__(self, group: Leases, leases: list[Lease] | None, interval_s: float):
        self.group = group
        self.leases = leases
        self.interval_s = interval_s
        self.beats = 0
        self._task: asyncio.Task | None = None

    def add(self, leases: Iterable[Lease]) -> None:
        if self.leases is not None:
            self.leases.extend(leases)

    async def beat(self) -> None:
        targets = self.group._held if self.leases is None else self.leases
        for lease in list(targets):
            await lease.in_progress()
        self.beats += 1

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.beat()
            except Exception as e:  # a broker blip must not kill the work it protects
                log.warning("heartbeat on %s failed: %s", self.group.stream, e)

    async def __aenter__(self) -> Heartbeat:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
