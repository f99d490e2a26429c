"""`specbus serve --speculative`: lossless speculative decoding with the run's draft, hot-swapped.

The decoding is core/eval's draft-and-verify (EAGLE3 chains of k drafts, DFlash-family
blocks; greedy verification at temperature 0, rejection sampling otherwise), the same
verification the evaluation measures acceptance with. Here it serves requests:
- A wave (`Generator`'s: the requests waiting when it starts, up to `live.serve_batch`) is
  one `SpecBatch` (`core.eval.batch`): one left-padded prefill, then a round at a time,
  every request's drafts verified in ONE target forward (the EAGLE3 chain drafted batched
  too, `ChainBatch`; DFlash-family blocks row by row), each request keeping its own accepted
  prefix; a finished request leaves the batch, answered and captured then. After each round
  the requests queued meanwhile join the rows left (`SpecBatch.admit`, up to
  `live.serve_batch`), so the batch stays full while traffic lasts. Every round's tokens
  stream to the users as they are verified. Each request's output is the one it would get
  decoded alone (`SpecSession`, batch 1; tests/test_spec_batch.py).
- The draft is the `DraftSlot`'s: the reloader (`ops/reload.py`, following the run's
  checkpoint pointer) builds a new draft off the worker thread and publishes it; the worker
  hands the wave to it between two rounds (`SpecBatch.swap`: the new draft's context is
  rebuilt from the verified positions' target features, one draft forward; the target's
  cache is kept). So a reload never fails a request and never stalls one for more than a
  round; the outputs stay the target's (greedy: the same tokens; sampled: the same
  distribution) whatever draft serves. A draft that cannot take over (its hand-over raises)
  leaves the wave on the draft it had.
- Capture is unchanged: a captured request's rows are the target's over `prompt +
  output[:-1]` (prefill, then the verified prefix of every verify forward), and its record
  carries the version of the draft that served its last round.
- `SpecStats` counts the served acceptance (accepted drafts and tokens per verify, tokens/s)
  per draft version and per request, for `/metrics`, TensorBoard and the response itself (a
  verify is one request's round: a batched round of B requests counts B verifies, its
  worker time split over them).

The draft version is the step of the checkpoint it was loaded from (0: the untrained draft).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from specbus.core.eval.batch import NoDrafter, SpecBatch, batch_drafter
from specbus.core.eval.block import BlockDrafter
from specbus.core.eval.speculative import ChainDrafter
from specbus.core.eval.verify import Sampling
from specbus.core.models.target import AuxCapture
from torch import nn

log = logging.getLogger("specbus.serve")


@dataclass(frozen=True)
class ServedDraft:
    """A draft ready to serve: on the engine's device and dtype, in eval mode. `version`: the
    checkpoint step it was loaded from (0: untrained); `block`: a DFlash-family draft
    (blocks) rather than an EAGLE3 chain; `aux_layers`: the target layers it reads."""

    version: int
    model: nn.Module
    block: bool
    aux_layers: tuple[int, ...]

    def drafter(self, target: nn.Module):
        """A fresh `Drafter` of this draft for one sequence."""
        return BlockDrafter(self.model, target) if self.block else ChainDrafter(self.model)

    def batch_drafter(self, target: nn.Module, rows: int):
        """A fresh `BatchDrafter` of this draft for `rows` sequences (`core.eval.batch`)."""
        return batch_drafter([self.drafter(target) for _ in range(rows)])

    def drafts_per_round(self, k: int) -> int:
        """An EAGLE3 chain drafts `k` tokens a round; a block, its own count (at most its size)."""
        return self.model.config.block_size if self.block else k


class DraftSlot:
    """The draft the server decodes with. `publish` (the reloader's thread) replaces it;
    `current()` (the worker, between rounds) reads it; None until the first draft, or while
    an operator turned speculation off (`enabled`: the benchmark's on/off arms)."""

    def __init__(self) -> None:
        self._draft: ServedDraft | None = None
        self._lock = threading.Lock()
        self.enabled = True

    def publish(self, draft: ServedDraft) -> None:
        """Serve `draft` from the next round on."""
        with self._lock:
            self._draft = draft

    def current(self) -> ServedDraft | None:
        """The draft to decode the next round with (None: decode without one)."""
        with self._lock:
            return self._draft if self.enabled else None

    @property
    def version(self) -> int | None:
        """The published draft's version, enabled or not (None before the first)."""
        with self._lock:
            return None if self._draft is None else self._draft.version


@dataclass
class SpecRecord:
    """What speculative decoding did for one request (in its response and capture record)."""

    versions: list[int] = field(default_factory=list)  # the draft versions that served it
    verifies: int = 0  # target verify forwards (rounds); the prefill is not one
    accepted: int = 0  # drafts accepted over all rounds
    tokens: int = 0  # tokens the rounds emitted (accepted + one per round, before any cut)
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0  # from the request's prefill to its last token

    @property
    def version(self) -> int | None:
        """The version that served the last round."""
        return self.versions[-1] if self.versions else None

    @property
    def accept_length(self) -> float:
        """Tokens per verify (accepted drafts + 1); NaN before the first round."""
        return self.tokens / self.verifies if self.verifies else math.nan

    def as_dict(self, completion_tokens: int) -> dict[str, Any]:
        """The `specbus` block of a response."""
        rate = completion_tokens / self.seconds if self.seconds > 0 else None
        return {"draft_version": self.version, "draft_versions": list(self.versions),
                "verifies": self.verifies, "accepted_tokens": self.accepted,
                "accept_length": None if not self.verifies else round(self.accept_length, 4),
                "tokens_per_s": None if rate is None else round(rate, 3)}  # fmt: skip


@dataclass
class VersionTotals:
    """Served totals of one draft version."""

    verifies: int = 0
    accepted: int = 0
    tokens: int = 0
    seconds: float = 0.0  # worker time in this version's rounds
    requests: int = 0


class SpecStats:
    """The served acceptance (module doc). `metrics` (`core.prometheus.Metrics`) gets the
    series below; `on_request(row)` / `on_version(row)` (TensorBoard rows) are called with
    each finished request's and each superseded version's figures."""

    REQUEST_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)
    RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    SWAP_BUCKETS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)

    def __init__(self, metrics=None, *, on_request: Callable[[dict], None] | None = None,
                 on_version: Callable[[dict], None] | None = None):  # fmt: skip
        self.versions: dict[int, VersionTotals] = {}
        self.current: int | None = None
        self.reloads: dict[str, int] = {"loaded": 0, "refused": 0}
        self.requests = 0
        self.on_request, self.on_version = on_request, on_version
        self._lock = threading.Lock()
        self._hist = None
        if metrics is not None:
            self._register(metrics)

    def _register(self, m) -> None:
        def per(attr: str) -> Callable[[], dict]:
            return lambda: {(str(v),): getattr(t, attr) for v, t in self.snapshot().items()}

        m.read("specbus_serve_draft_version", "version (checkpoint step) of the served draft; "
               "-1: none yet", lambda: -1 if self.current is None else self.current)  # fmt: skip
        m.read("specbus_serve_draft_reloads", "draft reloads by outcome",
               lambda: {(k,): v for k, v in self.reloads.items()}, kind="counter",
               labels=("outcome",))  # fmt: skip
        lab = ("draft_version",)
        for name, attr, doc in (
            ("specbus_serve_spec_verifies", "verifies", "target verify forwards (rounds)"),
            ("specbus_serve_spec_accepted_tokens", "accepted", "drafts accepted"),
            ("specbus_serve_spec_tokens", "tokens", "tokens emitted by verify rounds"),
            ("specbus_serve_spec_seconds", "seconds", "worker seconds in verify rounds"),
            ("specbus_serve_spec_requests", "requests", "requests finished"),
        ):
            m.read(name, doc + ", per draft version", per(attr), kind="counter", labels=lab)
        m.read("specbus_serve_spec_accept_length", "tokens per verify (accepted drafts + 1), "
               "per draft version", lambda: {(str(v),): t.tokens / t.verifies
                                             for v, t in self.snapshot().items() if t.verifies},
               labels=lab)  # fmt: skip
        m.read("specbus_serve_spec_tokens_per_second", "tokens per worker second of verify "
               "rounds, per draft version", lambda: {(str(v),): t.tokens / t.seconds
                                                     for v, t in self.snapshot().items()
                                                     if t.seconds > 0}, labels=lab)  # fmt: skip
        self._hist = (
            m.histogram("specbus_serve_request_accept_length", "tokens per verify of each "
                        "request", self.REQUEST_BUCKETS),
            m.histogram("specbus_serve_request_tokens_per_second", "completion tokens per "
                        "second of each request (prefill to last token)", self.RATE_BUCKETS),
            m.histogram("specbus_serve_draft_swap_seconds", "worker time to hand a request in "
                        "flight to a new draft (between two of its rounds)", self.SWAP_BUCKETS),
        )  # fmt: skip

    def snapshot(self) -> dict[int, VersionTotals]:
        """A copy of the per-version totals."""
        with self._lock:
            return {v: VersionTotals(**t.__dict__) for v, t in self.versions.items()}

    def serving(self, version: int) -> None:
        """`version` is published (the previous one's totals go to `on_version`)."""
        with self._lock:
            before, self.current = self.current, version
            self.versions.setdefault(version, VersionTotals())
            done = self.versions.get(before) if before not in (None, version) else None
        if done is not None and done.verifies and self.on_version is not None:
            self.on_version({"step": before, "served_accept_length": done.tokens / done.verifies,
                             "served_tokens_per_s": done.tokens / max(done.seconds, 1e-9),
                             "served_requests": done.requests})  # fmt: skip

    def round(self, version: int, accepted: int, tokens: int, seconds: float) -> None:
        """One verify round served by `version`."""
        with self._lock:
            t = self.versions.setdefault(version, VersionTotals())
            t.verifies, t.accepted = t.verifies + 1, t.accepted + accepted
            t.tokens, t.seconds = t.tokens + tokens, t.seconds + seconds

    def request(self, record: SpecRecord, completion_tokens: int) -> None:
        """A request finished (decoded with a draft)."""
        with self._lock:
            self.requests += 1
            n = self.requests
            if record.version is not None:
                self.versions.setdefault(record.version, VersionTotals()).requests += 1
        rate = completion_tokens / record.seconds if record.seconds > 0 else math.nan
        if self._hist is not None and record.verifies:
            self._hist[0].observe(record.accept_length)
            if rate == rate:
                self._hist[1].observe(rate)
        if self.on_request is not None and record.verifies:
            self.on_request({"step": n, "request_accept_length": record.accept_length,
                             "request_tokens_per_s": rate,
                             "draft_version": record.version})  # fmt: skip

    def swapped(self, seconds: float) -> None:
        """The worker handed a request in flight to a new draft in `seconds`."""
        if self._hist is not None:
            self._hist[2].observe(seconds)


