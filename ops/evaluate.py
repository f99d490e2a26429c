"""Measured acceptance length of the untrained vs the trained draft on held-back prompts."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from specbus.core.config import RunConfig
from specbus.core.data.datasets import load_source, split_holdout
from specbus.core.data.templates import detect_template
from specbus.core.data.tokenize import prompt_ids
from specbus.core.eval.speculative import AcceptanceReport, measure_acceptance
from specbus.core.models.target import load_target_heads
from specbus.core.strategies.base import build_strategy
from specbus.ops.export import load_trained_draft
from specbus.producers.engines.registry import build_engine


def block_drafts(config) -> int:
    """Tokens a DFlash-family draft proposes per block (DSpark drafts from the anchor too)."""
    return config.block_size if config.projector == "dspark" else config.block_size - 1


@dataclass
class Comparison:
    """Measured acceptance of the untrained and the trained draft on the same held-back prompts."""

    untrained: AcceptanceReport
    trained: AcceptanceReport
    num_draft_tokens: int

    def table(self) -> str:
        """The comparison as the lines the demo prints."""
        rows = [
            f"measured acceptance length (k={self.num_draft_tokens} draft tokens, greedy, lossless-checked, "
            f"{self.trained.prompts} held-back prompts):",
            f"  untrained draft: {self.untrained.accept_length:.3f} tokens/verify "
            f"({self.untrained.mean_accepted:.3f} drafts accepted)",
            f"  trained draft:   {self.trained.accept_length:.3f} tokens/verify "
            f"({self.trained.mean_accepted:.3f} drafts accepted)",
        ]
        return "\n".join(rows)


def compare_drafts(
    cfg: RunConfig,
    *,
    num_prompts: int = 20,
    max_new_tokens: int = 64,
    num_draft_tokens: int = 3,
    checkpoint: str = "latest",
    progress=lambda message: None,
) -> Comparison:
    """Decode `num_prompts` held-back prompts with the untrained and the trained draft (real
    speculative decoding, greedy, checked lossless against the target) and measure both."""
    engine = build_engine(cfg.target)
    try:
        records = load_source(cfg.data.source)
        _, holdout = split_holdout(records, cfg.data.holdout, cfg.data.limit)
        if engine.tokenizer is None:
            prompts = [
                torch.tensor(r["input_ids"][: cfg.data.max_length // 2])
                for r in holdout[:num_prompts]
            ]
        else:
            template = detect_template(engine.tokenizer)
            prompts = [prompt_ids(r, engine.tokenizer, template) for r in holdout[:num_prompts]]
        trained = load_trained_draft(cfg, checkpoint)
        heads = load_target_heads(engine.path)
        strategy = build_strategy(
            cfg.strategy, engine.info, heads=heads, aux_layers=cfg.target.aux_layers
        )
        from specbus.core.data.vocab import VocabMapping

        torch.manual_seed(cfg.training.seed)  # the trainers' initialisation
        block = getattr(trained, "config", None) is not None and hasattr(
            trained.config, "projector"
        )
        untrained = strategy.build_model(
            engine.info,
            heads,
            None if block else VocabMapping(d2t=trained.d2t.clone(), t2d=trained.t2d.clone()),
        )
        if block:  # DFlash family: one block per verification, its size fixed by the draft
            from specbus.core.eval.block import block_generate

            num_draft_tokens = block_drafts(trained.config)
        kwargs = dict(
            generate=block_generate if block else None,
            aux_layers=strategy.aux_layers,
            num_draft_tokens=num_draft_tokens,
            max_new_tokens=max_new_tokens,
            eos_ids=tuple(engine.info.eos_token_ids),
            references={},  # the target's greedy outputs, computed once for both drafts
        )
        device, dtype = engine.device, engine.dtype
        progress(
            f"decoding {len(prompts)} held-back prompts with the untrained draft (and the target alone)"
        )
        before = measure_acceptance(
            engine.model, untrained.to(device=device, dtype=dtype).eval(), prompts, **kwargs
        )
        progress("decoding them with the trained draft")
        after = measure_acceptance(
            engine.model, trained.to(device=device, dtype=dtype).eval(), prompts, **kwargs
        )
        return Comparison(before, after, num_draft_tokens)
    finally:
        engine.close()
