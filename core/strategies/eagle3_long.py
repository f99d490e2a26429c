"""EAGLE3 at long context: the teacher and the TTT loss a chunk of positions at a time.

Shape legend (eagle3.py's): B batch, L sequence, H hidden, V target vocab, Vd draft vocab,
K TTT steps, c positions of a chunk.

The plain path (eagle3.py) holds, per micro-batch, the target's logits over the whole
vocabulary (`[B, L, V]`, bf16 and an fp32 copy), the teacher's two distributions over the
draft vocabulary (`[B, L+K, Vd]` fp32 each) and every step's draft logits with their
gradient (`[B, L, Vd]` each, kept until the backward): ~1.7 MB per token on a Qwen3-8B-shaped
target with a 32k draft vocabulary and 7 steps, the bulk of its memory at 16k tokens. Here:

- `LongTeacher`: the target's logits are formed `chunk` positions at a time and reduced at
  once to what the loss reads: their draft-vocabulary columns in the logits' own dtype (the
  values the plain path softmaxes: nothing is rounded), the log-sum-exp over the whole
  vocabulary and the argmax ids. The two distributions are rebuilt per chunk (`rows`).
- `TTTHead` (the draft's `head=`): each step's loss, metrics and gradients w.r.t. the step's
  hidden state, the final norm's weight and the lm_head's weight, `chunk` positions at a time
  in the forward (`_ChunkedTTTLoss`); the backward only scales what the forward kept (one
  `[B, L, H]` per step, one `[Vd, H]`, one `[H]`). No `[B, L, Vd]` tensor outlives a chunk.

Both compute the plain path's functions, reference and fused arithmetic alike; only the order
of the sums over positions differs (tests/test_eagle3_long.py: values and gradients on a tiny
model, in float64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from specbus.core.models.kernels import compiled, rms_norm, upcast


def shifted(x_BL: torch.Tensor, k: int, lo: int, hi: int, value=0) -> torch.Tensor:
    """Positions `lo..hi-1` of `x` shifted left by `k` (`shift_left` k times, or the teacher's
    padding): `x[:, lo+k : hi+k]`, `value` past the end."""
    seq = x_BL.shape[1]
    part = x_BL[:, min(lo + k, seq) : min(hi + k, seq)]
    pad = (hi - lo) - part.shape[1]
    if not pad:
        return part
    widths = (0, 0) * (x_BL.dim() - 2) + (0, pad)
    return F.pad(part, widths, value=value)


def teacher_distributions(logits_BcVd, lse_Bc1):
    """(target_p, target_p_on_draft) from the target's draft-column logits and its log-sum-exp
    over the whole vocabulary: the softmax over the draft columns, and the full-vocabulary
    probability of each draft column."""
    logits = upcast(logits_BcVd)
    return torch.softmax(logits, dim=2), torch.exp(logits - lse_Bc1)


@dataclass(frozen=True)
class LongTeacher:
    """The TTT teacher, kept as the target's draft-column logits (module doc)."""

    draft_logits_BLVd: torch.Tensor  # the target's logits at the draft columns, their dtype
    lse_BL1: torch.Tensor  # log-sum-exp of the target's logits over the whole vocabulary
    target_ids_BL: torch.Tensor  # the target's argmax (full vocabulary)
    position_mask_BL1: torch.Tensor  # loss_mask * t2d[argmax]

    def rows(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(target_p, target_p_on_draft) of teacher rows `lo..hi-1` as `compute_teacher` pads
        them: rows past L are uniform / zero."""
        return teacher_distributions(*self.logit_rows(lo, hi))

    def logit_rows(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft-column logits, lse) of rows `lo..hi-1`, what `rows` is computed from (the
        fused chunk forms the two distributions itself): rows past L are logits 0 and lse
        +inf, whose softmax is the uniform row and whose exp(logits - lse) is zeros."""
        seq = self.draft_logits_BLVd.shape[1]
        logits = self.draft_logits_BLVd[:, min(lo, seq) : min(hi, seq)]
        lse = self.lse_BL1[:, min(lo, seq) : min(hi, seq)]
        pad = (hi - lo) - logits.shape[1]
        if pad:
            logits = F.pad(logits, (0, 0, 0, pad), value=0.0)
            lse = F.pad(lse, (0, 0, 0, pad), value=float("inf"))
        return logits, lse


@compiled
def teacher_rows(logits_BcV: torch.Tensor, draft_ids_Vd: torch.Tensor):
    """(argmax ids, log-sum-exp fp32 `[B, c, 1]`, draft-column logits in the logits' dtype) of
    a chunk of the target's logits over the whole vocabulary (compiled on CUDA: one read of
    the bf16 logits for both reductions; eagerly, at 32k tokens, the fp32 copy, the argmax
    and logsumexp's max, shift, exp and sum were ~8 passes over a [c, V] fp32 array per
    chunk, ~40 ms a sample)."""
    full = upcast(logits_BcV)
    lse = torch.logsumexp(full, dim=-1, keepdim=True)
    return full.argmax(-1), lse, logits_BcV.index_select(-1, draft_ids_Vd)


@torch.no_grad()
def long_teacher(
    target_hidden_BLH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    t2d_V: torch.Tensor,
    draft_ids_Vd: torch.Tensor,
    loss_mask_BL1: torch.Tensor,
    chunk: int,
) -> LongTeacher:
    """`compute_teacher` of `lm_head(target_hidden)` (the shifted final hidden state), the
    logits formed `chunk` positions at a time (module doc)."""
    batch, seq, _ = target_hidden_BLH.shape
    device = target_hidden_BLH.device
    draft_logits = torch.empty(
        (batch, seq, draft_ids_Vd.numel()), dtype=lm_head_VH.dtype, device=device
    )
    lse = torch.empty((batch, seq, 1), dtype=upcast(lm_head_VH[:1, :1]).dtype, device=device)
    ids = torch.empty((batch, seq), dtype=torch.long, device=device)
    for lo in range(0, seq, chunk):
        hi = min(lo + chunk, seq)
        logits = F.linear(target_hidden_BLH[:, lo:hi].to(lm_head_VH.dtype), lm_head_VH)
        ids[:, lo:hi], lse[:, lo:hi], draft_logits[:, lo:hi] = teacher_rows(logits, draft_ids_Vd)
        del logits
    position_mask = t2d_V[ids][..., None].int() * loss_mask_BL1
    return LongTeacher(draft_logits, lse, ids, position_mask)


@compiled
def chunk_terms(logits_BcVd, teacher_BcVd, lse_Bc1, position_mask_Bc1, inv_count, weight):
    """`ttt_step_terms` of a chunk in one compiled kernel on CUDA, the teacher's two
    distributions formed inside it (`teacher_distributions` of `logit_rows`; every [c, Vd]
    pass outside it was a round trip through memory): per position its share of the step
    loss (times `inv_count` = 1 / (B * L)) and its acceptance sum `[B, c]`, the draft's
    argmax, and `weight` x d loss / d logits in the logits' dtype. Every reduction is over a
    row (the chunk's totals are summed outside: a sum over the whole chunk made Inductor
    split the kernel's reduction, and drop its online softmax). `inv_count` and `weight` are
    0-dim tensors (a float would be baked into the graph, one per length/step)."""
    target_p, on_draft = teacher_distributions(teacher_BcVd, lse_Bc1)
    logp = torch.log_softmax(upcast(logits_BcVd), dim=2)
    scale = position_mask_Bc1 * inv_count
    ploss = -torch.sum(target_p * logp, 2) * scale.squeeze(-1)
    prob = logp.exp()
    per_token = torch.minimum(on_draft, prob.to(on_draft.dtype))
    accepted = per_token.sum(-1) * position_mask_Bc1.squeeze(-1).to(per_token.dtype)
    # d ploss / d logits = -scale * (target_p - prob * sum(target_p)), and a softmax sums to
    # 1: one reduction over the row fewer (H200, a 4096 x 32k chunk: 1.54 -> 1.36 ms)
    grad = (prob - target_p) * scale
    return ploss, accepted, logits_BcVd.argmax(-1), (grad * weight).to(logits_BcVd.dtype)


def _reference_terms(logits, target_p, position_mask, on_draft, inv_count: float):
    """The reference arithmetic of a chunk (`step_loss`, `acceptance_rate`): its loss share
    (differentiable) and its acceptance sum."""
    logp = torch.log_softmax(upcast(logits), dim=2)
    ploss = -torch.sum(position_mask * (target_p * logp), 2).sum() * inv_count
    with torch.no_grad():
        draft_p = torch.softmax(upcast(logits), dim=-1).to(on_draft.dtype)
        per_token = torch.minimum(on_draft, draft_p).sum(-1)
        accepted = (per_token * position_mask.squeeze(-1).to(per_token.dtype)).sum()
    return ploss, accepted


@dataclass
class TTTHead:
    """The draft's `head=` at long context: the weighted TTT loss of every step's hidden state,
    `chunk` positions at a time (module doc). Call returns `(loss, stats_K5)`: per step
    ploss, correct, denom, accepted sum, supervised count (detached)."""

    teacher: LongTeacher
    loss_mask_BL1: torch.Tensor
    d2t_Vd: torch.Tensor
    step_weight: float
    chunk: int
    fused: bool

    def __call__(self, hiddens, norm_weight, eps, lm_head_weight):
        return _ChunkedTTTLoss.apply(self, norm_weight, lm_head_weight, eps, *hiddens)


class _ChunkedTTTLoss(torch.autograd.Function):
    """Forward: loss, metrics and every gradient, chunk by chunk (`TTTHead`); backward: the
    kept gradients times the incoming one."""

    @staticmethod
    def forward(ctx, head: TTTHead, norm_w, head_w, eps: float, *hiddens):
        batch, seq = hiddens[0].shape[:2]
        inv_count = 1.0 / (batch * seq)
        acc_dtype = upcast(norm_w.detach()[:1]).dtype
        grad_norm = torch.zeros(norm_w.shape, dtype=acc_dtype, device=norm_w.device)
        grad_head = torch.zeros(head_w.shape, dtype=acc_dtype, device=head_w.device)
        grad_hidden = [torch.empty_like(h) for h in hiddens]
        total = torch.zeros((), dtype=acc_dtype, device=norm_w.device)
        stats = torch.zeros((len(hiddens), 5), dtype=torch.float64, device=norm_w.device)
        # one leaf per weight for every chunk: autocast casts a grad-requiring leaf once and
        # reuses the cast (a fresh leaf per chunk cast the [Vd, H] lm_head 7 x L / chunk times);
        # the fused path casts the lm_head itself, once
        leaves = (norm_w.detach().requires_grad_(True), head_w.detach().requires_grad_(True))
        head_mm = _matmul_operand(head_w.detach()) if head.fused else None
        for k, hidden in enumerate(hiddens):
            weight_k = head.step_weight**k
            for lo in range(0, seq, head.chunk):
                hi = min(lo + head.chunk, seq)
                terms = _chunk(
                    head, k, lo, hi, hidden, *leaves, head_mm, eps, inv_count, weight_k, grad_head
                )
                ploss, accepted, correct, (g_hidden, g_norm) = terms
                grad_hidden[k][:, lo:hi] = g_hidden
                grad_norm += g_norm
                total += weight_k * ploss
                stats[k, 0] += ploss.double()
                stats[k, 1] += correct.double()
                stats[k, 3] += accepted.double()
            lm = shifted(head.loss_mask_BL1, k, 0, seq)
            pm = shifted(head.teacher.position_mask_BL1, k, 0, seq)
            stats[k, 2] = lm.sum().double().clamp_min(1e-6)
            stats[k, 4] = pm.sum().double()
        ctx.save_for_backward(grad_norm, grad_head, *grad_hidden)
        ctx.dtypes = (norm_w.dtype, head_w.dtype)
        ctx.mark_non_differentiable(stats)
        return total, stats

    @staticmethod
    def backward(ctx, g_loss, _):
        grad_norm, grad_head, *grad_hidden = ctx.saved_tensors
        norm_dtype, head_dtype = ctx.dtypes
        return (
            None, (grad_norm * g_loss).to(norm_dtype), (grad_head * g_loss).to(head_dtype), None,
            *[(g * g_loss).to(g.dtype) for g in grad_hidden],
        )  # fmt: skip


def _matmul_operand(x: torch.Tensor) -> torch.Tensor:
    """`x` in the dtype a matrix product casts it to: autocast's where it is on (bf16 on the
    GPU), else its own."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x


def add_product(acc_MN: torch.Tensor, a_MK: torch.Tensor, b_KN: torch.Tensor) -> None:
    """`acc += a @ b`, the product accumulated in `acc`'s dtype: on CUDA fp32 straight from
    bf16 operands (cuBLAS's `out_dtype`: no rounded [M, N] product, no cast, no separate sum;
    at 32k tokens these were ~3 passes over a [Vd, H] fp32 array per chunk and step)."""
    with torch.autocast(acc_MN.device.type, enabled=False):
        if a_MK.dtype == acc_MN.dtype:
            acc_MN.addmm_(a_MK, b_KN)
        elif acc_MN.is_cuda:
            torch.addmm(acc_MN, a_MK, b_KN, out_dtype=acc_MN.dtype, out=acc_MN)
        else:
            acc_MN += (a_MK @ b_KN).to(acc_MN.dtype)


def _chunk(head: TTTHead, k, lo, hi, hidden, nw, hw, hw_mm, eps, inv_count, weight_k, grad_head):
    """One chunk of step `k`: (loss share, acceptance sum, correct count, gradients of the
    weighted loss share w.r.t. the chunk's hidden state and the norm weight `nw`); the
    lm_head's (`hw`; `hw_mm` its matmul operand on the fused path) is added to `grad_head`.
    `nw`, `hw`: detached leaves requiring grad."""
    pm = shifted(head.teacher.position_mask_BL1, k, lo, hi)
    lm = shifted(head.loss_mask_BL1, k, lo, hi).squeeze(-1)
    with torch.enable_grad():
        h = hidden[:, lo:hi].detach().requires_grad_(True)
        normed = rms_norm(h, nw, eps)
    if head.fused:
        # the lm_head's backward written out: d normed = grad @ W, dW += grad^T @ normed
        normed_mm = _matmul_operand(normed.detach())
        logits = F.linear(normed_mm, hw_mm)
        acc = upcast(logits[:0]).dtype
        count = torch.full((), inv_count, dtype=acc, device=h.device)
        weight = torch.full((), weight_k, dtype=acc, device=h.device)
        teacher, lse = head.teacher.logit_rows(lo + k, hi + k)
        ploss, accepted, pred, grad = chunk_terms(logits, teacher, lse, pm, count, weight)
        ploss, accepted = ploss.sum(), accepted.sum()
        add_product(grad_head, grad.flatten(0, 1).T, normed_mm.flatten(0, 1))
        d_normed = (grad @ hw_mm).to(normed.dtype)
        grads = torch.autograd.grad(normed, (h, nw), grad_outputs=d_normed)
    else:
        with torch.enable_grad():
            logits = F.linear(normed, hw)
            target_p, on_draft = head.teacher.rows(lo + k, hi + k)
            ploss, accepted = _reference_terms(logits, target_p, pm, on_draft, inv_count)
            weight = torch.tensor(weight_k, dtype=ploss.dtype, device=ploss.device)
            grads = torch.autograd.grad(ploss, (h, nw, hw), grad_outputs=weight)
        grad_head += grads[2]
        grads = grads[:2]
        pred = logits.detach().argmax(-1)
    with torch.no_grad():
        ids = shifted(head.teacher.target_ids_BL, k, lo, hi)
        correct = ((pred + head.d2t_Vd[pred] == ids) * lm).sum()
    return ploss.detach(), accepted, correct, grads
