"""`specbus serve --speculative` in-process: the real HTTP server and the real `openai` client.

The tiny chat target behind `Generator` with a `DraftSlot` (what `specbus serve --speculative`
builds), drafts of every strategy built by `ops.reload.DraftLoader` (the reloader's code), a
real uvicorn server on a free loopback port. Pinned: every response (chat and completions,
streamed or not) is the target's own greedy output, before and after a draft is swapped in
while requests are being decoded (the swap lands mid-request: a response names both
versions); an oracle draft (the target's continuation of known prompts, so every draft is
accepted) shows up in the served acceptance; `/metrics` parses with
`prometheus_client.parser` and has the acceptance and version series; the served
acceptance reaches TensorBoard.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
import torch
from openai import OpenAI
from specbus.core.config import TargetConfig
from specbus.core.data.vocab import VocabMapping
from specbus.core.eval.speculative import greedy_generate
from specbus.core.prometheus import Metrics
from specbus.ops.reload import DraftLoader
from specbus.producers.engines.hf import HFEngine
from specbus.producers.live.generate import Generator
from specbus.producers.live.serve import Server, build_app
from specbus.producers.live.speculative import DraftSlot, ServedDraft, SpecStats

from tests.fixtures.live import live_config, wait_until, write_chats

QUESTIONS = ["what is the sum of 12 and 30?", "add seven apples", "the sum of", "hi",
             "clips and the sum", "12 and 30 is"]  # fmt: skip


@pytest.fixture(scope="module")
def engine(chat_target):
    engine = HFEngine(TargetConfig(model=str(chat_target), dtype="float32", device="cpu"))
    yield engine
    engine.close()


def loader_of(chat_target, tmp_path, strategy: str) -> DraftLoader:
    cfg = live_config("spec", tmp_path / "run", chat_target, write_chats(tmp_path / "c.jsonl"),
                      store_uri="mem://spec", strategy=strategy)  # fmt: skip
    return DraftLoader(cfg, torch.device("cpu"), torch.float32)


def vocab_of(loader: DraftLoader) -> VocabMapping | None:
    """EAGLE3's draft vocabulary (64 of the 128 ids), as a manifest would give it."""
    return VocabMapping.from_d2t([0] * 64, 128) if loader.needs_vocab else None


