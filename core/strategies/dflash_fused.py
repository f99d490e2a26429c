"""The DFlash family's fused vocabulary head (the CUDA path of `dflash_loss` / `dspark_loss`).

Per chunk of blocks the logits' gradient is formed in the forward (`fused_head`): no logits
are kept or recomputed (one vocabulary matmul for the logits and one for the gradient,
instead of three under activation checkpointing). The per-chunk terms are compiled on CUDA
(`core.models.kernels.compiled`); the CPU keeps the checkpointed reference arithmetic
(dflash_loss.py). docs/dflash.md, "Training".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from specbus.core.errors import ConfigError
from specbus.core.models.kernels import compiled
from specbus.core.strategies.dflash_blocks import accept_prefix, head_logits, rows_linear


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
            z = head_logits(hc, lm_head_VH)
            if e is not None:
                z = z + rows_linear(e[:, sl], m2)
            # contiguous chunks: one compiled graph for every chunk (no stride guards)
            chunk_args = (t[:, sl].contiguous() if t is not None else None for t in per_block)
            grad_z, c_sums, c_rows = terms(z, *chunk_args)
            grad_z = grad_z.to(z.dtype)
            grad_h[:, sl] = rows_linear(grad_z, lm_head_VH.to(grad_z.dtype).T).to(h.dtype)
            if e is not None:
                grad_e[:, sl] = rows_linear(grad_z, m2.to(grad_z.dtype).T).to(e.dtype)
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
    of sum(ce * w) w.r.t. z (in z's dtype), then the sums `dflash_loss` pools (compiled on
    CUDA)."""
    ce, grad = fused_ce_grad(z, tgt, w)
    pred = z.argmax(-1)
    hit = ((pred == tgt) & (m > 0.5)).float()
    acc_len = accept_prefix(pred, tgt, m > 0)
    blocks = (m > 0).any(-1).float()
    return (
        grad.to(z.dtype), (ce * w).sum(), w.sum(), hit.sum(), m.sum(),
        hit.sum((0, 1)), m.sum((0, 1)), (ce * m).sum((0, 1)),
        ((acc_len + 1.0) * blocks).sum(), blocks.sum(),
    )  # fmt: skip


@compiled
def dspark_chunk_terms(z, t_logits, tgt, w, ev, ce_alpha: float, l1_alpha: float):
    """DSpark's terms of one chunk from its logits `z [B, n, K, V]` (base + Markov bias) and
    the teacher's logits (None: no L1 term): `(d objective / dz, accept, objective, <the
    checkpointed path's sums>)`, objective = ce_alpha * sum(ce * w) + l1_alpha * sum(l1 * w);
    the gradient in z's dtype (as the matmul that consumes it). Compiled on CUDA."""
    return _dspark_terms(z, t_logits, tgt, w, ev, ce_alpha, l1_alpha)


@compiled
def dspark_chunk_terms_table(z, t_logits_BLV, pos_BnK, tgt, w, ev, ce_alpha, l1_alpha):
    """`dspark_chunk_terms` with the teacher's logits gathered here from the per-position
    table `[B, L, V]` at the chunk's positions `[B, n, K]`: compiled, the gather is an
    indirect load inside the reduction kernel instead of a `[B, n, K, V]` copy (on an H200
    the copy was 4 index kernels = 6.3 ms of a 95 ms DSpark step at 2304 tokens)."""
    rows = torch.arange(pos_BnK.shape[0], device=pos_BnK.device)[:, None, None]
    return _dspark_terms(z, t_logits_BLV[rows, pos_BnK], tgt, w, ev, ce_alpha, l1_alpha)


def _dspark_terms(z, t_logits, tgt, w, ev, ce_alpha: float, l1_alpha: float):
    # Every term from four row statistics (max and log-sum-exp of the draft's and the
    # teacher's logits): the probabilities' maxima are exp(max - lse), not reductions over a
    # softmax, and p is exp(log p), not a second softmax. Compiled, that is fewer passes over
    # the chunk's [rows, V] logits in the one reduction kernel (19.7 of an 88 ms H200 step).
    evf = ev.float()
    zf = z.float()
    z_max = zf.amax(-1)
    lse = z_max + (zf - z_max[..., None]).exp().sum(-1).log()
    logp = zf - lse[..., None]
    ce = lse - zf.gather(-1, tgt[..., None]).squeeze(-1)
    pred = z.argmax(-1)
    hit = ((pred == tgt) & ev).float()
    zero = ce.new_zeros(())
    l1_num = agree = t_top1 = d_top1 = tau_num = tau_den = zero
    rate_K = ce.new_zeros(ce.shape[-1])
    accept = torch.zeros_like(ce)
    blocks = ev.any(-1).float()
    p = logp.exp()
    if t_logits is not None:
        tf = t_logits.float()
        t_max = tf.amax(-1)
        t_lse = t_max + (tf - t_max[..., None]).exp().sum(-1).log()
        t_ids = t_logits.argmax(-1)
        t_top1 = ((t_max - t_lse).exp() * evf).sum()
        diff = p - (tf - t_lse[..., None]).exp()
        l1 = diff.abs().sum(-1)
        accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0)
        l1_num = (l1 * w).sum()
        agree = ((pred == t_ids).float() * evf).sum()
        d_top1 = ((z_max - lse).exp() * evf).sum()
        tau_num = (((accept * evf).cumprod(-1).sum(-1) + 1.0) * blocks).sum()
        tau_den = blocks.sum()
        rate_K = (accept * evf).sum((0, 1))
        # d|p - t|_1 / dz = p * (sign - <sign, p>): softmax's backward of the sign
        sign_p = diff.sign() * p
        grad = (sign_p - p * sign_p.sum(-1, keepdim=True)) * (l1_alpha * w)[..., None]
        if ce_alpha:
            grad = grad + p * (ce_alpha * w)[..., None]
    else:
        grad = p * (ce_alpha * w)[..., None]
    if ce_alpha:
        grad = grad.scatter_add(-1, tgt[..., None], -(ce_alpha * w)[..., None])
    acc_len = accept_prefix(pred, tgt, ev)
    return (
        grad.to(z.dtype), accept, ce_alpha * (ce * w).sum() + l1_alpha * l1_num,
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
            grad, accept, *sums = dspark_chunk_terms_table(
                z, table.logits_BLV, th, tgt, w, ev, ce_alpha, l1_alpha
            )
        else:
            t_logits = head_logits(th, lm_head_VH) if use_teacher else None
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
