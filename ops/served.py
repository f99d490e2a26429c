"""The served acceptance of a speculative `specbus serve`, read from its own `/metrics`.

What `specbus top`, `specbus demo --live` and the live benchmark show of a serving server:
its `/metrics` text (`producers/live/speculative.py`'s series) parsed with
`prometheus_client.parser` into a `Served` (the served draft version, reloads by outcome,
and per draft version the verifies, accepted drafts, tokens, tokens per verify and tokens
per worker second). Where the servers of a run are: `specbus serve` writes
`<run_dir>/live/servers/<host>-<pid>.json` (its URL) while it runs (`register`), which
`discover` reads.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from specbus.core.config import RunConfig

_PER_VERSION = {
    "specbus_serve_spec_verifies_total": "verifies",
    "specbus_serve_spec_accepted_tokens_total": "accepted",
    "specbus_serve_spec_tokens_total": "tokens",
    "specbus_serve_spec_seconds_total": "seconds",
    "specbus_serve_spec_requests_total": "requests",
}


@dataclass
class Served:
    """One server's served acceptance (module doc); `versions[v]` holds `verifies`,
    `accepted`, `tokens`, `seconds`, `requests` and, once it verified, `accept_length`
    (tokens per verify) and `tokens_per_s`."""

    url: str
    version: int | None = None  # the draft serving now (None: none yet)
    reloads: dict[str, int] = field(default_factory=dict)
    versions: dict[int, dict[str, float]] = field(default_factory=dict)
    requests: int = 0  # answered with 200, every route

    @property
    def latest(self) -> dict[str, float] | None:
        """The figures of the version serving now (None before it verified anything)."""
        got = self.versions.get(self.version) if self.version is not None else None
        return got if got and got.get("verifies") else None

    def line(self) -> str:
        """One line: the version serving, its tokens per verify and tokens/s, the previous
        versions' tokens per verify, reloads."""
        if self.version is None:
            return f"served     {self.url}: no draft yet ({self.requests} requests answered)"
        now = self.latest
        head = f"served     {self.url}: draft v{self.version}"
        if now is not None:
            head += (f" | {now['accept_length']:.2f} tok/verify, {now['tokens_per_s']:.1f} tok/s "
                     f"({int(now['requests'])} req)")  # fmt: skip
        before = [f"v{v} {d['accept_length']:.2f}" for v, d in sorted(self.versions.items())
                  if v != self.version and d.get("verifies")][-4:]  # fmt: skip
        if before:
            head += " | before: " + ", ".join(before)
        loaded, refused = self.reloads.get("loaded", 0), self.reloads.get("refused", 0)
        return head + f" | reloads {loaded}" + (f" ({refused} refused)" if refused else "")


def parse(url: str, text: str) -> Served:
    """A `Served` from the text of `url`'s `/metrics`."""
    from prometheus_client.parser import text_string_to_metric_families

    served = Served(url)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "specbus_serve_draft_version":
                served.version = None if s.value < 0 else int(s.value)
            elif s.name == "specbus_serve_draft_reloads_total":
                served.reloads[s.labels["outcome"]] = int(s.value)
            elif s.name in _PER_VERSION:
                row = served.versions.setdefault(int(s.labels["draft_version"]), {})
                row[_PER_VERSION[s.name]] = s.value
            elif s.name == "specbus_serve_requests_total" and s.labels.get("status") == "200":
                served.requests += int(s.value)
    for row in served.versions.values():
        if row.get("verifies"):
            row["accept_length"] = row.get("tokens", 0.0) / row["verifies"]
            row["tokens_per_s"] = row.get("tokens", 0.0) / max(row.get("seconds", 0.0), 1e-9)
    return served


def scrape(url: str, timeout_s: float = 3.0) -> Served | None:
    """The served acceptance of the server at `url` (None: it does not answer)."""
    import httpx

    try:
        resp = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout_s)
        resp.raise_for_status()
    except httpx.HTTPError:
        return None
    return parse(url, resp.text)


def _servers_dir(cfg: RunConfig) -> Path:
    return cfg.resolved_run_dir / "live" / "servers"


def register(cfg: RunConfig, url: str) -> Path:
    """Announce a running server of the run (module doc); the file to remove at its stop."""
    path = _servers_dir(cfg) / f"{socket.gethostname()}-{os.getpid()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"url": url, "pid": os.getpid(), "host": socket.gethostname()}))
    os.replace(tmp, path)
    return path


def discover(cfg: RunConfig) -> list[str]:
    """The URLs of the run's announced servers (a killed one's file stays: its scrape fails)."""
    urls = []
    for path in sorted(_servers_dir(cfg).glob("*.json")):
        try:
            urls.append(json.loads(path.read_text())["url"])
        except (OSError, ValueError, KeyError):
            continue
    return urls


