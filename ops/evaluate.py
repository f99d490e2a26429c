"""Measured acceptance length of the untrained vs the trained draft on held-back prompts.

EAGLE3 drafts are measured by replay (`core.eval.replay`): the target's greedy continuation of
every prompt is decoded once, batched, and shared by both drafts; each draft then drafts and
is verified against it exactly as in live speculative decoding. `live_check` prompts are also
decoded live with the trained draft (real draft-and-verify, lossless-checked) and their
acceptance compared with the replay's. DFlash-family drafts are decoded live (block drafting),
P-EAGLE drafts live too (parallel drafting of `num_depths` tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
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
from specbus.producers.engines.hf import sdpa_backends
from specbus.producers.engines.registry import build_engine

# phase(description, total, unit) -> a context manager yielding something with
# update(done, info=...) (ops/progress.py's `phase`)
PhaseFactory = Callable[..., AbstractContextManager]


class _Silent:
    def update(self, *args, **kwargs) -> None:
        pass


def _silent_phase(*args, **kwargs) -> AbstractContextManager:
    return nullcontext(_Silent())


def block_drafts(config) -> int:
    """Tokens a DFlash-family draft proposes per block (DSpark drafts from the anchor too)."""
    return config.block_size if config.projector == "dspark" else config.block_size - 1


@dataclass
class Comparison:
    """Measured acceptance of the untrained and the trained draft on the same held-back prompts."""

    untrained: AcceptanceReport
    trained: AcceptanceReport
    num_draft_tokens: int
    method: str = "live"  # "replay" (core.eval.replay) or "live" decoding
    live: AcceptanceReport | None = None  # the live cross-check of the trained draft
    live_replayed: AcceptanceReport | None = None  # the replay of the same prompts

    def table(self) -> str:
        """The comparison as the lines the demo prints."""
        how = "replayed against the target's greedy output" if self.method == "replay" else (
            "live decoding, lossless-checked")  # fmt: skip
        rows = [
            f"measured acceptance length (k={self.num_draft_tokens} draft tokens, greedy, {how}, "
            f"{self.trained.prompts} held-back prompts, {self.trained.tokens} tokens):",
            f"  untrained draft: {self.untrained.accept_length:.3f} tokens/verify "
            f"({self.untrained.mean_accepted:.3f} drafts accepted)",
            f"  trained draft:   {self.trained.accept_length:.3f} tokens/verify "
            f"({self.trained.mean_accepted:.3f} drafts accepted)",
        ]
        if self.live is not None and self.live_replayed is not None:
            rows.append(
                f"  live check ({self.live.prompts} prompts, real draft-and-verify, "
                f"{'lossless' if self.live.lossless else f'{self.live.mismatches} mismatches'}): "
                f"{self.live.accept_length:.3f} live vs {self.live_replayed.accept_length:.3f} "
                "replayed"
            )
        return "\n".join(rows)


def compare_drafts(
    cfg: RunConfig,
    *,
    num_prompts: int = 20,
    max_new_tokens: int = 64,
    num_draft_tokens: int = 3,
    checkpoint: str = "latest",
    live_check: int = 1,
    phase: PhaseFactory = _silent_phase,
) -> Comparison:
    """Measure the untrained and the trained draft on `num_prompts` held-back prompts (module
    doc); `phase` draws the progress of each step."""
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
        device, dtype = engine.device, engine.dtype
        untrained = untrained.to(device=device, dtype=dtype).eval()
        trained = trained.to(device=device, dtype=dtype).eval()
        eos = tuple(engine.info.eos_token_ids)
        # decoding makes a new attention shape every step: not cuDNN first (`sdpa_backends`)
        with sdpa_backends(device=device):
            if block:  # DFlash family: one block per verification, its size fixed by the draft
                return _compare_live_blocks(
                    engine, strategy, untrained, trained, prompts, max_new_tokens, eos, phase
                )
            if strategy.name == "peagle":  # parallel drafting of its num_depths tokens, live
                return _compare_live_blocks(
                    engine, strategy, untrained, trained, prompts, max_new_tokens, eos, phase
                )
            return _compare_replayed(
                engine, strategy, untrained, trained, prompts,
                num_draft_tokens, max_new_tokens, eos, live_check, phase,
            )  # fmt: skip
    finally:
        engine.close()


def _compare_replayed(engine, strategy, untrained, trained, prompts, k, max_new_tokens, eos,
                      live_check, phase) -> Comparison:  # fmt: skip
    from specbus.core.eval.replay import replay_acceptance, target_aux
    from specbus.ops.bench.regenerate import generate_batched

    target, need = engine.model, max_new_tokens + k + 1
    with phase(f"target's greedy output ({len(prompts)} prompts, batched)", need, "tokens") as p:
        # not cut at an eos: the replay's last round compares drafts past the end too
        continuations = generate_batched(
            target, prompts, max_new_tokens=need, pad_id=engine.pad_id,
            on_token=lambda i, total: p.update(i),
        )  # fmt: skip
    cases = []
    with phase("target features", len(prompts), "prompts") as p:
        for i, (prompt, cont) in enumerate(zip(prompts, continuations, strict=True)):
            seq = prompt.tolist() + cont
            cases.append((target_aux(target, torch.tensor(seq), strategy.aux_layers), seq,
                          len(prompt)))  # fmt: skip
            p.update(i + 1)
    kwargs = dict(num_draft_tokens=k, max_new_tokens=max_new_tokens, eos_ids=eos)
    reports = {}
    for name, draft in (("untrained", untrained), ("trained", trained)):
        with one_thread(), phase(f"drafting ({name})", len(cases), "prompts") as p:
            reports[name] = replay_acceptance(
                draft, cases, progress=lambda done, total, p=p: p.update(done), **kwargs
            )
            p.update(len(cases), info=f"{reports[name].accept_length:.3f} tokens/verify")
    live = live_replayed = None
    if live_check > 0:
        n = min(live_check, len(prompts))
        references = {}  # the batched decode's greedy output, cut as live decoding cuts it
        from specbus.core.eval.speculative import _finish

        for prompt, cont in zip(prompts[:n], continuations[:n], strict=True):
            references[tuple(prompt.tolist())] = _finish(cont, max_new_tokens, set(eos))[0]
        with phase("live check (trained draft)", n, "prompts") as p:
            live = measure_acceptance(
                target, trained, prompts[:n], aux_layers=strategy.aux_layers,
                references=references, strict=False, **kwargs,
            )  # fmt: skip
            p.update(n, info=f"{live.accept_length:.3f} tokens/verify")
        live_replayed = replay_acceptance(trained, cases[:n], **kwargs)
    return Comparison(reports["untrained"], reports["trained"], k, "replay", live, live_replayed)


@contextmanager
def one_thread():
    """Small matmuls (the draft's, batch 1) on one thread: on a loaded 2-core machine a
    replay round took 45 ms on one thread and 312 ms on two."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _compare_live_blocks(engine, strategy, untrained, trained, prompts, max_new_tokens, eos,
                         phase) -> Comparison:  # fmt: skip
    from specbus.core.eval.block import block_generate
    from specbus.core.eval.peagle import peagle_generate

    parallel = strategy.name == "peagle"
    k = trained.config.num_depths if parallel else block_drafts(trained.config)
    kwargs = dict(
        generate=peagle_generate if parallel else block_generate,
        aux_layers=strategy.aux_layers,
        num_draft_tokens=k,
        max_new_tokens=max_new_tokens,
        eos_ids=eos,
        references={},  # the target's greedy outputs, computed once for both drafts
    )
    reports = {}
    for name, draft in (("untrained", untrained), ("trained", trained)):
        with phase(f"decoding ({name} draft)", len(prompts), "prompts") as p:
            reports[name] = measure_acceptance(engine.model, draft, prompts, **kwargs)
            p.update(len(prompts))
    return Comparison(reports["untrained"], reports["trained"], k, "live")