def _sampling(job, seed_of) -> Sampling | None:
    if job.temperature <= 0:
        return None
    seed = job.seed if job.seed is not None else seed_of(job.request_id)
    return Sampling(job.temperature, job.top_p, torch.Generator().manual_seed(seed))


@torch.no_grad()
def decode_wave(gen, wave: list, draft: ServedDraft | None, slot: DraftSlot | None, k: int,
                stats: SpecStats | None, seed_of, ended) -> None:  # fmt: skip
    """Decode `wave` (jobs of `gen`, a `Generator`) speculatively, all its requests in one
    `SpecBatch` (module doc). `ended(i, sample_id, aux, final)` is called once for each job
    as soon as its decoding ends (the round it finished in), with its sample id (None: not
    captured) and its captured rows (aux chunks, final chunks; empty when not captured).

    `draft` None: a plain wave (`NoDrafter`: one token a row per forward, no `SpecRecord`, no
    stats), with the same admission and per-request settling; it admits requests only while
    `slot` has no draft, so that a draft once published serves the next wave."""
    model = gen.model
    wanted = gen.sample_ids(wave)
    # recording whenever the sink has a handshake: a request admitted later may be captured
    rows = gen.capture_hooks() if gen.sink is not None else None
    kept: list[tuple[list, list]] = [([], []) for _ in wave]

    def keep(order: list[int], spans: list[slice]) -> None:
        """The rows the last target forward recorded: row j is request order[j]."""
        if rows is None:
            return
        a, f = rows.take_batch()
        for j, (i, span) in enumerate(zip(order, spans, strict=True)):
            if wanted[i] is not None:
                kept[i][0].append(a[j, span])
                if f is not None:
                    kept[i][1].append(f[j, span])

    def settle(before: list[int], batch_rows: list[int]) -> None:
        """The jobs of `before` that left the batch: their rows are all kept now."""
        for i in sorted(set(before) - set(batch_rows)):
            job = wave[i]
            if job.spec is not None:
                job.spec.seconds = time.monotonic() - job.spec.started
                if stats is not None:
                    stats.request(job.spec, len(job.output_ids))
            ended(i, wanted[i], kept[i][0], kept[i][1])

    def admitting() -> bool:
        return draft is not None or slot is None or slot.current() is None

    features = AuxCapture(model, list(draft.aux_layers)) if draft is not None else None
    with features or contextlib.nullcontext() as aux:
        if rows is not None:
            rows.recording = True
        try:
            wave_run = _Wave(gen, wave, draft, k, aux, seed_of)
            keep(list(range(len(wave))), [slice(p, None) for p in wave_run.batch.pads])
            settle(list(range(len(wave))), wave_run.batch.rows)  # ended at their first token
            while wave_run.batch.rows:
                order = list(wave_run.batch.rows)
                accepted = wave_run.round(slot, stats)
                keep(order, [slice(0, a + 1) for a in accepted])
                settle(order, wave_run.batch.rows)
                # continuous batching: requests queued meanwhile join the rows left
                left = len(wave_run.batch.rows)
                joining = gen.waiting(gen.max_batch - left) if left and admitting() else []
                if joining:
                    start = len(wave)
                    wanted += gen.sample_ids(joining)
                    kept += [([], []) for _ in joining]
                    wave_run.admit(joining)  # `wave` grows by them
                    new = list(range(start, len(wave)))
                    keep(new, [slice(p, None) for p in wave_run.batch.pads[start:]])
                    settle(new, wave_run.batch.rows)
        finally:
            if rows is not None:
                rows.recording = False


