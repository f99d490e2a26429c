"""`specbus serve`: an OpenAI-compatible server on the hf engine that captures through the sink.

The reference implementation of the capture-sink contract (`producers/live/sink.py`):
- `POST /v1/chat/completions` (the tokenizer's chat template, generation prompt added) and
  `POST /v1/completions` (a prompt string or token ids), streaming (SSE, `data: [DONE]`) or
  not; `GET /v1/models`; `GET /healthz`; `GET /metrics` (Prometheus text, `core/prometheus.py`:
  requests by route and status, the sink's outcomes, and with a draft the served acceptance
  per draft version, `producers/live/speculative.py`); `GET /v1/spec-capture/sink` (the
  sink's counts as JSON); `POST /v1/spec-capture/sink {"enabled": false|true}` (an operator
  switch: serve without capturing, then again with; the benchmark's on/off arms run on one
  server this way); `GET|POST /v1/spec-decode` (the draft's version and served totals; the
  same kind of switch for speculative decoding).
- Speculative decoding (`specbus serve --speculative`): a response says how it was decoded in
  an extra `specbus` object (the last chunk of a stream): `draft_version` (the checkpoint step
  of the draft that served its last round), `draft_versions`, `verifies`, `accepted_tokens`,
  `accept_length` (tokens per verify), `tokens_per_s`. Clients that do not know it ignore it.
- Generation (`producers/live/generate.py`): KV-cache decoding on one worker thread, in waves of up to `live.serve_batch`
  requests (those waiting when a wave starts are prefilled and decoded together; a CPU
  reference server, not a continuous-batching engine). Greedy at `temperature: 0`, else
  temperature / top-p sampling (seeded by `seed`, an int64, else by the request id; top_p
  keeps the likeliest token at least). Stops at an EOS
  token, a `stop` string or `max_tokens` (capped by `live.max_new_tokens` and the context).
- Capture: the request id (`X-Request-Id`, else a fresh one) decides through
  `sink.wants(request_id)`; a captured request's forwards keep their aux-layer outputs (and
  the final norm's output when the handshake asks for it), one row per fed token, prefill
  and decode alike; after the response is complete the rows go to `sink.submit` (a bounded,
  non-blocking enqueue). Nothing of the capture can fail or slow a request beyond that.
- Answers: 200, 400 (an OpenAI error naming the field: a request that cannot be generated is
  refused before it joins a wave, where its failure would fail the others' requests too), 503
  (overloaded). A 500 is a bug (`tests/test_live_fuzz.py` fuzzes every route for one).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import Counter
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from specbus.core.prometheus import Metrics
from specbus.producers.live.generate import Generator, Job

log = logging.getLogger("specbus.serve")


# ---------------------------------------------------------------- OpenAI-compatible HTTP
class BadRequest(Exception):
    """A request the server answers with a 400 and this message."""

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
    """The HTTP side: requests -> jobs -> OpenAI responses. `metrics`: the process's registry
    (`core.prometheus.Metrics`; a new one by default) that `/metrics` serves."""

    def __init__(self, generator: Generator, model_name: str, metrics: Metrics | None = None):
        self.gen, self.model_name = generator, model_name
        self.tokenizer = generator.tokenizer
        self.requests: Counter = Counter()  # (route, status)
        self.metrics = metrics or Metrics()
        self._register(self.metrics)
        self.template = None
        if self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None):
            from specbus.core.data.templates import detect_template

            self.template = detect_template(self.tokenizer)

    def chat_prompt(self, body: dict) -> list[int]:
        """A chat request's prompt: `messages` through the chat template, generation prompt
        added. Raises `BadRequest`."""
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
                texts = [p.get("text", "") for p in content if isinstance(p, dict)]
                content = "".join(texts) if all(isinstance(t, str) for t in texts) else None
            if not isinstance(content, str):
                raise BadRequest("message content must be a string or text parts")
            turns.append({"role": m["role"], "content": content})
        if self.template is None:
            raise BadRequest("this target has no chat template: use /v1/completions")
        from jinja2 import TemplateError

        try:
            return prompt_ids({"messages": turns}, self.tokenizer, self.template).tolist()
        except (TemplateError, ValueError) as e:  # no user turn; a template's raise_exception
            raise BadRequest(f"the chat template refused the messages: {e}") from None

    def text_prompt(self, body: dict) -> list[int]:
        """A completion request's prompt: a string, a list of one string, or token ids.
        Raises `BadRequest`."""
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
        """The generation job of a request: sampling settings checked, `max_tokens` capped by
        `live.max_new_tokens` and the context. Raises `BadRequest`."""
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
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                                 or not -(2**63) <= seed < 2**63):  # fmt: skip
            raise BadRequest("seed must be an integer in [-2^63, 2^63)")
        return Job(
            request_id=request_id, prompt_ids=prompt, max_tokens=max_tokens,
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
            seed=seed,
            stop=_stop_list(body.get("stop")),
        )  # fmt: skip

    def text_of(self, ids: list[int]) -> str:
        """Generated ids as text (EOS and special tokens dropped)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([t for t in ids if t not in self.gen.eos],
                                     skip_special_tokens=True)  # fmt: skip

    def _register(self, m: Metrics) -> None:
        """The server's series, read at scrape time from its own counters."""
        m.read("specbus_serve_requests", "requests by route and status",
               lambda: {(r, str(s)): n for (r, s), n in list(self.requests.items())},
               kind="counter", labels=("route", "status"))  # fmt: skip
        m.read("specbus_serve_generated_tokens", "completion tokens generated",
               lambda: self.gen.stats["tokens"], kind="counter")  # fmt: skip
        m.read("specbus_serve_queue", "requests waiting for the worker", self.gen.jobs.qsize)
        if self.gen.sink is not None:
            sink = self.gen.sink
            m.read("specbus_capture", "capture outcomes",
                   lambda: {(k,): v for k, v in dict(sink.counts).items()}, kind="counter",
                   labels=("outcome",))  # fmt: skip

    def prometheus(self) -> tuple[bytes, str]:
        """`GET /metrics`: the registry's exposition (body, content type)."""
        return self.metrics.exposition()

    def spec_block(self, job: Job) -> dict | None:
        """The `specbus` object of a speculatively decoded response (None: decoded plainly)."""
        return None if job.spec is None else job.spec.as_dict(len(job.output_ids))

    def spec_state(self) -> dict:
        """`GET /v1/spec-decode`: the draft's version, the switch and the served totals."""
        slot, stats = self.gen.drafts, self.gen.spec_stats
        if slot is None:
            return {"speculative": False}
        totals = stats.snapshot() if stats is not None else {}
        return {"speculative": True, "enabled": slot.enabled, "draft_version": slot.version,
                "num_draft_tokens": self.gen.num_draft_tokens,
                "versions": {str(v): t.__dict__ for v, t in sorted(totals.items())}}  # fmt: skip