class AcceptanceLog:
    """The served acceptance over time (`specbus demo --live`, the live benchmark): `poll()`
    scrapes the server and returns the lines to print: one per draft version once it is
    superseded (its final tokens per verify), and the version serving now every call."""

    def __init__(self, url: str, started: float | None = None):
        import time

        self.url, self.started = url, time.monotonic() if started is None else started
        self.seen: dict[int, dict[str, float]] = {}
        self.reloads: dict[str, int] = {}
        self.curve: list[dict[str, float]] = []  # (t, version, accept_length, tokens/s) rows
        self._reported: set[int] = set()

    def poll(self) -> list[str]:
        """Lines for what changed since the last poll (empty when the server is not up)."""
        import time

        served = scrape(self.url)
        if served is None or served.version is None:
            return []
        t = time.monotonic() - self.started
        lines = []
        for v, row in sorted(served.versions.items()):
            if v != served.version and v not in self._reported and row.get("verifies"):
                self._reported.add(v)
                lines.append(f"  [{t:6.0f}s] draft v{v}: {row['accept_length']:.3f} tokens/verify "
                             f"over {int(row['verifies'])} verifies, {int(row['requests'])} "
                             "requests (superseded)")  # fmt: skip
        now = served.latest
        if now is not None:
            self.curve.append({"t": round(t, 1), "version": served.version,
                               "accept_length": now["accept_length"],
                               "tokens_per_s": now["tokens_per_s"]})  # fmt: skip
            lines.append(f"  [{t:6.0f}s] serving draft v{served.version}: "
                         f"{now['accept_length']:.3f} tokens/verify, {now['tokens_per_s']:.1f} "
                         f"tok/s so far ({int(now['requests'])} requests)")  # fmt: skip
        self.seen, self.reloads = served.versions, served.reloads
        return lines


def probe(url: str, prompts: list, max_tokens: int) -> list[tuple[list, str, dict | None]]:
    """Greedy chat requests to the server: (messages, answer, its `specbus` block) each."""
    from openai import OpenAI

    client = OpenAI(base_url=url.rstrip("/") + "/v1", api_key="specbus", max_retries=0)
    out = []
    try:
        model = client.models.list().data[0].id
        for messages in prompts:
            r = client.chat.completions.create(model=model, messages=messages,
                                               max_tokens=max_tokens, temperature=0)  # fmt: skip
            out.append(
                (messages, r.choices[0].message.content, (r.model_extra or {}).get("specbus"))
            )
    finally:
        client.close()
    return out


@dataclass(frozen=True)
class Divergence:
    """Where a served answer left the target's greedy output: probe index, the first token
    (0-based, of the continuation) whose decode departs from the served text, and the
    target's top-1 minus top-2 logit there (one forward over the prompt and the tokens before
    it, the logits upcast to fp32). In bf16 a margin within a few logit ulps (~0.06-0.25 at
    the usual magnitudes) is a near-tie that a verify forward and a one-token forward can
    round apart; a large margin is a bug."""

    probe: int
    token: int
    margin: float


def first_divergence(decode, tokens: list[int], text: str) -> int:
    """The first index j of `tokens` whose decoded prefix `decode(tokens[:j+1])` is no longer
    a prefix of `text` (len(tokens) when every prefix is, i.e. `text` only runs longer)."""
    for j in range(len(tokens)):
        if not text.startswith(decode(tokens[: j + 1])):
            return j
    return len(tokens)


def lossless_check(cfg: RunConfig, answers: list[tuple[list, str, dict | None]],
                   max_tokens: int) -> tuple[list[Divergence], str]:  # fmt: skip
    """The answers (from `probe`) that differ from the target's own greedy output (decoded
    here token by token, `core.eval.speculative.greedy_generate`), each as a `Divergence`,
    and the target's dtype (in bf16 a verify forward and a one-token forward can round a
    near-tie apart; in fp32 the outputs must be equal)."""
    import torch
    from specbus.core.data.templates import detect_template
    from specbus.core.data.tokenize import prompt_ids
    from specbus.core.eval.speculative import greedy_generate
    from specbus.producers.engines.hf import sdpa_backends
    from specbus.producers.engines.registry import build_engine

    engine = build_engine(cfg.target)
    try:
        tok, eos = engine.tokenizer, tuple(engine.info.eos_token_ids)
        template = detect_template(tok)

        def decode(ids: list[int]) -> str:
            return tok.decode([t for t in ids if t not in eos], skip_special_tokens=True)

        differ = []
        with torch.no_grad(), sdpa_backends(device=engine.device):  # as the server decodes
            for i, (messages, text, _) in enumerate(answers):
                ids = prompt_ids({"messages": messages}, tok, template)
                tokens = greedy_generate(engine.model, ids, max_tokens, eos)
                if decode(tokens) == text:
                    continue
                j = min(first_divergence(decode, tokens, text), len(tokens) - 1)
                seq = torch.cat([ids, torch.tensor(tokens[:j], dtype=ids.dtype)])
                logits = engine.model(seq[None].to(engine.device)).logits[0, -1].float()
                top = logits.topk(2).values
                differ.append(Divergence(i, j, float(top[0] - top[1])))
        return differ, str(engine.dtype).removeprefix("torch.")
    finally:
        engine.close()
