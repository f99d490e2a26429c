"""EAGLE3 attention for training and decoding: the TTT and decode caches and the TTT kernels.

Shape legend (llama_eagle3.py's): B batch, L sequence, N attention heads, D head dim, K TTT step.
Training (TTT, `TTTCache`): at step 0 every query attends causally (+ key padding) to the
step-0 keys; at step K > 0 to the same step-0 keys plus, from each step 1..K, only the key at
its own position. `_ttt_eager` reproduces SpecForge's sdpa-backend arithmetic exactly;
`_ttt_flex` (CUDA) builds a flex-attention block mask instead. Decoding (`DecodeCache`) is
plain causal attention over a growing KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class TTTCache:
    """Keys/values of every TTT step so far (step 0 first) and the step-0 mask.

    `key_padding_BL` is the batch attention mask (1 = real token). `mask_BNLL` (eager) is the
    additive causal+padding mask of step 0, built lazily once per forward.
    """

    key_padding_BL: torch.Tensor
    attention: str = "eager"
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    mask_B1LL: torch.Tensor | None = None

    @property
    def step(self) -> int:
        """The TTT step the next forward computes (0 first)."""
        return len(self.keys)


@dataclass
class DecodeCache:
    """Causal KV cache for inference: `k/v [B, N, T, D]` (kv heads already repeated)."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """Positions cached so far."""
        return 0 if self.k is None else int(self.k.shape[2])

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (the verified prefix after a rejection)."""
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]


def step0_mask(key_padding_BL: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive `[B, 1, L, L]` mask: 0 where query i may see key j (j <= i, j real), else min."""
    seq = key_padding_BL.shape[1]
    device = key_padding_BL.device
    causal_LL = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    allowed_B1LL = causal_LL[None, None] & key_padding_BL.bool()[:, None, None, :]
    mask = torch.zeros(allowed_B1LL.shape, dtype=dtype, device=device)
    return mask.masked_fill(~allowed_B1LL, torch.finfo(dtype).min)


def _ttt_eager(q_BNLD: torch.Tensor, cache: TTTCache) -> torch.Tensor:
    """SpecForge's sdpa-backend arithmetic: scores vs step-0 keys + one diagonal per earlier step."""
    scale = math.sqrt(q_BNLD.shape[-1])
    k0, v0 = cache.keys[0], cache.values[0]
    seq = q_BNLD.shape[2]
    if cache.mask_B1LL is None:
        cache.mask_B1LL = step0_mask(cache.key_padding_BL, q_BNLD.dtype)
    scores = torch.matmul(q_BNLD, k0.transpose(2, 3)) / scale + cache.mask_B1LL
    diag = [((q_BNLD * k).sum(-1) / scale)[..., None] for k in cache.keys[1:]]
    scores = torch.cat([scores, *diag], dim=-1) if diag else scores
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q_BNLD.dtype)
    out = torch.matmul(probs[..., :seq], v0)
    for i, v in enumerate(cache.values[1:], start=1):
        out = out + probs[..., seq + i - 1, None] * v
    return out


def _ttt_flex(q_BNLD: torch.Tensor, cache: TTTCache) -> torch.Tensor:
    """Same attention with a flex-attention block mask over [K0 | K1 | ... | Kk] (no L x L tensor)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, n, seq, _ = q_BNLD.shape
    pad_BL = cache.key_padding_BL.bool()

    def mask_mod(bi, hi, qi, kvi):
        step, j = kvi // seq, kvi % seq
        return ((step == 0) & (j <= qi) & pad_BL[bi, j]) | ((step > 0) & (j == qi))

    total = seq * cache.step
    block = create_block_mask(mask_mod, b, None, seq, total, device=q_BNLD.device)
    k = torch.cat(cache.keys, dim=2)
    v = torch.cat(cache.values, dim=2)
    return _compiled_flex()(q_BNLD, k, v, block_mask=block)


_FLEX = None


def _compiled_flex():
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        # dynamic=None: the key length grows with the TTT step and L varies by batch; a static
        # compile per shape would hit the recompile limit and fall back to the unfused kernel.
        _FLEX = torch.compile(flex_attention, dynamic=None)
    return _FLEX
