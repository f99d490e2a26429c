"""Block draft-and-verify decoding for DFlash-family drafts (DFlash, Domino, DSpark).

Shape legend: T tokens in a forward, K block size, H hidden, A aux width.

State before a round: n tokens verified, their target features injected into the draft's
context cache (positions 0..n-1), and `next_tok` (token n) chosen by the target but not yet run
through it. The draft runs the block [next_tok, MASK x (K-1)] at positions n..n+K-1 in one
forward (it sees the whole context and its own block) and drafts:
- dflash: block positions 1..K-1 through the target lm_head, one token each: K-1 tokens;
- domino: K-1 tokens from the base logits of positions 1..K-1 (0..K-2 with `shift_label`)
  plus, after the pure-draft prefix, the GRU correction, position by position (the GRU reads
  the embeddings of next_tok and the tokens drafted so far, as in training it reads the true
  ones; SGLang's `domino_greedy_rollout`);
- dspark: block positions 0..K-1 (position k predicts token n+k+1) plus the Markov bias of the
  previous token (next_tok, then the drafted ones): K tokens.
Each token is the argmax (greedy) or drawn from the draft's distribution at the request's
temperature (sampled: `core.eval.verify`). The target verifies [next_tok, d1..dk] in one
forward (`SpecSession` in `core.eval.speculative`, shared with EAGLE3 chains): greedily, the
longest prefix equal to its own greedy choices and its next token; sampled, by rejection
sampling. The target cache is cropped to the accepted prefix and the draft context grows by
the a+1 verified positions (their target features come from the verify forward). Greedy
verification makes the output the target's own greedy decoding (checked by
`measure_acceptance`).
"""

from __future__ import annotations

import torch
from specbus.core.eval.speculative import SpecResult, _device, run_session
from specbus.core.eval.verify import Sampling
from specbus.core.models.dflash import ContextCache, DFlashDraft
from torch import nn


def _lm_head(target: nn.Module) -> nn.Module:
    return target.get_output_embeddings()


class _Pick:
    """Chooses each drafted token (argmax, or a draw at the request's temperature) and keeps
    the distribution it was drawn from."""

    def __init__(self, sampling: Sampling | None):
        self.sampling = sampling
        self.q_probs: list[torch.Tensor] = []

    def __call__(self, logits_V: torch.Tensor) -> int:
        if self.sampling is None:
            return int(logits_V.argmax())
        q_V = self.sampling.draft_probs(logits_V)
        self.q_probs.append(q_V)
        return self.sampling.draw(q_V)


@torch.no_grad()
def draft_block(
    draft: DFlashDraft,
    target: nn.Module,
    cache: ContextCache,
    next_tok: int,
    start: int,
    sampling: Sampling | None = None,
    q_probs: list[torch.Tensor] | None = None,
) -> list[int]:
    """Draft one block after `next_tok` (at position `start`); see the module docstring. When
    sampling, the distribution of each draft is appended to `q_probs`."""
    pick = _Pick(sampling)
    drafts = _draft_block(draft, target, cache, next_tok, start, pick)
    if q_probs is not None:
        q_probs.extend(pick.q_probs)
    return drafts


def _draft_block(draft, target, cache, next_tok: int, start: int, pick: _Pick) -> list[int]:
    cfg = draft.config
    device = _device(target)
    embed = target.get_input_embeddings()
    head = _lm_head(target)
    ids = torch.full((1, cfg.block_size), cfg.mask_token_id, dtype=torch.long, device=device)
    ids[0, 0] = next_tok
    hidden = draft.block_hidden(cache, embed(ids), start)  # [1, K, H]
    w_dtype = head.weight.dtype
    if cfg.projector == "dflash":
        return [pick(row) for row in head(hidden[:, 1:].to(w_dtype))[0]]
    if cfg.projector == "domino":
        base = head(hidden.to(w_dtype))[0]  # [K, V]
        first = 0 if cfg.shift_label else 1  # the block position of the first draft
        drafts, state, prev = [], None, next_tok
        for k in range(first, first + cfg.block_size - 1):
            emb = embed(torch.tensor([[prev]], device=device)).to(draft.fc.weight.dtype)
            out, state = draft.prefix_gru(emb, state)
            logits = base[k]
            if k >= cfg.suffix_start:  # the pure-draft prefix keeps the base logits
                feat = torch.cat([hidden[:, k : k + 1], out.to(hidden.dtype)], dim=-1)
                logits = logits + draft.embed_proj(feat)[0, 0].to(base.dtype)
            prev = pick(logits)
            drafts.append(prev)
        return drafts
    base = head(hidden.to(w_dtype))[0]  # dspark: [K, V], position k -> token start+k+1
    drafts, state, prev = [], None, next_tok
    for k in range(cfg.block_size):
        logits = base[k]
        if draft.markov_head is not None:
            bias, state = draft.markov_head.step_bias(
                torch.tensor([prev], device=device), hidden[:, k], state
            )
            logits = logits + bias[0].to(logits.dtype)
        prev = pick(logits)
        drafts.append(prev)
    return drafts


class BlockDrafter:
    """Block drafting (module doc) behind the `Drafter` protocol of `SpecSession`: the draft's
    context cache over the verified positions. The target's embedding and lm_head are used."""

    def __init__(self, draft: DFlashDraft, target: nn.Module):
        self.draft, self.target = draft, target
        self.dtype = draft.fc.weight.dtype
        self.cache = ContextCache()

    def extend(self, aux_1TA: torch.Tensor, follow_T: torch.Tensor, start: int) -> None:
        """Keep context positions 0..start-1 and inject the target features of start..;
        (`follow_T`, the tokens after them, is not needed: the block embeds its own)."""
        del follow_T
        self.draft.extend_context(self.cache, aux_1TA.to(self.dtype), start=start)

    def propose(self, next_tok: int, n: int, k: int, sampling: Sampling | None):
        """One block after `next_tok` (its size fixed by the draft; the session keeps the
        first `k`) and, when sampling, the distribution of each draft."""
        if k <= 0:
            return [], []
        if sampling is None:
            return draft_block(self.draft, self.target, self.cache, next_tok, n), []
        q_probs: list[torch.Tensor] = []
        drafts = draft_block(self.draft, self.target, self.cache, next_tok, n, sampling, q_probs)
        return drafts, q_probs


@torch.no_grad()
def block_generate(
    target: nn.Module,
    draft: DFlashDraft,
    prompt_ids: torch.Tensor,
    *,
    aux_layers: list[int] | None = None,
    max_new_tokens: int = 128,
    eos_ids: tuple[int, ...] = (),
    sampling: Sampling | None = None,
    **_: object,
) -> SpecResult:
    """Decode with block drafting (module docstring), greedily or, with `sampling`, by rejection
    sampling. Batch size 1."""
    layers = list(aux_layers if aux_layers is not None else draft.config.target_layer_ids)
    return run_session(target, BlockDrafter(draft, target), prompt_ids, aux_layers=layers,
                       num_draft_tokens=draft.config.block_size, max_new_tokens=max_new_tokens,
                       eos_ids=eos_ids, sampling=sampling)  # fmt: skip
