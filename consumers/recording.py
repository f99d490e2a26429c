"""Offline training from a recording (W1): the recorded samples, epoch after epoch.

A recording is a run captured once (`specbus capture`): its SAMPLES stream holds one
SampleRef per captured sample and its features live in a persistent `file://` store. It is
read from one of:
- the broker (`BusRecording`, a run name): the run's recording marker (KV) and its SAMPLES
  stream, replayed from sequence 1;
- the recording's directory (`DirRecording`): `recording.json` and `refs.jsonl`, the copy of
  the final refs `specbus capture` writes next to the features, so a recording can be moved
  or used without the broker that captured it;
- an offline dump in SpecForge's layout (`consumers/specforge.py`) or in vLLM speculators'
  (`consumers/speculators.py`).

Every one offers the same thing: `count` samples in recorded order, each loaded by position.
Of a stream with recaptures or duplicate publishes, the recorded samples are the last
generation of each sample id, at the position of its first ref (`final_refs`).

`RecordingSource` is the loader's `Source` over a recording, without leases: epochs are
concatenated into one virtual stream of `epochs * count` positions; epoch 0 replays the
recording in its recorded order (the feeder's seeded permutation, so it trains what an online
run trains, step for step), every later epoch in a seeded permutation (`data.seed`, epoch).
Position `v` (0-based) has the ledger key `(v + 1, "<sample id>/e<epoch>")`: the cursor's
sequences are these virtual positions, so the checkpoint's cursor floor says the epoch
(`floor // count`) and the position in it, and every sample is trained exactly once per epoch
by the same ledger filter as online. Each rank takes its share of every lockstep step in a
fixed pattern: of the global windows of `world * need` positions counted from the cursor floor
at start, rank r takes positions `r*need .. (r+1)*need - 1`; after a resume (any world size)
the split starts again from the checkpoint's floor and the ledger skips what it holds above
it. Features are never released: the recording is read again next epoch. A sample whose
features are missing or corrupt is skipped (logged, counted as `missing`, retired from the
cursor): a recording has no producer to recapture it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from specbus.bus.connection import Bus
from specbus.bus.run import RunBus, open_run
from specbus.bus.subjects import TRAINERS
from specbus.consumers.ledger import Ledger
from specbus.core.contracts import Manifest, SampleRef
from specbus.core.errors import ConfigError, FeatureMissing, IntegrityError, RecordError
from specbus.core.source import Item, Upstream
from specbus.core.store import open_store

log = logging.getLogger("specbus.recording")

FORMAT = "specbus-recording/1"
MARKER_FILE = "recording.json"
REFS_FILE = "refs.jsonl"


def final_refs(records: Iterable[tuple[int, SampleRef]]) -> list[tuple[int, SampleRef]]:
    """The recorded samples of a SAMPLES stream, in recorded order: per sample id, the ref
    of its highest generation, placed at the sequence of the sample's first ref."""
    first: dict[str, int] = {}
    last: dict[str, SampleRef] = {}
    for seq, ref in records:
        first.setdefault(ref.sample_id, seq)
        if ref.sample_id not in last or ref.generation > last[ref.sample_id].generation:
            last[ref.sample_id] = ref
    return sorted(((first[sid], ref) for sid, ref in last.items()), key=lambda x: x[0])


class Recording:
    """`count` samples in recorded order, loaded by position (see module doc)."""

    name: str
    manifest: Manifest
    count: int
    store_uri: str | None = None

    async def load(
        self, position: int, features: tuple[str, ...]
    ) -> tuple[str, int, dict[str, torch.Tensor]]:
        """(sample id, tokens, tensors) of the recorded sample at `position`. Raises
        FeatureMissing / IntegrityError when its features cannot be read."""
        raise NotImplementedError

    def usage(self) -> Any:
        """The store's usage for a log row (None when there is no specbus store)."""
        return None

    def close(self) -> None:
        """Let go of the files and stores it holds."""


class _StoreBacked(Recording):
    """Recordings whose features are in a specbus store, named by SampleRefs."""

    def __init__(self, store_uri: str):
        self.store_uri = store_uri
        self._store = None

    @property
    def store(self):
        """The `file://` store holding the features, opened on first use."""
        if self._store is None:
            self._store = open_store(self.store_uri)
        return self._store

    async def ref(self, position: int) -> SampleRef:
        """The final ref of the recorded sample at `position`."""
        raise NotImplementedError

    async def load(self, position, features):
        ref = await self.ref(position)
        tensors = await asyncio.to_thread(self.store.get, ref, features)
        return ref.sample_id, ref.num_tokens, tensors

    def usage(self):
        return self._store.usage() if self._store is not None else None

    def close(self) -> None:
        if self._store is not None:
            self._store.close()