class Serving:
    """A speculative `specbus serve` app on uvicorn in a thread (as `run_serve` builds it)."""

    def __init__(self, engine, slot: DraftSlot, stats: SpecStats, metrics: Metrics,
                 max_new_tokens: int = 40):  # fmt: skip
        import uvicorn
        from specbus.ops.live import bind
        from specbus.ops.services.common import free_port

        self.generator = Generator(engine, None, max_new_tokens=max_new_tokens, max_batch=4,
                                   drafts=slot, num_draft_tokens=3, spec_stats=stats)  # fmt: skip
        self.server = Server(self.generator, "tiny", metrics)
        port = free_port()
        self.uvicorn = uvicorn.Server(uvicorn.Config(build_app(self.server),
                                                     log_level="warning", lifespan="off"))  # fmt: skip
        sock = bind("127.0.0.1", port)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.uvicorn.serve(sockets=[sock])),
                                       daemon=True)  # fmt: skip
        self.thread.start()
        self.url = f"http://127.0.0.1:{port}"
        wait_until(self._up, 30, "the server")
        self.client = OpenAI(base_url=self.url + "/v1", api_key="u", max_retries=0)

    def _up(self) -> bool:
        try:
            return httpx.get(self.url + "/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        self.client.close()
        self.uvicorn.should_exit = True
        self.thread.join(10)
        self.generator.close()


def reference(engine, server: Server, question: str, max_tokens: int) -> str:
    """The target's greedy answer (`greedy_generate`, token by token), as the server's text."""
    prompt = server.chat_prompt({"messages": [{"role": "user", "content": question}]})
    out = greedy_generate(engine.model, torch.tensor(prompt), max_tokens,
                          tuple(engine.info.eos_token_ids))  # fmt: skip
    return server.text_of(out)


def ask(serving: Serving, question: str, max_tokens: int, stream: bool):
    """(text, the response's `specbus` block) of one chat request."""
    args = dict(model="tiny", messages=[{"role": "user", "content": question}],
                max_tokens=max_tokens, temperature=0)  # fmt: skip
    if not stream:
        r = serving.client.chat.completions.create(**args)
        return r.choices[0].message.content, r.model_extra["specbus"]
    text, spec = "", None
    for chunk in serving.client.chat.completions.create(**args, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        spec = (chunk.model_extra or {}).get("specbus") or spec
    return text, spec


class ReloadingSlot(DraftSlot):
    """A slot that publishes a draft itself after the worker looked at it `n` more times
    (the worker looks once per round): a reload at a known point of the decoding."""

    def publish_after(self, n: int, draft: ServedDraft, then) -> None:
        self._pending = [n, draft, then]

    def current(self):
        pending = getattr(self, "_pending", None)
        if pending is not None:
            pending[0] -= 1
            if pending[0] <= 0:
                self._pending = None
                self.publish(pending[1])
                pending[2]()
        return super().current()


class OracleDraft(ServedDraft):
    """A stub draft that proposes the target's greedy continuation of known prompts (every
    draft accepted), so the served acceptance has something to show."""

    def drafter(self, target):
        return _Oracle(self.model.fulls)


class _Oracle:
    def __init__(self, fulls: list[list[int]]):
        self.fulls, self.known = fulls, []  # known: tokens 1..n of the sequence

    def extend(self, aux_1TA, follow_T, start: int) -> None:
        self.known = self.known[:start] + follow_T.tolist()

    def propose(self, next_tok: int, n: int, k: int, sampling):
        for full in self.fulls:
            if full[1 : n + 1] == self.known:
                return (full[n + 1 : n + 1 + k] + [0] * k)[:k], []
        return [0] * k, []


def oracle(engine, server: Server, version: int, max_tokens: int) -> OracleDraft:
    fulls = []
    for q in QUESTIONS:
        prompt = server.chat_prompt({"messages": [{"role": "user", "content": q}]})
        fulls.append(prompt + greedy_generate(engine.model, torch.tensor(prompt), max_tokens + 4))
    holder = torch.nn.Module()
    holder.fulls = fulls
    return OracleDraft(version, holder, block=False, aux_layers=(1, 2))


@pytest.mark.parametrize("strategy", ["eagle3", "dflash", "domino", "dspark"])
def test_speculative_outputs_are_the_targets_greedy_before_and_after_a_reload(
    engine, chat_target, tmp_path, strategy
):
    from prometheus_client.parser import text_string_to_metric_families

    loader = loader_of(chat_target, tmp_path, strategy)
    slot, metrics = ReloadingSlot(), Metrics()
    stats = SpecStats(metrics)
    slot.publish(loader.untrained(vocab_of(loader)))
    stats.serving(0)
    serving = Serving(engine, slot, stats, metrics)
    try:
        want = {q: reference(engine, serving.server, q, 40) for q in QUESTIONS}
        for i, q in enumerate(QUESTIONS[:3]):  # version 0, the untrained draft
            text, spec = ask(serving, q, 40, stream=bool(i % 2))
            assert text == want[q] and spec["draft_versions"] == [0], (q, spec)

        # a reload under traffic: three streams at once; the new draft is published by the
        # slot itself at the worker's 6th look after this point (a reloader publishing
        # mid-request, at a known round), so it lands inside a request being decoded
        torch.manual_seed(7)
        newer = ServedDraft(2, loader.untrained(vocab_of(loader)).model, loader.block,
                            tuple(loader.strategy.aux_layers))  # fmt: skip
        slot.publish_after(6, newer, lambda: stats.serving(2))
        results: dict[str, tuple] = {}

        def streamed(q: str) -> None:
            results[q] = ask(serving, q, 40, stream=True)

        threads = [threading.Thread(target=streamed, args=(q,)) for q in QUESTIONS[:3]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert set(results) == set(QUESTIONS[:3])
        for q, (text, _) in results.items():
            assert text == want[q], (q, text, want[q])
        swapped = [s["draft_versions"] for _, s in results.values()]
        assert [0, 2] in swapped, f"the swap did not land mid-request: {swapped}"
        for i, q in enumerate(QUESTIONS[3:]):  # version 2 alone
            text, spec = ask(serving, q, 40, stream=bool(i % 2))
            assert text == want[q] and spec["draft_versions"] == [2]

        families = {f.name: f for f in text_string_to_metric_families(
            httpx.get(serving.url + "/metrics").text)}  # fmt: skip
        version = families["specbus_serve_draft_version"].samples[0].value
        assert version == 2
        served = {s.labels["draft_version"]: s.value
                  for s in families["specbus_serve_spec_accept_length"].samples}  # fmt: skip
        assert set(served) == {"0", "2"} and all(v >= 1.0 for v in served.values())
        verifies = {s.labels["draft_version"]: s.value
                    for s in families["specbus_serve_spec_verifies"].samples
                    if s.name.endswith("_total")}  # fmt: skip
        assert verifies["0"] > 0 and verifies["2"] > 0
        requests = {(s.labels["route"], s.labels["status"]): s.value
                    for s in families["specbus_serve_requests"].samples}  # fmt: skip
        assert requests == {("chat", "200"): len(QUESTIONS) + 3}
        swaps = families["specbus_serve_draft_swap_seconds"].samples
        assert any(s.name.endswith("_count") and s.value >= 1 for s in swaps)  # mid-request
        hist = families["specbus_serve_request_accept_length"]
        assert any(s.name.endswith("_count") and s.value == len(QUESTIONS) + 3
                   for s in hist.samples)  # fmt: skip
    finally:
        serving.close()


def test_an_accepting_draft_shows_in_the_served_acceptance_and_tensorboard(
    engine, chat_target, tmp_path
):
    """An oracle (version 5) has every draft accepted: 3 drafts a round give ~4 tokens per
    verify (the last rounds draft fewer: max_tokens), the output is still the greedy one, and
    the figures reach `/metrics`, the response, `/v1/spec-decode` and TensorBoard."""
    from specbus.core.tensorboard import ScalarWriter
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    loader = loader_of(chat_target, tmp_path, "eagle3")
    writer = ScalarWriter(tmp_path / "tb")
    slot, metrics = DraftSlot(), Metrics()
    stats = SpecStats(metrics, on_request=lambda r: writer.write(r, flush=False),
                      on_version=writer.write)  # fmt: skip
    slot.publish(loader.untrained(vocab_of(loader)))
    stats.serving(0)
    serving = Serving(engine, slot, stats, metrics)
    try:
        want = {q: reference(engine, serving.server, q, 24) for q in QUESTIONS}
        ask(serving, QUESTIONS[0], 24, stream=False)
        slot.publish(oracle(engine, serving.server, 5, 24))
        stats.serving(5)
        for i, q in enumerate(QUESTIONS):
            text, spec = ask(serving, q, 24, stream=bool(i % 2))
            assert text == want[q]
            assert spec["draft_version"] == 5 and spec["accepted_tokens"] > 0
        state = httpx.get(serving.url + "/v1/spec-decode").json()
        five = state["versions"]["5"]
        assert state["draft_version"] == 5 and five["requests"] == len(QUESTIONS)
        assert five["accepted"] == five["tokens"] - five["verifies"]  # every draft, plus one
        assert five["tokens"] / five["verifies"] >= 3.0, five
        from specbus.ops.served import scrape  # what `specbus top` and the demo read

        served = scrape(serving.url)
        assert served.version == 5 and served.reloads == {"loaded": 0, "refused": 0}
        assert served.versions[5]["accept_length"] == pytest.approx(
            five["tokens"] / five["verifies"]
        )
        assert served.versions[5]["requests"] == len(QUESTIONS) and served.requests == 7
        assert f"draft v5 | {served.versions[5]['accept_length']:.2f} tok/verify" in served.line()
        # the operator switch: without the draft the same answers, no `specbus` block
        assert httpx.post(serving.url + "/v1/spec-decode", json={"enabled": False}).json() == {
            "enabled": False}  # fmt: skip
        r = serving.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=24,
            temperature=0)  # fmt: skip
        assert r.choices[0].message.content == want[QUESTIONS[0]]
        assert (r.model_extra or {}).get("specbus") is None
        slot.enabled = True
        stats.serving(6)  # version 5 is superseded: its totals go to TensorBoard
    finally:
        serving.close()
        writer.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"served/request_accept_length", "served/request_tokens_per_s",
            "served/accept_length_by_version", "served/draft_version"} <= tags  # fmt: skip
    (by_version,) = [e for e in acc.Scalars("served/accept_length_by_version") if e.step == 5]
    assert by_version.value >= 3.0


@pytest.mark.parametrize("strategy", ["eagle3", "dspark"])
def test_speculative_captures_equal_the_driven_engines_features(engine, chat_target, tmp_path,
                                                                strategy):  # fmt: skip
    """A captured request's rows are the target's over `prompt + output[:-1]` whatever the
    rounds accepted (an oracle draft: several tokens a round; a random one: mostly one), and
    the capture names the draft version that served it."""
    from specbus.core.models.target import load_target_info
    from specbus.core.strategies.base import build_strategy
    from specbus.producers.live.generate import Job
    from specbus.producers.live.manifest import capture_config

    from tests.test_live_serve import RecordingSink, run_jobs

    loader = loader_of(chat_target, tmp_path, strategy)
    cfg = live_config("spec", tmp_path / "run", chat_target, tmp_path / "none.jsonl",
                      store_uri="mem://x", strategy=strategy)  # fmt: skip
    info = load_target_info(chat_target)
    contract = build_strategy(cfg.strategy, info).feature_contract(info)
    cap = capture_config(cfg, contract, store_uri="mem://x", store_id="x", float_dtype="float32",
                         target_fingerprint="t", tokenizer_fingerprint="k")  # fmt: skip
    sink = RecordingSink(cap)
    slot = DraftSlot()
    generator = Generator(engine, sink, max_new_tokens=16, max_batch=4, start=False, drafts=slot,
                          num_draft_tokens=3)  # fmt: skip
    server = Server(generator, "tiny")
    if strategy == "eagle3":
        slot.publish(oracle(engine, server, 9, 16))
    else:
        slot.publish(ServedDraft(9, loader.untrained(None).model, True,
                                 tuple(loader.strategy.aux_layers)))  # fmt: skip
    prompts = [server.chat_prompt({"messages": [{"role": "user", "content": q}]})
               for q in QUESTIONS[:3]]  # fmt: skip
    jobs = [Job(request_id=f"s{i}", prompt_ids=p, max_tokens=10 + i, temperature=0)
            for i, p in enumerate(prompts)]  # fmt: skip
    try:
        run_jobs(generator, jobs, start=True)
    finally:
        generator.close()
    by_id = {c.request_id: c for c in sink.handed}
    compared = 0
    for job in jobs:
        c = by_id[job.request_id]
        assert c.draft_version == 9 and job.spec.versions == [9]
        if strategy == "eagle3":
            assert job.spec.accepted > 0  # rounds of several tokens
        tensors = sink.tensors(c, cap)
        if tensors is None:
            continue
        seq = c.prompt_ids + c.output_ids[:-1]
        assert tensors["input_ids"].tolist() == seq
        (ref,) = engine.capture([torch.tensor(seq)], None, contract)
        for name in [n for n in contract.names if n not in ("input_ids", "loss_mask")]:
            torch.testing.assert_close(tensors[name], ref[name], atol=2e-4, rtol=1e-3)
        compared += 1
    assert compared >= 2


def test_sampled_serving_keeps_the_targets_distribution(engine, chat_target, tmp_path):
    """Sampled requests (temperature 0.9, top-p 0.95, a seed each) decoded speculatively by the
    server's worker with an untrained EAGLE3 draft (its proposals far from the target's, so
    the rejection path runs): every generated token's randomised PIT under the target's own
    sampling distribution is uniform (chi-square, fixed seeds: deterministic)."""
    from specbus.core.eval.verify import warp
    from specbus.producers.live.generate import Job

    from tests.test_live_serve import run_jobs
    from tests.test_spec_sampling import chi_square_p

    loader = loader_of(chat_target, tmp_path, "eagle3")
    slot, stats = DraftSlot(), SpecStats()
    slot.publish(loader.untrained(vocab_of(loader)))
    generator = Generator(engine, None, max_new_tokens=12, max_batch=4, start=False,
                          drafts=slot, num_draft_tokens=3, spec_stats=stats)  # fmt: skip
    tok = engine.tokenizer
    prompts = [tok.encode(q) for q in QUESTIONS]
    jobs = [Job(request_id=f"t{i}", prompt_ids=prompts[i % len(prompts)], max_tokens=12,
                temperature=0.9, top_p=0.95, seed=i) for i in range(96)]  # fmt: skip
    try:
        run_jobs(generator, jobs, start=True)
    finally:
        generator.close()
    gen = torch.Generator().manual_seed(0)
    u = []
    with torch.no_grad():
        for job in jobs:
            seq = job.prompt_ids + job.output_ids
            logits = engine.model(input_ids=torch.tensor([seq])).logits[0]
            for i, x in enumerate(job.output_ids):
                p = warp(logits[len(job.prompt_ids) - 1 + i], 0.9, 0.95).double()
                u.append(float(p[:x].sum()) + float(torch.rand(1, generator=gen)) * float(p[x]))
    assert all(j.spec is not None for j in jobs) and sum(j.spec.verifies for j in jobs) > 500
    assert len(u) > 800
    counts = torch.histc(torch.tensor(u), bins=10, min=0.0, max=1.0)
    assert chi_square_p(counts, torch.full((10,), 0.1)) > 1e-3, counts.tolist()


class BrokenDraft(ServedDraft):
    """A draft that cannot take over a request (its context rebuild raises)."""

    def drafter(self, target):
        class Refuses:
            def extend(self, *args):
                raise RuntimeError("out of memory (a stand-in)")

        return Refuses()


def test_a_draft_that_cannot_take_over_leaves_requests_on_theirs(engine, chat_target, tmp_path,
                                                                 caplog):  # fmt: skip
    """A new draft whose hand-over fails mid-request (say, out of memory) fails no request:
    each goes on with the draft it had, the output is still the greedy one."""
    from specbus.producers.live.generate import Job

    from tests.test_live_serve import run_jobs

    loader = loader_of(chat_target, tmp_path, "dflash")
    slot = ReloadingSlot()
    slot.publish(loader.untrained(None))
    slot.publish_after(4, BrokenDraft(3, torch.nn.Module(), True, (1,)), lambda: None)
    generator = Generator(engine, None, max_new_tokens=20, max_batch=4, start=False, drafts=slot)
    server = Server(generator, "tiny")
    jobs = [Job(request_id=f"b{i}", prompt_ids=server.chat_prompt(
                {"messages": [{"role": "user", "content": q}]}), max_tokens=20, temperature=0)
            for i, q in enumerate(QUESTIONS[:3])]  # fmt: skip
    try:
        run_jobs(generator, jobs, start=True)
    finally:
        generator.close()
    for job, q in zip(jobs, QUESTIONS, strict=False):
        assert job.finish_reason != "error" and server.text_of(job.output_ids) == reference(
            engine, server, q, 20)  # fmt: skip
        assert job.spec.versions == [0]
    assert "handing them to version 3 failed" in caplog.text


@pytest.mark.parametrize("speculative", [False, True])
def test_a_short_answer_is_settled_before_its_waves_longest_ends(engine, chat_target, tmp_path,
                                                                  speculative):  # fmt: skip
    """A request is answered ("done") and captured as soon as its own decoding ends, not when
    the longest request of its wave does (it used to wait for the whole wave: a 2-token
    answer waited for a 256-token one, and so did its capture)."""
    from specbus.producers.live.generate import Job

    from tests.test_live_serve import RecordingSink

    slot = DraftSlot() if speculative else None
    generator = Generator(engine, RecordingSink(None), max_new_tokens=40, max_batch=4,
                          start=False, drafts=slot, num_draft_tokens=3)  # fmt: skip
    server = Server(generator, "tiny")
    if speculative:
        loader = loader_of(chat_target, tmp_path, "eagle3")
        slot.publish(ServedDraft(1, loader.untrained(vocab_of(loader)).model, False,
                                 tuple(loader.strategy.aux_layers)))  # fmt: skip
    prompt = server.chat_prompt({"messages": [{"role": "user", "content": QUESTIONS[0]}]})
    longest = len(greedy_generate(engine.model, torch.tensor(prompt), 40, ()))
    assert longest >= 10  # the tiny target's greedy answer is long enough to outlast the short one
    seen: list[tuple[str, str]] = []  # (request, event kind) in the order the worker sent them
    emit = generator._emit

    def recording(job, event):
        seen.append((job.request_id, event[0]))
        emit(job, event)

    generator._emit = recording
    short = Job(request_id="short", prompt_ids=prompt, max_tokens=2, temperature=0)
    long = Job(request_id="long", prompt_ids=prompt, max_tokens=40, temperature=0)
    try:
        from tests.test_live_serve import run_jobs

        run_jobs(generator, [short, long], start=True)
    finally:
        generator.close()
    assert generator.stats["waves"] == 1 and len(long.output_ids) >= 10
    last_long_token = max(i for i, e in enumerate(seen) if e == ("long", "token"))
    assert seen.index(("short", "done")) < last_long_token
    assert seen[-1] == ("long", "done") and seen.count(("short", "done")) == 1


@pytest.mark.parametrize("wave", ["speculative", "plain", "plain-then-draft"])
def test_requests_queued_during_a_wave_join_it_and_decode_as_alone(engine, chat_target,
                                                                    tmp_path, wave):  # fmt: skip
    """Continuous batching: two requests queued while a wave runs join it after the round
    (speculative) or step (plain: no draft published) they came in (`SpecBatch.admit`: one
    wave in all), each answered with the target's own greedy output, and a capture for each.
    A plain wave admits nobody once a draft is published ("plain-then-draft": the draft comes
    with the late requests): they wait for the next wave, which the draft serves."""
    from specbus.producers.live.generate import Job
    from specbus.producers.live.manifest import capture_config

    from tests.test_live_serve import RecordingSink

    loader = loader_of(chat_target, tmp_path, "eagle3")
    cfg = live_config("spec", tmp_path / "run", chat_target, tmp_path / "none.jsonl",
                      store_uri="mem://x", strategy="eagle3")  # fmt: skip
    from specbus.core.models.target import load_target_info
    from specbus.core.strategies.base import build_strategy

    info = load_target_info(chat_target)
    contract = build_strategy(cfg.strategy, info).feature_contract(info)
    cap = capture_config(cfg, contract, store_uri="mem://x", store_id="x", float_dtype="float32",
                         target_fingerprint="t", tokenizer_fingerprint="k")  # fmt: skip
    sink, slot = RecordingSink(cap), DraftSlot()
    generator = Generator(engine, sink, max_new_tokens=40, max_batch=4, start=False, drafts=slot,
                          num_draft_tokens=3)  # fmt: skip
    server = Server(generator, "tiny")
    draft = ServedDraft(1, loader.untrained(vocab_of(loader)).model, False,
                        tuple(loader.strategy.aux_layers))  # fmt: skip
    if wave == "speculative":
        slot.publish(draft)
    prompts = [server.chat_prompt({"messages": [{"role": "user", "content": q}]})
               for q in QUESTIONS[:3]]  # fmt: skip
    first = Job(request_id="first", prompt_ids=prompts[0], max_tokens=40, temperature=0)
    late = [Job(request_id=f"late{i}", prompt_ids=p, max_tokens=12, temperature=0)
            for i, p in enumerate(prompts[1:])]  # fmt: skip
    emit, queued = generator._emit, []

    def on_event(job, event):  # the worker's thread: queue the late ones at the 3rd token
        emit(job, event)
        if job is first and len(first.output_ids) == 3 and not queued:
            queued.append(True)
            if wave == "plain-then-draft":
                slot.publish(draft)
            for j in late:
                generator.jobs.put_nowait(j)

    generator._emit = on_event

    async def go():
        for j in late:  # what submit() sets, without queueing them yet
            j.loop, j.events = asyncio.get_running_loop(), asyncio.Queue()
        assert generator.submit(first)
        generator.start()
        for j in [first, *late]:
            while (await j.events.get())[0] != "done":
                pass

    try:
        asyncio.run(go())
    finally:
        generator.close()
    waves = 2 if wave == "plain-then-draft" else 1
    assert queued and generator.stats["waves"] == waves and generator.stats["requests"] == 3
    for job, prompt in zip([first, *late], prompts, strict=True):
        want = greedy_generate(engine.model, torch.tensor(prompt), job.max_tokens,
                               tuple(engine.info.eos_token_ids))  # fmt: skip
        assert job.output_ids == want
        if wave == "speculative" or (wave == "plain-then-draft" and job is not first):
            assert job.spec.versions == [1]
        else:
            assert job.spec is None
    assert len(first.output_ids) >= 10  # it was still decoding when the others joined
    assert {c.request_id for c in sink.handed} == {"first", "late0", "late1"}
