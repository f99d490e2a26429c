"""Real draft-and-verify decoding: EAGLE3 chain drafting of k tokens, greedy verification.

`SpecSession` is the one draft-and-verify loop of the project, a round at a time behind a
`Drafter` (`ChainDrafter` here; `core.eval.block.BlockDrafter` for the DFlash family): the
evaluation runs it to the end (`speculative_generate`, `block_generate`, `measure_acceptance`)
and `specbus serve --speculative` steps it per request, handing a request to a reloaded draft
between rounds (`swap`). Verification is greedy, or with a `Sampling` rejection sampling that
keeps the target's distribution (`core.eval.verify`; at temperature > 0 the chain drafts by
sampling the draft's distribution instead of its argmax).

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
from typing import Protocol

import torch
from specbus.core.errors import SpecbusError
from specbus.core.eval.verify import Sampling, greedy_accept, sampled_accept
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


def _forward_kw(target: nn.Module, cache, *, last_only: bool = False) -> dict:
    """The target forward's keyword arguments for a KV cache (`cache` on transformers >= 5.24,
    else `past_key_values`) and, with `last_only`, `logits_to_keep=1` where the forward takes
    it: a prefill needs the last position's logits only (the [B, T, V] logits of every prompt
    position were 45 % of a CPU serving wave's time, SmolLM2 cut to 4 layers and 64 GSM8K
    prompts, and would be a GB on a GPU)."""
    params = inspect.signature(target.forward).parameters
    kw = {"cache" if "cache" in params else "past_key_values": cache}
    if last_only and "logits_to_keep" in params:
        kw["logits_to_keep"] = 1
    return kw


def _forward(target: nn.Module, ids_1T: torch.Tensor, cache, *, last_only: bool = False):
    """Target forward with a KV cache; `last_only`: the last position's logits only."""
    return target(input_ids=ids_1T, use_cache=True,
                  **_forward_kw(target, cache, last_only=last_only)).logits  # fmt: skip


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
        logits = _forward(target, ids, cache, last_only=True)
        token = int(logits[0, -1].argmax())
        out.append(token)
        if token in eos_ids:
            break
        ids = torch.tensor([[token]], device=device)
    return out


class Drafter(Protocol):
    """The draft's side of a `SpecSession`, for one sequence."""

    def extend(self, aux_1TA: torch.Tensor, follow_T: torch.Tensor, start: int) -> None:
        """Forget context positions from `start` on, then add start..start+T-1: the target's
        aux features of token j (`aux_1TA`) and token j+1 (`follow_T`)."""

    def propose(self, next_tok: int, n: int, k: int, sampling: Sampling | None
                ) -> tuple[list[int], list[torch.Tensor]]:  # fmt: skip
        """Up to k drafts after the n verified tokens (`next_tok` is token n, not yet run by
        the target) and, when `sampling`, the distribution over the target vocab each was
        drawn from (else [])."""


class ChainDrafter:
    """EAGLE3 chain drafting (module docstring) behind the `Drafter` protocol of `SpecSession`:
    the draft's KV cache over the verified positions and its last pre-norm output."""

    def __init__(self, draft: nn.Module):
        self.draft = draft
        self.dtype = draft.fc.weight.dtype
        self.cache = DecodeCache()
        self.last_h: torch.Tensor | None = None

    def extend(self, aux_1TA: torch.Tensor, follow_T: torch.Tensor, start: int) -> None:
        """Keep positions 0..start-1 and add start..start+T-1 (aux of token j, token j+1)."""
        self.cache.crop(start)
        self.last_h = _draft_extend(self.draft, self.cache, aux_1TA.to(self.dtype), follow_T,
                                    start=start)  # fmt: skip

    def propose(self, next_tok: int, n: int, k: int, sampling: Sampling | None):
        """k drafts after the n verified tokens (`next_tok` is token n, not needed: the chain
        starts from the output at n-1) and, when sampling, the distribution of each."""
        del next_tok
        if k <= 0:
            return [], []
        return _chain(self.draft, self.cache, self.last_h, n, k, sampling)


