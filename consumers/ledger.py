"""The trainer's record of what is in the model: the single truth behind exactly-once, in
memory and checkpoints bounded by what is in flight, not by the run's length.

The `Ledger` holds
- the cursor of the group's stream (SAMPLES; TASKS colocated; a recording's positions): the
  floor below which everything is settled, plus the settled sequences above it;
- `tasks`, the TASKS messages whose sample is settled (`SeqSet`: ranges, few gaps): a ref
  carries the TASKS sequence it was captured from (`task_seq`), so a producer's republish of a
  task past the broker's duplicate window (same task, a new SAMPLES sequence) is known;
- the ids of the last `recent_ids` samples recorded, a safety net for a duplicate that carries
  no task (live mode: a capture re-POSTed past the duplicate window within that many samples);
- the lineage count, and the ids recorded since the last checkpoint: `CheckpointManager.save`
  appends them to the lineage file beside the checkpoints (consumers/lineage.py) and
  `flushed()` lets them go. The lineage as a list is read back from there (`lineage`).
A recapture supersedes its ref before any rank could train it twice: a rank frees trained
tensors only after the next lockstep exchange, when every rank has recorded them
(`Loader`), so a rank that finds tensors gone knows from its own ledger whether they were
trained. The loader owns the ledger (a `Stateful` saved in every checkpoint) and filters
every lockstep window against it identically on every rank (`plan_round`); recording is
idempotent. docs/architecture.md, "Exactly once into the model".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specbus.consumers import lineage as lineage_file
from specbus.consumers.cursor import SamplesCursor, SeqSet

# (stream sequence, sample id) or (stream sequence, sample id, TASKS sequence; 0: none)
Key = tuple[int, str] | tuple[int, str, int]
RECENT_IDS = 32768  # ids kept for the by-id check (about 0.5 MB in a checkpoint)


def unpack(key: Key | int) -> tuple[int, str, int]:
    """A key as (seq, sample id, task seq); a bare int is a sequence with neither."""
    if isinstance(key, int):
        return key, "", 0
    if len(key) == 2:
        return int(key[0]), key[1], 0
    return int(key[0]), key[1], int(key[2])


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
    """What is in the model (see the module doc). Queries are safe from the bus thread;
    updates belong to the training thread. `lineage_path`: the lineage file (set by the
    trainer from its checkpoints; None: the ids since the last `flushed()` are all it has)."""

    cursor: SamplesCursor = field(default_factory=SamplesCursor)
    tasks: SeqSet = field(default_factory=SeqSet)
    recent_ids: int = RECENT_IDS
    lineage_path: Path | None = None
    _recent: deque = field(default_factory=deque, repr=False)
    _recent_set: set[str] = field(default_factory=set, repr=False)
    _count: int = 0  # ids in the lineage file as of the last checkpoint
    _bytes: int = 0  # their length in the file
    _pending: list[str] = field(default_factory=list, repr=False)  # recorded since
    _pending_bytes: int = 0

    # -- queries (safe from the bus thread: reads of sets and ints) ------------------------
    def contains(self, seq: int, sample_id: str, task_seq: int = 0) -> bool:
        """True when the item is settled: its sequence (trained, dead, superseded), its task
        (a republish of a task whose sample is in), or its id among the recent ones."""
        return (
            self.cursor.is_done(seq)
            or (task_seq > 0 and task_seq in self.tasks)
            or sample_id in self._recent_set
        )

    def trained_sample(self, sample_id: str) -> bool:
        """True when a sample with this id was recorded recently or since the last checkpoint
        (`trained_among` reads the whole lineage)."""
        return sample_id in self._recent_set

    def trained_among(self, ids: Iterable[str]) -> set[str]:
        """Those of `ids` in the lineage (the file, streamed, and what came since): the store
        sweep's question, asked of what a store holds (bounded by the store, not the run)."""
        wanted = set(ids)
        found = wanted & (self._recent_set | set(self._pending))
        if self.lineage_path is not None and wanted - found:
            for sid in lineage_file.iter_ids(self.lineage_path, self._count, self._bytes):
                if sid in wanted:
                    found.add(sid)
        return found

    def __len__(self) -> int:
        """Samples in the model (the lineage's length)."""
        return self._count + len(self._pending)

    @property
    def lineage(self) -> list[str]:
        """Every trained id in training order, read from the lineage file (tools and tests:
        the whole list is never held by a running trainer)."""
        head: list[str] = []
        if self.lineage_path is not None and self._count:
            head = list(lineage_file.iter_ids(self.lineage_path, self._count, self._bytes))
        return head + self._pending

    def size(self) -> dict[str, int]:
        """What it holds (the bounded parts, for the scale bench and metrics)."""
        return {"done_above": len(self.cursor.done_above), "task_ranges": len(self.tasks),
                "recent_ids": len(self._recent), "pending_ids": len(self._pending)}  # fmt: skip

    # -- updates (training thread) ---------------------------------------------------------------
    def _remember(self, sample_id: str) -> None:
        if len(self._recent) >= self.recent_ids:
            self._recent_set.discard(self._recent.popleft())
        self._recent.append(sample_id)
        self._recent_set.add(sample_id)

    def record(self, keys: Iterable[Key]) -> int:
        """Mark trained items; idempotent (a key already settled is not counted again).
        Returns how many sample ids entered the lineage."""
        added = 0
        for key in keys:
            seq, sample_id, task_seq = unpack(key)
            if not self.contains(seq, sample_id, task_seq):
                self._remember(sample_id)
                self._pending.append(sample_id)
                self._pending_bytes += len(lineage_file.line_of(sample_id))
                added += 1
            self.cursor.mark([seq])
            if task_seq > 0:
                self.tasks.add(task_seq)
        return added

    def retire(self, keys: Iterable[Key | int]) -> None:
        """Items that will never be trained (dead-lettered, superseded by a recapture) or that
        were settled as duplicates: their sequences (and tasks) are done. Every rank retires the
        same keys (they come from the lockstep gather), so the ledgers stay equal."""
        for key in keys:
            seq, _, task_seq = unpack(key)
            self.cursor.mark([seq])
            if task_seq > 0:
                self.tasks.add(task_seq)

    def flushed(self) -> None:
        """A checkpoint holding this ledger's `state_dict` is durable (or none ever will be):
        the ids recorded since are in the lineage file; let them go."""
        self._count += len(self._pending)
        self._bytes += self._pending_bytes
        self._pending, self._pending_bytes = [], 0

    # -- Stateful ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's `cursor`, `ledger` (tasks, recent ids) and `lineage`: the count and
        length the file will have, with the ids to append (`append`) past `base`, which
        `CheckpointManager.save` writes to the file and drops from the saved state."""
        return {
            "cursor": self.cursor.to_dict(),
            "ledger": {"version": 2, "tasks": self.tasks.to_list(), "recent": list(self._recent)},
            "lineage": {
                "file": lineage_file.LINEAGE_FILE,
                "count": len(self),
                "bytes": self._bytes + self._pending_bytes,
                "base": [self._count, self._bytes],
                "append": list(self._pending),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned, or a checkpoint (whose lineage is in the file;
        an older checkpoint's is the list itself: it is appended to the file at the next one)."""
        self.cursor = SamplesCursor.from_dict(state["cursor"])
        saved = state.get("ledger") or {}
        self.tasks = SeqSet.from_list(saved.get("tasks", []))
        lin = state.get("lineage") or {}
        if isinstance(lin, list):  # an older checkpoint: the whole lineage, no file yet
            recent, base, pending = lin[-self.recent_ids :], (0, 0), list(lin)
        else:
            recent = saved.get("recent", [])
            base = lin.get("base", (lin.get("count", 0), lin.get("bytes", 0)))
            pending = list(lin.get("append", []))
        self._recent, self._recent_set = deque(), set()
        for sample_id in recent:
            self._remember(sample_id)
        self._count, self._bytes = int(base[0]), int(base[1])
        self._pending = pending
        self._pending_bytes = sum(len(lineage_file.line_of(i)) for i in pending)


def plan_round(ledger: Ledger, windows: Sequence[Sequence[Key]]) -> list[RoundPlan]:
    """Filter every rank's candidate window against the ledger and against each other.

    `windows[r]`: rank r's candidates in order. Deterministic in its inputs, so every rank
    computes the same plans from the same gathered windows. The first occurrence of a
    sequence, a sample id or a task (by rank, then position) is kept; a later one in the same
    round is parked; anything the ledger already holds is `trained`."""
    seen_seqs: set[int] = set()
    seen_ids: set[str] = set()
    seen_tasks: set[int] = set()
    plans = []
    for window in windows:
        plan = RoundPlan()
        for i, key in enumerate(window):
            seq, sample_id, task_seq = unpack(key)
            if ledger.contains(seq, sample_id, task_seq):
                plan.trained.append(i)
            elif seq in seen_seqs or sample_id in seen_ids or task_seq in seen_tasks:
                plan.parked.append(i)
            else:
                seen_seqs.add(seq)
                seen_ids.add(sample_id)
                if task_seq > 0:
                    seen_tasks.add(task_seq)
                plan.keep.append(i)
        plans.append(plan)
    return plans
