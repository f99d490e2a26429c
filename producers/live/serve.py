"""`specbus serve`: an OpenAI-compatible server on the hf engine that captures through the sink.

The reference implementation of the capture-sink contract (`producers/live/sink.py`):
- `POST /v1/chat/completions` (the tokenizer's chat template, generation prompt added) and
  `POST /v1/completions` (a prompt string or token ids), streaming (SSE, `data: [DONE]`) or
  not; `GET /v1/models`; `GET /healthz`; `GET /metrics` (Prometheus text: requests by route
  and status, the sink's outcomes); `GET /v1/spec-capture/sink` (the same as JSON);
  `POST /v1/spec-capture/sink {"enabled": false|true}` (an operator switch: serve without
  capturing, then again with; the benchmark's on/off arms run on one server this way).
- Generation: KV-cache decoding on one worker thread, in waves of up to `live.serve_batch`
  requests (those waiting when a wave starts are prefilled and decoded together; a CPU
  reference server, not a continuous-batching engine). Greedy at `temperature: 0`, else
  temperature / top-p sampling (seeded by `seed`, else by the request id). Stops at an EOS
  token, a `stop` string or `max_tokens` (capped by `live.max_new_tokens` and the context).
- Capture: the request id (`X-Request-Id`, else a fresh one) decides through
  `sink.wants(request_id)`; a captured request's forwards keep their aux-layer outputs (and
  the final norm's output when the handshake asks for it), one row per fed token, prefill
  and decode alike; after the response is complete the rows go to `sink.submit` (a bounded,
  non-blocking enqueue). Nothing of the capture can fail or slow a request beyond that.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import queue
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from specbus.core.models.target import decoder_layers
from specbus.producers.live.sink import Capture, CaptureSink

log = logging.getLogger("specbus.serve")


@dataclass
class Job:
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
    (pad positions and rows of finished requests are never captured)."""

    def __init__(self, engine, sink: CaptureSink | None, *, max_new_tokens: int = 256,
                 max_queue: int = 1024, max_batch: int = 4, start: bool = True):  # fmt: skip
        self.engine, self.sink = engine, sink
        self.model, self.tokenizer = engine.model, engine.tokenizer
        self.max_new_tokens, self.max_batch = max_new_tokens, max_batch
        self.context = engine.context_length
        self.eos = set(engine.info.eos_token_ids)
        self.pad_id = engine.pad_id
        self.device = engine.device
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.stats: Counter = Counter()
        self._rows: _Rows | None = None
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._closing = False
        self._thread = threading.Thread(target=self._work, name="specbus-generate", daemon=True)
        if start:
            self._thread.start()

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self.jobs.put(None)
        self._thread.join(10)

    # -- the worker --------------------------------------------------------------------
    def _work(self) -> None:
        while not self._closing:
            first = self.jobs.get()
            if first is None:
                return
            wave = [first]
            while len(wave) < self.max_batch:
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self._closing = True
                    break
                wave.append(job)
            try:
                self._generate(wave)
                for job in wave:
                    self._emit(job, ("done", job.finish_reason))
            except Exception as e:  # noqa: BLE001 - answered to the users as a 500
                log.exception("generation of %s failed", [j.request_id for j in wave])
                for job in wave:
                    self._emit(job, ("error", f"{type(e).__name__}: {e}"))

    def _emit(self, job: Job, event) -> None:
        if job.loop is not None and not job.loop.is_closed():
            job.loop.call_soon_threadsafe(job.events.put_nowait, event)

    def _hooks(self) -> _Rows | None:
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

    def _choose(self, logits: torch.Tensor, job: Job, gen: torch.Generator | None) -> int:
        if job.temperature <= 0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / job.temperature, dim=-1)
        if job.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < job.top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=gen))

    @torch.no_grad()
    def _generate(self, wave: list[Job]) -> None:
        from transformers import DynamicCache

        n = len(wave)
        wanted = [self.sink.wants(j.request_id) if self.sink is not None else None for j in wave]
        rows = self._hooks() if any(w is not None for w in wanted) else None
        aux: list[list[torch.Tensor]] = [[] for _ in wave]
        final: list[list[torch.Tensor]] = [[] for _ in wave]
        gens = [
            torch.Generator().manual_seed(j.seed if j.seed is not None else _seed_of(j.request_id))
            if j.temperature > 0 else None
            for j in wave
        ]  # fmt: skip
        longest = max(len(j.prompt_ids) for j in wave)
        pads = [longest - len(j.prompt_ids) for j in wave]
        ids = torch.full((n, longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, longest), dtype=torch.long)
        for i, j in enumerate(wave):
            ids[i, pads[i] :] = torch.tensor(j.prompt_ids, dtype=torch.long)
            mask[i, pads[i] :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        active = [True] * n
        cache = DynamicCache()
        if rows is not None:
            rows.recording = True
        try:
            step = 0
            while any(active):
                kw = {} if n == 1 else {"attention_mask": mask.to(self.device),
                                        "position_ids": positions.to(self.device)}  # fmt: skip
                logits = self.model(input_ids=ids.to(self.device), use_cache=True,
                                    **{self._cache_kw: cache}, **kw).logits  # fmt: skip
                if rows is not None:
                    a, f = rows.take_batch()
                    for i in range(n):
                        if wanted[i] is not None and active[i]:
                            skip = pads[i] if step == 0 else 0
                            aux[i].append(a[i, skip:])
                            if f is not None:
                                final[i].append(f[i, skip:])
                nxt = []
                for i, j in enumerate(wave):
                    if not active[i]:
                        nxt.append(self.pad_id)
                        continue
                    token = self._choose(logits[i, -1], j, gens[i])
                    j.output_ids.append(token)
                    self._emit(j, ("token", token))
                    nxt.append(token)
                    if token in self.eos or (j.stop and self._stopped(j)):
                        j.finish_reason = "stop"
                        active[i] = False
                    elif len(j.output_ids) >= j.max_tokens:
                        active[i] = False
                    elif j.cancelled:
                        j.finish_reason = "cancelled"
                        active[i] = False
                ids = torch.tensor(nxt, dtype=torch.long)[:, None]
                mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long)], dim=1)
                positions = positions[:, -1:] + 1
                step += 1
        finally:
            if rows is not None:
                rows.recording = False
        self.stats["waves"] += 1
        for i, j in enumerate(wave):
            self.stats["requests"] += 1
            self.stats["tokens"] += len(j.output_ids)
            if wanted[i] is not None:
                self.sink.submit(Capture(
                    request_id=j.request_id, prompt_ids=list(j.prompt_ids),
                    output_ids=list(j.output_ids), aux=aux[i], final=final[i],
                    sample_id=wanted[i],
                ))  # fmt: skip

    def _stopped(self, job: Job) -> bool:
        text = self.tokenizer.decode(job.output_ids, skip_special_tokens=True)
        return any(s and s in text for s in job.stop)

    # -- the server's side -------------------------------------------------------------
    def submit(self, job: Job) -> bool:
        job.loop = asyncio.get_running_loop()
        job.events = asyncio.Queue()
        try:
            self.jobs.put_nowait(job)
            return True
        except queue.Full:
            return False


