"""EAGLE3 attention for training and decoding: the TTT and decode caches and the TTT kernels.

Shape legend (llama_eagle3.py's): B batch, L sequence, N attention heads, D head dim, K TTT step,
Qt/Kt query/key tiles of `TILE`. Training (TTT, `TTTCache`): at step 0 every query attends
causally (+ key padding) to the step-0 keys; at step K > 0 to the same step-0 keys plus, from
each step 1..K, only the key at its own position. `_ttt_eager` reproduces SpecForge's
sdpa-backend arithmetic exactly; `_ttt_flex` (the CUDA default) uses flex attention with every
step's BlockMask built once per forward at the tile level (`ttt_block_masks`;
`block_mask_from_tiles` is shared with the DFlash family). A long sequence on the eager path
(`TTTCache.block`) is attended `block` queries at a time, each block recomputed in the
backward (`_ttt_eager_blocked`): O(L * block) memory instead of the dense L x L mask and
probabilities. Decoding (`DecodeCache`) is plain causal attention over a growing KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from specbus.core.models import ttt_flash
from specbus.core.models.kernels import raise_recompile_limit


@dataclass
class TTTCache:
    """Keys/values of every TTT step so far (step 0 first) and the step-0 mask.

    `key_padding_BL` is the batch attention mask (1 = real token). `mask_BNLL` (eager) is the
    additive causal+padding mask of step 0, built lazily once per forward; `block_masks`
    (flex) the BlockMask of every step, built once per forward (`ttt_block_masks`). `block`
    (eager): attend this many queries at a time when the sequence is longer (no L x L mask).
    """

    key_padding_BL: torch.Tensor
    attention: str = "eager"
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    mask_B1LL: torch.Tensor | None = None
    block_masks: list[Any] | None = None
    block: int | None = None

    @property
    def step(self) -> int:
        """The TTT step the next forward computes (0 first)."""
        return len(self.keys)

    def upto(self, step: int) -> TTTCache:
        """A cache holding the keys/values of steps `0..step-1` only (the same tensors, the same
        masks): a checkpointed step runs on it, at its forward and at its recomputation."""
        return TTTCache(
            key_padding_BL=self.key_padding_BL, attention=self.attention,
            keys=self.keys[:step], values=self.values[:step], mask_B1LL=self.mask_B1LL,
            block_masks=self.block_masks, block=self.block,
        )  # fmt: skip


@dataclass
class DecodeCache:
    """Causal KV cache for inference: `k/v [B, N, T, D]` (kv heads already repeated).

    `valid_BL` (ragged batches, `core.eval.batch`): which key columns are real, covering the
    columns a forward is about to append too (the caller sets it before the forward);
    None: every column of every row."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    valid_BL: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """Positions cached so far."""
        return 0 if self.k is None else int(self.k.shape[2])

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (the verified prefix after a rejection)."""
        if self.valid_BL is not None:
            self.valid_BL = self.valid_BL[:, :length]
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
    seq = q_BNLD.shape[2]
    if cache.block is not None and seq > cache.block:
        return _ttt_eager_blocked(q_BNLD, cache, cache.block)
    scale = math.sqrt(q_BNLD.shape[-1])
    k0, v0 = cache.keys[0], cache.values[0]
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