class SpecSession:
    """One sequence decoded by draft-and-verify, a round at a time (batch 1).

    Built from the prompt: the target's prefill (its KV cache) chooses token n; the drafter's
    context is the prompt's aux features. `step(k)` drafts up to k tokens, verifies them in one
    target forward (greedy, or rejection sampling with `sampling`), crops both caches to the
    accepted prefix, extends the drafter and returns (tokens emitted, drafts accepted).
    `aux` is an open `AuxCapture` on the target for the drafter's layers (one per target: the
    caller's, shared by every session on it). `swap(drafter)` hands the sequence to another
    drafter between rounds (a reloaded draft): its context is rebuilt from the aux features of
    every verified position, kept for that when `keep_aux` (one drafter forward over the
    context; the target is not run again)."""

    def __init__(self, target: nn.Module, drafter: Drafter, prompt_ids: torch.Tensor,
                 aux: AuxCapture, *, sampling: Sampling | None = None,
                 keep_aux: bool = False):  # fmt: skip
        self.target, self.drafter, self.aux, self.sampling = target, drafter, aux, sampling
        self.device = _device(target)
        self.cache = _new_cache()
        prompt = prompt_ids.to(self.device)
        logits = _forward(target, prompt[None], self.cache, last_only=True)
        aux_1TA = aux.concat()
        self.n = int(prompt.numel())
        self.next_tok = self._first(logits[0, -1])
        self.tokens = [self.next_tok]  # generated so far (the prefill's token first)
        self.accepted: list[int] = []  # drafts accepted per round
        self._seq = [*prompt.tolist(), self.next_tok]  # verified tokens + next_tok
        self._aux = [aux_1TA] if keep_aux else None
        drafter.extend(aux_1TA, self._follow(0, self.n), start=0)

    def _first(self, logits_V: torch.Tensor) -> int:
        if self.sampling is None:
            return int(logits_V.argmax())
        return self.sampling.draw(self.sampling.target_probs(logits_V))

    def _follow(self, start: int, count: int) -> torch.Tensor:
        """Tokens start+1..start+count: what drafter positions start.. embed."""
        return torch.tensor(self._seq[start + 1 : start + 1 + count], device=self.device)

    def step(self, k: int) -> tuple[list[int], int]:
        """One round with up to `k` drafts (class doc): (tokens emitted, drafts accepted)."""
        n, next_tok = self.n, self.next_tok
        drafts, q_probs = self.drafter.propose(next_tok, n, k, self.sampling)
        drafts = drafts[: max(k, 0)]
        logits = _forward(self.target, torch.tensor([[next_tok, *drafts]], device=self.device),
                          self.cache)  # fmt: skip
        aux_1TA = self.aux.concat()
        if self.sampling is None:
            emitted, a = greedy_accept(drafts, logits[0])
        else:
            emitted, a = sampled_accept(drafts, q_probs[: len(drafts)], logits[0], self.sampling)
        _crop(self.cache, n + a + 1)
        self._seq[n + 1 :] = emitted
        kept = aux_1TA[:, : a + 1]
        if self._aux is not None:
            self._aux.append(kept)
        self.drafter.extend(kept, self._follow(n, a + 1), start=n)
        self.n, self.next_tok = n + a + 1, emitted[-1]
        self.tokens.extend(emitted)
        self.accepted.append(a)
        return emitted, a

    def swap(self, drafter: Drafter) -> None:
        """Continue with `drafter` (class doc); needs `keep_aux`."""
        if self._aux is None:
            raise ValueError("swap needs a session built with keep_aux=True")
        if len(self._aux) > 1:
            self._aux = [torch.cat(self._aux, dim=1)]
        drafter.extend(self._aux[0], self._follow(0, self.n), start=0)
        self.drafter = drafter


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
    sampling: Sampling | None = None,
) -> SpecResult:
    """Decode with EAGLE3 chain drafting (module docstring), greedily or, with `sampling`, by
    rejection sampling (`core.eval.verify`). Batch size 1."""
    return run_session(target, ChainDrafter(draft), prompt_ids, aux_layers=aux_layers,
                       num_draft_tokens=num_draft_tokens, max_new_tokens=max_new_tokens,
                       eos_ids=eos_ids, sampling=sampling)  # fmt: skip


def run_session(target: nn.Module, drafter: Drafter, prompt_ids: torch.Tensor, *, aux_layers: list[int],
                num_draft_tokens: int, max_new_tokens: int, eos_ids: tuple[int, ...] = (),
                sampling: Sampling | None = None) -> SpecResult:  # fmt: skip
    """A `SpecSession` run to `max_new_tokens` or an end-of-sequence token."""
    eos = set(eos_ids)
    with AuxCapture(target, aux_layers) as aux:
        session = SpecSession(target, drafter, prompt_ids, aux, sampling=sampling)
        while not _finish(session.tokens, max_new_tokens, eos)[1]:
            session.step(num_draft_tokens)
    tokens = _finish(session.tokens, max_new_tokens, eos)[0]
    return SpecResult(tokens=tokens, accepted=session.accepted)


def _draft_extend(draft, cache: DecodeCache, aux_1TA, follow_T, start: int) -> torch.Tensor:
    """Add positions start..start+T-1 (aux of token j, embedding of token j+1); return last output."""
    positions = torch.arange(start, start + follow_T.numel(), device=follow_T.device)[None]
    hidden = draft.backbone(draft.embed(follow_T[None]), draft.project(aux_1TA), positions, cache)
    return hidden[:, -1:]


def _chain(draft, cache: DecodeCache, last_h, n: int, k: int, sampling: Sampling | None = None):
    """Draft k tokens: d1 from the output at n-1, then d_{i+1} from position n-1+i. Returns
    (drafts, their distributions over the target vocab when `sampling`, else [])."""
    drafts: list[int] = []
    q_probs: list[torch.Tensor] = []
    hidden = last_h
    for i in range(1, k + 1):
        logits = draft.compute_logits(hidden)[0, -1]
        if sampling is None:
            token = _to_target(draft, logits.argmax())
        else:
            q_d = sampling.draft_probs(logits)
            draft_id = sampling.draw(q_d)
            token = _to_target(draft, torch.tensor(draft_id, device=draft.d2t.device))
            q_probs.append(_on_target_vocab(draft, q_d))
        drafts.append(token)
        if i < k:
            positions = torch.tensor([[n - 1 + i]], device=hidden.device)
            hidden = draft.backbone(
                draft.embed(torch.tensor([[token]], device=hidden.device)), hidden, positions, cache
            )
    return drafts, q_probs


def _on_target_vocab(draft, q_d: torch.Tensor) -> torch.Tensor:
    """A distribution over the draft vocab spread onto the target vocab (draft id i is target
    id i + d2t[i]; 0 where the draft vocab has no entry)."""
    ids = torch.arange(q_d.numel(), device=q_d.device) + draft.d2t.to(q_d.device)
    size = draft.t2d.numel() if hasattr(draft, "t2d") else int(ids.max()) + 1
    return torch.zeros(size, device=q_d.device).index_add_(0, ids, q_d)


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
