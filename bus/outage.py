"""Riding through broker outages: the one retry loop every bus operation goes through.

`ride(bus, what, op)` awaits a request until the broker answers: transient failures are
retried with backoff (0.05 s doubling to 1 s, cut short by the reconnect), nothing is
requested while the connection is down, and after `bus.outage_give_up_s` it raises
`BrokerUnavailable`; other nats failures are raised as `BusError`s (bus/errors.py). `send`
publishes fire-and-forget messages (acks, naks, heartbeats), buffered while disconnected.
One outage is two WARNING lines per connection. docs/bus.md, "Ride-through".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

import nats.errors
import nats.js.errors
from specbus.bus.errors import wrap
from specbus.core.errors import BrokerUnavailable, BusError

if TYPE_CHECKING:
    from specbus.bus.connection import Bus

log = logging.getLogger("specbus.bus")

T = TypeVar("T")

FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0


class NoAnswer(Exception):
    """An operation got no (complete) answer from the broker yet: retry it (transient)."""


_TRANSIENT = (
    NoAnswer,
    asyncio.TimeoutError,  # nats.errors.TimeoutError and FlushTimeoutError derive from it
    nats.errors.NoRespondersError,  # JetStream not loaded yet, or a consumer being recreated
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,  # the client's reconnect buffer is full
    nats.errors.StaleConnectionError,
    nats.js.errors.ServiceUnavailableError,  # 503: JetStream temporarily unavailable
    nats.js.errors.NoStreamResponseError,  # a JetStream publish answered "no responders"
)


def is_transient(error: BaseException) -> bool:
    """True for a failure that a broker coming back would cure (see the module doc)."""
    return isinstance(error, _TRANSIENT)


def _describe(error: BaseException | None) -> str:
    if error is None:
        return "not connected"
    text = str(error).strip()
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


IDLE_NOTICE_S = 1.0  # an outage no operation noticed is logged (once, when over) past this


class Outage:
    """The outage state of one connection: when it began, whether it was announced.

    Fed by the connection's callbacks (`lost`, `reconnected`) and by every operation
    (`failed`, `recovered`); see the module doc for what is logged and when it gives up.
    """

    def __init__(self, url: str, give_up_s: float, clock: Callable[[], float] = time.monotonic):
        self.url = url
        self.give_up_s = give_up_s
        self.clock = clock
        self.since: float | None = None  # clock() when the broker was first seen gone
        self.announced = False
        self.retries = 0
        self.outages = 0  # outages announced so far (one per begin line)
        self._doing: dict[int, str] = {}  # operations waiting for the broker now
        self._token = 0

    @property
    def active(self) -> bool:
        """True while an outage is in progress (the broker was seen gone and has not answered since)."""
        return self.since is not None

    @contextlib.contextmanager
    def doing(self, what: str) -> Iterator[None]:
        """An operation waits for the broker meanwhile: a connection lost now is announced
        at once, naming it (it may only notice when its request times out)."""
        self._token += 1
        token = self._token
        self._doing[token] = what
        try:
            yield
        finally:
            del self._doing[token]

    def lost(self) -> None:
        """The connection dropped: the outage (if any) counts from now, and is announced now
        if an operation was waiting for the broker."""
        if self.since is None:
            self.since = self.clock()
        if self._doing and not self.announced:
            self._announce(next(iter(self._doing.values())), None, "connection lost")

    def reconnected(self) -> None:
        """The connection is back. An outage no operation noticed is over; an announced one
        ends with the next answer (the broker may accept connections before JetStream is up)."""
        if not self.announced:
            # No operation waited on the broker meanwhile (e.g. a rank blocked in a collective):
            # say so once, after the fact, when the outage was long enough to matter.
            if self.since is not None and (gone := self.clock() - self.since) >= IDLE_NOTICE_S:
                log.warning("broker %s unavailable while idle (no operation waited on it); "
                            "back after %.1f s", self.url, gone)  # fmt: skip
            self.since = None

    def failed(self, what: str, error: BaseException | None) -> None:
        """An operation found the broker unavailable while `what`. Logs the begin line once;
        raises `BrokerUnavailable` once the outage is `give_up_s` old."""
        now = self.clock()
        if self.since is None:
            self.since = now
        self.retries += 1
        gone = now - self.since
        if not self.announced:
            self._announce(what, error)
        if gone >= self.give_up_s:
            raise BrokerUnavailable(
                f"broker {self.url} unavailable for {gone:.0f} s while {what} "
                f"({_describe(error)}); gave up after bus.outage_give_up_s={self.give_up_s:g}"
            ) from error

    def _announce(self, what: str, error: BaseException | None, why: str = "") -> None:
        assert self.since is not None
        self.announced = True
        self.outages += 1
        left = max(self.give_up_s - (self.clock() - self.since), 0)
        until = time.strftime("%H:%M:%S", time.localtime(time.time() + left))
        log.warning(
            "broker %s unavailable while %s (%s); retrying with backoff until %s "
            "(bus.outage_give_up_s=%g)",
            self.url,
            what,
            why or _describe(error),
            until,
            self.give_up_s,
        )

    def recovered(self) -> None:
        """An operation got an answer: an outage in progress is over (logged once if it was
        announced)."""
        if self.since is None:
            return
        if self.announced:
            log.warning(
                "broker %s back after %.1f s (%d retries)",
                self.url,
                self.clock() - self.since,
                self.retries,
            )
        self.since = None
        self.announced = False
        self.retries = 0


def check_open(bus: Bus, what: str) -> None:
    """Raise if the connection is closed for good (no reconnect will come): `BusError` after
    this process closed it, `BrokerUnavailable` after the reconnect attempts ran out."""
    if bus.nc.is_closed:
        if bus.closing:
            raise BusError(f"cannot {what}: the connection to {bus.url} is closed")
        raise BrokerUnavailable(
            f"cannot {what}: the connection to {bus.url} was closed after "
            f"bus.max_reconnect_attempts={bus.cfg.max_reconnect_attempts} reconnect attempts"
        )


async def ride(bus: Bus, what: str, op: Callable[[], Awaitable[T]], *, buffered: bool = False) -> T:
    """`await op()` until it returns, riding through broker outages (see the module doc).

    `what` says what is being done ("reading KV key 'x'"), for the log and the error. `op` is
    called again after a transient failure, so it must be safe to repeat (and it may keep
    state across attempts, e.g. what is left to confirm). Raises `BrokerUnavailable` after
    `bus.outage_give_up_s`, or the first non-transient error of `op`: a nats error as the
    `BusError` that keeps its codes (`bus.errors.wrap`), anything else as is.

    `buffered=True` is for an `op` that only hands messages to the client (a plain publish):
    it is tried even while the connection is down (the client buffers it), and its success
    is no sign that the broker answers.
    """
    outage = bus.outage
    delay = FIRST_BACKOFF_S
    while True:
        check_open(bus, what)
        error: BaseException | None = None
        if buffered or bus.connected:
            try:
                if buffered:
                    result = await op()
                else:
                    with outage.doing(what):
                        result = await op()
            except Exception as e:
                if not is_transient(e):
                    wrapped = wrap(e, what)
                    if wrapped is e:
                        raise
                    raise wrapped from e
                bus.raise_if_denied()  # no answer because the broker refused it
                error = e
            else:
                if not buffered:
                    outage.recovered()
                return result
        outage.failed(what, error)
        await _pause(bus, delay)
        delay = min(delay * 2, MAX_BACKOFF_S)


async def _pause(bus: Bus, delay_s: float) -> None:
    """Back off for `delay_s`, but no longer than the connection stays down: a reconnect
    ends the pause, so the broker's return is used at once, not up to a backoff later."""
    if bus.connected:
        await asyncio.sleep(delay_s)
        return
    deadline = time.monotonic() + delay_s
    while not bus.connected and not bus.nc.is_closed:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        await asyncio.sleep(min(remaining, 0.02))


async def send(
    bus: Bus,
    subject: str,
    payload: bytes,
    *,
    what: str,
    reply: str = "",
    headers: dict[str, str] | None = None,
) -> None:
    """Publish one fire-and-forget message (an ack, nak, term, heartbeat). While the
    connection is down the client buffers it and sends it on reconnect; only a full buffer
    (or a client state that refuses publishes) makes it wait, through `ride`. Raises a
    `BusError` (a closed connection, a bad subject), `BrokerUnavailable` after the give-up."""
    publish = bus.nc.publish
    try:  # the hot path (an ack per message) pays for no closure and no loop
        await publish(subject, payload, reply=reply, headers=headers)
        return
    except _TRANSIENT:
        pass
    except nats.errors.Error as e:
        check_open(bus, what)
        raise wrap(e, what) from e
    await ride(
        bus,
        what,
        lambda: publish(subject, payload, reply=reply, headers=headers),
        buffered=True,
    )