class BusRecording(_StoreBacked):
    """A recording read from the broker: the run's recording marker and its SAMPLES stream."""

    def __init__(self, run: RunBus, marker: dict, manifest: Manifest, seqs: list[int]):
        super().__init__(marker["store_uri"])
        self.runbus, self.name, self.marker, self.manifest = run, run.run, marker, manifest
        self.seqs, self.count = seqs, len(seqs)

    @classmethod
    async def open(cls, bus: Bus, name: str) -> BusRecording:
        """The recording of run `name` on this broker. Raises `ConfigError` when it is not a
        complete recording, or its SAMPLES no longer hold every recorded ref."""
        run = await open_run(bus, name)
        marker = None if run is None else await run.kv.recording()
        if marker is None:
            raise ConfigError(
                f"run {run!r} is not a complete recording on this broker (no recording marker): "
                "capture it with `specbus capture`, or give the recording's directory"
            )
        run_name = name
        manifest = await run.kv.get_manifest()
        records = []
        async for stored in run.replay(TRAINERS, 1, end_seq=marker["last_seq"]):
            try:
                records.append((stored.seq, SampleRef.from_bytes(stored.data)))
            except RecordError as e:
                log.warning("recording %s: SAMPLES seq %d skipped: %s", run_name, stored.seq, e)
        seqs = [seq for seq, _ in final_refs(records)]
        if len(seqs) != marker["samples"]:
            raise ConfigError(
                f"recording {run_name!r}: SAMPLES holds {len(seqs)} recorded samples, its marker "
                f"says {marker['samples']} (the stream aged out or was purged?): use the "
                "recording's directory instead"
            )
        return cls(run, marker, manifest, seqs)

    async def ref(self, position: int) -> SampleRef:
        """The recorded ref at `position`, read back from SAMPLES (`FeatureMissing` once it is
        gone)."""
        stored = await self.runbus.sample(self.seqs[position])
        if stored is None:
            where = f"{self.runbus.names.samples_stream}#{self.seqs[position]}"
            raise FeatureMissing(where, "the ref is gone")
        return SampleRef.from_bytes(stored.data)


class DirRecording(_StoreBacked):
    """A recording read from its directory: `recording.json` + `refs.jsonl` (one final ref
    per line, recorded order) beside the `file://` store's `samples/`."""

    def __init__(self, root: Path):
        self.root = Path(root)
        marker = json.loads((self.root / MARKER_FILE).read_text())
        if marker.get("format") != FORMAT:
            raise ConfigError(
                f"{self.root / MARKER_FILE}: format {marker.get('format')!r}, this reader "
                f"speaks {FORMAT!r}"
            )
        store_id = marker.get("store_id", "default")
        super().__init__(
            f"file://{self.root}" + (f"?store_id={store_id}" if store_id != "default" else "")
        )
        self.name, self.marker = str(self.root), marker
        self.manifest = Manifest.from_bytes(json.dumps(marker["manifest"]).encode())
        self._offsets = []
        with open(self.root / REFS_FILE, "rb") as f:
            at = 0
            for line in f:
                if line.strip():
                    self._offsets.append((at, len(line)))
                at += len(line)
        self.count = len(self._offsets)
        if self.count != marker["samples"]:
            raise ConfigError(
                f"{self.root}: {REFS_FILE} holds {self.count} refs, {MARKER_FILE} says "
                f"{marker['samples']}"
            )
        self._fd = os.open(self.root / REFS_FILE, os.O_RDONLY)

    async def ref(self, position: int) -> SampleRef:
        """The recorded ref at `position`, read from `refs.jsonl`."""
        at, n = self._offsets[position]
        return SampleRef.from_bytes(os.pread(self._fd, n, at).strip())

    def close(self) -> None:
        """Close the store and `refs.jsonl`."""
        super().close()
        os.close(self._fd)


def is_run_name(spec: str) -> bool:
    """Whether `spec` names a run on the broker (not a directory)."""
    return not (Path(spec).is_dir() or Path(spec).is_absolute() or spec.startswith("."))


