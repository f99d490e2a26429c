"""A short real run: train an EAGLE3 draft for SmolLM2-135M-Instruct on GSM8K, on CPU.

64 GSM8K conversations (128 tokens max) are captured once and trained for 3 epochs
(batch 4, TTT length 2); then the untrained draft (same init) and the trained one decode six
held-back questions with 3 draft tokens per round, both checked lossless against the target's
greedy output. The trained draft must have more of its tokens accepted.
"""

import pytest
import torch
from specbus.core.config import build_config
from specbus.core.data.templates import detect_template
from specbus.core.data.tokenize import prompt_ids
from specbus.core.eval.speculative import measure_acceptance
from specbus.ops.bench.local_loop import train_local
from specbus.producers.engines.hf import HFEngine

pytestmark = pytest.mark.slow


def test_training_on_gsm8k_raises_the_measured_acceptance_length():
    cfg = build_config(
        {},
        [
            "data.source=gsm8k",
            "data.limit=64",
            "data.max_length=128",
            "data.holdout=50",
            "data.epochs=3",
            "strategy.ttt_length=2",
            "strategy.draft.draft_vocab_size=2048",
            "training.lr=3e-3",
            "training.micro_batch=4",
            "training.warmup_ratio=0.05",
        ],
    )
    engine = HFEngine(cfg.target)
    run = train_local(cfg, engine, cache_features=True)
    assert run.samples > 50  # questions longer than 128 tokens leave no answer to supervise
    assert run.steps == -(-3 * run.samples // 4)
    first = sum(r["loss"] for r in run.history[:8]) / 8
    last = sum(r["loss"] for r in run.history[-8:]) / 8
    assert last < first

    torch.manual_seed(cfg.training.seed)  # the init train_local started from
    untrained = run.strategy.build_model(engine.info, run.strategy.heads, run.vocab).eval()
    template = detect_template(engine.tokenizer)
    prompts = [prompt_ids(r, engine.tokenizer, template) for r in run.held_out[:6]]
    references: dict = {}
    kw = dict(
        aux_layers=run.strategy.aux_layers,
        num_draft_tokens=3,
        max_new_tokens=32,
        eos_ids=engine.info.eos_token_ids,
        references=references,
    )
    before = measure_acceptance(engine.model, untrained, prompts, **kw)
    after = measure_acceptance(engine.model, run.draft.eval(), prompts, **kw)
    print(
        f"accept length untrained {before.accept_length:.3f} -> trained {after.accept_length:.3f}"
    )
    assert before.lossless and after.lossless
    assert after.accept_length > before.accept_length + 0.05