def build_app(server: Server):
    """The FastAPI app of `specbus serve` (routes in the module doc)."""
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
        answer = {"id": rid, "object": kind, "created": created, "model": server.model_name,
                  "choices": [choice],
                  "usage": {"prompt_tokens": len(job.prompt_ids),
                            "completion_tokens": len(job.output_ids),
                            "total_tokens": len(job.prompt_ids) + len(job.output_ids)}}  # fmt: skip
        if (spec := server.spec_block(job)) is not None:
            answer["specbus"] = spec
        return JSONResponse(answer, headers={"X-Request-Id": request_id})

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
        body, content_type = server.prometheus()
        return Response(body, media_type=content_type)

    @app.get("/v1/spec-decode")
    async def spec_state() -> dict:
        return server.spec_state()

    @app.post("/v1/spec-decode")
    async def spec_switch(request: Request) -> Response:
        """Operator switch: `{"enabled": false}` decodes without the draft (loopback server)."""
        slot = server.gen.drafts
        try:
            enabled = json.loads(await request.body())["enabled"]
            assert isinstance(enabled, bool) and slot is not None
        except Exception:  # noqa: BLE001
            return error("spec", 400, 'expected {"enabled": true|false} on a speculative server')
        slot.enabled = enabled
        return JSONResponse({"enabled": enabled})

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
        if finish is not None and (spec := server.spec_block(job)) is not None:
            payload["specbus"] = spec
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