# ---------------------------------------------------------------- OpenAI-compatible HTTP
class BadRequest(Exception):
    pass


def _stop_list(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop[:4])
    raise BadRequest("stop must be a string or a list of strings")


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise BadRequest(f"{key} must be a number in [{lo}, {hi}]")
    return float(value)


class Server:
    """The HTTP side: requests -> jobs -> OpenAI responses."""

    def __init__(self, generator: Generator, model_name: str):
        self.gen, self.model_name = generator, model_name
        self.tokenizer = generator.tokenizer
        self.requests: Counter = Counter()  # (route, status)
        self.template = None
        if self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None):
            from specbus.core.data.templates import detect_template

            self.template = detect_template(self.tokenizer)

    def chat_prompt(self, body: dict) -> list[int]:
        from specbus.core.data.tokenize import prompt_ids

        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list")
        turns = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest("each message needs a role")
            content = m.get("content")
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(content, str):
                raise BadRequest("message content must be a string or text parts")
            turns.append({"role": m["role"], "content": content})
        if self.template is None:
            raise BadRequest("this target has no chat template: use /v1/completions")
        return prompt_ids({"messages": turns}, self.tokenizer, self.template).tolist()

    def text_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise BadRequest("this target has no tokenizer: send token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            vocab = self.gen.engine.info.vocab_size
            if not all(0 <= t < vocab for t in prompt):
                raise BadRequest(f"token ids must be in [0, {vocab})")
            return list(prompt)
        raise BadRequest("prompt must be a string, a list of one string, or token ids")

    def job(self, body: dict, prompt: list[int], request_id: str) -> Job:
        if body.get("n", 1) != 1:
            raise BadRequest("only n=1 is supported")
        if not prompt:
            raise BadRequest("the prompt is empty")
        room = self.gen.context - len(prompt)
        if room < 1:
            raise BadRequest(f"the prompt has {len(prompt)} tokens, the context {self.gen.context}")
        asked = body.get("max_completion_tokens", body.get("max_tokens"))
        if asked is not None and (
            isinstance(asked, bool) or not isinstance(asked, int) or asked < 1
        ):
            raise BadRequest("max_tokens must be a positive integer")
        max_tokens = min(asked or self.gen.max_new_tokens, self.gen.max_new_tokens, room)
        seed = body.get("seed")
        return Job(
            request_id=request_id, prompt_ids=prompt, max_tokens=max_tokens,
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
            seed=seed if isinstance(seed, int) and not isinstance(seed, bool) else None,
            stop=_stop_list(body.get("stop")),
        )  # fmt: skip

    def text_of(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([t for t in ids if t not in self.gen.eos],
                                     skip_special_tokens=True)  # fmt: skip

    def prometheus(self) -> str:
        lines = ["# TYPE specbus_serve_requests_total counter"]
        for (route, status), n in sorted(self.requests.items()):
            lines.append(f'specbus_serve_requests_total{{route="{route}",status="{status}"}} {n}')
        lines.append("# TYPE specbus_serve_generated_tokens_total counter")
        lines.append(f"specbus_serve_generated_tokens_total {self.gen.stats['tokens']}")
        lines.append("# TYPE specbus_serve_queue gauge")
        lines.append(f"specbus_serve_queue {self.gen.jobs.qsize()}")
        sink = self.gen.sink
        if sink is not None:
            lines.append("# TYPE specbus_capture_total counter")
            for what, n in sorted(dict(sink.counts).items()):
                lines.append(f'specbus_capture_total{{outcome="{what}"}} {n}')
        return "\n".join(lines) + "\n"


def build_app(server: Server):
    app = FastAPI(title="specbus serve", docs_url=None, redoc_url=None, openapi_url=None)

    def error(route: str, code: int, message: str, kind: str = "invalid_request_error") -> Response:
        server.requests[(route, code)] += 1
        return JSONResponse({"error": {"message": message, "type": kind, "code": code}},
                            status_code=code)  # fmt: skip

    async def body_of(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except Exception:  # noqa: BLE001
            raise BadRequest("the body is not JSON") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    async def complete(request: Request, route: str, chat: bool) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        request_id = request_id[:128]
        try:
            body = await body_of(request)
            prompt = server.chat_prompt(body) if chat else server.text_prompt(body)
            job = server.job(body, prompt, request_id)
        except BadRequest as e:
            return error(route, 400, str(e))
        if not server.gen.submit(job):
            return error(route, 503, "the server is overloaded", "server_error")
        created = int(time.time())
        rid = ("chatcmpl-" if chat else "cmpl-") + request_id
        kind = "chat.completion" if chat else "text_completion"
        if body.get("stream"):
            opts = body.get("stream_options") or {}
            usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
            server.requests[(route, 200)] += 1
            return StreamingResponse(
                _stream(server, job, rid, created, chat, usage), media_type="text/event-stream",
                headers={"X-Request-Id": request_id},
            )  # fmt: skip
        try:
            while True:
                what, value = await job.events.get()
                if what == "done":
                    break
                if what == "error":
                    return error(route, 500, value, "server_error")
        except asyncio.CancelledError:
            job.cancelled = True
            raise
        text = server.text_of(job.output_ids)
        if job.stop:
            text = _cut_at_stop(text, job.stop)
        finish = "stop" if job.finish_reason == "stop" else "length"
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": finish, "logprobs": None}  # fmt: skip
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        server.requests[(route, 200)] += 1
        return JSONResponse(
            {"id": rid, "object": kind, "created": created, "model": server.model_name,
             "choices": [choice],
             "usage": {"prompt_tokens": len(job.prompt_ids),
                       "completion_tokens": len(job.output_ids),
                       "total_tokens": len(job.prompt_ids) + len(job.output_ids)}},
            headers={"X-Request-Id": request_id},
        )  # fmt: skip

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(request, "chat", chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, "completions", chat=False)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": server.model_name, "object": "model",
                                            "created": 0, "owned_by": "specbus"}]}  # fmt: skip

    @app.get("/healthz")
    async def healthz() -> dict:
        sink = server.gen.sink
        return {"ok": True, "capture": sink is not None,
                "handshake": sink is not None and sink.config is not None}  # fmt: skip

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(server.prometheus())

    @app.get("/v1/spec-capture/sink")
    async def sink_state() -> dict:
        sink = server.gen.sink
        if sink is None:
            return {"capture": False, "counts": {}}
        return {"capture": True, "handshake": sink.config is not None, "idle": sink.idle(),
                "enabled": sink.enabled, "counts": dict(sink.counts)}  # fmt: skip

    @app.post("/v1/spec-capture/sink")
    async def sink_switch(request: Request) -> Response:
        """Operator switch: `{"enabled": false}` serves without capturing (loopback server)."""
        sink = server.gen.sink
        try:
            enabled = json.loads(await request.body())["enabled"]
            assert isinstance(enabled, bool) and sink is not None
        except Exception:  # noqa: BLE001
            return error("sink", 400, 'expected {"enabled": true|false} on a capturing server')
        sink.enabled = enabled
        return JSONResponse({"enabled": enabled})

    return app


