"""The JetStream pull protocol, done cheaply: one inbox, one request per fetch, no task per message.

nats-py's `PullSubscription.fetch` waits for each message with its own task and timer, which
costs more than the message itself at thousands of messages per second. `Puller` subscribes
once to `<inbox>.*`, names every pull request `<inbox>.<n>`, and collects deliveries in a
deque fed by the subscription callback; a fetch only sleeps when nothing is buffered.

A fetch of n:
1. takes what is already buffered (deliveries of earlier requests that arrived late: they are
   leased to this member, so they are handed out, never dropped);
2. asks for the rest with `no_wait`: the server delivers what is available now and ends the
   request with a status (404 no messages, 408, 409 max ack pending...);
3. only if that brought nothing, waits up to the timeout for one message (a lingering request
   of batch 1 whose `expires` ends before the client gives up), then takes whatever else is
   available with another `no_wait` request.
So a fetch returns as soon as anything is available, and never leaves a request open that
could lease more than it asked for after it returned (except the single late message of step 3,
which the next fetch hands out).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import orjson
from nats.aio.msg import Msg

from bus.connection import Bus
from core.errors import BusError

_STATUS = "Status"
_DESCRIPTION = "Description"
_EXPIRES_MARGIN_S = 0.02  # the server ends a lingering request this much before the client does


class Puller:
    """Pull deliveries of one consumer (durable or ephemeral) of one stream into this process."""

    def __init__(self, bus: Bus, stream: str, consumer: str):
        self.bus = bus
        self.stream = stream
        self.consumer = consumer
        self._next_subject = f"{bus.js._prefix}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._buffer: deque[Msg] = deque()
        self._inbox = ""
        self._sub = None
        self._rid = 0
        self._ended: int = 0  # id of the newest request the server ended with a status
        self._error: str | None = None
        self._wakeup: asyncio.Future | None = None

    @property
    def buffered(self) -> int:
        """Deliveries received (so leased to us) but not handed out yet."""
        return len(self._buffer)

    async def start(self) -> Puller:
        if self._sub is None:
            self._inbox = self.bus.nc.new_inbox()
            self._sub = await self.bus.nc.subscribe(f"{self._inbox}.*", cb=self._on_msg)
        return self

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def _on_msg(self, msg: Msg) -> None:
        headers = msg.headers
        if headers and _STATUS in headers and not msg.reply:
            status = headers[_STATUS]
            if status == "100":  # idle heartbeat / flow control: not an end of request
                return
            rid = int(msg.subject.rsplit(".", 1)[1])
            if rid > self._ended:
                self._ended = rid
            if status not in ("404", "408", "409"):
                self._error = f"{status} {headers.get(_DESCRIPTION, '')}".strip()
            elif status == "409" and "deleted" in headers.get(_DESCRIPTION, "").lower():
                self._error = f"409 {headers.get(_DESCRIPTION)}"
        else:
            self._buffer.append(msg)
        w = self._wakeup
        if w is not None and not w.done():
            w.set_result(None)

    async def _request(self, batch: int, expires_s: float | None) -> int:
        self._rid += 1
        req: dict = {"batch": batch}
        if expires_s is None:
            req["no_wait"] = True
        else:
            req["expires"] = int(expires_s * 1e9)
        await self.bus.nc.publish(
            self._next_subject, orjson.dumps(req), reply=f"{self._inbox}.{self._rid}"
        )
        return self._rid

    async def _wait(self, rid: int, want: int, deadline: float) -> None:
        """Until `want` deliveries are buffered, request `rid` ended, or the deadline passed."""
        while len(self._buffer) < want and self._ended < rid:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._wakeup = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(self._wakeup, remaining)
            except asyncio.TimeoutError:
                return
            finally:
                self._wakeup = None

    def _take(self, n: int, out: list[Msg]) -> None:
        buf = self._buffer
        while buf and len(out) < n:
            out.append(buf.popleft())

    def _raise_error(self) -> None:
        if self._error:
            error, self._error = self._error, None
            raise BusError(f"pull from {self.stream}/{self.consumer} failed: {error}")

    async def fetch(self, n: int, timeout_s: float, *, wait: bool = True) -> list[Msg]:
        """Up to `n` deliveries, as soon as any is available, else after `timeout_s` (maybe none).

        With `wait=False` it returns after step 2 (what is available now). Raises `BusError` if the server answers with an error (consumer deleted, no stream...).
        """
        await self.start()
        out: list[Msg] = []
        self._take(n, out)
        if len(out) == n:
            return out
        deadline = time.monotonic() + timeout_s
        rid = await self._request(n - len(out), None)
        await self._wait(rid, n - len(out), deadline)
        self._take(n, out)
        self._raise_error()
        remaining = deadline - time.monotonic()
        if out or not wait or remaining <= _EXPIRES_MARGIN_S * 2:
            return out
        rid = await self._request(1, remaining - _EXPIRES_MARGIN_S)
        await self._wait(rid, 1, deadline)
        self._take(n, out)
        self._raise_error()
        if out and len(out) < n:
            rid = await self._request(n - len(out), None)
            await self._wait(rid, n - len(out), time.monotonic() + timeout_s)
            self._take(n, out)
        return out
