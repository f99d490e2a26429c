"""Settling a `Source`'s items through the bus leases they hold (`core.source.Source`).

Both sources (disaggregated, colocated) hold one `Leases` group member per rank and settle
items the same way: heartbeat, confirmed ack at the optimizer boundary, nak to give back, and
a close that lets the last pull request expire before giving back what landed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from specbus.core.source import Item


class LeaseSettlement:
    """Mixin: the settlement half of `Source` for items whose `lease` is a `bus.lease.Lease`
    of `self.group` (a `Leases`) on `self.bus`."""

    group: Any
    bus: Any

    async def keepalive(self, items: list[Item]) -> None:
        """Restart the `ack_wait` clock of every item's lease (`in_progress`)."""
        for item in items:
            await item.lease.in_progress()

    async def ack(self, items: list[Item], *, confirm: bool = True) -> None:
        """Ack every item's lease: confirmed by the server unless `confirm=False` (see
        `Leases.ack_all`)."""
        await self.group.ack_all([i.lease for i in items], confirm=confirm)

    async def nak(self, items: list[Item], delay_s: float = 0.0) -> None:
        """Give the items back for redelivery after `delay_s` (0: at once)."""
        await self.group.nak_all([i.lease for i in items], delay_s)

    def unsettled(self) -> int:
        """Leases this member holds unsettled, plus deliveries buffered for its next fetch."""
        return self.group.outstanding

    async def give_back(self) -> None:
        # A pull request of the last fetch may still be open at the broker and deliver after
        # the loader stopped: let it expire, then nak what landed and what is still held.
        """Stop leasing: after the last pull request expired, nak what is buffered and every unsettled
        lease, then flush."""
        await asyncio.sleep(self.group.cfg.fetch_timeout_s)
        await self.group.close(nak_held=True)
        await self.bus.flush()  # a settlement still buffered when the bus closes is lost
