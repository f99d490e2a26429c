"""The JetStream pull protocol, done cheaply: one inbox, one request per fetch, no task per message.

`Puller` subscribes once to `<inbox>.*`, names every pull request `<inbox>.<n>` (`no_wait`,
with `expires`) and collects deliveries in a deque; a fetch returns as soon as something is
available and never outlives its timeout. Deliveries that land after a fetch returned are
handed out by the next one. During an outage it sends nothing; whether the server answered
(`answered`) or said 503 (`unavailable`) is the caller's to interpret. docs/bus.md, "Leases".
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import orjson
from nats.aio.msg import Msg
from specbus.bus.connection import Bus
from specbus.bus.errors import status_error, wrap
from specbus.bus.outage import check_open, is_transient

_STATUS = "Status"
_DESCRIPTION = "Description"
_EXPIRES_MARGIN_S = 0.01  # the server ends a request this much before the client gives up
_MIN_EXPIRES_S = 0.005


class Puller:
    """Pull deliveries of one consumer (durable or ephemeral) of one stream into this process."""

    def __init__(self, bus: Bus, stream: str, consumer: str, *, linger_s: float = 0.005):
        self.bus = bus
        self.stream = stream
        self.consumer = consumer
        self.linger_s = linger_s
        self._next_subject = f"{bus.js._prefix}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._buffer: deque[Msg] = deque()
        self._inbox = ""
        self._sub = None
        self._rid = 0
        self._ended: int = 0  # id of the newest request the server ended with a status
        self._error: tuple[str, str] | None = None  # (status, description) of a failed pull
        self._wakeup: asyncio.Future | None = None
        self.answered = False  # the server answered the last fetch (a delivery or a status)
        self.unavailable = False  # ... with "503 No Responders"

    @property
    def buffered(self) -> int:
        """Deliveries received (so leased to us) but not handed out yet."""
        return len(self._buffer)

    async def start(self) -> Puller:
        """Subscribe to this puller's inbox (once; later calls do nothing)."""
        if self._sub is None:
            self._inbox = self.bus.nc.new_inbox()
            self._sub = await self.bus.nc.subscribe(f"{self._inbox}.*", cb=self._on_msg)
        return self

    async def stop(self) -> list[Msg]:
        """Unsubscribe; returns the deliveries still buffered (the caller settles them)."""
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        left = list(self._buffer)
        self._buffer.clear()
        return left

    async def _on_msg(self, msg: Msg) -> None:
        headers = msg.headers
        self.answered = True
        if not msg.reply and headers and _STATUS in headers:
            status = headers[_STATUS]
            if status == "100":  # idle heartbeat / flow control: not an end of request
                return
            if status == "503":  # no responders: the request is lost; see fetch
                self.unavailable = True
            rid = int(msg.subject.rsplit(".", 1)[1])
            if rid > self._ended:
                self._ended = rid
            description = headers.get(_DESCRIPTION, "")
            if status not in ("404", "408", "409", "503") or "deleted" in description.lower():
                self._error = (status, description)
        else:
            self._buffer.append(msg)
        w = self._wakeup
        if w is not None and not w.done():
            w.set_result(None)

    async def _request(self, batch: int, expires_s: float | None) -> int:
        self._rid += 1
        req: dict = {"batch": batch, "no_wait": True}
        if expires_s is not None:
            req["expires"] = int(max(expires_s, _MIN_EXPIRES_S) * 1e9)
        await self.bus.nc.publish(
            self._next_subject, orjson.dumps(req), reply=f"{self._inbox}.{self._rid}"
        )
        return self._rid

    async def _wait(self, rid: int, want: int, deadline: float) -> None:
        """Until `want` deliveries are buffered, request `rid` ended, the deliveries paused for
        `linger_s`, or the deadline passed."""
        loop = asyncio.get_running_loop()
        while len(self._buffer) < want and self._ended < rid:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            have = len(self._buffer)
            self._wakeup = loop.create_future()
            try:
                await asyncio.wait_for(
                    self._wakeup, min(remaining, self.linger_s) if have else remaining
                )
            except asyncio.TimeoutError:
                if have:
                    return
            finally:
                self._wakeup = None

    def _take(self, n: int, out: list[Msg]) -> None:
        buf = self._buffer
        while buf and len(out) < n:
            out.append(buf.popleft())

    async def _connected(self, deadline: float) -> bool:
        """Wait for the connection until `deadline`; False if it is still down. A closed
        connection raises (`check_open`): returning at once, with nothing awaited, made a
        caller's fetch loop spin on the event loop and starve everything else on it."""
        while not self.bus.connected:
            check_open(self.bus, f"pull from {self.stream}/{self.consumer}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            await asyncio.sleep(min(remaining, 0.05))
        return True

    async def fetch(self, n: int, timeout_s: float, *, wait: bool = True) -> list[Msg]:
        """Up to `n` deliveries, as soon as any is available, else after `timeout_s` (maybe none).

        `wait=False` sends a plain `no_wait` request: only what is available now (use it only
        on consumers without ack credit limits, e.g. replay's ack-less ones). Raises `BusError`
        if the server answers with an error (consumer deleted, ...). While the broker is away
        it returns what is buffered after `timeout_s`, with `answered` False (module doc).
        """
        await self.start()
        self.answered = self.unavailable = False
        out: list[Msg] = []
        self._take(n, out)
        if len(out) == n:
            return out
        deadline = time.monotonic() + timeout_s
        if not await self._connected(deadline):
            return out
        remaining = deadline - time.monotonic()
        try:
            rid = await self._request(n - len(out), remaining - _EXPIRES_MARGIN_S if wait else None)
        except Exception as e:  # lost the connection just now (full reconnect buffer)
            if not is_transient(e):
                raise wrap(e, f"pulling from {self.stream}/{self.consumer}") from e
            return out
        await self._wait(rid, n - len(out), deadline)
        self._take(n, out)
        if self._error:
            (status, description), self._error = self._error, None
            raise status_error(f"pull from {self.stream}/{self.consumer} failed", status,
                               description, stream=self.stream)  # fmt: skip
        if not out and not self.answered:
            self.bus.raise_if_denied()  # the broker refused the pull request
        return out
