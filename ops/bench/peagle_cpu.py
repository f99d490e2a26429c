"""P-EAGLE vs EAGLE3 on CPU with the embedded SmolLM2 target, at the same training budget.

Both drafts train single-process on the same packed GSM8K conversations (`--steps` optimizer
steps of one `--seq`-token sample, the same lr, schedule and draft vocabulary; EAGLE3 with its
TTT unroll of `--ttt`, P-EAGLE with `--depths` parallel depths and its other settings at
speculators' defaults), then the untrained (same init) and trained drafts decode the held-back
questions greedily, lossless-checked against the target: EAGLE3 by chain drafting of k tokens
(core/eval/speculative.py), P-EAGLE by parallel drafting of k tokens in one draft forward
(core/eval/peagle.py), for each k of `--k`. Writes one JSON record.

    python ops/bench/peagle_cpu.py --steps 60 --seq 256 --k 3,8 --out runs/bench/peagle_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def run_one(name: str, args, engine, packed, prompts) -> dict:
    from specbus.core.config import build_config
    from specbus.core.eval.peagle import peagle_generate
    from specbus.core.eval.speculative import measure_acceptance, speculative_generate
    from specbus.ops.bench.local_loop import train_local

    special = [f"strategy.ttt_length={args.ttt}"] if name == "eagle3" else [
        f"strategy.peagle.num_depths={args.depths}"]  # fmt: skip
    cfg = build_config({}, [
        f"strategy.name={name}", f"data.max_length={args.seq}", f"training.lr={args.lr}",
        f"strategy.draft.draft_vocab_size={args.draft_vocab}", f"training.max_steps={args.steps}",
        "training.warmup_ratio=0.02", "training.micro_batch=1", "data.epochs=1", *special,
    ])  # fmt: skip
    t0 = time.perf_counter()
    run = train_local(
        cfg, engine, records=packed[: args.steps],
        on_step=lambda r: print(f"{name} step {r['step']:4d} loss {r['loss']:.3f} acc0 "
                                f"{r['acc_0']:.3f} train {r['train_s']:.2f}s", flush=True)
        if r["step"] % 10 == 0 else None,
    )  # fmt: skip
    torch.manual_seed(cfg.training.seed)  # the init train_local started from
    untrained = run.strategy.build_model(engine.info, run.strategy.heads, run.vocab).eval()
    generate = speculative_generate if name == "eagle3" else peagle_generate
    out = {"strategy": name, "steps": run.steps, "train_tokens": run.tokens,
           "train_s_per_step": run.train_s / max(run.steps, 1),
           "final_train_acc": [round(float(run.history[-1][f"acc_{j}"]), 3) for j in range(3)],
           "by_k": {}}  # fmt: skip
    for k in args.k:
        kw = dict(aux_layers=run.strategy.aux_layers, num_draft_tokens=k, generate=generate,
                  max_new_tokens=args.max_new_tokens, eos_ids=engine.info.eos_token_ids,
                  references=args.references)  # fmt: skip
        before = measure_acceptance(engine.model, untrained, prompts, **kw)
        after = measure_acceptance(engine.model, run.draft.eval(), prompts, **kw)
        out["by_k"][k] = {"untrained": before.as_dict(), "trained": after.as_dict()}
    out["total_s"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--strategies", default="peagle,eagle3")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--depths", type=int, default=8)
    ap.add_argument("--k", default="3,8", help="draft tokens per verification round")
    ap.add_argument("--holdout", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    args.k = [int(k) for k in args.k.split(",")]
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from specbus.core.config import build_config
    from specbus.core.data.datasets import gsm8k_records, split_holdout
    from specbus.core.data.templates import detect_template
    from specbus.core.data.tokenize import prompt_ids, tokenize_record
    from specbus.ops.bench.eagle3_cpu import pack
    from specbus.producers.engines.hf import HFEngine

    engine = HFEngine(build_config({}).target)
    template = detect_template(engine.tokenizer)
    train, held = split_holdout(gsm8k_records(), args.holdout)
    packed = pack(train, engine.tokenizer, template, args.seq, tokenize_record)
    prompts = [prompt_ids(r, engine.tokenizer, template) for r in held]
    args.references = {}  # the target's greedy outputs, shared by every draft
    results = []
    for name in args.strategies.split(","):
        results.append(run_one(name, args, engine, packed, prompts))
        print(json.dumps(results[-1], indent=2), flush=True)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
