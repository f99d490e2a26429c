"""DFlash, Domino and DSpark: block drafting from injected target context (SpecForge 0.2.0 semantics).

Shape legend: B batch, L sequence, N blocks (anchors), K block size, Q = N*K, S = L + Q,
H hidden, V target vocab, A aux width (target layers x H).

Shared by the three (`draft_blocks`):
- Anchors: up to `num_anchors` positions t per sample where loss_mask[t] and loss_mask[t+1]
  are set, drawn without replacement (uniform scores from an explicit generator, the lowest
  `num_anchors` kept, sorted); a sample with fewer valid positions pads with kept=False
  blocks (anchor 0). Fixed anchors can be passed instead.
- Block n = [token at anchor_n, MASK x (K-1)], embedded with the target's embedding, at
  positions anchor_n + k. The draft attends to the projected, normed target context (KV
  injection): block n sees context positions < anchor_n and all of block n (bidirectional).

Objectives (`*_loss`, pure: inputs -> (loss, metrics); `model` is called once):
- dflash: position k predicts token anchor+k through the target lm_head;
  w[n,k] = keep * (anchor+k < L) * (k >= 1) * loss_mask[anchor+k] * exp(-(k-1)/gamma);
  loss = sum(CE * w) / sum(w).
- domino: the same labels; final logits = base + embed_proj(hidden_k, GRU(emb(tokens
  anchor..anchor+k-1))) for k >= 1 (teacher forced); loss = (1-lambda) * CE_final + lambda *
  CE_base (each sum(CE*w) / (sum(w) + 1e-6)); lambda = lambda_start * (1 - step / (ratio *
  total)) clamped to [0, 1], 0 when the total is unknown.
- dspark: position k (0..K-1) predicts token anchor+k+1; eval mask = keep * in range *
  loss_mask, cut at the first unsupervised position of the block; w = eval * exp(-k/gamma);
  logits = base + Markov bias of the previous token (the anchor, then the true tokens);
  L1 = sum_v |softmax(draft) - softmax(teacher)|, the teacher being the target lm_head on the
  captured final hidden state at anchor+k; accept = clamp(1 - L1/2, 0, 1); confidence =
  BCE(confidence logit, accept); loss = world * (a_ce CE + a_l1 L1 + a_conf conf) . w /
  sum over ranks of sum(w).
Logits are computed `chunk_blocks` blocks at a time (activation-checkpointed when training).

Metrics (detached): per drafted position j (the j-th token after the anchor) correct_j,
denom_j, acc_j, ploss_j; accuracy; accept_len (mean over blocks of the accepted prefix + 1);
sim_accept_len = sum_j prod_{i<=j} acc_i; loss, loss_denom; plus each objective's own terms.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from specbus.core.config import StrategyConfig
from specbus.core.errors import ConfigError
from specbus.core.models.dflash import DFlashConfig, DFlashDraft, flex_blocks
from specbus.core.models.kernels import compiled
from specbus.core.models.target import TargetHeads, TargetInfo
from specbus.core.strategies.base import (
    FeatureContract,
    FeatureField,
    Metrics,
    StepContext,
    TrainBatch,
    pad_right,
    register_strategy,
)
from specbus.core.strategies.eagle3 import unwrap
from torch import nn

# ---------------------------------------------------------------------------------------------
# Anchors, masks, blocks


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


def chunked_sum(fn: Callable[..., tuple[torch.Tensor, ...]], *tensors, chunk: int):
    """Sum `fn`'s terms over slices of dim 1 (blocks) of every tensor (None passes through);
    activation-checkpointed per slice when gradients are needed (SpecForge's chunked reduce)."""
    n = next(t for t in tensors if t is not None).shape[1]
    step = chunk or n
    totals = None
    for start in range(0, n, step):
        args = tuple(t[:, start : start + step] if t is not None else None for t in tensors)
        if (
            chunk
            and torch.is_grad_enabled()
            and any(t is not None and t.requires_grad for t in args)
        ):
            from torch.utils.checkpoint import checkpoint

            terms = checkpoint(fn, *args, use_reentrant=False)
        else:
            terms = fn(*args)
        totals = (
            terms if totals is None else tuple(a + b for a, b in zip(totals, terms, strict=True))
        )
    return totals


@torch.no_grad()
def accept_prefix(pred_BNK, target_BNK, valid_BNK) -> torch.Tensor:
    """Accepted prefix length per block: consecutive correct valid positions (invalid count as
    correct inside the prefix, zero themselves), as the reference's `compute_accept_len`."""
    correct = (pred_BNK == target_BNK) | ~valid_BNK
    return (correct.long().cumprod(dim=2) * valid_BNK.long()).sum(dim=2).float()


def _position_metrics(metrics: Metrics, correct_K, denom_K, ce_K, first: int) -> None:
    """Per drafted position j = k - first: correct_j, denom_j, acc_j, ploss_j; sim_accept_len.
    Computed for all positions at once (a few kernels, not a few per position)."""
    denom = denom_K[first:].clamp_min(1e-6)
    acc_J = correct_K[first:] / denom
    ploss_J = ce_K[first:] / denom
    for j in range(acc_J.shape[0]):
        metrics[f"correct_{j}"] = correct_K[first + j]
        metrics[f"denom_{j}"] = denom_K[first + j]
        metrics[f"acc_{j}"] = acc_J[j]
        metrics[f"ploss_{j}"] = ploss_J[j]
    metrics["sim_accept_len"] = acc_J.cumprod(0).sum()


def _logits(hidden: torch.Tensor, lm_head_VH: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden.to(lm_head_VH.dtype), lm_head_VH)


def _ce(logits_BNKV: torch.Tensor, target_BNK: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits_BNKV.reshape(-1, logits_BNKV.shape[-1]).float(),
        target_BNK.reshape(-1),
        reduction="none",
    ).view_as(target_BNK)


class _FusedHead(torch.autograd.Function):
    """Chunked vocabulary head whose gradient is computed in the forward (`fused_head`)."""

    @staticmethod
    def forward(ctx, terms, lm_head_VH, chunk, h, e, m2, *per_block):
        n = h.shape[1]
        step = chunk or n
        grad_h = torch.empty_like(h)
        grad_e = torch.empty_like(e) if e is not None else None
        grad_m2 = torch.zeros_like(m2, dtype=torch.float32) if m2 is not None else None
        sums, rows = None, []
        for start in range(0, n, step):
            sl = slice(start, start + step)
            hc = h[:, sl]
            z = F.linear(hc.to(lm_head_VH.dtype), lm_head_VH)
            if e is not None:
                z = z + F.linear(e[:, sl], m2)
            # contiguous chunks: one compiled graph for every chunk (no stride guards)
            chunk_args = (t[:, sl].contiguous() if t is not None else None for t in per_block)
            grad_z, c_sums, c_rows = terms(z, *chunk_args)
            grad_z = grad_z.to(z.dtype)
            grad_h[:, sl] = torch.matmul(grad_z, lm_head_VH.to(grad_z.dtype)).to(h.dtype)
            if e is not None:
                grad_e[:, sl] = torch.matmul(grad_z, m2.to(grad_z.dtype)).to(e.dtype)
                flat = grad_z.reshape(-1, grad_z.shape[-1])
                grad_m2 += (flat.T @ e[:, sl].reshape(-1, e.shape[-1]).to(flat.dtype)).float()
            del z, grad_z
            if sums is None:  # distinct outputs even where terms returned one tensor twice
                sums = tuple(t.clone() for t in c_sums)
            else:
                sums = tuple(a + b for a, b in zip(sums, c_sums, strict=True))
            rows.append(c_rows)
        ctx.save_for_backward(grad_h, grad_e, grad_m2)
        ctx.m2_dtype = m2.dtype if m2 is not None else None
        ctx.num_per_block = len(per_block)
        out = (*sums, *(torch.cat(parts, dim=1) for parts in zip(*rows, strict=True)))
        ctx.mark_non_differentiable(*out[1:])
        return out

    @staticmethod
    def backward(ctx, g_obj, *_):
        grad_h, grad_e, grad_m2 = ctx.saved_tensors
        return (
            None, None, None, grad_h * g_obj,
            grad_e * g_obj if grad_e is not None else None,
            (grad_m2 * g_obj).to(ctx.m2_dtype) if grad_m2 is not None else None,
            *([None] * ctx.num_per_block),
        )  # fmt: skip


def fused_head(terms, lm_head_VH, chunk, h, *per_block, markov=None):
    """Sum `terms` over chunks of `chunk` blocks like `chunked_sum`, but with the logits'
    gradient computed right away: per chunk, z = lm_head(h) (+ the low-rank Markov bias
    `e @ M2^T`, `markov = (e_BNKR, M2_VR)`), then `terms(z, *per_block chunk)` returns
    `(dobj/dz, sums, rows)` where `sums[0]` is the objective; the hidden's (and the Markov
    inputs') gradient is one matmul of dobj/dz per chunk, kept until the backward (which
    scales it). No logits are kept or recomputed: one vocabulary matmul per chunk for the
    logits and one for the gradient, instead of three under activation checkpointing.
    Returns `(objective, *sums[1:], *rows concatenated on dim 1)`; only the objective has a
    gradient (to `h`, `e`, `M2`)."""
    e, m2 = markov if markov is not None else (None, None)
    return _FusedHead.apply(terms, lm_head_VH, chunk, h, e, m2, *per_block)


def fused_ce_grad(z: torch.Tensor, tgt: torch.Tensor, w: torch.Tensor):
    """`(ce, d sum(ce * w) / dz)` of logits `z`: ce as `_ce` computes it (cross_entropy =
    nll of log_softmax), the gradient (exp(log_softmax) - onehot) * w as log_softmax's
    backward does, in place in one fp32 buffer."""
    logp = torch.log_softmax(z.float(), dim=-1)
    ce = -logp.gather(-1, tgt[..., None]).squeeze(-1)
    grad = logp.exp_().mul_(w[..., None])
    grad.scatter_add_(-1, tgt[..., None], -w[..., None])
    return ce, grad


@compiled
def dflash_chunk_terms(z, tgt, m, w):
    """DFlash's terms of one chunk of blocks from its logits `z [B, n, K, V]`: the gradient
    of sum(ce * w) w.r.t. z, then the sums `dflash_loss` pools (compiled on CUDA)."""
    ce, grad = fused_ce_grad(z, tgt, w)
    pred = z.argmax(-1)
    hit = ((pred == tgt) & (m > 0.5)).float()
    acc_len = accept_prefix(pred, tgt, m > 0)
    blocks = (m > 0).any(-1).float()
    return (
        grad, (ce * w).sum(), w.sum(), hit.sum(), m.sum(),
        hit.sum((0, 1)), m.sum((0, 1)), (ce * m).sum((0, 1)),
        ((acc_len + 1.0) * blocks).sum(), blocks.sum(),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# DFlash


def dflash_loss(
    model: nn.Module,
    *,
    input_ids_BL: torch.Tensor,
    loss_mask_BL: torch.Tensor,
    hidden_states_BLA: torch.Tensor,
    embed_VH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    mask_token_id: int,
    block_size: int = 16,
    num_anchors: int = 512,
    gamma: float | None = 7.0,
    anchors: tuple[torch.Tensor, torch.Tensor] | None = None,
    generator: torch.Generator | None = None,
    chunk_blocks: int = 128,
    attention: str = "sdpa",
    den_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    world_size: int = 1,
    fused: bool = False,
) -> tuple[torch.Tensor, Metrics]:
    """The DFlash objective (module docstring). `anchors` = (anchors_BN, keep_BN) or sampled
    with `generator`; `den_reduce` sums the weight total over data-parallel ranks; `fused`:
    the logits' gradient in the forward (`fused_head`), else activation checkpointing."""
    anchors_BN, keep_BN = anchors or sample_anchors(loss_mask_BL, num_anchors, generator)
    hidden = draft_blocks(
        model, input_ids_BL=input_ids_BL, hidden_states_BLA=hidden_states_BLA,
        anchors_BN=anchors_BN, keep_BN=keep_BN, embed_VH=embed_VH,
        mask_token_id=mask_token_id, block_size=block_size, attention=attention,
    )  # fmt: skip
    offsets = torch.arange(block_size, device=input_ids_BL.device)
    target, in_range, _ = gather_blocks(input_ids_BL, anchors_BN, offsets)
    lm, _, _ = gather_blocks(loss_mask_BL.float(), anchors_BN, offsets)
    mask = keep_BN[:, :, None].float() * in_range.float() * (offsets > 0).float() * lm
    decay = (
        torch.exp(-(offsets - 1).clamp(min=0).float() / gamma)
        if gamma
        else torch.ones(block_size, device=offsets.device)
    )
    weights = mask * decay

    def terms(h, tgt, m, w):
        logits = _logits(h, lm_head_VH)
        ce = _ce(logits, tgt)
        with torch.no_grad():
            pred = logits.argmax(-1)
            hit = ((pred == tgt) & (m > 0.5)).float()
            acc_len = accept_prefix(pred, tgt, m > 0)
            blocks = (m > 0).any(-1).float()
        return (
            (ce * w).sum(), w.sum(), hit.sum(), m.sum(),
            hit.sum((0, 1)), m.sum((0, 1)), (ce.detach() * m).sum((0, 1)),
            ((acc_len + 1.0) * blocks).sum(), blocks.sum(),
        )  # fmt: skip

    def fused_terms(z, tgt, m, w):
        grad, *sums = dflash_chunk_terms(z, tgt, m, w)
        return grad, tuple(sums), ()

    if fused:
        num, den, correct, acc_den, correct_K, den_K, ce_K, acc_num, blocks = fused_head(
            fused_terms, lm_head_VH, chunk_blocks, hidden, target, mask, weights
        )
    else:
        num, den, correct, acc_den, correct_K, den_K, ce_K, acc_num, blocks = chunked_sum(
            terms, hidden, target, mask, weights, chunk=chunk_blocks
        )
    total = den_reduce(den.detach().clone()) if den_reduce is not None else den.detach()
    loss = world_size * num / total.clamp_min(1e-12)
    metrics: Metrics = {
        "loss": loss.detach(),
        "loss_denom": den.detach(),
        "accuracy": correct / acc_den.clamp_min(1e-6),
        "accept_len": acc_num / blocks.clamp_min(1e-6),
    }
    _position_metrics(metrics, correct_K, den_K, ce_K, first=1)
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# Domino


def domino_lambda(step: StepContext | None, start: float = 1.0, decay_ratio: float = 0.5) -> float:
    """Base-loss weight: linear from `start` to 0 over the first `decay_ratio` of the schedule."""
    if step is None or not step.total_steps:
        return 0.0
    decay_steps = max(1, int(step.total_steps * decay_ratio))
    progress = min(step.global_step / decay_steps, 1.0)
    return max(0.0, min(1.0, start * (1.0 - progress)))


def domino_loss(
    model: nn.Module,
    *,
    input_ids_BL: torch.Tensor,
    loss_mask_BL: torch.Tensor,
    hidden_states_BLA: torch.Tensor,
    embed_VH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    mask_token_id: int,
    lambda_base: float,
    block_size: int = 16,
    num_anchors: int = 512,
    gamma: float | None = 7.0,
    anchors: tuple[torch.Tensor, torch.Tensor] | None = None,
    generator: torch.Generator | None = None,
    chunk_blocks: int = 128,
    attention: str = "sdpa",
) -> tuple[torch.Tensor, Metrics]:
    """The Domino objective (module docstring); `lambda_base` from `domino_lambda`."""
    draft = unwrap(model)
    anchors_BN, keep_BN = anchors or sample_anchors(loss_mask_BL, num_anchors, generator)
    hidden = draft_blocks(
        model, input_ids_BL=input_ids_BL, hidden_states_BLA=hidden_states_BLA,
        anchors_BN=anchors_BN, keep_BN=keep_BN, embed_VH=embed_VH,
        mask_token_id=mask_token_id, block_size=block_size, attention=attention,
    )  # fmt: skip
    offsets = torch.arange(block_size, device=input_ids_BL.device)
    target, in_range, _ = gather_blocks(input_ids_BL, anchors_BN, offsets)
    lm, _, _ = gather_blocks(loss_mask_BL.float(), anchors_BN, offsets)
    mask = keep_BN[:, :, None].float() * in_range.float() * (offsets > 0).float() * lm
    decay = (
        torch.exp(-(offsets - 1).clamp(min=0).float() / gamma)
        if gamma
        else torch.ones(block_size, device=offsets.device)
    )
    weights = mask * decay

    def terms(h, tgt, m, w):
        base = _logits(h, lm_head_VH)
        final = draft.domino_logits(base, h, F.embedding(tgt, embed_VH))
        final_ce, base_ce = _ce(final, tgt), _ce(base, tgt)
        with torch.no_grad():
            pred, base_pred = final.argmax(-1), base.argmax(-1)
            valid = m > 0.5
            hit = ((pred == tgt) & valid).float()
            base_hit = ((base_pred == tgt) & valid).float()
            blocks = (m > 0).any(-1).float()
            acc_len = accept_prefix(pred, tgt, m > 0)
            base_len = accept_prefix(base_pred, tgt, m > 0)
        return (
            (final_ce * w).sum(), (base_ce * w).sum(), w.sum(), hit.sum(), base_hit.sum(), m.sum(),
            ((acc_len + 1.0) * blocks).sum(), ((base_len + 1.0) * blocks).sum(), blocks.sum(),
            hit.sum((0, 1)), m.sum((0, 1)), (final_ce.detach() * m).sum((0, 1)),
        )  # fmt: skip

    (final_num, base_num, den, correct, base_correct, acc_den, acc_num, base_acc_num, blocks,
     correct_K, den_K, ce_K) = chunked_sum(terms, hidden, target, mask, weights, chunk=chunk_blocks)  # fmt: skip
    final_loss = final_num / (den + 1e-6)
    base_loss = base_num / (den + 1e-6)
    loss = (1.0 - lambda_base) * final_loss + lambda_base * base_loss
    metrics: Metrics = {
        "loss": loss.detach(),
        "loss_denom": den.detach(),
        "final_loss": final_loss.detach(),
        "base_loss": base_loss.detach(),
        "accuracy": correct / (acc_den + 1e-6),
        "base_accuracy": base_correct / (acc_den + 1e-6),
        "accept_len": acc_num / (blocks + 1e-6),
        "base_accept_len": base_acc_num / (blocks + 1e-6),
        "lambda_base": torch.tensor(float(lambda_base)),
    }
    _position_metrics(metrics, correct_K, den_K, ce_K, first=1)
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# DSpark


def dspark_loss(
    model: nn.Module,
    *,
    input_ids_BL: torch.Tensor,
    loss_mask_BL: torch.Tensor,
    hidden_states_BLA: torch.Tensor,
    target_BLH: torch.Tensor,
    embed_VH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    mask_token_id: int,
    block_size: int = 16,
    num_anchors: int = 512,
    gamma: float | None = 7.0,
    ce_alpha: float = 0.1,
    l1_alpha: float = 0.9,
    confidence_alpha: float = 1.0,
    anchors: tuple[torch.Tensor, torch.Tensor] | None = None,
    generator: torch.Generator | None = None,
    chunk_blocks: int = 128,
    attention: str = "sdpa",
    den_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    world_size: int = 1,
    fused: bool = False,
) -> tuple[torch.Tensor, Metrics]:
    """The DSpark objective (module docstring); `target_BLH` is the captured post-norm final
    hidden state (the teacher for L1 and the confidence target). `fused`: CE and L1 with their
    logits' gradient in the forward (`fused_head`; a vanilla or no Markov head), else
    activation checkpointing."""
    draft = unwrap(model)
    anchors_BN, keep_BN = anchors or sample_anchors(loss_mask_BL, num_anchors, generator)
    hidden = draft_blocks(
        model, input_ids_BL=input_ids_BL, hidden_states_BLA=hidden_states_BLA,
        anchors_BN=anchors_BN, keep_BN=keep_BN, embed_VH=embed_VH,
        mask_token_id=mask_token_id, block_size=block_size, attention=attention,
    )  # fmt: skip
    b, seq = input_ids_BL.shape
    device = input_ids_BL.device
    offsets = torch.arange(1, block_size + 1, device=device)
    idx = anchors_BN[:, :, None] + offsets
    safe = torch.where(keep_BN[:, :, None], idx.clamp(max=seq - 1), torch.zeros_like(idx))
    n = anchors_BN.shape[1]
    target = torch.gather(input_ids_BL[:, None].expand(-1, n, -1), 2, safe)
    lm = torch.gather(loss_mask_BL[:, None].expand(-1, n, -1), 2, safe)
    eval_mask = (idx < seq) & (lm > 0.5) & keep_BN[:, :, None]
    eval_mask = eval_mask.int().cumprod(dim=-1).bool()
    weights = eval_mask.float()
    if gamma:
        weights = weights * torch.exp(-torch.arange(block_size, device=device).float() / gamma)
    anchor_tok = torch.gather(input_ids_BL, 1, anchors_BN)
    prev = torch.cat([anchor_tok[:, :, None], target[:, :, :-1]], dim=-1)
    need_teacher = l1_alpha > 0 or (confidence_alpha > 0 and draft.confidence_head is not None)
    teacher_h = None
    if need_teacher:
        teacher_idx = (safe - 1).clamp(min=0).reshape(b, -1, 1).expand(-1, -1, target_BLH.shape[-1])
        teacher_h = torch.gather(target_BLH, 1, teacher_idx).view(b, n, block_size, -1)

    def terms(h, prv, tgt, w, ev, th):
        base = _logits(h, lm_head_VH)
        logits = (
            draft.markov_head.block_logits(base, prv, h) if draft.markov_head is not None else base
        )
        ce = _ce(logits, tgt)
        zero = ce.new_zeros(())
        l1_num = conf_num = conf_err = agree = t_top1 = d_top1 = tau_num = tau_den = zero
        rate_K = ce.new_zeros(ce.shape[-1])
        accept = None
        if th is not None:
            with torch.no_grad():
                t_logits = _logits(th, lm_head_VH)
                t_prob = torch.softmax(t_logits.float(), dim=-1)
                t_ids = t_logits.argmax(-1)
            d_prob = torch.softmax(logits.float(), dim=-1)
            l1 = (d_prob - t_prob).abs().sum(-1)
            accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0)
            if l1_alpha > 0:
                l1_num = (l1 * w).sum()
        conf = draft.confidence_logits(h, prv)
        if conf is not None and confidence_alpha > 0:
            if accept is None:
                raise ConfigError("DSpark's confidence loss needs the target's final hidden state")
            bce = F.binary_cross_entropy_with_logits(
                conf.float(), accept.detach(), reduction="none"
            )
            conf_num = (bce * w).sum()
            conf_err = ((conf.float().sigmoid() - accept).abs() * w).sum()
        with torch.no_grad():
            pred = logits.argmax(-1)
            hit = ((pred == tgt) & ev).float()
            evf = ev.float()
            if accept is not None:
                agree = ((pred == t_ids).float() * evf).sum()
                t_top1 = (t_prob.max(-1).values * evf).sum()
                d_top1 = (d_prob.max(-1).values * evf).sum()
                blocks = ev.any(-1).float()
                tau_num = (((accept.detach() * evf).cumprod(-1).sum(-1) + 1.0) * blocks).sum()
                tau_den = blocks.sum()
                rate_K = (accept.detach() * evf).sum((0, 1))
            acc_len = accept_prefix(pred, tgt, ev)
            blocks = ev.any(-1).float()
        return (
            (ce * w).sum(), l1_num, conf_num, conf_err, hit.sum(), evf.sum(),
            (ce.detach() * evf).sum((0, 1)), hit.sum((0, 1)), evf.sum((0, 1)),
            agree, t_top1, d_top1, tau_num, tau_den, rate_K,
            ((acc_len + 1.0) * blocks).sum(), blocks.sum(),
        )  # fmt: skip

    markov = draft.markov_head
    if fused and (markov is None or markov.kind == "vanilla"):
        teacher = teacher_h
        if need_teacher and b * seq <= b * n * block_size:
            # positions repeat across overlapping blocks: the teacher's logits once per position
            # of the sequence, gathered per block row (fewer rows through the vocabulary matmul)
            with torch.no_grad():
                teacher = TeacherTable(
                    _logits(target_BLH, lm_head_VH), (safe - 1).clamp(min=0).view(b, n, -1)
                )
        objective, *sums = _dspark_fused(
            draft, lm_head_VH, chunk_blocks, hidden, prev, target, weights, eval_mask, teacher,
            ce_alpha=ce_alpha, l1_alpha=l1_alpha, confidence_alpha=confidence_alpha,
        )  # fmt: skip
        (ce_num, l1_num, conf_num, conf_err, correct, eval_den, ce_K, correct_K, den_K, agree,
         t_top1, d_top1, tau_num, tau_den, rate_K, acc_num, blocks) = sums  # fmt: skip
    else:
        (ce_num, l1_num, conf_num, conf_err, correct, eval_den, ce_K, correct_K, den_K, agree,
         t_top1, d_top1, tau_num, tau_den, rate_K, acc_num, blocks) = chunked_sum(
            terms, hidden, prev, target, weights, eval_mask, teacher_h, chunk=chunk_blocks
        )  # fmt: skip
        objective = ce_alpha * ce_num + l1_alpha * l1_num + confidence_alpha * conf_num
    den = weights.sum()
    total = den_reduce(den.detach().clone()) if den_reduce is not None else den.detach()
    loss = world_size * objective / total.clamp_min(1e-12)
    d = den.clamp_min(1e-12)
    e = eval_den.clamp_min(1.0)
    metrics: Metrics = {
        "loss": loss.detach(),
        "loss_denom": den.detach(),
        "accuracy": correct / e,
        "ce_loss": ce_num.detach() / d,
        "l1_loss": l1_num.detach() / d,
        "confidence_loss": conf_num.detach() / d,
        "confidence_abs_error": conf_err.detach() / d,
        "accept_len": acc_num / blocks.clamp_min(1e-6),
    }
    if teacher_h is not None:
        metrics.update(
            teacher_agreement=agree / e, teacher_top1_prob=t_top1 / e,
            draft_top1_prob=d_top1 / e, tau_probabilistic=tau_num / tau_den.clamp_min(1e-6),
        )  # fmt: skip
        for j in range(block_size):
            metrics[f"acceptance_rate_{j}"] = rate_K[j] / den_K[j].clamp_min(1e-6)
    _position_metrics(metrics, correct_K, den_K, ce_K, first=0)
    return loss, metrics


@compiled
def dspark_chunk_terms(z, t_logits, tgt, w, ev, ce_alpha: float, l1_alpha: float):
    """DSpark's terms of one chunk from its logits `z [B, n, K, V]` (base + Markov bias) and
    the teacher's logits (None: no L1 term): `(d objective / dz, accept, objective, <the
    checkpointed path's sums>)`, objective = ce_alpha * sum(ce * w) + l1_alpha * sum(l1 * w).
    Compiled on CUDA."""
    evf = ev.float()
    logp = torch.log_softmax(z.float(), dim=-1)
    ce = -logp.gather(-1, tgt[..., None]).squeeze(-1)
    pred = z.argmax(-1)
    hit = ((pred == tgt) & ev).float()
    zero = ce.new_zeros(())
    l1_num = agree = t_top1 = d_top1 = tau_num = tau_den = zero
    rate_K = ce.new_zeros(ce.shape[-1])
    accept = torch.zeros_like(ce)
    blocks = ev.any(-1).float()
    if t_logits is not None:
        t_prob = torch.softmax(t_logits.float(), dim=-1)
        t_ids = t_logits.argmax(-1)
        p = torch.softmax(z.float(), dim=-1)
        t_top1 = (t_prob.max(-1).values * evf).sum()
        diff = p - t_prob
        del t_prob
        l1 = diff.abs().sum(-1)
        accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0)
        l1_num = (l1 * w).sum()
        agree = ((pred == t_ids).float() * evf).sum()
        d_top1 = (p.max(-1).values * evf).sum()
        tau_num = (((accept * evf).cumprod(-1).sum(-1) + 1.0) * blocks).sum()
        tau_den = blocks.sum()
        rate_K = (accept * evf).sum((0, 1))
        # d|p - t|_1 / dz = p * (sign - <sign, p>): softmax's backward of the sign
        grad = diff.sign_().mul_(p)
        grad.sub_(p * grad.sum(-1, keepdim=True)).mul_((l1_alpha * w)[..., None])
        if ce_alpha:
            grad.add_(logp.exp_().mul_((ce_alpha * w)[..., None]))
        del p
    else:
        grad = logp.exp_().mul_((ce_alpha * w)[..., None])
    if ce_alpha:
        grad.scatter_add_(-1, tgt[..., None], -(ce_alpha * w)[..., None])
    acc_len = accept_prefix(pred, tgt, ev)
    return (
        grad, accept, ce_alpha * (ce * w).sum() + l1_alpha * l1_num,
        (ce * w).sum(), l1_num, hit.sum(), evf.sum(),
        (ce * evf).sum((0, 1)), hit.sum((0, 1)), evf.sum((0, 1)),
        agree, t_top1, d_top1, tau_num, tau_den, rate_K,
        ((acc_len + 1.0) * blocks).sum(), blocks.sum(),
    )  # fmt: skip


