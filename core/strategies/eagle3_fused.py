"""EAGLE3's fused TTT loss: the CUDA path of `eagle3.eagle3_ttt_loss` (`fused=True`).

Shape legend: eagle3.py's; P = L + K (a tensor padded by K rows for the shifted steps).

The same function as the reference arithmetic (eagle3.py; fp64 tests pin them to 1e-12) in
fewer passes: every step's logits from one final norm and one lm_head product over the
stacked hidden states (the draft's `head=`, `stacked_logits`); each step's loss, acceptance
rate and the loss's gradient w.r.t. the logits from one log_softmax in one compiled call over
all K steps, the gradient formed in the forward and only scaled in the backward; the teacher
kept as the target's logits at the draft columns and two log-sum-exps (`LogitTeacher`),
whose distributions the fused kernel forms. The CPU keeps the reference arithmetic (its
default); the compiled functions are `core.models.kernels.compiled` (eager on the CPU).
docs/eagle3.md, "Objective".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from specbus.core.models.kernels import compiled, upcast
from specbus.core.models.llama_eagle3 import stacked_logits
from specbus.core.strategies.base import Metrics
from torch import nn


@dataclass(frozen=True)
class LogitTeacher:
    """The teacher as the fused path reads it: the target's logits at the draft columns (in
    their own dtype: bf16 on the GPU, so nothing is rounded) and two log-sum-exps, from which
    `target_p = exp(logits - lse_draft)` and `target_p_on_draft = exp(logits - lse_full)` are
    formed inside each step's fused kernel; padded by K rows that give 1/Vd and 0 as
    `compute_teacher`'s padding does. A quarter of `Teacher`'s bytes (one bf16 `[B, L, Vd]`
    against two fp32 ones), read once a step instead of twice as much."""

    draft_logits_BLVd: torch.Tensor
    lse_draft_BL1: torch.Tensor
    lse_full_BL1: torch.Tensor
    target_ids_BL: torch.Tensor
    position_mask_BL1: torch.Tensor


@torch.no_grad()
def compute_logit_teacher(
    target_logits_BLV: torch.Tensor,
    t2d_V: torch.Tensor,
    loss_mask_BL1: torch.Tensor,
    ttt_length: int,
    draft_ids_Vd: torch.Tensor,
) -> LogitTeacher:
    """`compute_teacher`'s teacher as a `LogitTeacher` (the same distributions; one compiled
    function on CUDA)."""
    return LogitTeacher(
        *logit_teacher_tensors(target_logits_BLV, t2d_V, loss_mask_BL1, ttt_length, draft_ids_Vd)
    )


@compiled
def logit_teacher_tensors(target_logits_BLV, t2d_V, loss_mask_BL1, ttt_length: int, draft_ids_Vd):
    """`compute_logit_teacher`'s tensors (compiled on CUDA). Padding rows: logits 0 and
    lse_draft log(Vd) give target_p 1/Vd; lse_full +inf gives target_p_on_draft 0."""
    logits = upcast(target_logits_BLV)
    target_ids = logits.argmax(-1)
    position_mask = t2d_V[target_ids][..., None].int() * loss_mask_BL1
    draft_logits = target_logits_BLV.index_select(-1, draft_ids_Vd)
    lse_draft = torch.logsumexp(upcast(draft_logits), dim=-1, keepdim=True)
    lse_full = torch.logsumexp(logits, dim=-1, keepdim=True)
    rows = (0, 0, 0, ttt_length)
    return (
        F.pad(draft_logits, rows, value=0.0),
        F.pad(lse_draft, rows, value=math.log(draft_ids_Vd.shape[0])),
        F.pad(lse_full, rows, value=float("inf")),
        F.pad(target_ids, (0, ttt_length), value=0),
        position_mask,
    )


@compiled
def ttt_step_terms(
    logits_BLVd, teacher_logits_BLVd, lse_draft_BL1, lse_full_BL1, position_mask_BL1
):
    """`(ploss, acceptance_rate, d ploss / d logits)` of TTT steps: `step_loss` and
    `acceptance_rate` from one log_softmax, the teacher's two distributions formed from its
    logits (`LogitTeacher`), the gradient as log_softmax's backward forms it. One step's
    `[B, L, Vd]` or all steps' `[K, B, L, Vd]` (then ploss and rate are `[K]`). Compiled on
    CUDA (`core/models/kernels.py`): a few fused passes over the vocabulary."""
    batch, seq = logits_BLVd.shape[-3:-1]
    teacher = upcast(teacher_logits_BLVd)
    target_p = torch.exp(teacher - lse_draft_BL1)
    target_p_on_draft = torch.exp(teacher - lse_full_BL1)
    logp = torch.log_softmax(upcast(logits_BLVd), dim=-1)
    weight = position_mask_BL1 * target_p  # pm * (tp * logp) == (pm * tp) * logp: pm 0/1
    ploss = -torch.sum(weight * logp, -1).mean((-2, -1))
    prob = logp.exp()
    per_token = torch.minimum(target_p_on_draft, prob.to(target_p_on_draft.dtype))
    mask = position_mask_BL1.squeeze(-1).to(per_token.dtype)
    rate = (per_token.sum(-1) * mask).sum((-2, -1)) / mask.sum((-2, -1)).clamp_min(1e-8)
    grad_logp = weight * (-1.0 / (batch * seq))
    grad = grad_logp - prob * grad_logp.sum(-1, keepdim=True)
    return ploss, rate, grad


class _FusedStepLoss(torch.autograd.Function):
    """`step_loss` and `acceptance_rate` of every TTT step in one pass over the logits
    `[K, B, L, Vd]` (`ploss`, `rate`: `[K]`), with the loss's gradient w.r.t. the logits
    formed in the forward (`ttt_step_terms`) and kept until the backward, which only scales
    each step's by its weight: no second softmax for the acceptance rate, no saved
    log-probabilities, no backward passes over the vocabulary. The teacher comes as a
    `LogitTeacher`'s rows of each step (`step_rows`). Memory: the kept gradient is what the
    K per-step calls kept (K fp32 `[B, L, Vd]`), but the compiled kernels' transient buffers
    are K steps wide (on the CPU, two fp32 `[K, B, L, Vd]`: ~3.7 GB at 2048 tokens and a 32k
    draft vocabulary); past `strategy.chunk_tokens` the long path takes over."""

    @staticmethod
    def forward(
        ctx, logits_KBLVd, teacher_logits_KBLVd, lse_draft_KBL1, lse_full_KBL1, position_mask_KBL1
    ):
        ploss, rate, grad = ttt_step_terms(
            logits_KBLVd, teacher_logits_KBLVd, lse_draft_KBL1, lse_full_KBL1, position_mask_KBL1
        )
        ctx.save_for_backward(grad)
        ctx.dtype = logits_KBLVd.dtype
        ctx.mark_non_differentiable(rate)
        return ploss, rate

    @staticmethod
    def backward(ctx, g_ploss_K, _):
        (grad,) = ctx.saved_tensors
        return scaled_to(grad, g_ploss_K[:, None, None, None], ctx.dtype), None, None, None, None


def step_rows(x_BP_: torch.Tensor, steps: int, seq: int) -> torch.Tensor:
    """`[B, L + K, ...]` (padded by K rows) -> `[K, B, L, ...]` whose row k is `x[:, k : k + L]`:
    a strided view of overlapping windows, no copy."""
    s = x_BP_.stride()
    return x_BP_.as_strided(
        (steps, x_BP_.shape[0], seq, *x_BP_.shape[2:]), (s[1], s[0], s[1], *s[2:]),
        x_BP_.storage_offset(),
    )  # fmt: skip


@compiled
def scaled_to(grad_BLVd: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`(grad * scale).to(dtype)`: one pass over the vocabulary-wide gradient on CUDA, not a
    product written in fp32 and read again by the cast."""
    return (grad_BLVd * scale).to(dtype)


