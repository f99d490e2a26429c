"""Parallel draft-and-verify decoding for P-EAGLE drafts (vLLM's `parallel_drafting`), greedy.

Shape legend: T tokens in a forward, K drafted tokens per round, H hidden, A aux width.

State before a round: n tokens verified and `next_tok` (token n) chosen by the target; the draft
holds, per layer, the keys/values of its depth-0 rows of positions 0..start-1 (row j = the
embedding of token j+1 and the aux features of position j). One draft forward runs the rows not
yet cached (positions start..n-1, the last one carrying next_tok) and K-1 mask rows (the MASK
token and `mask_hidden` at positions n..n+K-2); row n-1 drafts token n+1 and mask row n-1+d
drafts token n+1+d: K tokens at once. Attention is causal over positions, depth-0 keys inside
the sliding window (training's mask for a chain anchored at n-1). The mask rows are dropped
from the cache after the forward. The target verifies [next_tok, d1..dK] in one forward; the
longest agreeing prefix plus the target's own token is emitted, and the next round adds the
verified positions' rows (features from the verify forward). Greedy verification makes the
output the target's own greedy decoding (checked by `measure_acceptance`).
"""

from __future__ import annotations

import torch
from specbus.core.eval.speculative import SpecResult, _crop, _device, _finish, _forward, _new_cache
from specbus.core.models.peagle import PEagleDraft
from specbus.core.models.target import AuxCapture
from torch import nn


@torch.no_grad()
def draft_parallel(
    draft: PEagleDraft,
    caches: list,
    aux_1MA: torch.Tensor,
    follow_M: torch.Tensor,
    start: int,
    k: int,
) -> list[int]:
    """Add the depth-0 rows of positions start..start+M-1 (aux of j, token j+1) to `caches` and
    draft k tokens after the last one with k-1 mask rows (module doc); target token ids."""
    device = follow_M.device
    m, n = follow_M.numel(), start + follow_M.numel()
    ids = torch.cat([follow_M, torch.full((k - 1,), draft.config.mask_token_id, device=device)])
    is_mask = torch.arange(m + k - 1, device=device) >= m
    aux = torch.cat([aux_1MA, aux_1MA.new_zeros(1, k - 1, aux_1MA.shape[-1])], dim=1)
    q_pos = torch.arange(start, n + k - 1, device=device)
    k_pos = torch.arange(0, n + k - 1, device=device)
    allow = k_pos[None] <= q_pos[:, None]
    if draft.config.sliding_window is not None:
        in_window = k_pos[None] > q_pos[:, None] - draft.config.sliding_window
        allow = allow & (in_window | (k_pos >= n)[None])  # mask rows: the chain, no window
    logits = draft(ids[None], aux, is_mask, q_pos[None], allow, caches)
    for cache in caches:  # keep the depth-0 rows only
        cache[0], cache[1] = cache[0][:, :, :n], cache[1][:, :, :n]
    picked = logits[0, m - 1 :].argmax(-1)  # rows n-1, n, ..., n+k-2
    return (picked + draft.d2t[picked]).tolist()


@torch.no_grad()
def peagle_generate(
    target: nn.Module,
    draft: PEagleDraft,
    prompt_ids: torch.Tensor,
    *,
    aux_layers: list[int] | None = None,
    num_draft_tokens: int | None = None,
    max_new_tokens: int = 128,
    eos_ids: tuple[int, ...] = (),
    **_: object,
) -> SpecResult:
    """Decode greedily with parallel drafting of `num_draft_tokens` (default the draft's
    `num_depths`) per round (module doc). Batch size 1."""
    device, eos = _device(target), set(eos_ids)
    k = num_draft_tokens or draft.config.num_depths
    layers = list(aux_layers if aux_layers is not None else draft.config.aux_layers)
    dtype = draft.fc.weight.dtype
    t_cache, caches = _new_cache(), [[None, None] for _ in draft.layers]
    with AuxCapture(target, layers) as aux:
        logits = _forward(target, prompt_ids.to(device)[None], t_cache, last_only=True)
        n = int(prompt_ids.numel())
        next_tok = int(logits[0, -1].argmax())
        result = SpecResult(tokens=[next_tok])
        new_aux = aux.concat().to(dtype)
        follow = torch.cat([prompt_ids[1:].to(device), torch.tensor([next_tok], device=device)])
        start = 0
        while not _finish(result.tokens, max_new_tokens, eos)[1]:
            drafts = draft_parallel(draft, caches, new_aux, follow, start, k)
            logits = _forward(target, torch.tensor([[next_tok, *drafts]], device=device), t_cache)
            greedy = logits[0].argmax(-1).tolist()
            a = 0
            while a < len(drafts) and drafts[a] == greedy[a]:
                a += 1
            result.accepted.append(a)
            result.tokens.extend([*drafts[:a], greedy[a]])
            _crop(t_cache, n + a + 1)
            new_aux = aux.concat()[:, : a + 1].to(dtype)
            follow = torch.tensor([*drafts[:a], greedy[a]], device=device)
            start, n, next_tok = n, n + a + 1, greedy[a]
    result.tokens = _finish(result.tokens, max_new_tokens, eos)[0]
    return result
