"""The generation side of `specbus serve`: KV-cache decoding on one worker thread, capturing.

`Generator` decodes `Job`s in waves of up to `live.serve_batch` requests, one `SpecBatch`
each (`speculative.decode_wave`; plain waves draft nothing): those waiting when a wave starts
are prefilled together (left-padded, per-row positions), a finished request leaves the batch
the step it ends, and requests queued meanwhile are prefilled and join the rows left
(continuous batching; a plain wave stops admitting once a draft is published, so the draft
serves the next wave). Greedy at `temperature: 0`, else
temperature / top-p sampling (seeded by `seed`, else by the request id). Stops at an EOS
token, a `stop` string or `max_tokens`. A captured request's forwards keep their aux-layer
outputs (and the final norm's output when the handshake asks for it), one row per fed token;
after the response is complete the rows go to `sink.submit` (bounded, non-blocking). The HTTP
side is `producers/live/serve.py`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import Counter
from dataclasses import dataclass, field

import torch
from specbus.core.models.target import decoder_layers
from specbus.producers.engines.hf import sdpa_backends
from specbus.producers.live.sink import Capture, CaptureSink
from specbus.producers.live.speculative import DraftSlot, SpecRecord, SpecStats, decode_wave

log = logging.getLogger("specbus.serve")


@dataclass
class Job:
    """One request to decode: its prompt and sampling settings; the worker fills
    `output_ids` and `finish_reason` and sends ("token", id) / ("done", None) events to
    `events` on `loop` (set by `Generator.submit`)."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    cancelled: bool = False
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    text: str = ""
    spec: SpecRecord | None = None  # what speculative decoding did for it (None: decoded plainly)
    settled: bool = False  # answered ("done") and its capture handed on, when its decoding ended


def _seed_of(request_id: str) -> int:
    import hashlib

    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:4], "big")


