"""Block draft-and-verify decoding for DFlash-family drafts (DFlash, Domino, DSpark), greedy.

Shape legend: T tokens in a forward, K block size, H hidden, A aux width.

State before a round: n tokens verified, their target features injected into the draft's
context cache (positions 0..n-1), and `next_tok` (token n) chosen by the target but not yet run
through it. The draft runs the block [next_tok, MASK x (K-1)] at positions n..n+K-1 in one
forward (it sees the whole context and its own block) and drafts:
- dflash: block positions 1..K-1 through the target lm_head, argmax each: K-1 tokens;
- domino: K-1 tokens from the base logits of positions 1..K-1 (0..K-2 with `shift_label`)
  plus, after the pure-draft prefix, the GRU correction, position by position (the GRU reads
  the embeddings of next_tok and the tokens drafted so far, as in training it reads the true
  ones; SGLang's `domino_greedy_rollout`);
- dspark: block positions 0..K-1 (position k predicts token n+k+1) plus the Markov bias of the
  previous token (next_tok, then the drafted ones): K tokens.
The target verifies [next_tok, d1..dk] in one forward; `a` = the longest prefix of drafts
equal to its greedy choices; the round emits d1..da and the target's own next token. The
target cache is cropped to the accepted prefix and the draft context grows by the a+1
verified positions (their target features come from the verify forward). Greedy verification
makes the output the target's own greedy decoding (checked by `measure_acceptance`).
"""

from __future__ import annotations

import torch
from specbus.core.eval.speculative import SpecResult, _crop, _device, _finish, _forward, _new_cache
from specbus.core.models.dflash import ContextCache, DFlashDraft
from specbus.core.models.target import AuxCapture
from torch import nn


def _lm_head(target: nn.Module) -> nn.Module:
    return target.get_output_embeddings()


@torch.no_grad()
def draft_block(
    draft: DFlashDraft, target: nn.Module, cache: ContextCache, next_tok: int, start: int
) -> list[int]:
    """Draft one block after `next_tok` (at position `start`); see the module docstring."""
    cfg = draft.config
    device = _device(target)
    embed = target.get_input_embeddings()
    head = _lm_head(target)
    ids = torch.full((1, cfg.block_size), cfg.mask_token_id, dtype=torch.long, device=device)
    ids[0, 0] = next_tok
    hidden = draft.block_hidden(cache, embed(ids), start)  # [1, K, H]
    w_dtype = head.weight.dtype
    if cfg.projector == "dflash":
        return head(hidden[:, 1:].to(w_dtype))[0].argmax(-1).tolist()
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
            prev = int(logits.argmax())
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
        prev = int(logits.argmax())
        drafts.append(prev)
    return drafts


@torch.no_grad()
def block_generate(
    target: nn.Module,
    draft: DFlashDraft,
    prompt_ids: torch.Tensor,
    *,
    aux_layers: list[int] | None = None,
    max_new_tokens: int = 128,
    eos_ids: tuple[int, ...] = (),
    **_: object,
) -> SpecResult:
    """Decode greedily with block drafting (module docstring). Batch size 1."""
    device, eos = _device(target), set(eos_ids)
    layers = list(aux_layers if aux_layers is not None else draft.config.target_layer_ids)
    dtype = draft.fc.weight.dtype
    t_cache, cache = _new_cache(), ContextCache()
    with AuxCapture(target, layers) as aux:
        logits = _forward(target, prompt_ids.to(device)[None], t_cache)
        draft.extend_context(cache, aux.concat().to(dtype), start=0)
        n = int(prompt_ids.numel())
        next_tok = int(logits[0, -1].argmax())
        result = SpecResult(tokens=[next_tok])
        while not _finish(result.tokens, max_new_tokens, eos)[1]:
            drafts = draft_block(draft, target, cache, next_tok, n)
            logits = _forward(target, torch.tensor([[next_tok, *drafts]], device=device), t_cache)
            greedy = logits[0].argmax(-1).tolist()
            a = 0
            while a < len(drafts) and drafts[a] == greedy[a]:
                a += 1
            result.accepted.append(a)
            result.tokens.extend([*drafts[:a], greedy[a]])
            _crop(t_cache, n + a + 1)
            draft.extend_context(cache, aux.concat()[:, : a + 1].to(dtype), start=n)
            n, next_tok = n + a + 1, greedy[a]
    result.tokens = _finish(result.tokens, max_new_tokens, eos)[0]
    return result
