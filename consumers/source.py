"""What the loader needs from upstream, as a protocol: leased items and their lifecycle.

The disaggregated source (`consumers/bus_source.py`) leases SampleRefs from the trainers'
consumer group and reads tensors from the feature store named by each ref; the colocated
source leases PromptTasks and captures them in-process. The loader, the lockstep window
and the trainer are the same for both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class Item:
    """One leased unit of training data on this rank."""

    seq: int  # stream sequence of the leased message (the cursor's unit)
    sample_id: str
    num_tokens: int
    lease: Any  # the source's handle (a bus lease); opaque to the loader
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    links: list[Any] = field(default_factory=list)  # trace links to the capture spans
    stored: Any = None  # what the source's store releases (a SampleRef, or the put's specs)
    redelivered: bool = False


class Source(Protocol):
    async def take(self, n: int, timeout_s: float) -> list[Item]:
        """Lease up to `n` items with their tensors loaded. Items that cannot be trained
        (invalid, poisoned, superseded by a recapture) are handled here and not returned.
        Returns [] after `timeout_s` when nothing came."""

    async def upstream_done(self) -> bool:
        """True when no more items can come (feed complete, nothing pending anywhere)."""

    async def keepalive(self, items: list[Item]) -> None:
        """Extend the leases of items still being worked on (in-progress heartbeat)."""

    async def ack(self, items: list[Item]) -> None:
        """The items are in the model: confirm them to the broker."""

    async def nak(self, items: list[Item], delay_s: float = 0.0) -> None:
        """Give the items back for redelivery (a partial window at the end, a shutdown)."""

    def release(self, items: list[Item]) -> None:
        """Free the items' tensors in the store (after ack)."""


class GroupSettlement:
    """keepalive / ack / nak for sources whose items hold bus leases of `self.group`."""

    group: Any

    async def keepalive(self, items: list[Item]) -> None:
        for item in items:
            await item.lease.in_progress()

    async def ack(self, items: list[Item]) -> None:
        await self.group.ack_all([i.lease for i in items])

    async def nak(self, items: list[Item], delay_s: float = 0.0) -> None:
        await self.group.nak_all([i.lease for i in items], delay_s)