class _Rows:
    """Forward hooks keeping the aux layers' outputs (and the final norm's) while recording."""

    def __init__(self, model, aux_layers: tuple[int, ...], final: bool):
        self.aux_layers, self.final = tuple(aux_layers), final
        self.recording = False
        self.outs: list[torch.Tensor | None] = [None] * len(self.aux_layers)
        self.norm_out: torch.Tensor | None = None
        layers = decoder_layers(model)
        self.handles = [layers[i].register_forward_hook(self._keep(k))
                        for k, i in enumerate(self.aux_layers)]  # fmt: skip
        if final:
            norm = getattr(getattr(model, "model", model), "norm", None)
            if norm is None:
                raise ValueError("the target has no final norm (model.model.norm) to capture")
            self.handles.append(norm.register_forward_hook(self._keep_norm))

    def _keep(self, slot: int):
        def hook(_m, _i, output):
            if self.recording:
                self.outs[slot] = output[0] if isinstance(output, tuple) else output

        return hook

    def _keep_norm(self, _m, _i, output):
        if self.recording:
            self.norm_out = output[0] if isinstance(output, tuple) else output

    def take_batch(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This forward's rows: `[B, T, A]` aux and `[B, T, H]` final."""
        aux = torch.cat(self.outs, dim=-1)
        final = self.norm_out if self.final else None
        self.outs = [None] * len(self.aux_layers)
        self.norm_out = None
        return aux, final

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class Generator:
    """The hf engine's model generating on a worker thread, in waves of up to `max_batch`
    requests: the requests waiting when a wave starts are prefilled together (left-padded,
    masked, position ids per row) and decoded together until every one of them is done; the
    next wave takes what arrived meanwhile. Row `i` of every forward belongs to request `i`
    (pad positions and rows of finished requests are never captured).

    With `drafts` (a `DraftSlot`), a wave is decoded speculatively with the slot's current
    draft, up to `num_draft_tokens` drafts a round, counted in `spec_stats`
    (`producers/live/speculative.py`); without a draft in the slot, as above."""

    def __init__(self, engine, sink: CaptureSink | None, *, max_new_tokens: int = 256,
                 max_queue: int = 1024, max_batch: int = 4, start: bool = True,
                 drafts: DraftSlot | None = None, num_draft_tokens: int = 3,
                 spec_stats: SpecStats | None = None):  # fmt: skip
        self.engine, self.sink = engine, sink
        self.drafts, self.num_draft_tokens, self.spec_stats = drafts, num_draft_tokens, spec_stats
        self.model, self.tokenizer = engine.model, engine.tokenizer
        self.max_new_tokens, self.max_batch = max_new_tokens, max_batch
        self.context = engine.context_length
        self.eos = set(engine.info.eos_token_ids)
        self.pad_id = engine.pad_id
        self.device = engine.device
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.stats: Counter = Counter()
        self._rows: _Rows | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._work, name="specbus-generate", daemon=True)
        if start:
            self._thread.start()

    def start(self) -> None:
        """Start the worker thread (when built with `start=False`)."""
        self._thread.start()

    def close(self) -> None:
        """Stop the worker after the jobs queued before this."""
        self.jobs.put(None)
        self._thread.join(10)

    # -- the worker --------------------------------------------------------------------
    def _work(self) -> None:
        while not self._closing:
            first = self.jobs.get()
            if first is None:
                return
            wave = [first, *self.waiting(self.max_batch - 1)]
            try:
                draft = self.drafts.current() if self.drafts is not None else None
                # The capture's SDPA order on a GPU (flash, then efficient, before cuDNN):
                # torch 2.11's own order picks cuDNN for the decode's masked attention and
                # builds its plan on the host for every new shape, i.e. every step as the
                # cache grows: 42 ms a call on an H200 against 0.05 ms for the efficient
                # kernel (ops/bench/sdpa_decode.py; docs/benchmarks.md, the closed loop).
                with sdpa_backends(device=self.device):
                    self._generate(wave, draft)
            except Exception as e:  # noqa: BLE001 - answered to the users as a 500
                log.exception("generation of %s failed", [j.request_id for j in wave])
                for job in wave:
                    if not job.settled:  # the ones answered before the failure keep their answer
                        self._emit(job, ("error", f"{type(e).__name__}: {e}"))

    def waiting(self, most: int) -> list[Job]:
        """Up to `most` queued requests, without waiting (a new wave, or those a running
        speculative wave admits); the close sentinel ends the worker after the wave."""
        out: list[Job] = []
        while len(out) < most and not self._closing:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:
                self._closing = True
                break
            out.append(job)
        return out

    def _emit(self, job: Job, event) -> None:
        if job.loop is not None and not job.loop.is_closed():
            job.loop.call_soon_threadsafe(job.events.put_nowait, event)

    def capture_hooks(self) -> _Rows | None:
        """The forward hooks keeping the rows the sink's handshake asks for (None: no handshake)."""
        cfg = self.sink.config if self.sink is not None else None
        if cfg is None:
            return None
        final = any(d.source == "final" for d in cfg.features)
        if self._rows is None or (self._rows.aux_layers, self._rows.final) != (
            tuple(cfg.aux_layers), final,
        ):  # fmt: skip
            if self._rows is not None:
                self._rows.remove()
            self._rows = _Rows(self.model, tuple(cfg.aux_layers), final)
        return self._rows

    def take(self, job: Job, tokens: list[int]) -> bool:
        """Append generated `tokens` to `job` (streamed to its user) up to its end: an EOS
        token, a stop string, `max_tokens`, or a cancelled request; True once it ended (the
        tokens after the end are dropped)."""
        for token in tokens:
            job.output_ids.append(token)
            self._emit(job, ("token", token))
            if token in self.eos or (job.stop and self._stopped(job)):
                job.finish_reason = "stop"
                return True
            if len(job.output_ids) >= job.max_tokens:
                return True
            if job.cancelled:
                job.finish_reason = "cancelled"
                return True
        return False

    def _generate(self, wave: list[Job], draft) -> None:
        """Decode `wave` (`speculative.decode_wave`): speculatively with `draft`, plainly when
        it is None; requests queued meanwhile join the rows left, and each request is settled
        as its own decoding ends."""

        def ended(i: int, sample_id: str | None, aux: list, final: list) -> None:
            self._settle(wave[i], sample_id, aux, final)

        decode_wave(self, wave, draft, self.drafts, self.num_draft_tokens, self.spec_stats,
                    _seed_of, ended)  # fmt: skip
        self.stats["waves"] += 1

    def sample_ids(self, jobs: list[Job]) -> list[str | None]:
        """Each job's sample id if the sink captures it, else None (`CaptureSink.wants`)."""
        return [self.sink.wants(j.request_id) if self.sink is not None else None for j in jobs]

    def _settle(self, job: Job, sample_id: str | None, aux: list, final: list) -> None:
        """A request whose decoding ended: counted, its capture (`sample_id`: to be captured)
        handed to the sink, its user answered ("done"), once; as soon as its own decoding
        ends, not its wave's (a short answer does not wait for the wave's longest, and the
        trainers get it as early)."""
        if job.settled:
            return
        job.settled = True
        self.stats["requests"] += 1
        self.stats["tokens"] += len(job.output_ids)
        if sample_id is not None:
            self.sink.submit(Capture(
                request_id=job.request_id, prompt_ids=list(job.prompt_ids),
                output_ids=list(job.output_ids), aux=aux, final=final,
                sample_id=sample_id, draft_version=job.spec.version if job.spec else None,
            ))  # fmt: skip
        self._emit(job, ("done", job.finish_reason))

    def _stopped(self, job: Job) -> bool:
        text = self.tokenizer.decode(job.output_ids, skip_special_tokens=True)
        return any(s and s in text for s in job.stop)

    # -- the server's side -------------------------------------------------------------
    def submit(self, job: Job) -> bool:
        """Queue `job` from the event loop that reads its `events`; False when the queue is
        full (the server answers 503)."""
        job.loop = asyncio.get_running_loop()
        job.events = asyncio.Queue()
        try:
            self.jobs.put_nowait(job)
            return True
        except queue.Full:
            return False
