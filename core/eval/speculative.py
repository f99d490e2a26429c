"""Real draft-and-verify decoding: EAGLE3 chain drafting of k tokens, greedy verification.

Shape legend: T tokens in a forward, H hidden, A = 3 * target hidden (aux features).

One round, with n tokens already verified and `next_tok` (token n) chosen by the target:
the draft has KV entries for positions 0..n-1 (position j = aux features of token j + the
embedding of token j+1) and its pre-norm output at n-1; it drafts d1..dk by chaining (position
n-1+i embeds d_i with the previous output as hidden). The target then runs [next_tok, d1..dk]
in one forward; `a` = the longest prefix of drafts equal to the target's greedy choices; the
round emits d1..da plus the target's own next token. Both KV caches are cropped to the
accepted prefix and the draft extends over the a+1 verified positions with the target's aux
features. Greedy verification makes the output identical to the target's greedy decoding
(`check_lossless` compares against `greedy_generate` and raises `LosslessError` otherwise).

Acceptance length here is tokens emitted per target verification forward (= accepted drafts
+ 1, SGLang's "accept length"); `mean_accepted` is the accepted drafts alone.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from specbus.core.errors import SpecbusError
from specbus.core.models.llama_eagle3 import DecodeCache
from specbus.core.models.target import AuxCapture
from torch import nn


class LosslessError(SpecbusError):
    """Speculative output differs from the target's greedy output (a bug, or numerics at a tie)."""


@dataclass
class SpecResult:
    """One speculative decode: the tokens produced and the drafts accepted per verify round."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # accepted drafts per verification round


def _new_cache():
    from transformers import DynamicCache

    return DynamicCache()


def _crop(cache, keep: int) -> None:
    """Keep the first `keep` positions (a negative crop means "remove" in transformers 4 and 5)."""
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)


def _forward(target: nn.Module, ids_1T: torch.Tensor, cache):
    """Target forward with a KV cache (`cache=` on transformers >= 5.24, else past_key_values)."""
    name = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    return target(input_ids=ids_1T, use_cache=True, **{name: cache}).logits


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _finish(tokens: list[int], max_new_tokens: int, eos: set[int]) -> tuple[list[int], bool]:
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in eos:
            return tokens[: i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


@torch.no_grad()
def greedy_generate(
    target: nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int, eos_ids: tuple[int, ...] = ()
) -> list[int]:
    """The target's own greedy continuation, one token per forward with a KV cache."""
    device, cache = _device(target), _new_cache()
    ids = prompt_ids.to(device)[None]
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = _forward(target, ids, cache)
        token = int(logits[0, -1].argmax())
        out.append(token)
        if token in eos_ids:
            break
        ids = torch.tensor([[token]], device=device)
    return out


@torch.no_grad()
def speculative_generate(
    target: nn.Module,
    draft: nn.Module,
    prompt_ids: torch.Tensor,
    *,
    aux_layers: list[int],
    num_draft_tokens: int = 3,
    max_new_tokens: int = 128,
    eos_ids: tuple[int, ...] = (),
) -> SpecResult:
    """Decode greedily with EAGLE3 chain drafting (module docstring). Batch size 1."""
    device, eos = _device(target), set(eos_ids)
    dtype = draft.fc.weight.dtype
    t_cache, d_cache = _new_cache(), DecodeCache()
    with AuxCapture(target, aux_layers) as aux:
        logits = _forward(target, prompt_ids.to(device)[None], t_cache)
        aux_1TA = aux.concat()
        n = int(prompt_ids.numel())
        next_tok = int(logits[0, -1].argmax())
        result = SpecResult(tokens=[next_tok])
        follow = torch.cat([prompt_ids[1:].to(device), torch.tensor([next_tok], device=device)])
        last_h = _draft_extend(draft, d_cache, aux_1TA.to(dtype), follow, start=0)
        while not _finish(result.tokens, max_new_tokens, eos)[1]:
            drafts = _chain(draft, d_cache, last_h, n, num_draft_tokens)
            chunk = torch.tensor([[next_tok, *drafts]], device=device)
            logits = _forward(target, chunk, t_cache)
            aux_1TA = aux.concat()
            greedy = logits[0].argmax(-1).tolist()
            a = 0
            while a < len(drafts) and drafts[a] == greedy[a]:
                a += 1
            result.accepted.append(a)
            result.tokens.extend([*drafts[:a], greedy[a]])
            _crop(t_cache, n + a + 1)
            d_cache.crop(n)
            follow = torch.tensor([*drafts[:a], greedy[a]], device=device)
            last_h = _draft_extend(draft, d_cache, aux_1TA[:, : a + 1].to(dtype), follow, start=n)
            n, next_tok = n + a + 1, greedy[a]
    result.tokens = _finish(result.tokens, max_new_tokens, eos)[0]
    return result