def epoch_permutation(count: int, seed: int, epoch: int) -> list[int]:
    """Recorded indices in the order epoch `epoch` trains them: recorded order for epoch 0,
    a permutation seeded by (seed, epoch) after."""
    order = list(range(count))
    if epoch:
        random.Random(f"specbus:recording:{seed}:{epoch}").shuffle(order)
    return order


class RecordingSource:
    """The loader's `Source` over a recording (see module doc)."""

    def __init__(
        self,
        recording: Recording,
        *,
        features: tuple[str, ...],
        epochs: int,
        seed: int,
        rank: int,
        world: int,
        need: int,
        trained: Ledger,
        concurrency: int = 4,
    ):
        self.recording, self.features = recording, tuple(features)
        self.count, self.epochs, self.seed = recording.count, epochs, seed
        self.rank, self.world, self.need = rank, world, need
        self.total = epochs * self.count
        self.trained = trained
        self.start = trained.cursor.floor  # positions below the floor are done
        self._positions = self._mine()
        self._exhausted = False
        self._requeued: deque[Item] = deque()
        self._retired: list[int] = []
        self._perm: tuple[int, list[int]] | None = None
        self._sem = asyncio.Semaphore(concurrency)
        self.stats = {"missing": 0}

    def _mine(self):
        """This rank's positions, in order (see module doc)."""
        step = self.world * self.need
        base = self.start + self.rank * self.need
        while base < self.total:
            yield from range(base, min(base + self.need, self.total))
            base += step

    def _recorded_index(self, v: int) -> tuple[int, int]:
        epoch, i = divmod(v, self.count)
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, epoch_permutation(self.count, self.seed, epoch))
        return epoch, self._perm[1][i]

    async def _load(self, v: int) -> Item | None:
        epoch, index = self._recorded_index(v)
        async with self._sem:
            try:
                sample_id, tokens, tensors = await self.recording.load(index, self.features)
            except (FeatureMissing, IntegrityError) as e:
                log.warning(
                    "recording %s: sample at position %d skipped in epoch %d: %s",
                    self.recording.name, index, epoch, e,
                )  # fmt: skip
                self.stats["missing"] += 1
                self._retired.append(v + 1)
                return None
        return Item(seq=v + 1, sample_id=f"{sample_id}/e{epoch}", num_tokens=tokens,
                    lease=None, tensors=tensors)  # fmt: skip

    # -- Source protocol -----------------------------------------------------------------
    async def take(self, n: int, timeout_s: float) -> list[Item]:
        """Up to `n` items of this rank's next positions (requeued ones first)."""
        out: list[Item] = []
        while self._requeued and len(out) < n:
            out.append(self._requeued.popleft())
        todo = []
        while len(out) + len(todo) < n:
            v = next(self._positions, None)
            if v is None:
                self._exhausted = True
                break
            if not self.trained.cursor.is_done(v + 1):
                todo.append(v)
        loaded = await asyncio.gather(*(self._load(v) for v in todo))
        out += [item for item in loaded if item is not None]
        if not out:  # nothing left here: yield the loop (the loader polls again at once)
            await asyncio.sleep(min(timeout_s, 0.05))
        return out

    async def upstream(self) -> Upstream:
        """Done once this rank's positions are read to the end and nothing is requeued."""
        if self._exhausted and not self._requeued:
            return Upstream(True)
        return Upstream(False, waiting_for="recording not read to the end")

    async def keepalive(self, items: list[Item]) -> None:
        """Nothing to keep alive: no lease."""

    async def ack(self, items: list[Item], *, confirm: bool = True) -> None:
        """Nothing to ack: the ledger records what is trained."""

    async def nak(self, items: list[Item], delay_s: float = 0.0) -> None:
        """Take `items` again next (in order)."""
        self._requeued.extendleft(reversed(items))

    async def give_back(self) -> None:
        """Forget what was requeued (a stop)."""
        self._requeued.clear()

    def unsettled(self) -> int:
        """0: nothing is leased."""
        return 0

    def release(self, items: list[Item]) -> None:
        """Nothing: a recording is read again next epoch."""

    def checkpointed(self) -> None:
        """Nothing: a recording is never released."""

    def drain_retired(self) -> list[int]:
        """Positions skipped (missing features) since the last call, for the cursor."""
        out, self._retired = self._retired, []
        return out

    def usage(self):
        """The recording store's usage (for log rows)."""
        return self.recording.usage()

    def close(self) -> None:
        """Close the recording."""
        self.recording.close()
