"""EAGLE3 on CPU with the embedded SmolLM2 target: training speed and real acceptance length.

One run: GSM8K minus the last 50 questions (held back) is packed into multi-turn
conversations of exactly `--seq` tokens; a draft is trained single-process (capture with the
hf engine -> collate -> TTT loss -> AdamW step, batch 1); then the untrained draft (same
init, same vocab mapping) and the trained draft decode the 50 held-back questions with
chain drafting of k tokens and greedy verification (outputs checked equal to the target's
greedy decoding). Prints and writes one JSON record.

With `--set target.quantize=fp8` the draft trains on the FP8 target's features and is still
measured against the unquantised target (what a bf16 deployment would see):

    python ops/bench/eagle3_cpu.py --steps 60 --seq 256 --lr 2e-3 --holdout 12 \
        --max-new-tokens 32 --set target.quantize=fp8

    python ops/bench/eagle3_cpu.py --steps 120 --out runs/bench/eagle3_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--steps", type=int, default=120, help="optimizer steps (batch 1, one packed sample each)"
    )
    ap.add_argument("--seq", type=int, default=512, help="tokens per training sample")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--holdout", type=int, default=50)
    ap.add_argument("--k", type=int, default=3, help="draft tokens per verification round")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--set", action="append", default=[], help="more dotted config overrides")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from specbus.core.config import build_config
    from specbus.core.data.datasets import gsm8k_records, split_holdout
    from specbus.core.data.templates import detect_template
    from specbus.core.data.tokenize import prompt_ids, tokenize_record
    from specbus.core.eval.speculative import measure_acceptance
    from specbus.ops.bench.local_loop import train_local
    from specbus.producers.engines.hf import HFEngine

    cfg = build_config(
        {},
        [
            f"data.max_length={args.seq}",
            f"strategy.ttt_length={args.ttt}",
            f"strategy.draft.draft_vocab_size={args.draft_vocab}",
            f"training.lr={args.lr}",
            f"training.max_steps={args.steps}",
            "training.warmup_ratio=0.02",
            "training.micro_batch=1",
            "data.epochs=1",
            *args.set,
        ],
    )
    t0 = time.perf_counter()
    engine = HFEngine(cfg.target)
    load_s = time.perf_counter() - t0
    template = detect_template(engine.tokenizer)
    train, held = split_holdout(gsm8k_records(), args.holdout)
    packed = pack(train, engine.tokenizer, template, args.seq, tokenize_record)[: args.steps]

    run = train_local(
        cfg,
        engine,
        records=packed,
        on_step=lambda r: (
            print(
                f"step {r['step']:4d} loss {r['loss']:.3f} acc0 {r['acc_0']:.3f} tau {r['sim_accept_len']:.2f} "
                f"capture {r['capture_s']:.2f}s train {r['train_s']:.2f}s",
                flush=True,
            )
            if r["step"] % 10 == 0
            else None
        ),
    )

    # acceptance against the unquantised target whatever the capture ran (target.quantize)
    if cfg.target.quantize != "none":
        engine = HFEngine(cfg.target.model_copy(update={"quantize": "none"}))
    torch.manual_seed(cfg.training.seed)  # the same init train_local started from
    untrained = run.strategy.build_model(engine.info, run.strategy.heads, run.vocab).eval()
    prompts = [prompt_ids(r, engine.tokenizer, template) for r in held]
    references: dict = {}
    eval_kw = dict(
        aux_layers=run.strategy.aux_layers,
        num_draft_tokens=args.k,
        max_new_tokens=args.max_new_tokens,
        eos_ids=engine.info.eos_token_ids,
        references=references,
    )
    t1 = time.perf_counter()
    before = measure_acceptance(engine.model, untrained, prompts, **eval_kw)
    after = measure_acceptance(engine.model, run.draft.eval(), prompts, **eval_kw)
    result = {
        "target": "smollm2-135m-instruct (bf16 cache, run in fp32 on CPU)",
        "capture_quantize": cfg.target.quantize,
        "host": platform.processor() or platform.machine(),
        "torch_threads": args.threads,
        "seq": args.seq,
        "batch": 1,
        "ttt_length": args.ttt,
        "draft_vocab_size": run.vocab.draft_vocab_size,
        "steps": run.steps,
        "train_tokens": run.tokens,
        "steps_per_s": run.steps / (run.capture_s + run.train_s),
        "train_only_steps_per_s": run.steps_per_s,
        "capture_tokens_per_s": run.tokens / run.capture_s,
        "final_train_acc": [round(run.history[-1][f"acc_{k}"], 3) for k in range(args.ttt)],
        "k": args.k,
        "heldout_questions": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "untrained": before.as_dict(),
        "trained": after.as_dict(),
        "target_load_s": load_s,
        "eval_s": time.perf_counter() - t1,
        "total_s": time.perf_counter() - t0,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


def pack(records, tokenizer, template, seq, tokenize_record):
    """Concatenate consecutive Q/A records into multi-turn conversations of >= `seq` tokens."""
    packed, turns = [], []
    for record in records:
        turns.extend(record["messages"])
        sample = tokenize_record({"messages": turns}, tokenizer, template, max_length=seq)
        if len(sample) >= seq:
            packed.append({"messages": list(turns)})
            turns = []
    return packed


if __name__ == "__main__":
    main()
