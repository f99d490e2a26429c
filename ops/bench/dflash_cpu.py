"""DFlash / Domino / DSpark on CPU with the embedded SmolLM2 target: real acceptance length.

Per strategy: GSM8K minus the last `--holdout` questions is packed into multi-turn
conversations of `--seq` tokens; a draft is trained single-process for `--steps` optimizer
steps (capture with the hf engine -> collate -> the strategy's loss -> AdamW, batch 1); then
the untrained draft (same init) and the trained draft decode the held-back questions with
block draft-and-verify (greedy, outputs checked equal to the target's greedy decoding).
Prints and writes one JSON record per strategy.

    python ops/bench/dflash_cpu.py --strategies dflash,domino,dspark --steps 80 \
        --out runs/bench/dflash_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def run_one(name: str, args, engine, packed, held, template) -> dict:
    from specbus.core.config import build_config
    from specbus.core.data.tokenize import prompt_ids
    from specbus.core.eval.block import block_generate
    from specbus.core.eval.speculative import measure_acceptance
    from specbus.ops.bench.local_loop import train_local

    cfg = build_config(
        {},
        [
            f"strategy.name={name}",
            f"strategy.block_size={args.block}",
            f"strategy.num_anchors={args.anchors}",
            f"data.max_length={args.seq}",
            f"training.lr={args.lr}",
            f"training.max_steps={args.steps}",
            "training.warmup_ratio=0.02",
            "training.micro_batch=1",
            "data.epochs=1",
        ],
    )
    t0 = time.perf_counter()
    run = train_local(
        cfg,
        engine,
        records=packed[: args.steps],
        on_step=lambda r: (
            print(
                f"{name} step {r['step']:4d} loss {r['loss']:.3f} acc0 {r['acc_0']:.3f} "
                f"accept_len {r['accept_len']:.2f} capture {r['capture_s']:.2f}s train {r['train_s']:.2f}s",
                flush=True,
            )
            if r["step"] % 10 == 0
            else None
        ),
    )
    torch.manual_seed(cfg.training.seed)  # the init train_local started from
    untrained = run.strategy.build_model(engine.info, run.strategy.heads).eval()
    prompts = [prompt_ids(r, engine.tokenizer, template) for r in held]
    kw = dict(
        aux_layers=run.strategy.aux_layers,
        max_new_tokens=args.max_new_tokens,
        eos_ids=engine.info.eos_token_ids,
        references=args.references,
        generate=block_generate,
    )
    t1 = time.perf_counter()
    before = measure_acceptance(engine.model, untrained, prompts, **kw)
    after = measure_acceptance(engine.model, run.draft.eval(), prompts, **kw)
    last = run.history[-1]
    return {
        "strategy": name,
        "block_size": args.block,
        "num_anchors": args.anchors,
        "seq": args.seq,
        "steps": run.steps,
        "lr": args.lr,
        "train_tokens": run.tokens,
        "train_s": run.train_s,
        "capture_s": run.capture_s,
        "final_train_accept_len": round(float(last["accept_len"]), 3),
        "final_train_acc": [round(float(last[f"acc_{j}"]), 3) for j in range(3)],
        "heldout_questions": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "untrained": before.as_dict(),
        "trained": after.as_dict(),
        "eval_s": time.perf_counter() - t1,
        "total_s": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--strategies", default="dflash,domino,dspark")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--holdout", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from specbus.core.config import build_config
    from specbus.core.data.datasets import gsm8k_records, split_holdout
    from specbus.core.data.templates import detect_template
    from specbus.core.data.tokenize import tokenize_record
    from specbus.ops.bench.eagle3_cpu import pack
    from specbus.producers.engines.hf import HFEngine

    engine = HFEngine(build_config({}).target)
    template = detect_template(engine.tokenizer)
    train, held = split_holdout(gsm8k_records(), args.holdout)
    packed = pack(train, engine.tokenizer, template, args.seq, tokenize_record)
    args.references = {}  # the target's greedy outputs, shared by every draft
    results = []
    for name in args.strategies.split(","):
        results.append(run_one(name, args, engine, packed, held, template))
        print(json.dumps(results[-1], indent=2), flush=True)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