@dataclass(frozen=True)
class TeacherTable:
    """The teacher's logits `[B, L, V]` once per sequence position, and the position of each
    block row `[B, N, K]` (instead of the captured hidden state gathered per block row)."""

    logits_BLV: torch.Tensor
    index_BNK: torch.Tensor


def _dspark_fused(draft, lm_head_VH, chunk, hidden, prev, target, weights, eval_mask, teacher,
                  *, ce_alpha, l1_alpha, confidence_alpha):  # fmt: skip
    """DSpark's chunked terms through `fused_head`: the CE and L1 gradients w.r.t. the logits
    (base + vanilla Markov bias) are formed in the forward; the confidence head (one linear
    layer) runs afterwards over every block with plain autograd, against the L1 acceptance.
    `teacher`: the captured final hidden state per block row `[B, N, K, H]`, a `TeacherTable`,
    or None (no L1 / confidence target). Returns `(objective, ce_num, l1_num, conf_num,
    conf_err, <the metric sums of the checkpointed path, in its order>)`."""
    markov = draft.markov_head
    use_teacher = teacher is not None
    table = teacher if isinstance(teacher, TeacherTable) else None
    teacher_h = teacher.index_BNK if table is not None else teacher

    def terms(z, prv, tgt, w, ev, th):
        if table is not None:  # th: the chunk's positions [B, n, K]
            rows = torch.arange(th.shape[0], device=th.device)[:, None, None]
            t_logits = table.logits_BLV[rows, th]
        else:
            t_logits = _logits(th, lm_head_VH) if use_teacher else None
        grad, accept, *sums = dspark_chunk_terms(z, t_logits, tgt, w, ev, ce_alpha, l1_alpha)
        return grad, tuple(sums), (accept,)

    m = (markov.prev_embeddings(prev), markov.markov_w2.weight) if markov is not None else None
    (obj, ce_num, l1_num, correct, eval_den, ce_K, correct_K, den_K, agree, t_top1, d_top1,
     tau_num, tau_den, rate_K, acc_num, blocks, accept) = fused_head(
        terms, lm_head_VH, chunk, hidden, prev, target, weights, eval_mask, teacher_h, markov=m
    )  # fmt: skip
    conf_num = conf_err = obj.new_zeros(())
    conf = draft.confidence_logits(hidden, prev)
    if conf is not None and confidence_alpha > 0:
        if not use_teacher:
            raise ConfigError("DSpark's confidence loss needs the target's final hidden state")
        bce = F.binary_cross_entropy_with_logits(conf.float(), accept, reduction="none")
        conf_num = (bce * weights).sum()
        with torch.no_grad():
            conf_err = ((conf.float().sigmoid() - accept).abs() * weights).sum()
    objective = obj + confidence_alpha * conf_num
    return (objective, ce_num, l1_num, conf_num, conf_err, correct, eval_den, ce_K, correct_K,
            den_K, agree, t_top1, d_top1, tau_num, tau_den, rate_K, acc_num, blocks)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The strategies


