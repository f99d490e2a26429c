"""Measured acceptance by replay: EAGLE3 drafting against the target's greedy continuation.

Shape legend: T tokens, A = len(aux_layers) * target hidden (aux features).

With greedy verification, speculative decoding emits exactly the target's greedy
continuation, and in each round the target's verify forward only supplies (a) its greedy
tokens after the drafted positions and (b) its aux features at the accepted positions. Both
are known in advance once the greedy continuation is: one target forward over
prompt + continuation gives the aux features of every position. `replay_generate` runs the
draft exactly as `speculative_generate` does (same KV cache, the same chain, crop and extend
per round) and reads the target's side from that forward instead of calling the target per
round. The accepted counts equal live decoding's up to floating-point rounding (a full
forward vs incremental KV-cached ones): `tests/test_eval_speculative.py` checks them equal on
a tiny model, and the demo cross-checks a few prompts with live decoding.

Cost: one batched greedy decode of the target (shared by every draft) and one target forward
per prompt, instead of a target forward per verify round per draft (on a loaded 2-core CPU,
SmolLM2-135M: ~0.27 s per round).
"""

from __future__ import annotations

import torch
from specbus.core.eval.speculative import (
    AcceptanceReport,
    SpecResult,
    _chain,
    _draft_extend,
    _finish,
)
from specbus.core.models.llama_eagle3 import DecodeCache
from specbus.core.models.target import AuxCapture
from torch import nn


@torch.no_grad()
def target_aux(target: nn.Module, seq_T: torch.Tensor, aux_layers: list[int]) -> torch.Tensor:
    """`[1, T, A]` aux features of the target over one sequence (batch 1, no cache)."""
    device = next(target.parameters()).device
    with AuxCapture(target, aux_layers) as aux:
        target(input_ids=seq_T.to(device)[None], use_cache=False, logits_to_keep=1)
        return aux.concat()


@torch.no_grad()
def replay_generate(
    draft: nn.Module,
    aux_1TA: torch.Tensor,
    seq: list[int],
    prompt_len: int,
    *,
    num_draft_tokens: int = 3,
    max_new_tokens: int = 128,
    eos_ids: tuple[int, ...] = (),
) -> SpecResult:
    """Speculative decoding of `seq[:prompt_len]` replayed against `seq[prompt_len:]`, the
    target's greedy continuation (at least `max_new_tokens + num_draft_tokens + 1` tokens, not
    cut at an end-of-sequence token: the last round compares drafts past the end too, as live
    decoding does); `aux_1TA` the target's aux features over `seq`."""
    k, n, eos = num_draft_tokens, prompt_len, set(eos_ids)
    if len(seq) < prompt_len + max_new_tokens + k + 1:
        raise ValueError(f"the continuation needs {max_new_tokens + k + 1} tokens")
    device = aux_1TA.device
    dtype = draft.fc.weight.dtype
    seq_T = torch.tensor(seq, device=device)
    cache = DecodeCache()
    result = SpecResult(tokens=[seq[n]])
    last_h = _draft_extend(draft, cache, aux_1TA[:, :n].to(dtype), seq_T[1 : n + 1], start=0)
    while not _finish(result.tokens, max_new_tokens, eos)[1]:
        drafts, _ = _chain(draft, cache, last_h, n, k)
        a = 0
        while a < k and drafts[a] == seq[n + 1 + a]:
            a += 1
        result.accepted.append(a)
        result.tokens.extend(seq[n + 1 : n + a + 2])
        cache.crop(n)
        last_h = _draft_extend(
            draft, cache, aux_1TA[:, n : n + a + 1].to(dtype), seq_T[n + 1 : n + a + 2], start=n
        )
        n += a + 1
    result.tokens = _finish(result.tokens, max_new_tokens, eos)[0]
    return result


def replay_acceptance(
    draft: nn.Module,
    cases: list[tuple[torch.Tensor, list[int], int]],
    *,
    num_draft_tokens: int = 3,
    max_new_tokens: int = 128,
    eos_ids: tuple[int, ...] = (),
    progress=None,
) -> AcceptanceReport:
    """`replay_generate` over `cases` (aux features, sequence, prompt length), one report.
    `progress(done, total)` after each case."""
    rounds = accepted = tokens = 0
    for i, (aux_1TA, seq, prompt_len) in enumerate(cases):
        spec = replay_generate(
            draft,
            aux_1TA,
            seq,
            prompt_len,
            num_draft_tokens=num_draft_tokens,
            max_new_tokens=max_new_tokens,
            eos_ids=eos_ids,
        )
        rounds += len(spec.accepted)
        accepted += sum(spec.accepted)
        tokens += len(spec.tokens)
        if progress is not None:
            progress(i + 1, len(cases))
    mean_accepted = accepted / max(rounds, 1)
    return AcceptanceReport(
        prompts=len(cases),
        rounds=rounds,
        tokens=tokens,
        mean_accepted=mean_accepted,
        accept_length=mean_accepted + 1.0,
        lossless=True,
    )