def _draft_extend(draft, cache: DecodeCache, aux_1TA, follow_T, start: int) -> torch.Tensor:
    """Add positions start..start+T-1 (aux of token j, embedding of token j+1); return last output."""
    positions = torch.arange(start, start + follow_T.numel(), device=follow_T.device)[None]
    hidden = draft.backbone(draft.embed(follow_T[None]), draft.project(aux_1TA), positions, cache)
    return hidden[:, -1:]


def _chain(draft, cache: DecodeCache, last_h, n: int, k: int) -> list[int]:
    """Draft k tokens: d1 from the output at n-1, then d_{i+1} from position n-1+i."""
    drafts: list[int] = []
    hidden = last_h
    for i in range(1, k + 1):
        token = _to_target(draft, draft.compute_logits(hidden)[0, -1].argmax())
        drafts.append(token)
        if i < k:
            positions = torch.tensor([[n - 1 + i]], device=hidden.device)
            hidden = draft.backbone(
                draft.embed(torch.tensor([[token]], device=hidden.device)), hidden, positions, cache
            )
    return drafts


def _to_target(draft, draft_id: torch.Tensor) -> int:
    return int(draft_id + draft.d2t[draft_id])


@dataclass
class AcceptanceReport:
    """Measured acceptance over several prompts: tokens per verify round and drafts accepted."""

    prompts: int
    rounds: int
    tokens: int
    mean_accepted: float  # accepted drafts per verification round
    accept_length: float  # tokens emitted per verification round (= mean_accepted + 1)
    lossless: bool
    mismatches: int = 0  # prompts whose output differed from greedy (strict=False only)

    def as_dict(self) -> dict:
        """A JSON-able dict of the report."""
        return self.__dict__.copy()


def measure_acceptance(
    target: nn.Module,
    draft: nn.Module,
    prompts: list[torch.Tensor],
    *,
    aux_layers: list[int],
    num_draft_tokens: int = 3,
    max_new_tokens: int = 128,
    eos_ids: tuple[int, ...] = (),
    check_lossless: bool = True,
    references: dict[tuple[int, ...], list[int]] | None = None,
    generate=None,
    strict: bool = True,
) -> AcceptanceReport:
    """Speculative decoding over `prompts`; raises `LosslessError` if an output differs from greedy.

    `references` (optional) memoises the greedy outputs by prompt, so several drafts can be
    checked against one set of target decodes. A memoised reference the output differs from
    is decoded again here (token by token, batch 1) before the output counts as different: a
    caller may fill `references` from a faster decode (batched), whose rounding can differ.
    `strict=False` counts the prompts whose output still differs (`mismatches`, `lossless`
    False) instead of raising. `generate` is the decoding loop
    (`speculative_generate`, EAGLE3 chains, by default; `core.eval.block.block_generate` for
    DFlash-family drafts, which ignores `num_draft_tokens`: a block drafts its own count).
    """
    generate = generate or speculative_generate
    rounds = accepted = tokens = mismatches = 0
    for i, prompt in enumerate(prompts):
        spec = generate(
            target,
            draft,
            prompt,
            aux_layers=aux_layers,
            num_draft_tokens=num_draft_tokens,
            max_new_tokens=max_new_tokens,
            eos_ids=eos_ids,
        )
        if check_lossless:
            key = tuple(prompt.tolist())
            cached = references.get(key) if references is not None else None
            reference = (
                cached
                if cached is not None
                else greedy_generate(target, prompt, max_new_tokens, eos_ids)
            )
            if spec.tokens != reference and cached is not None:  # memoised: decode it again
                reference = greedy_generate(target, prompt, max_new_tokens, eos_ids)
            if references is not None:
                references[key] = reference
            if spec.tokens != reference and not strict:
                mismatches += 1
            elif spec.tokens != reference:
                first = next(
                    (
                        j
                        for j, (a, b) in enumerate(zip(spec.tokens, reference, strict=False))
                        if a != b
                    ),
                    min(len(spec.tokens), len(reference)),
                )
                raise LosslessError(
                    f"prompt {i}: speculative output differs from greedy at token {first} "
                    f"({spec.tokens[first : first + 3]} vs {reference[first : first + 3]})"
                )
        rounds += len(spec.accepted)
        accepted += sum(spec.accepted)
        tokens += len(spec.tokens)
    mean_accepted = accepted / max(rounds, 1)
    return AcceptanceReport(
        prompts=len(prompts),
        rounds=rounds,
        tokens=tokens,
        mean_accepted=mean_accepted,
        accept_length=mean_accepted + 1.0,
        lossless=check_lossless and mismatches == 0,
        mismatches=mismatches,
    )
