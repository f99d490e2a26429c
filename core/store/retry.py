"""Riding out a store that is unavailable for a while (a restarted Mooncake store node or
master, an HTTP producer coming back): the caller's work is fine, the store is not.

`while_unavailable(op, ...)` runs a blocking store call in a thread and, while it raises
`StoreUnavailable`, retries it with backoff for up to `give_up_s`, calling `keepalive`
between tries (a producer or trainer heartbeats the lease it holds, so the wait neither
redelivers the work nor counts toward `max_deliver`). One WARNING line when the store goes
missing, one when it answers again. Other errors propagate at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from specbus.core.errors import StoreUnavailable

log = logging.getLogger("specbus.store")
T = TypeVar("T")


async def while_unavailable(
    op: Callable[[], T],
    *,
    what: str,
    give_up_s: float,
    keepalive: Callable[[], Awaitable[None]] | None = None,
) -> T:
    """`op()` in a thread, retried while the store is unavailable (see the module doc).
    Raises the last `StoreUnavailable` once `give_up_s` has passed since the first one."""
    first: float | None = None
    delay = 0.5
    while True:
        try:
            out = await asyncio.to_thread(op)
        except StoreUnavailable as e:
            now = time.monotonic()
            if first is None:
                first = now
                log.warning(
                    "store unavailable while %s: %s; retrying for up to %.0fs", what, e, give_up_s
                )
            if now - first >= give_up_s:
                raise
            if keepalive is not None:
                await keepalive()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
            continue
        if first is not None:
            log.warning("store back after %.1fs (%s)", time.monotonic() - first, what)
        return out
