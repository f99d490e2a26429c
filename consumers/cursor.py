"""The SAMPLES cursor: which stream sequences are already in the model.

`floor`: every sequence <= floor is done (trained, or dead/superseded and never to be trained).
`done_above`: done sequences above the floor. A checkpoint stores the cursor; resuming
repositions the trainers' consumer at `floor + 1` and skips `done_above`, so each published
sample enters the final model's lineage exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class SamplesCursor:
    """Progress through SAMPLES: every sequence at or below `floor` is done, and those in `done_above`
    (the set drains into the floor as gaps fill)."""

    floor: int = 0
    done_above: set[int] = field(default_factory=set)

    def mark(self, seqs: Iterable[int]) -> None:
        """Mark sequences done (trained or retired); idempotent."""
        for seq in seqs:
            if seq > self.floor:
                self.done_above.add(seq)
        self._advance()

    def raise_floor(self, floor: int) -> None:
        """The broker's ack floor: everything at or below it was acked or terminated."""
        if floor > self.floor:
            self.floor = floor
            self.done_above = {s for s in self.done_above if s > floor}
        self._advance()

    def is_done(self, seq: int) -> bool:
        """True when `seq` is done."""
        return seq <= self.floor or seq in self.done_above

    def _advance(self) -> None:
        while self.floor + 1 in self.done_above:
            self.floor += 1
            self.done_above.discard(self.floor)

    def to_dict(self) -> dict:
        """A JSON-able form (for the checkpoint)."""
        return {"floor": self.floor, "done_above": sorted(self.done_above)}

    @classmethod
    def from_dict(cls, d: dict) -> SamplesCursor:
        """The cursor `to_dict` wrote."""
        return cls(floor=int(d["floor"]), done_above={int(s) for s in d["done_above"]})