def _eager_rows(q_BNcD, pad_Bh, lo: int, k0_BNhD, v0_BNhD, diag_keys, diag_values):
    """`_ttt_eager` for the queries at `lo..lo+c-1` (`hi` = lo + c): the step-0 keys up to
    the last of them (`k0/v0[:, :, :hi]`, `pad[:, :hi]`: later keys are masked anyway), the
    earlier steps' keys/values at the queries' own positions (`[:, :, lo:hi]`)."""
    scale = math.sqrt(q_BNcD.shape[-1])
    hi = lo + q_BNcD.shape[2]
    dtype = q_BNcD.dtype
    rows = torch.arange(lo, hi, device=q_BNcD.device)
    allowed = (torch.arange(hi, device=q_BNcD.device)[None] <= rows[:, None])[None, None]
    allowed = allowed & pad_Bh[:, None, None, :].bool()
    # masked scores set to min (the dense path adds min: both give exact zeros after softmax)
    scores = torch.matmul(q_BNcD, k0_BNhD.transpose(2, 3)) / scale
    scores = scores.masked_fill(~allowed, torch.finfo(dtype).min)
    diag = [((q_BNcD * k).sum(-1) / scale)[..., None] for k in diag_keys]
    scores = torch.cat([scores, *diag], dim=-1) if diag else scores
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
    out = torch.matmul(probs[..., :hi], v0_BNhD)
    for i, v in enumerate(diag_values, start=1):
        out = out + probs[..., hi + i - 1, None] * v
    return out


def _block_inputs(q, pad, keys, values, lo: int, hi: int):
    return (q[:, :, lo:hi], pad[:, :hi], lo, keys[0][:, :, :hi], values[0][:, :, :hi],
            [k[:, :, lo:hi] for k in keys[1:]], [v[:, :, lo:hi] for v in values[1:]])  # fmt: skip


class _BlockedTTTAttention(torch.autograd.Function):
    """`_ttt_eager` `block` queries at a time; the backward recomputes each block's
    probabilities (nothing of them is kept): memory O(L * block), never an L x L tensor.
    The same function as the dense path (masked keys add exact zeros), summed in another
    order."""

    @staticmethod
    def forward(ctx, block: int, pad_BL, q_BNLD, steps: int, *keys_values):
        keys, values = keys_values[:steps], keys_values[steps:]
        seq = q_BNLD.shape[2]
        outs = [
            _eager_rows(*_block_inputs(q_BNLD, pad_BL, keys, values, lo, min(lo + block, seq)))
            for lo in range(0, seq, block)
        ]
        ctx.save_for_backward(pad_BL, q_BNLD, *keys_values)
        ctx.block, ctx.steps = block, steps
        return torch.cat(outs, dim=2)

    @staticmethod
    def backward(ctx, grad_BNLD):
        pad, q, *keys_values = ctx.saved_tensors
        steps, seq = ctx.steps, q.shape[2]
        keys, values = keys_values[:steps], keys_values[steps:]
        grad_q = torch.zeros_like(q)
        grad_k = [torch.zeros_like(k) for k in keys]
        grad_v = [torch.zeros_like(v) for v in values]
        for lo in range(0, seq, ctx.block):
            hi = min(lo + ctx.block, seq)
            with torch.enable_grad():
                qb, pb, _, k0, v0, dk, dv = _block_inputs(q, pad, keys, values, lo, hi)
                leaves = [t.detach().requires_grad_(True) for t in (qb, k0, v0, *dk, *dv)]
                qb, k0, v0 = leaves[:3]
                dk, dv = leaves[3 : 2 + steps], leaves[2 + steps :]
                out = _eager_rows(qb, pb, lo, k0, v0, dk, dv)
                g = torch.autograd.grad(out, leaves, grad_BNLD[:, :, lo:hi])
            grad_q[:, :, lo:hi] = g[0]
            grad_k[0][:, :, :hi] += g[1]
            grad_v[0][:, :, :hi] += g[2]
            for s in range(1, steps):
                grad_k[s][:, :, lo:hi] += g[2 + s]
                grad_v[s][:, :, lo:hi] += g[1 + steps + s]
        return None, None, grad_q, None, *grad_k, *grad_v


def _ttt_eager_blocked(q_BNLD: torch.Tensor, cache: TTTCache, block: int) -> torch.Tensor:
    """`_ttt_eager` through `_BlockedTTTAttention` (its doc); step 0 of a batch without
    padding is plain causal attention: torch's SDPA (a fused kernel, O(L) memory)."""
    if len(cache.keys) == 1 and bool(cache.key_padding_BL.bool().all()):
        return F.scaled_dot_product_attention(
            q_BNLD, cache.keys[0], cache.values[0], is_causal=True
        )
    return _BlockedTTTAttention.apply(
        block, cache.key_padding_BL, q_BNLD, len(cache.keys), *cache.keys, *cache.values
    )


