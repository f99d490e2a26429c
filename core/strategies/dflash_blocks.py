"""The DFlash family's blocks: anchors, the training block mask, the draft's hidden of every
block, the vocabulary head over block rows and a block's accepted prefix (shared by the three
objectives in dflash_loss.py and their fused forms in dflash_fused.py; the shape legend and
the semantics are in dflash_loss.py's module docstring).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from specbus.core.models.dflash import flex_blocks
from torch import nn


def sample_anchors(
    loss_mask_BL: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(anchors_BN, keep_BN)`: see the module docstring. N = min(num_anchors, max valid count);
    with no valid position anywhere, N = 1 and nothing is kept."""
    device = loss_mask_BL.device
    seq = loss_mask_BL.shape[1]
    cand = max(seq - 1, 0)
    valid = (loss_mask_BL[:, :cand] > 0.5) & (loss_mask_BL[:, 1 : cand + 1] > 0.5)
    counts = valid.sum(dim=1)
    width = min(num_anchors, int(counts.max())) if cand else 0
    if width == 0:
        shape = (loss_mask_BL.shape[0], 1)
        return torch.zeros(shape, dtype=torch.long, device=device), torch.zeros(
            shape, dtype=torch.bool, device=device
        )
    scores = torch.rand(valid.shape, generator=generator, device=_gen_device(generator)).to(device)
    scores.masked_fill_(~valid, 2.0)
    picked = scores.argsort(dim=1)[:, :width]
    keep = torch.arange(width, device=device)[None] < counts.clamp(max=width)[:, None]
    anchors = torch.where(keep, picked, torch.full_like(picked, cand)).sort(dim=1).values
    keep = anchors < cand
    return torch.where(keep, anchors, 0), keep


def _gen_device(generator: torch.Generator | None) -> torch.device:
    return generator.device if generator is not None else torch.device("cpu")


def block_mask(
    anchors_BN: torch.Tensor, keep_BN: torch.Tensor, seq_len: int, block_size: int
) -> torch.Tensor:
    """`allow_BQS`: query q (block q // K) may see key s: a context key s < anchor, or a key of
    its own block; nothing for a block that is not kept."""
    device = anchors_BN.device
    n = anchors_BN.shape[1]
    q = torch.arange(n * block_size, device=device)
    s = torch.arange(seq_len + n * block_size, device=device)
    q_block = (q // block_size)[None, :, None]
    anchor_BQ1 = anchors_BN.repeat_interleave(block_size, dim=1)[:, :, None]
    context = (s[None, None] < seq_len) & (s[None, None] < anchor_BQ1)
    own = (s[None, None] >= seq_len) & ((s[None, None] - seq_len) // block_size == q_block)
    return (context | own) & keep_BN.repeat_interleave(block_size, dim=1)[:, :, None]


def gather_blocks(values_BL: torch.Tensor, anchors_BN: torch.Tensor, offsets_K: torch.Tensor):
    """`values[anchor + k]` for every block `[B, N, K]` (indices clamped), and the in-range mask."""
    seq = values_BL.shape[1]
    idx = anchors_BN[:, :, None] + offsets_K[None, None]
    safe = idx.clamp(max=seq - 1)
    gathered = torch.gather(values_BL[:, None].expand(-1, anchors_BN.shape[1], -1), 2, safe)
    return gathered, idx < seq, safe


def draft_blocks(
    model: nn.Module,
    *,
    input_ids_BL: torch.Tensor,
    hidden_states_BLA: torch.Tensor,
    anchors_BN: torch.Tensor,
    keep_BN: torch.Tensor,
    embed_VH: torch.Tensor,
    mask_token_id: int,
    block_size: int,
    attention: str = "sdpa",
) -> torch.Tensor:
    """The draft's post-norm hidden of every block `[B, N, K, H]` (one call of `model`)."""
    b, seq = input_ids_BL.shape
    n = anchors_BN.shape[1]
    device = input_ids_BL.device
    noise = torch.full((b, n, block_size), mask_token_id, dtype=torch.long, device=device)
    anchor_tok = torch.gather(input_ids_BL, 1, anchors_BN.clamp(0, seq - 1))
    noise[:, :, 0] = torch.where(keep_BN, anchor_tok, torch.full_like(anchor_tok, mask_token_id))
    noise_BQH = F.embedding(noise.view(b, n * block_size), embed_VH)
    offsets = torch.arange(block_size, device=device)
    positions = torch.cat(
        [
            torch.arange(seq, device=device)[None].expand(b, -1),
            (anchors_BN[:, :, None] + offsets).view(b, n * block_size),
        ],
        dim=1,
    )
    if attention == "flex":  # a tile-level BlockMask, no dense [B, Q, S] mask
        allow = flex_blocks(anchors_BN, keep_BN, seq, block_size)
    else:
        allow = block_mask(anchors_BN, keep_BN, seq, block_size)
    hidden = model(noise_BQH, hidden_states_BLA, positions, allow, attention)
    return hidden.view(b, n, block_size, -1)


@torch.no_grad()
def accept_prefix(pred_BNK, target_BNK, valid_BNK) -> torch.Tensor:
    """Accepted prefix length per block: consecutive correct valid positions (invalid count as
    correct inside the prefix, zero themselves), as the reference's `compute_accept_len`."""
    correct = (pred_BNK == target_BNK) | ~valid_BNK
    return (correct.long().cumprod(dim=2) * valid_BNK.long()).sum(dim=2).float()


def rows_linear(x: torch.Tensor, weight_OI: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` as one 2-D matmul over all leading dims. A chunk sliced out of
    `[B, N, K, H]` along N is not foldable into rows without a copy, and `matmul` then runs a
    batched GEMM of B*n tiny `[K, H] @ [H, V]` products: on the H200 that was 39 ms per chunk
    against ~4 ms for the same FLOPs as one GEMM (docs/dflash.md, "Training"). The reshape
    copies such a slice (megabytes) instead."""
    return F.linear(x.reshape(-1, x.shape[-1]), weight_OI).view(*x.shape[:-1], weight_OI.shape[0])


def head_logits(hidden: torch.Tensor, lm_head_VH: torch.Tensor) -> torch.Tensor:
    """The vocabulary head over every block row (`hidden` cast to the head's dtype)."""
    return rows_linear(hidden.to(lm_head_VH.dtype), lm_head_VH)
