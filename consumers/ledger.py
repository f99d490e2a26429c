"""The trainer's record of what is in the model: the single truth behind exactly-once.

The `Ledger` holds the SAMPLES cursor (floor + done sequences above it), the trained sample
ids and the lineage (ids in training order). The loader owns it (a `Stateful` saved in every
checkpoint) and filters every lockstep window against it identically on every rank
(`plan_round`); recording is idempotent. docs/architecture.md, "Exactly once into the model".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specbus.consumers.cursor import SamplesCursor

Key = tuple[int, str]  # (stream sequence, sample id) of one leased item


@dataclass
class RoundPlan:
    """What one rank does with its candidate window after the gather (see `plan_round`).

    `keep`: indexes trained this step (if every rank keeps a full window); `trained`: indexes
    already in the model (ack and release them, never train); `parked`: indexes duplicating an
    item kept by this round (held back until the next commit, when they become `trained`)."""

    keep: list[int] = field(default_factory=list)
    trained: list[int] = field(default_factory=list)
    parked: list[int] = field(default_factory=list)


@dataclass
class Ledger:
    """What is in the model: the SAMPLES cursor, the trained sample ids and the lineage (see the module
    doc). Queries are safe from the bus thread; updates belong to the training thread."""

    cursor: SamplesCursor = field(default_factory=SamplesCursor)
    lineage: list[str] = field(default_factory=list)
    _ids: set[str] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        self._ids = set(self.lineage)

    # -- queries (safe from the bus thread: reads of a set and an int) -----------------------
    def contains(self, seq: int, sample_id: str) -> bool:
        """True when the item is in the model (or its sequence was retired as dead/superseded)."""
        return self.cursor.is_done(seq) or sample_id in self._ids

    def trained_sample(self, sample_id: str) -> bool:
        """True when a sample with this id is in the model (whatever its sequence or generation)."""
        return sample_id in self._ids

    def __len__(self) -> int:
        return len(self.lineage)

    # -- updates (training thread) ---------------------------------------------------------------
    def record(self, keys: Iterable[Key]) -> int:
        """Mark trained items; idempotent (a key already recorded is not counted again).
        Returns how many sample ids entered the lineage."""
        added = 0
        seqs = []
        for seq, sample_id in keys:
            seqs.append(seq)
            if sample_id not in self._ids:
                self._ids.add(sample_id)
                self.lineage.append(sample_id)
                added += 1
        self.cursor.mark(seqs)
        return added

    def retire(self, seqs: Iterable[int]) -> None:
        """Sequences that will never be trained (dead-lettered, superseded by a recapture)."""
        self.cursor.mark(seqs)

    # -- Stateful ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's `cursor` and `lineage`."""
        return {"cursor": self.cursor.to_dict(), "lineage": list(self.lineage)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (or a checkpoint holding those keys)."""
        self.cursor = SamplesCursor.from_dict(state["cursor"])
        self.lineage = list(state["lineage"])
        self._ids = set(self.lineage)


def plan_round(ledger: Ledger, windows: Sequence[Sequence[Key]]) -> list[RoundPlan]:
    """Filter every rank's candidate window against the ledger and against each other.

    `windows[r]`: rank r's candidates in order. Deterministic in its inputs, so every rank
    computes the same plans from the same gathered windows. The first occurrence of a sequence
    or a sample id (by rank, then position) is kept; a later one in the same round is parked;
    anything the ledger already holds is `trained`."""
    seen_seqs: set[int] = set()
    seen_ids: set[str] = set()
    plans = []
    for window in windows:
        plan = RoundPlan()
        for i, (seq, sample_id) in enumerate(window):
            if ledger.contains(seq, sample_id):
                plan.trained.append(i)
            elif seq in seen_seqs or sample_id in seen_ids:
                plan.parked.append(i)
            else:
                seen_seqs.add(seq)
                seen_ids.add(sample_id)
                plan.keep.append(i)
        plans.append(plan)
    return plans