class _Wave:
    """The requests of one wave in one `SpecBatch`, on one draft version at a time."""

    def __init__(self, gen, wave: list, draft: ServedDraft | None, k: int, aux, seed_of):
        self.gen, self.wave, self.k, self.aux, self.seed_of = gen, wave, k, aux, seed_of
        self.draft = draft  # the version the wave decodes with (admitted requests too)
        self.version = draft.version if draft is not None else None  # None: a plain wave
        self.per_round = draft.drafts_per_round(k) if draft is not None else 0
        self.unusable: int | None = None  # a version the wave could not be handed to
        self.batch = self._prefill(wave)
        self._ended_at_first(0, wave)

    def _prefill(self, jobs: list) -> SpecBatch:
        """A batch of `jobs` on the wave's draft version, prefilled (their first token)."""
        plain = self.draft is None
        for job in jobs:
            job.spec = None if plain else SpecRecord()
        drafter = NoDrafter() if plain else self.draft.batch_drafter(self.gen.model, len(jobs))
        return SpecBatch(
            self.gen.model, drafter,
            [torch.tensor(j.prompt_ids, dtype=torch.long) for j in jobs], self.aux,
            sampling=[_sampling(j, self.seed_of) for j in jobs], keep_aux=not plain,
            pad_id=self.gen.pad_id,
        )  # fmt: skip

    def _ended_at_first(self, base: int, jobs: list) -> None:
        """Retire the jobs (batch indices from `base`) whose first token ended them."""
        self.batch.retire([base + i for i, j in enumerate(jobs)
                           if self.gen.take(j, self.batch.tokens[base + i][:1])])  # fmt: skip

    def admit(self, jobs: list) -> None:
        """Prefill `jobs` and continue them in the wave's rounds (`SpecBatch.admit`), on the
        wave's draft version; they are appended to `wave`."""
        base = len(self.wave)
        self.wave.extend(jobs)
        self.batch.admit(self._prefill(jobs))
        self._ended_at_first(base, jobs)

    def round(self, slot: DraftSlot, stats: SpecStats | None) -> list[int]:
        """One verify round of every request left, on the slot's current draft (handed over
        first if new); returns the drafts each row accepted (the batch's row order)."""
        current = slot.current() if slot is not None and self.draft is not None else None
        if current is not None and current.version not in (self.version, self.unusable):
            self._swap(current, stats)
        batch, wave = self.batch, self.wave
        ks = [min(self.per_round, wave[i].max_tokens - len(wave[i].output_ids) - 1)
              for i in batch.rows]  # drafting past a request's end is wasted work  # fmt: skip
        order = list(batch.rows)
        t0 = time.monotonic()
        results = batch.step(ks)
        share = (time.monotonic() - t0) / len(order)  # the worker's time, split over the rows
        done = []
        for i, (emitted, accepted) in zip(order, results, strict=True):
            spec = wave[i].spec
            if spec is not None:  # None: a plain wave's request
                spec.verifies, spec.accepted, spec.tokens = (spec.verifies + 1,
                                                             spec.accepted + accepted,
                                                             spec.tokens + len(emitted))  # fmt: skip
                if not spec.versions or spec.versions[-1] != self.version:
                    spec.versions.append(self.version)
                if stats is not None:
                    stats.round(self.version, accepted, len(emitted), share)
            if self.gen.take(wave[i], emitted):
                done.append(i)
        batch.retire(done)
        return [a for _, a in results]

    def _swap(self, current: ServedDraft, stats: SpecStats | None) -> None:
        t0 = time.monotonic()
        try:
            self.batch.swap(current.batch_drafter(self.gen.model, len(self.batch.rows)))
        except Exception as e:  # noqa: BLE001 - the wave goes on with the draft it had
            self.unusable = current.version
            log.warning("requests %s stay on draft version %s: handing them to version %s "
                        "failed: %s", [self.wave[i].request_id for i in self.batch.rows],
                        self.version, current.version, e)  # fmt: skip
        else:
            self.draft = current
            self.version, self.per_round = current.version, current.drafts_per_round(self.k)
            if stats is not None:
                stats.swapped(time.monotonic() - t0)
