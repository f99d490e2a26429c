"""What one `specbus serve --speculative` worker serves: a wave of `--wave` requests, in-process.

The server's own worker (`Generator` on the hf engine, `--target` SmolLM2-135M-Instruct by
default) decodes waves of GSM8K chat prompts (greedy, `--max-tokens` each, every request
captured by a sink that keeps the rows in memory, as the intake's sink would hand them on):
plain decoding (no draft), then speculative with the run's untrained EAGLE3 draft (k =
`--draft-tokens`; nothing is accepted, so the figure is the cost of a round, not a draft's
gain), then with an oracle drafter that proposes the target's own continuation (every draft
accepted: the most a round can emit). Reported per arm: served tokens/s, requests (=
captures)/s, latency p50 (submitted -> done), tokens per verify, waves. `--arrival-rate`
submits a wave's requests over time (Poisson) instead of at once and `--mixed-lengths` varies
their `max_tokens` (the same draws in every arm): what continuous batching is for. Runs
against whichever `specbus` is importable, so the same file measures two checkouts (before /
after a change):

    python ops/bench/spec_wave.py --wave 8 --max-tokens 32 --repeats 2 --out runs/bench/wave.json
    python ops/bench/spec_wave.py --arms plain --wave 16 --max-tokens 48 --mixed-lengths \
        --arrival-rate 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import torch


class _Sink:
    """Captures everything, keeps the rows (what a real sink hands to the store)."""

    def __init__(self, config):
        self.config, self.handed = config, []

    def wants(self, request_id: str):
        return request_id

    def submit(self, capture) -> None:
        self.handed.append(capture)


def _run(generator, jobs, gaps: list[float]) -> list[float]:
    """Submit `jobs`, job i `gaps[i]` s after job i-1 (all at once: zeros); each job's
    latency (submitted -> done), in job order."""

    async def one(job, submitted: float) -> float:
        while (await job.events.get())[0] != "done":
            pass
        return time.perf_counter() - submitted

    async def go():
        waits = []
        for job, gap in zip(jobs, gaps, strict=True):
            if gap:
                await asyncio.sleep(gap)
            assert generator.submit(job)
            waits.append(asyncio.create_task(one(job, time.perf_counter())))
        return list(await asyncio.gather(*waits))

    return asyncio.run(go())


def main(argv=None) -> int:
    """The benchmark (module doc)."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--wave", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--draft-tokens", type=int, default=3)
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=8192,
        help="the draft's vocabulary "
        "(at most the target's: 64 for ops/bench/tiny_chat.py's target)",
    )
    p.add_argument("--repeats", type=int, default=2, help="waves per arm (after one warm-up)")
    p.add_argument("--arms", default="plain,untrained,oracle")
    p.add_argument(
        "--arrival-rate",
        type=float,
        default=0.0,
        help="requests/s, Poisson (0: a wave's requests all at once)",
    )
    p.add_argument(
        "--mixed-lengths",
        action="store_true",
        help="each request's max_tokens drawn from [max-tokens/4, max-tokens]",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from specbus.core.config import TargetConfig, build_config
    from specbus.core.data.vocab import VocabMapping
    from specbus.core.eval.speculative import greedy_generate
    from specbus.core.strategies.base import build_strategy
    from specbus.ops.reload import DraftLoader
    from specbus.ops.traffic import load_prompts
    from specbus.producers.engines.hf import HFEngine
    from specbus.producers.live.generate import Generator, Job
    from specbus.producers.live.manifest import capture_config
    from specbus.producers.live.serve import Server
    from specbus.producers.live.speculative import DraftSlot, ServedDraft, SpecStats

    torch.manual_seed(0)
    if args.device == "cpu":
        torch.set_num_threads(1)
    engine = HFEngine(TargetConfig(model=args.target, dtype=args.dtype, device=args.device))
    cfg = build_config({"target": {"model": args.target, "device": args.device},
                        "strategy": {"draft": {"draft_vocab_size": args.draft_vocab}},
                        "store": {"uri": "mem://wave"}})  # fmt: skip
    loader = DraftLoader(cfg, torch.device(args.device), getattr(torch, args.dtype))
    info = loader.info
    contract = build_strategy(cfg.strategy, info).feature_contract(info)
    cap = capture_config(cfg, contract, store_uri="mem://wave", store_id="w", float_dtype="float32",
                         target_fingerprint="t", tokenizer_fingerprint="k")  # fmt: skip
    chat = Server(Generator(engine, None, start=False), "bench")
    prompts = [chat.chat_prompt({"messages": m})
               for m in load_prompts("gsm8k", holdout=50)[: args.wave * (args.repeats + 1)]]  # fmt: skip
    eos = tuple(engine.info.eos_token_ids)
    vocab = VocabMapping.from_d2t([0] * args.draft_vocab, engine.info.vocab_size)

    class _Oracle:  # proposes the target's greedy continuation of the known prompts
        def __init__(self, fulls):
            self.fulls, self.known = fulls, []

        def extend(self, aux_1TA, follow_T, start):
            self.known = self.known[:start] + follow_T.tolist()

        def propose(self, next_tok, n, k, sampling):
            for full in self.fulls:
                if full[1 : n + 1] == self.known:
                    return (full[n + 1 : n + 1 + k] + [0] * k)[:k], []
            return [0] * k, []

    class OracleDraft(ServedDraft):
        def drafter(self, target):
            return _Oracle(self.model.fulls)

    results = {"args": vars(args)}
    for arm in args.arms.split(","):
        slot, stats = None, SpecStats()
        if arm != "plain":
            slot = DraftSlot()
            if arm == "untrained":
                slot.publish(loader.untrained(vocab))
            else:
                holder = torch.nn.Module()
                with torch.no_grad():
                    holder.fulls = [q + greedy_generate(engine.model, torch.tensor(q), args.max_tokens + 4, eos)
                                    for q in prompts]  # fmt: skip
                slot.publish(
                    OracleDraft(
                        1, holder, block=False, aux_layers=tuple(loader.strategy.aux_layers)
                    )
                )
        sink = _Sink(cap)
        gen = Generator(engine, sink, max_new_tokens=args.max_tokens, max_batch=args.wave,
                        start=False, drafts=slot, num_draft_tokens=args.draft_tokens,
                        spec_stats=stats)  # fmt: skip
        gen.start()
        waves = []
        try:
            rng = random.Random(0)  # the same lengths and arrivals in every arm
            for r in range(args.repeats + 1):
                lengths = [rng.randint(max(args.max_tokens // 4, 1), args.max_tokens)
                           if args.mixed_lengths else args.max_tokens for _ in range(args.wave)]  # fmt: skip
                gaps = [rng.expovariate(args.arrival_rate) if args.arrival_rate > 0 and i else 0.0
                        for i in range(args.wave)]  # fmt: skip
                jobs = [Job(request_id=f"{arm}{r}-{i}", prompt_ids=prompts[r * args.wave + i],
                            max_tokens=lengths[i], temperature=0) for i in range(args.wave)]  # fmt: skip
                t0 = time.perf_counter()
                latencies = _run(gen, jobs, gaps)
                secs = time.perf_counter() - t0
                if r:  # the first wave warms up
                    waves.append({"seconds": secs, "tokens": sum(len(j.output_ids) for j in jobs),
                                  "requests": len(jobs), "waves": gen.stats["waves"],
                                  "latency_p50_s": statistics.median(latencies)})  # fmt: skip
        finally:
            gen.close()
        secs = sum(w["seconds"] for w in waves)
        toks = sum(w["tokens"] for w in waves)
        snap = stats.snapshot()
        ver = sum(t.verifies for t in snap.values())
        res = {"tokens_per_s": toks / secs, "requests_per_s": sum(w["requests"] for w in waves) / secs,
               "captures": len(sink.handed), "waves": waves,
               "latency_p50_s": statistics.median(w["latency_p50_s"] for w in waves),
               "tokens_per_verify": sum(t.tokens for t in snap.values()) / ver if ver else None}  # fmt: skip
        results[arm] = res
        print(f"{arm:>9}: {res['tokens_per_s']:.1f} tokens/s, {res['requests_per_s']:.3f} "
              f"requests (captures)/s, latency p50 {res['latency_p50_s']:.2f} s, waves "
              f"{gen.stats['waves']}, tokens/verify {res['tokens_per_verify']}", flush=True)  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