TILE = 128  # flex attention's BLOCK_SIZE (query and key tiles)


@dataclass
class TTTMask:
    """One TTT step's flex BlockMask and the tiles it was built from (`[B, Qt, Kt]` partial /
    full: a full tile skips the mask_mod in the kernel)."""

    block_mask: Any
    mask_mod: Any
    partial_BQtKt: torch.Tensor
    full_BQtKt: torch.Tensor
    kv_len: int


def _ordered(m_BQtKt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, indices) of the set tiles per row, ascending (`_dense_to_ordered`'s order)."""
    num = m_BQtKt.sum(-1, dtype=torch.int32)
    idx = torch.sort((~m_BQtKt).to(torch.uint8), dim=-1, stable=True).indices.to(torch.int32)
    return num[:, None].contiguous(), idx[:, None].contiguous()


def block_mask_from_tiles(partial_BQtKt, full_BQtKt, seq_lengths, mask_mod):
    """A flex BlockMask from dense `[B, Qt, Kt]` tile sets (partial: mask_mod applies; full:
    every key). The query-side (backward) indices come from the same tiles transposed, not
    from `from_kv_blocks`' dense round trip (a vmapped index_put per mask)."""
    from torch.nn.attention.flex_attention import BlockMask

    num, idx = _ordered(partial_BQtKt)
    full_num, full_idx = _ordered(full_BQtKt)
    q_num, q_idx = _ordered(partial_BQtKt.transpose(-2, -1))
    full_q_num, full_q_idx = _ordered(full_BQtKt.transpose(-2, -1))
    try:
        return BlockMask(
            seq_lengths=tuple(seq_lengths), kv_num_blocks=num, kv_indices=idx,
            full_kv_num_blocks=full_num, full_kv_indices=full_idx, q_num_blocks=q_num,
            q_indices=q_idx, full_q_num_blocks=full_q_num, full_q_indices=full_q_idx,
            BLOCK_SIZE=(TILE, TILE), mask_mod=mask_mod,
        )  # fmt: skip
    except TypeError:  # another constructor: let flex derive the query side itself
        return BlockMask.from_kv_blocks(
            num, idx, full_num, full_idx, BLOCK_SIZE=TILE, mask_mod=mask_mod,
            seq_lengths=tuple(seq_lengths),
        )  # fmt: skip


def ttt_mask_mod(key_padding_BL: torch.Tensor):
    """The TTT mask over [K0 | K1 | ... | Kk]: step 0 causal + key padding, step s > 0 only
    the key at the query's own position. Every length is a tensor (nothing baked into a
    compiled graph)."""
    pad_BL = key_padding_BL.bool()
    seq_t = torch.full((), key_padding_BL.shape[1], dtype=torch.long, device=pad_BL.device)

    def mask_mod(bi, hi, qi, kvi):
        step = torch.div(kvi, seq_t, rounding_mode="floor")
        j = kvi - step * seq_t
        return ((step == 0) & (j <= qi) & pad_BL[bi, j]) | ((step > 0) & (j == qi))

    return mask_mod


def ttt_block_masks(key_padding_BL: torch.Tensor, steps: int) -> list[TTTMask]:
    """The BlockMask of every TTT step (keys of steps 0..k), built once per forward at the tile
    level from [B, tiles] tensors on the device: no dense L x kL mask evaluation, no sort of
    a dense mask, no host sync (`create_block_mask` did all three per step). Step 0 region:
    a key tile is needed by a query tile when its first key is <= the tile's last query and
    it holds a real key; it is full when its last key is <= the tile's first query, every key
    is real and both tiles are whole (inside L). Step s > 0: the tiles holding keys s*L + q
    of the tile's queries (partial). The tiles equal `create_block_mask`'s for the same
    mask_mod (tested)."""
    device = key_padding_BL.device
    b, seq = key_padding_BL.shape
    qt = -(-seq // TILE)
    kt0 = qt
    pad = key_padding_BL.bool()
    pad_tiles = F.pad(pad, (0, kt0 * TILE - seq)).view(b, kt0, TILE)
    has_key, all_keys = pad_tiles.any(-1), pad_tiles.all(-1)  # [B, Kt0]
    q0 = torch.arange(qt, device=device) * TILE  # first query of each tile
    q1 = (q0 + TILE - 1).clamp(max=seq - 1)  # last
    k0 = torch.arange(kt0, device=device) * TILE
    causal_any = k0[None] <= q1[:, None]  # [Qt, Kt0]
    # full tiles only inside whole tiles of queries and keys (as create_block_mask marks them)
    causal_full = ((k0 + TILE - 1)[None] <= q0[:, None]) & (q0 + TILE <= seq)[:, None]
    inside = (k0 + TILE <= seq)[None]
    any0 = causal_any[None] & has_key[:, None]
    full0 = causal_full[None] & all_keys[:, None] & inside[:, None]
    mask_mod = ttt_mask_mod(key_padding_BL)
    masks = []
    for k in range(steps):
        kv_len = (k + 1) * seq
        kt = -(-kv_len // TILE)
        tiles = torch.arange(kt, device=device)
        step_any = F.pad(any0, (0, kt - kt0))
        full = F.pad(full0, (0, kt - kt0))
        if k:
            starts = torch.arange(1, k + 1, device=device)[:, None] * seq  # [k, 1]
            lo, hi = (starts + q0) // TILE, (starts + q1) // TILE  # [k, Qt]
            diag = (tiles >= lo[..., None]) & (tiles <= hi[..., None])  # [k, Qt, Kt]
            step_any = step_any | diag.any(0)[None]
        partial = step_any & ~full
        bm = block_mask_from_tiles(partial, full, (seq, kv_len), mask_mod)
        masks.append(TTTMask(bm, mask_mod, partial, full, kv_len))
    return masks


def _ttt_flex(q_BNLD: torch.Tensor, cache: TTTCache) -> torch.Tensor:
    """Same attention with a flex-attention block mask over [K0 | K1 | ... | Kk] (no L x L
    tensor); the masks of all steps are built at the first step of the forward."""
    if cache.block_masks is None or len(cache.block_masks) < cache.step:
        cache.block_masks = ttt_block_masks(cache.key_padding_BL, cache.step)
    block = cache.block_masks[cache.step - 1].block_mask
    k = torch.cat(cache.keys, dim=2)
    v = torch.cat(cache.values, dim=2)
    gqa = k.shape[1] != q_BNLD.shape[1]  # flex repeats the kv heads itself
    if q_BNLD.is_cuda:
        return _compiled_flex()(q_BNLD, k, v, block_mask=block, enable_gqa=gqa)
    from torch.nn.attention.flex_attention import flex_attention  # CPU: forward only (tests)

    return flex_attention(q_BNLD, k, v, block_mask=block, enable_gqa=gqa)


def _ttt_flash(q_BNLD: torch.Tensor, cache: TTTCache) -> torch.Tensor:
    """The same attention as one causal flash attention plus the diagonal keys, merged by
    their log-sum-exps (`ttt_flash.py`); flex where the flash kernel does not take `q` (fp32
    on CUDA, an odd head dim)."""
    if not ttt_flash.supported(q_BNLD):
        return _ttt_flex(q_BNLD, cache)
    return ttt_flash.ttt_flash(q_BNLD, cache.keys, cache.values)


_FLEX = None


def _compiled_flex():
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        # dynamic=None: the key length grows with the TTT step and L varies by batch; a static
        # compile per shape would hit the recompile limit and fall back to the unfused kernel.
        raise_recompile_limit()  # size-range guards: kernels.py
        _FLEX = torch.compile(flex_attention, dynamic=None)
    return _FLEX
