"""Leases: one member of a consumer group ("producers" on TASKS, "trainers" on SAMPLES).

    group = await Leases.join(bus, run, "trainers")          # SampleRef records
    leases = await group.fetch(8)                            # parsed, valid records only
    async with group.heartbeat(leases):                      # long work keeps them leased
        ...
    await group.ack_all(leases)                              # optimizer boundary: confirmed acks

A fetched message is leased for the consumer's `ack_wait` and redelivered unless settled or
kept alive (at-least-once); `fetch` asks for at most the member's remaining credit; records
that fail to parse are dead-lettered, never returned; settlement is idempotent; confirmed
acks are retried until the broker answered for each. docs/bus.md, "Leases".
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
from specbus.bus import headers as H
from specbus.bus.connection import Bus
from specbus.bus.dead import dead_letter
from specbus.bus.outage import NoAnswer, is_transient, ride, send
from specbus.bus.publisher import Publisher
from specbus.bus.pull import Puller
from specbus.bus.subjects import PRODUCERS, TRAINERS, Group, Names
from specbus.core.contracts import PromptTask, Record, SampleRef
from specbus.core.errors import BusError, BusNotFound, ConfigError, RecordError

log = logging.getLogger("specbus.bus")

RECORD_OF_GROUP: dict[str, type[Record]] = {PRODUCERS: PromptTask, TRAINERS: SampleRef}
_ACK = b"+ACK"
_NAK = b"-NAK"
_WPI = b"+WPI"
_MAX_SILENT_ROUNDS = 5  # confirm rounds a live broker may leave an ack unanswered (never seen)


def parse_record(cls: type[Record], data: bytes) -> Record:
    """`cls.from_bytes(data)`, with the validation done once on the happy path.

    Raises `RecordError` with the same reasons as `Record.from_bytes` (oversize, garbage,
    schema, invalid): a failure is re-run through `from_bytes` to classify it.
    """
    if len(data) > cls.max_bytes:
        return cls.from_bytes(data)  # raises oversize
    try:
        return cls.model_validate_json(data)
    except Exception:
        return cls.from_bytes(data)


class Lease:
    """One delivered, parsed record leased to this member, and how to settle it."""

    __slots__ = (
        "record", "msg", "stream", "consumer", "seq", "deliveries", "_group", "settled", "_wpi_buffered",
    )  # fmt: skip

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
        self._wpi_buffered = -1  # `bus.reconnects` when an in_progress was last buffered

    @property
    def headers(self) -> dict[str, str]:
        """The delivered message's headers ({} when it has none)."""
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
            await send(self._group.bus, self.msg.reply, _ACK, what=f"acking seq {self.seq}")

    async def nak(self, delay_s: float | None = None) -> None:
        """Not done: redeliver (after `delay_s`, default `bus.nak_delay_s`; 0 for at once)."""
        if not self.mark_settled("nak"):
            return
        delay_s = self._group.cfg.nak_delay_s if delay_s is None else delay_s
        payload = _NAK + (
            b" " + orjson.dumps({"delay": int(delay_s * 1e9)}) if delay_s > 0 else b""
        )
        await send(self._group.bus, self.msg.reply, payload, what=f"nak'ing seq {self.seq}")

    async def term(self, reason: str, detail: str = "") -> None:
        """Poison: never redeliver; a copy goes to DEAD with `reason` (see `bus.dead`)."""
        await dead_letter(self._group.publisher, self._group.names, self, reason, detail)

    async def in_progress(self) -> None:
        """Still working on it: restart the `ack_wait` clock (any number of times).

        While the connection is down, one per lease is buffered (sent on reconnect: it
        restarts the clock of the restarted broker); more would only fill the buffer."""
        if self.settled is not None:
            return
        bus = self._group.bus
        if not bus.connected:
            if self._wpi_buffered == bus.reconnects:
                return
            self._wpi_buffered = bus.reconnects
        await send(bus, self.msg.reply, _WPI, what=f"keeping seq {self.seq} leased")


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
        self._fetching = f"fetching from {self.stream}/{group}"
        self._held: set[Lease] = set()
        self.dead_lettered = 0
        self.acks_forgotten = 0  # confirmed acks the broker can no longer apply (ack_all)

    @classmethod
    async def join(
        cls, bus: Bus, run: str, group: Group, record_cls: type[Record] | None = None
    ) -> Leases:
        """Bind to the run's durable consumer `group` (declared by `bus.run.declare`).

        Raises `BusError` if the consumer does not exist.
        """
        names = Names(run)
        stream = names.stream_of(group)
        if record_cls is None:
            record_cls = RECORD_OF_GROUP.get(group)
            if record_cls is None:
                raise ConfigError(f"no record class for consumer group {group!r}")
        info = await _consumer_info(bus, stream, group, f"joining {stream}/{group}")
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
        """Deliveries this member may still ask for: `max_ack_pending` minus what it holds or has
        buffered."""
        return max(0, self.max_ack_pending - self.outstanding)

    @property
    def held(self) -> frozenset[Lease]:
        """The leases handed out and not settled yet."""
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
            with self.bus.outage.doing(self._fetching):
                msgs = await self._puller.fetch(want, max(remaining, 0.001))
            if await self._after_pull() and not msgs:
                # JetStream said 503 and the consumer exists: not yet serving it. Wait out
                # the timeout like an empty fetch, rather than spin on 503s.
                await asyncio.sleep(max(deadline - time.monotonic(), 0))
                return out
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

    async def _after_pull(self) -> bool:
        """Tell the outage state what the last pull learnt (an answer, or none while the
        connection was down: `BrokerUnavailable` past the give-up). A 503 on a live connection
        is JetStream not loaded yet, or the consumer gone: asked (riding through the former),
        the latter raises `BusError`. Returns True after a 503."""
        puller, bus = self._puller, self.bus
        if puller.unavailable:
            await _consumer_info(bus, self.stream, self.group, self._fetching)
            return True
        if puller.answered:
            bus.outage.recovered()
        elif not bus.connected:
            bus.outage.failed(self._fetching, None)
        return False

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
        it (sent together, one round trip for the window). When it returns, every ack is
        applied, except the acks of deliveries the server no longer knows: its consumer state
        went back in a crash (it is persisted asynchronously) to before them, and it never
        answers such an ack; those messages come again as first deliveries, which the caller
        must treat as duplicates (counted in `acks_forgotten`, logged).

        Rides through an outage: acks not answered within `timeout_s` (default
        `bus.connect_timeout_s`) are told apart by the consumer's state (applied: at or under
        the ack floor; forgotten: above the last delivered sequence) and the rest are sent
        again, until the broker answers or `bus.outage_give_up_s` passes
        (`BrokerUnavailable`). Raises `BusError` if the consumer is gone (deleted or
        repositioned: its leases are void), or if the broker answers everything but these
        acks `_MAX_SILENT_ROUNDS` times in a row (nats-server always answers an ack it
        applies or has applied; checked against server/consumer.go).
        """
        todo = [lease for lease in leases if lease.mark_settled("ack")]
        if not todo:
            return 0
        if not confirm:
            for lease in todo:
                await send(self.bus, lease.msg.reply, _ACK, what=f"acking seq {lease.seq}")
            return len(todo)
        timeout_s = self.cfg.connect_timeout_s if timeout_s is None else timeout_s
        await _Confirm(self, todo, timeout_s).run()
        return len(todo)

    async def nak_all(self, leases: Iterable[Lease], delay_s: float | None = None) -> None:
        """Nak every lease (see `Lease.nak`); already settled ones are skipped."""
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
            await send(self.bus, msg.reply, _NAK, what=f"closing {self.stream}/{self.group}")
        if nak_held:
            for lease in list(self._held):
                await lease.nak(0)


async def _consumer_info(bus: Bus, stream: str, group: str, what: str):
    """The durable consumer's info, riding through an outage; `BusError` if it does not exist."""
    try:
        return await ride(bus, what, lambda: bus.js.consumer_info(stream, group))
    except BusNotFound as e:
        raise BusNotFound(
            f"consumer {stream}/{group} not found while {what}: declare the run's topology "
            f"first, or join again after a reposition ({e})",
            code=e.code, err_code=e.err_code, stream=stream,
        ) from e  # fmt: skip


