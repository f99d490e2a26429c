"""The boundary between where training data comes from and the loader: the `Source` protocol.

A source leases items and owns their lifecycle (keepalive, ack, nak, release). The
disaggregated source (consumers/bus_source.py) leases SampleRefs and reads the store; the
colocated one (producers/colocated.py) leases PromptTasks and captures them. The loader,
lockstep windows and trainer are the same for both. It lives in core so that a producer can
implement it without importing the consumers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
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
    nbytes: int = 0  # bytes its tensors hold in the store (0: not counted by this source)
    task_seq: int = 0  # the TASKS message it was captured from (0: none, or `seq` is one)

    @property
    def key(self) -> tuple[int, str, int]:
        """(stream sequence, sample id, task sequence): what the ledger records and filters on."""
        return self.seq, self.sample_id, self.task_seq


@dataclass(frozen=True)
class Upstream:
    """A source's view of what may still come (see `Source.upstream`).

    `done`: nothing more can be delivered to this rank. `ack_pending`: messages the broker
    counts as delivered and not acked on this rank's consumer group; at the end they must all
    be held by some rank (a lost ack or a dead member's lease is redelivered after `ack_wait`,
    so the data is not over before it comes back). `waiting_for`: what is missing, for people."""

    done: bool
    ack_pending: int = 0
    waiting_for: str = ""


class Trained(Protocol):
    """The trainer's record of what is in the model (`consumers.ledger.Ledger`)."""

    def contains(self, seq: int, sample_id: str, task_seq: int = 0) -> bool:
        """True when the item with this sequence, task or sample id is already settled."""


class Source(Protocol):
    """Where a trainer rank's items come from (see the module doc); the loader's only view of upstream.
    `take`, `upstream`, `keepalive`, `ack`, `nak`, `give_back` run on the bus loop; `release`,
    `checkpointed`, `unsettled`, `drain_retired`, `usage` are safe from the training thread."""

    stats: dict[str, float]
    # True when other ranks read the store its items' tensors are in (SampleRefs): the loader
    # then frees them only after the next lockstep exchange (absent: False, its own store)
    shared_store: bool

    async def take(self, n: int, timeout_s: float) -> list[Item]:
        """Lease up to `n` items with their tensors loaded. Items that cannot be trained
        (invalid, poisoned, superseded by a recapture, already trained) are handled here and
        not returned. Returns [] after `timeout_s` when nothing came."""

    async def upstream(self) -> Upstream:
        """Whether more items can come (feed complete, nothing pending anywhere)."""

    async def keepalive(self, items: list[Item]) -> None:
        """Extend the leases of items still being worked on (in-progress heartbeat)."""

    async def ack(self, items: list[Item], *, confirm: bool = True) -> None:
        """The items are in the model: confirm them to the broker (`confirm=False`:
        fire-and-forget, for duplicates whose loss only costs another redelivery)."""

    async def nak(self, items: list[Item], delay_s: float = 0.0) -> None:
        """Give the items back for redelivery (a partial window at the end, a shutdown)."""

    async def give_back(self) -> None:
        """Stop leasing: give back deliveries not handed out and every unsettled lease."""

    def unsettled(self) -> int:
        """Leases this rank holds unsettled (handed out or received and buffered)."""

    def release(self, items: list[Item]) -> None:
        """The items are trained (after ack): free their tensors in the store, or, for a
        source whose tensors cannot be captured again (live), hold them until `checkpointed`."""

    def checkpointed(self) -> None:
        """A durable checkpoint holds everything trained so far (or none ever will: a trainer
        without checkpoints): free what `release` held back. A no-op for a source that frees
        at `release`."""

    def drain_retired(self) -> list[int | tuple[int, str, int]]:
        """Sequences settled here that will never be trained (dead, superseded, or skipped as
        already trained) since the last call, each a sequence or an item's `key` (which names
        its task too): the ledger passes them."""

    def usage(self) -> Any:
        """The store's residency as this rank sees it (None when unknown)."""