@compiled
def step_accuracy(logits_BLVd, d2t_Vd, target_ids_BL, loss_mask_BL1):
    """(correct, denom) of one TTT step (or of each of K: `[K, B, L, Vd]` logits give `[K]`):
    draft argmaxes mapped to target ids that equal the target's argmax, over the loss mask,
    and the mask's count (clamped to 1e-6). One compiled
    function on CUDA: an argmax over the draft vocabulary and a masked count, not ~9 launches."""
    pred = logits_BLVd.argmax(-1)
    correct = ((pred + d2t_Vd[pred] == target_ids_BL) * loss_mask_BL1.squeeze(-1)).sum((-2, -1))
    return correct, loss_mask_BL1.sum((-3, -2, -1)).clamp_min(1e-6)


def fused_steps(
    model: nn.Module,
    input_ids_BL: torch.Tensor,
    hidden_states_BL3H: torch.Tensor,
    attention_mask_BL: torch.Tensor,
    teacher: LogitTeacher,
    position_masks_BP1: torch.Tensor,
    loss_masks_BP1: torch.Tensor,
    d2t_Vd: torch.Tensor,
    *,
    ttt_length: int,
    attention: str,
    checkpoint: bool,
) -> tuple[list[torch.Tensor], Metrics]:
    """Every TTT step's loss (a list of K 0-dim tensors, with gradients) and metrics (ploss_k,
    acc_k, correct_k, denom_k, acceptance_rate_k) at once: the draft's logits of all steps
    from one lm_head product (`stacked_logits`), their loss, acceptance and accuracy from one
    fused call each. `input_ids_BL` are the once-shifted ids; the masks are padded by K rows
    (P = L + K), as `teacher` is."""
    seq = input_ids_BL.shape[1]
    rows = lambda x: step_rows(x, ttt_length, seq)  # noqa: E731
    logits_KBLVd = model(
        input_ids_BL, hidden_states_BL3H, attention_mask_BL, ttt_length=ttt_length,
        attention=attention, checkpoint=checkpoint, head=stacked_logits,
    )  # fmt: skip
    ploss_K, rate_K = _FusedStepLoss.apply(
        logits_KBLVd, rows(teacher.draft_logits_BLVd), rows(teacher.lse_draft_BL1),
        rows(teacher.lse_full_BL1), rows(position_masks_BP1),
    )  # fmt: skip
    with torch.no_grad():
        correct_K, denom_K = step_accuracy(
            logits_KBLVd, d2t_Vd, rows(teacher.target_ids_BL), rows(loss_masks_BP1)
        )
    losses, metrics = list(ploss_K.unbind(0)), {}
    for k, ploss in enumerate(losses):
        metrics[f"ploss_{k}"] = ploss.detach()
        metrics[f"acc_{k}"] = correct_K[k] / denom_K[k]
        metrics[f"correct_{k}"] = correct_K[k]
        metrics[f"denom_{k}"] = denom_K[k]
        metrics[f"acceptance_rate_{k}"] = rate_K[k]
    return losses, metrics