@dataclass(frozen=True)
class Heads:
    embed_VH: torch.Tensor
    lm_head_VH: torch.Tensor


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """SpecForge/SGLang's DFlash default: the middle layer for one draft layer, else evenly
    from layer 1 to layer L-3 (0-based decoder layer outputs)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [
        int(round(start + i * (end - start) / (num_draft_layers - 1)))
        for i in range(num_draft_layers)
    ]


class DFlashFamilyStrategy:
    """Adapter of the DFlash-family objectives to the strategy registry (`projector` picks one).

    Keys it reads: strategy.{block_size, num_anchors, loss_gamma, mask_token_id, anchor_seed,
    chunk_blocks, attention, draft.{num_layers, intermediate_size, num_attention_heads,
    num_key_value_heads}} and its own section (domino / dspark). Any other key set explicitly
    (ttt_length, step_weight, draft.draft_vocab_size, draft.hidden_size other than the target's,
    the other method's section), when it differs from its default, is refused by name.
    """

    projector = "dflash"
    SECTIONS: tuple[str, ...] = ()
    KEYS = frozenset(
        {"name", "block_size", "num_anchors", "loss_gamma", "mask_token_id", "anchor_seed",
         "chunk_blocks", "attention", "draft"}
    )  # fmt: skip
    DRAFT_KEYS = frozenset(
        {"num_layers", "hidden_size", "intermediate_size", "num_attention_heads",
         "num_key_value_heads"}
    )  # fmt: skip

    def __init__(
        self,
        cfg: StrategyConfig,
        target: TargetInfo,
        *,
        heads: TargetHeads | None = None,
        aux_layers: list[int] | None = None,
    ):
        self.name = self.projector
        self.cfg, self.target, self.heads = cfg, target, heads
        self._refuse_unused(cfg)
        if cfg.draft.hidden_size not in (None, target.hidden_size):
            raise ConfigError(
                f"strategy.draft.hidden_size={cfg.draft.hidden_size}: a {self.name} draft shares the "
                f"target's embedding and lm_head, so its width is the target's ({target.hidden_size})"
            )
        self.aux_layers = (
            list(aux_layers)
            if aux_layers is not None
            else default_target_layers(target.num_layers, cfg.draft.num_layers)
        )
        if not self.aux_layers or any(not 0 <= i < target.num_layers for i in self.aux_layers):
            raise ConfigError(
                f"target.aux_layers {self.aux_layers} must be layer indices in 0..{target.num_layers - 1}"
            )
        self.mask_token_id = self._mask_token(cfg, target)
        self._heads: dict[tuple[torch.device, torch.dtype], Heads] = {}
        self._micro = (-1, 0)  # (step, micro-batch index) for the anchor generator

    def _refuse_unused(self, cfg: StrategyConfig) -> None:
        """Refuse keys this strategy does not read when they differ from their defaults (a
        dumped and reloaded config sets every key, so "set" cannot mean "given")."""
        default = StrategyConfig()
        keys = self.KEYS | set(self.SECTIONS)
        unused = [
            f"strategy.{k}"
            for k in StrategyConfig.model_fields
            if k not in keys and getattr(cfg, k) != getattr(default, k)
        ]
        unused += [
            f"strategy.draft.{k}"
            for k in type(cfg.draft).model_fields
            if k not in self.DRAFT_KEYS | {"architecture"}
            and getattr(cfg.draft, k) != getattr(default.draft, k)
        ]
        if cfg.draft.architecture not in (default.draft.architecture, "dflash"):
            unused.append(f"strategy.draft.architecture={cfg.draft.architecture}")
        if unused:
            raise ConfigError(f"strategy {self.name!r} does not use {', '.join(unused)}: remove it")

    @staticmethod
    def _mask_token(cfg: StrategyConfig, target: TargetInfo) -> int:
        if cfg.mask_token_id is not None:
            if cfg.mask_token_id >= target.vocab_size:
                raise ConfigError(
                    f"strategy.mask_token_id={cfg.mask_token_id} is outside the target vocabulary ({target.vocab_size})"
                )
            return cfg.mask_token_id
        for candidate in (target.pad_token_id, *target.eos_token_ids):
            if candidate is not None and 0 <= int(candidate) < target.vocab_size:
                return int(candidate)
        raise ConfigError("set strategy.mask_token_id: the target has no pad or eos token to use")

    @property
    def draft_vocab_size(self) -> int:
        return self.target.vocab_size  # the target's own lm_head: no reduced vocabulary

    def feature_contract(self, target: TargetInfo | None = None) -> FeatureContract:
        target = target or self.target
        h = target.hidden_size
        fields = [
            FeatureField("input_ids", ("L",), "int64"),
            FeatureField("loss_mask", ("L",), "int64|bool"),
            FeatureField("hidden_states", ("L", len(self.aux_layers) * h), "float"),
        ]
        if self.projector == "dspark":
            fields.append(FeatureField("target", ("L", h), "float"))
        return FeatureContract(
            strategy=self.name,
            fields=tuple(fields),
            aux_layers=tuple(self.aux_layers),
            hidden_size=h,
            final_feature="target" if self.projector == "dspark" else None,
        )

    def collate(
        self, samples: list[dict[str, torch.Tensor]], max_length: int | None = None
    ) -> TrainBatch:
        """Truncate to `max_length` and right-pad with zeros (padding has loss mask 0, so no
        anchor and no block ever sees it); the loss mask is kept as captured."""
        if not samples:
            raise ConfigError("cannot collate an empty batch")
        contract = self.feature_contract()
        lengths = [contract.verify(s) for s in samples]
        if max_length is not None:
            lengths = [min(n, max_length) for n in lengths]
        seq = max(lengths)
        tensors = {
            name: pad_right([s[name][:n] for s, n in zip(samples, lengths, strict=True)], seq)
            for name in contract.names
        }
        tensors["loss_mask"] = tensors["loss_mask"].to(torch.long)
        return TrainBatch(
            tensors=tensors,
            num_samples=len(samples),
            num_tokens=sum(lengths),
            num_loss_tokens=int(tensors["loss_mask"].sum()),
        )

    def model_config(self, target: TargetInfo | None = None) -> DFlashConfig:
        target = target or self.target
        d = self.cfg.draft
        heads = d.num_attention_heads or target.num_attention_heads
        domino, dspark = self.cfg.domino, self.cfg.dspark
        return DFlashConfig(
            hidden_size=target.hidden_size,
            intermediate_size=d.intermediate_size or target.intermediate_size,
            num_layers=d.num_layers,
            num_attention_heads=heads,
            num_key_value_heads=d.num_key_value_heads or target.num_key_value_heads,
            head_dim=target.head_dim if d.num_attention_heads is None else target.hidden_size // heads,
            vocab_size=target.vocab_size,
            target_layer_ids=list(self.aux_layers),
            num_target_layers=target.num_layers,
            block_size=self.cfg.block_size,
            mask_token_id=self.mask_token_id,
            projector=self.projector,
            rms_norm_eps=target.rms_norm_eps,
            hidden_act=target.hidden_act,
            max_position_embeddings=target.max_position_embeddings,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            emb_dim=domino.emb_dim,
            gru_hidden_dim=domino.gru_hidden_dim,
            markov_rank=dspark.markov_rank if self.projector == "dspark" else 0,
            markov_head_type=dspark.markov_head_type,
            confidence_head=self.projector == "dspark" and dspark.confidence_head,
            confidence_with_markov=self.projector == "dspark" and dspark.confidence_with_markov,
            bos_token_id=target.bos_token_id,
            eos_token_id=list(target.eos_token_ids) if len(target.eos_token_ids) > 1
            else (target.eos_token_ids or [None])[0],
            pad_token_id=target.pad_token_id,
        )  # fmt: skip

    def build_model(
        self, target: TargetInfo | None = None, heads: TargetHeads | None = None, vocab=None
    ) -> nn.Module:
        """A fresh draft (the vocabulary mapping is not used: the target's lm_head drafts)."""
        return DFlashDraft(self.model_config(target))

    def target_heads(self, device: torch.device, dtype: torch.dtype) -> Heads:
        """The frozen embedding and lm_head on `device` in `dtype` (the feature dtype: bf16 on a
        GPU, as the reference keeps its target head), cached."""
        if self.heads is None:
            raise ConfigError(
                f"{self.name} embeds with the target's embedding: build_strategy(..., heads=...)"
            )
        key = (torch.device(device), dtype)
        if key not in self._heads:
            self._heads[key] = Heads(
                self.heads.embed_tokens.to(device=device, dtype=dtype),
                self.heads.lm_head.to(device=device, dtype=dtype),
            )
        return self._heads[key]

    def generator(self, step: StepContext | None) -> torch.Generator:
        """A CPU generator seeded by (anchor_seed, global step, rank, micro-batch of the step):
        every rank and every micro-batch draws its own anchors, reproducibly on any device."""
        global_step = step.global_step if step is not None else 0
        last, micro = self._micro
        micro = micro + 1 if last == global_step else 0
        self._micro = (global_step, micro)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        seed = hash_seed(self.cfg.anchor_seed, global_step, rank, micro)
        return torch.Generator().manual_seed(seed)

    def loss_kwargs(self, batch: TrainBatch, step: StepContext | None) -> dict:
        t = batch.tensors
        heads = self.target_heads(t["input_ids"].device, t["hidden_states"].dtype)
        anchors = None
        if "anchors" in t:  # fixed anchors (tests, reference comparison)
            anchors = (t["anchors"], t["anchor_keep"].bool())
        return dict(
            input_ids_BL=t["input_ids"], loss_mask_BL=t["loss_mask"],
            hidden_states_BLA=t["hidden_states"], embed_VH=heads.embed_VH,
            lm_head_VH=heads.lm_head_VH, mask_token_id=self.mask_token_id,
            block_size=self.cfg.block_size, num_anchors=self.cfg.num_anchors,
            gamma=self.cfg.loss_gamma, anchors=anchors,
            generator=None if anchors is not None else self.generator(step),
            chunk_blocks=self.cfg.chunk_blocks,
            attention=self.resolve_attention(t["input_ids"].device),
        )  # fmt: skip

    def resolve_attention(self, device: torch.device) -> str:
        """ "auto": flex attention on CUDA (a tile-level block mask: the context tiles below
        each query tile's anchors and its own blocks' tiles, no dense mask), the reference's
        eager arithmetic on CPU; "sdpa": SDPA with the dense boolean mask everywhere; "flex":
        flex everywhere (on the CPU the same tiles as a dense SDPA: a test path)."""
        if self.cfg.attention == "auto":
            return "flex" if torch.device(device).type == "cuda" else "eager"
        return self.cfg.attention

    @staticmethod
    def fused(batch: TrainBatch) -> bool:
        """The fused vocabulary head (`fused_head`) on CUDA; the reference's checkpointed
        chunks on the CPU (bitwise the reference's arithmetic)."""
        return batch.tensors["input_ids"].device.type == "cuda"

    def forward_loss(
        self, model: nn.Module, batch: TrainBatch, step: StepContext | None = None
    ) -> tuple[torch.Tensor, Metrics]:
        return dflash_loss(
            model, **self.loss_kwargs(batch, step), **_rank_pooling(), fused=self.fused(batch)
        )

    def export(self, model: nn.Module, out_dir, dtype: str = "bfloat16"):
        from specbus.core.export.dflash import export_dflash

        return export_dflash(unwrap(model), out_dir, dtype=dtype)


def hash_seed(*parts: int) -> int:
    """A 63-bit seed from integers (stable across processes, unlike hash())."""
    value = 0x9E3779B97F4A7C15
    for p in parts:
        value = (value ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        value ^= value >> 31
    return value & 0x7FFFFFFFFFFFFFFF


def _rank_pooling() -> dict:
    """Pool the loss denominator over data-parallel ranks (the reference's token pooling)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return {}

    def reduce(x: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(x)
        return x

    return {"den_reduce": reduce, "world_size": torch.distributed.get_world_size()}


class DominoStrategy(DFlashFamilyStrategy):
    projector = "domino"
    SECTIONS = ("domino",)

    def lambda_base(self, step: StepContext | None) -> float:
        d = self.cfg.domino
        return domino_lambda(step, d.lambda_start, d.lambda_decay_ratio)

    def forward_loss(self, model, batch, step=None):
        return domino_loss(
            model, **self.loss_kwargs(batch, step), lambda_base=self.lambda_base(step)
        )


class DSparkStrategy(DFlashFamilyStrategy):
    projector = "dspark"
    SECTIONS = ("dspark",)

    def forward_loss(self, model, batch, step=None):
        d = self.cfg.dspark
        return dspark_loss(
            model, **self.loss_kwargs(batch, step), target_BLH=batch.tensors["target"],
            ce_alpha=d.ce_alpha, l1_alpha=d.l1_alpha, confidence_alpha=d.confidence_alpha,
            **_rank_pooling(), fused=self.fused(batch),
        )  # fmt: skip


for _cls in (DFlashFamilyStrategy, DominoStrategy, DSparkStrategy):
    register_strategy(_cls.projector)(
        lambda cfg, target, *, heads=None, aux_layers=None, _cls=_cls: _cls(
            cfg, target, heads=heads, aux_layers=aux_layers
        )
    )

__all__ = [
    "DFlashFamilyStrategy",
    "DSparkStrategy",
    "DominoStrategy",
    "block_mask",
    "default_target_layers",
    "dflash_loss",
    "domino_lambda",
    "domino_loss",
    "draft_blocks",
    "dspark_loss",
    "sample_anchors",
]