def _cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    cut = min((text.find(s) for s in stops if s and s in text), default=-1)
    return text if cut < 0 else text[:cut]


async def _stream(server: Server, job: Job, rid: str, created: int, chat: bool, usage: bool):
    kind = "chat.completion.chunk" if chat else "text_completion"
    sent = ""

    def chunk(delta: str | None, finish: str | None, first: bool = False) -> str:
        if chat:
            d: dict = {"role": "assistant", "content": ""} if first else {}
            if delta:
                d["content"] = delta
            choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
        payload = {"id": rid, "object": kind, "created": created, "model": server.model_name,
                   "choices": [choice]}  # fmt: skip
        return f"data: {json.dumps(payload)}\n\n"

    try:
        if chat:
            yield chunk(None, None, first=True)
        while True:
            what, value = await job.events.get()
            if what == "error":
                err = {"error": {"message": value, "type": "server_error", "code": 500}}
                yield f"data: {json.dumps(err)}\n\n"
                break
            if what == "done":
                text = server.text_of(job.output_ids)
                if job.stop:
                    text = _cut_at_stop(text, job.stop)
                if len(text) > len(sent):
                    yield chunk(text[len(sent) :], None)
                finish = "stop" if job.finish_reason == "stop" else "length"
                yield chunk(None, finish)
                if usage:
                    n_p, n_c = len(job.prompt_ids), len(job.output_ids)
                    yield ("data: " + json.dumps({"id": rid, "object": kind, "created": created,
                           "model": server.model_name, "choices": [],
                           "usage": {"prompt_tokens": n_p, "completion_tokens": n_c,
                                     "total_tokens": n_p + n_c}}) + "\n\n")  # fmt: skip
                break
            text = server.text_of(job.output_ids)
            if job.stop:
                text = _cut_at_stop(text, job.stop)
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest
                continue
            if len(text) > len(sent) and text.startswith(sent):
                yield chunk(text[len(sent) :], None)
                sent = text
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled = True  # a client that went away stops the generation
