"""DFlash-family training attention as flex attention: the tile-level BlockMask of a batch's
blocks (`flex_blocks`, no dense `[Q, L + Q]` mask) and the kernel that applies it
(`flex_attend`: compiled on CUDA; on the CPU, or when it cannot compile, the same tiles and
mask_mod as a dense SDPA). Shape legend and semantics: core/models/dflash.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from specbus.core.models.eagle3_attention import TILE, block_mask_from_tiles
from specbus.core.models.kernels import raise_recompile_limit

log = logging.getLogger("specbus.dflash")

FLEX_TILE = TILE  # flex attention's default BLOCK_SIZE (query and key tiles)


def _repeat_kv(x_BNkvTD: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Key/value heads repeated `n_rep` times (grouped-query attention)."""
    if n_rep == 1:
        return x_BNkvTD
    b, n, t, d = x_BNkvTD.shape
    return x_BNkvTD[:, :, None].expand(b, n, n_rep, t, d).reshape(b, n * n_rep, t, d)


@dataclass
class FlexBlocks:
    """The training attention of one batch as a flex-attention BlockMask (no dense mask).

    Keys are laid out `[context padded to ctx_len | block tokens padded to q_pad]`, queries are
    the block tokens padded to `q_pad` (both whole tiles of `FLEX_TILE`). `keep_BQ` marks the
    real query rows of kept blocks (the others see no key: zero output). `tiles_BQtKt` /
    `full_BQtKt` are the partial / full tiles the mask was built from (a full tile skips the
    mask_mod in the kernel); the CPU path applies exactly those semantics to a dense SDPA.
    """

    block_mask: Any
    mask_mod: Any
    keep_BQ: torch.Tensor
    tiles_BQtKt: torch.Tensor
    full_BQtKt: torch.Tensor
    seq_len: int
    ctx_len: int
    q_len: int
    q_pad: int


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


def flex_blocks(
    anchors_BN: torch.Tensor, keep_BN: torch.Tensor, seq_len: int, block_size: int
) -> FlexBlocks:
    """The block mask of `strategies.dflash.block_mask` at the tile level: a query tile needs the
    context tiles below its largest kept anchor (full below its smallest, when every row of the
    tile is kept) and the block-token tiles of its own blocks. Built from [B, tiles] reductions
    on the device: no dense [Q, S] mask, no host sync."""
    device = anchors_BN.device
    b, n = anchors_BN.shape
    k, tile = block_size, FLEX_TILE
    q_len = n * k
    q_pad, ctx_len = _ceil_to(q_len, tile), _ceil_to(seq_len, tile)
    qt, kc, kb = q_pad // tile, ctx_len // tile, q_pad // tile
    q = torch.arange(q_pad, device=device)
    blk_Q = q // k
    blk_c = blk_Q.clamp(max=n - 1)
    anchor_BQ = anchors_BN[:, blk_c]
    keep_BQ = keep_BN[:, blk_c] & (q < q_len)[None]
    big = 1 << 40  # above any position or key, and safe to multiply by K
    a_t, k_t = anchor_BQ.view(b, qt, tile), keep_BQ.view(b, qt, tile)
    amax = torch.where(k_t, a_t, -1).amax(-1, keepdim=True)  # [B, Qt, 1]
    amin = torch.where(k_t, a_t, big).amin(-1, keepdim=True)
    start = torch.arange(kc, device=device) * tile
    ctx_any = start < amax  # some kept row sees some key of the tile
    ctx_full = k_t.all(-1, keepdim=True) & (start + tile <= amin)
    blk_t = blk_Q.view(1, qt, tile).expand(b, -1, -1)
    lo = torch.where(k_t, blk_t, big).amin(-1, keepdim=True) * k  # first own-block key
    hi = (torch.where(k_t, blk_t, -1).amax(-1, keepdim=True) + 1) * k  # past the last
    bstart = torch.arange(kb, device=device) * tile
    blk_any = (bstart < hi) & (bstart + tile > lo)
    full = torch.cat([ctx_full, torch.zeros_like(blk_any)], dim=-1)
    partial = torch.cat([ctx_any & ~ctx_full, blk_any], dim=-1)

    ctx_t = torch.full((), ctx_len, dtype=torch.long, device=device)

    def mask_mod(bi, hi_, qi, kv):  # hi_: the head (unused)
        in_ctx = kv < ctx_t
        sees_ctx = in_ctx & (kv < anchor_BQ[bi, qi])
        own = ~in_ctx & (torch.div(kv - ctx_t, k, rounding_mode="floor") == blk_Q[qi])
        return keep_BQ[bi, qi] & (sees_ctx | own)

    bm = block_mask_from_tiles(partial, full, (q_pad, ctx_len + q_pad), mask_mod)
    return FlexBlocks(bm, mask_mod, keep_BQ, partial, full, seq_len, ctx_len, q_len, q_pad)


def _flex_dense(fb: FlexBlocks) -> torch.Tensor:
    """`[B, 1, Qp, S]`: what the flex kernel computes with `fb`'s tiles (full tiles all, partial
    tiles the mask_mod, other tiles nothing). The CPU path and the tests use it."""
    b = fb.keep_BQ.shape[0]
    s = fb.ctx_len + fb.q_pad
    device = fb.keep_BQ.device
    bi = torch.arange(b, device=device)[:, None, None]
    qi = torch.arange(fb.q_pad, device=device)[None, :, None]
    kv = torch.arange(s, device=device)[None, None, :]
    mod = fb.mask_mod(bi, None, qi, kv)

    def dense(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(FLEX_TILE, 1).repeat_interleave(FLEX_TILE, 2)

    return ((dense(fb.tiles_BQtKt) & mod) | dense(fb.full_BQtKt))[:, None]


_FLEX_KERNEL: Any = None
_FLEX_FAILED = False


def _flex_kernel():
    global _FLEX_KERNEL
    if _FLEX_KERNEL is None:
        from torch.nn.attention.flex_attention import flex_attention

        # dynamic: lengths vary by batch (one compile; every mask input is a tensor, so no
        # length is baked into the graph)
        raise_recompile_limit()  # size-range guards: kernels.py
        _FLEX_KERNEL = torch.compile(flex_attention, dynamic=True)
    return _FLEX_KERNEL


def flex_attend(q, keys, values, fb: FlexBlocks, n_rep: int) -> torch.Tensor:
    """Attention of `q [B, Nh, Qp, D]` over `keys/values [B, Nkv, S, D]` under `fb`: the
    compiled flex kernel on CUDA; the same tiles as a dense SDPA elsewhere (and on CUDA if the
    kernel cannot be compiled: slower, same function)."""
    global _FLEX_FAILED
    dtype = values.dtype  # bf16 under autocast (what SDPA's autocast casts to), else fp32
    q, keys = q.to(dtype), keys.to(dtype)
    if q.device.type == "cuda" and not _FLEX_FAILED:
        try:
            return _flex_kernel()(q, keys, values, block_mask=fb.block_mask, enable_gqa=n_rep > 1)
        except Exception as e:
            _FLEX_FAILED = True
            log.warning("flex attention failed to compile, using the dense mask: %r", e)
    allow = _flex_dense(fb)
    empty = ~allow.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(
        q, _repeat_kv(keys, n_rep), _repeat_kv(values, n_rep), attn_mask=allow | empty
    )
    return out.masked_fill(empty, 0.0)