class _Confirm:
    """The confirmed acks of one window, retried until the broker answered for each of them
    (see `Leases.ack_all`)."""

    def __init__(self, group: Leases, todo: list[Lease], timeout_s: float):
        self.group, self.bus, self.timeout_s = group, group.bus, timeout_s
        self.left = todo
        self.silent_rounds = 0
        self.what = f"confirming {len(todo)} acks on {group.stream}/{group.group}"

    async def run(self) -> None:
        try:
            await ride(self.bus, self.what, self._attempt)
        except BusNotFound as e:
            raise BusNotFound(
                f"{len(self.left)} acks on {self.group.stream}/{self.group.group} are void: "
                f"the consumer is gone (deleted or repositioned) ({e})",
                code=e.code, err_code=e.err_code, stream=self.group.stream,
                seq=self.left[0].seq if self.left else None,
            ) from e  # fmt: skip

    async def _attempt(self) -> None:
        nc, reconnects = self.bus.nc, self.bus.reconnects
        results = await asyncio.gather(
            *(nc.request(lease.msg.reply, _ACK, timeout=self.timeout_s) for lease in self.left),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        for e in errors:
            if not isinstance(e, Exception) or not is_transient(e):
                raise e
        self.left = [
            lease
            for lease, r in zip(self.left, results, strict=True)
            if isinstance(r, BaseException)
        ]
        if not self.left:
            return
        # Unanswered: applied with the answer lost, never received (outage), or unanswerable
        # (the server forgot the delivery). The consumer's state tells them apart; asking it
        # also waits out an outage (a transient error here is retried by `ride`).
        group = self.group
        info = await self.bus.js.consumer_info(group.stream, group.group)
        floor = info.ack_floor.stream_seq if info.ack_floor else 0
        delivered = info.delivered.stream_seq if info.delivered else 0
        forgotten = [lease for lease in self.left if lease.seq > delivered]
        if forgotten:
            group.acks_forgotten += len(forgotten)
            log.warning(
                "%d acks on %s/%s can never be confirmed: the broker's consumer state went back "
                "to delivered seq %d (a crash lost it); seqs %s come again as first deliveries",
                len(forgotten), group.stream, group.group, delivered,
                [lease.seq for lease in forgotten][:8],
            )  # fmt: skip
        self.left = [lease for lease in self.left if floor < lease.seq <= delivered]
        if not self.left:
            return
        first = errors[0] if errors else None
        if self.bus.reconnects == reconnects and self.bus.connected:
            self.silent_rounds += 1
            if self.silent_rounds >= _MAX_SILENT_ROUNDS:
                raise BusError(
                    f"{len(self.left)} acks on {group.stream}/{group.group} not confirmed by a "
                    f"broker that answers otherwise, {self.silent_rounds} times in a row "
                    f"(first: seq {self.left[0].seq}: {first!r})"
                ) from first
        raise NoAnswer(f"{len(self.left)} acks not confirmed yet (first: seq {self.left[0].seq})")


class Heartbeat:
    """Keeps leases alive while a block of long work runs (see `Leases.heartbeat`)."""

    def __init__(self, group: Leases, leases: list[Lease] | None, interval_s: float):
        self.group = group
        self.leases = leases
        self.interval_s = interval_s
        self.beats = 0
        self._task: asyncio.Task | None = None

    def add(self, leases: Iterable[Lease]) -> None:
        """Keep these leases alive too (a heartbeat over all held leases needs no adding)."""
        if self.leases is not None:
            self.leases.extend(leases)

    async def beat(self) -> None:
        """Send one `in_progress` for every unsettled lease now."""
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
