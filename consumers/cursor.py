"""The SAMPLES cursor: which stream sequences are already in the model.

`floor`: every sequence <= floor is done (trained, or dead/superseded and never to be trained).
`done_above`: done sequences above the floor. A checkpoint stores the cursor; resuming
repositions the trainers' consumer at `floor + 1` and skips `done_above`, so each published
sample enters the final model's lineage exactly once.
"""

from __future__ import annotations

import bisect
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


class SeqSet:
    """A set of stream sequences held as sorted disjoint ranges `[lo, hi]`: its size is the
    number of gaps, not of members. The ledger's TASKS set: the task messages whose sample is
    settled (trained, or never to be), filled roughly in order, so the ranges stay few (a gap
    per task still in flight, or dead-lettered by a producer)."""

    def __init__(self) -> None:
        self._lo: list[int] = []
        self._hi: list[int] = []

    def add(self, seq: int) -> None:
        """Add `seq` (idempotent), merging it with its neighbours."""
        if seq <= 0:
            return
        i = bisect.bisect_right(self._lo, seq) - 1  # the range starting at or before seq
        if i >= 0 and seq <= self._hi[i]:
            return
        joins_left = i >= 0 and self._hi[i] == seq - 1
        joins_right = i + 1 < len(self._lo) and self._lo[i + 1] == seq + 1
        if joins_left and joins_right:
            self._hi[i] = self._hi[i + 1]
            del self._lo[i + 1], self._hi[i + 1]
        elif joins_left:
            self._hi[i] = seq
        elif joins_right:
            self._lo[i + 1] = seq
        else:
            self._lo.insert(i + 1, seq)
            self._hi.insert(i + 1, seq)

    def __contains__(self, seq: int) -> bool:
        i = bisect.bisect_right(self._lo, seq) - 1
        return i >= 0 and seq <= self._hi[i]

    def __len__(self) -> int:
        """How many ranges it holds (its size in memory and in a checkpoint)."""
        return len(self._lo)

    def to_list(self) -> list[list[int]]:
        """A JSON-able form: `[[lo, hi], ...]`."""
        return [[lo, hi] for lo, hi in zip(self._lo, self._hi, strict=True)]

    @classmethod
    def from_list(cls, ranges: list) -> SeqSet:
        """The set `to_list` wrote."""
        out = cls()
        for lo, hi in ranges:
            out._lo.append(int(lo))
            out._hi.append(int(hi))
        return out
