"""Verification of drafted tokens against the target: greedy, and rejection sampling.

Shape legend: V target vocab, T verified positions (= drafts + 1).

Greedy (temperature 0): `a` = the longest prefix of drafts equal to the target's argmax at
their positions; the round emits those drafts and the target's own argmax after them, so the
output is the target's greedy decoding whatever the draft proposes.

Sampled (temperature > 0; Leviathan et al. 2023, Chen et al. 2023): draft `x_i` was drawn
from the draft's distribution `q_i` (over the target vocab; 0 where the draft cannot
propose). It is accepted with probability `min(1, p_i(x_i) / q_i(x_i))`, `p_i` the target's
warped distribution at that position; the first rejection emits a token drawn from
`norm(max(0, p_i - q_i))` and ends the round; when every draft is accepted, a bonus token is
drawn from `p_T`. Each emitted token is then distributed exactly as the target's own sampling
(`warp`) would draw it: the served distribution is the target's, only faster.

`warp` is the one definition of the target's sampling distribution (temperature, then top-p
keeping the smallest prefix of the sorted probabilities whose mass reaches `top_p`): plain
decoding (`specbus serve` without a draft) samples from it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def warp(logits_V: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The sampling distribution of `logits_V` (fp32 probabilities): softmax at
    `temperature` (> 0), restricted to the top-p nucleus (the likeliest token always kept, so
    top_p 0 is greedy) and renormalised."""
    probs = _softmax_at(logits_V, temperature)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p
        keep[0] = True  # top_p 0 would keep none
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        probs = probs / probs.sum()
    return probs


def _softmax_at(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / temperature) in float64 with the max subtracted first, as fp32: a tiny
    temperature (1e-300 is 0 in float32) scales the others to -inf and the max to 0, never to
    inf - inf or 0 / 0."""
    logits = logits.double()
    return torch.softmax((logits - logits.max(-1, keepdim=True).values) / temperature, -1).float()


@dataclass
class Sampling:
    """How a request samples: `temperature` > 0 (0 is greedy and has no `Sampling`), `top_p`,
    and the request's own random stream (`generator`, None: torch's global one)."""

    temperature: float
    top_p: float = 1.0
    generator: torch.Generator | None = None

    def target_probs(self, logits_V: torch.Tensor) -> torch.Tensor:
        """The target's sampling distribution at one position (`warp`)."""
        return warp(logits_V, self.temperature, self.top_p)

    def draft_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's proposal distribution: its logits at the request's temperature (any
        proposal keeps the output exact; a closer one is accepted more often)."""
        return _softmax_at(logits, self.temperature)

    def draw(self, probs: torch.Tensor) -> int:
        """One index drawn from `probs` with the request's generator."""
        gen = self.generator
        if gen is not None and gen.device != probs.device:
            probs = probs.to(gen.device)
        return int(torch.multinomial(probs, 1, generator=gen))

    def uniform(self) -> float:
        """One U(0, 1) draw with the request's generator."""
        return float(torch.rand(1, generator=self.generator))


def greedy_accept(drafts: list[int], logits_TV: torch.Tensor) -> tuple[list[int], int]:
    """Greedy verification: (tokens emitted, drafts accepted). `logits_TV[i]` is the target's
    prediction after the i-th fed token ([next_tok, d1..dk] fed, T = k + 1)."""
    return greedy_prefix(drafts, logits_TV.argmax(-1).tolist())


def greedy_prefix(drafts: list[int], greedy: list[int]) -> tuple[list[int], int]:
    """`greedy_accept` given the target's argmax at each fed position (`greedy`, T long)."""
    a = 0
    while a < len(drafts) and drafts[a] == greedy[a]:
        a += 1
    return [*drafts[:a], greedy[a]], a


def sampled_accept(
    drafts: list[int], q_probs: list[torch.Tensor], logits_TV: torch.Tensor, sampling: Sampling
) -> tuple[list[int], int]:
    """Rejection sampling (module doc): (tokens emitted, drafts accepted). `q_probs[i]` is the
    distribution over the target vocab that `drafts[i]` was drawn from."""
    for i, (x, q_V) in enumerate(zip(drafts, q_probs, strict=True)):
        p_V = sampling.target_probs(logits_TV[i])
        q_V = q_V.to(p_V.device, torch.float32)
        px, qx = float(p_V[x]), float(q_V[x])
        if qx > 0 and sampling.uniform() * qx < px:  # accept with probability min(1, px / qx)
            continue
        residual = (p_V - q_V).clamp(min=0)
        total = float(residual.sum())
        # p <= q everywhere only when p == q (both sum to 1): then nothing is ever rejected
        # but by rounding, and p itself is the right distribution
        token = sampling.draw(residual / total if total > 0 else p_V)
        return [*drafts[:i], token], i
    bonus = sampling.draw(sampling.target_probs(logits_TV[len(drafts)]))
    return [*drafts, bonus], len(drafts)
