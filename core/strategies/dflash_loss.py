"""DFlash, Domino and DSpark objectives, pure: inputs -> (loss, metrics) (SpecForge 0.2.0 semantics).

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
- domino: labels as dflash, or with `shift_label` (the draft config's) position k predicts
  anchor+k+1 for every k, w = keep * in range * loss_mask[anchor+k+1] * exp(-k/gamma); final
  logits = base + embed_proj(hidden_k, GRU(emb(tokens before the label, from the anchor's)))
  for k >= suffix_start = pure_draft_prefix_len (+1 unshifted), base alone before (teacher
  forced); loss = (1-lambda) * CE_final + lambda * CE_base (each sum(CE*w) / (sum(w) +
  1e-6)); lambda = lambda_start * (1 - step / (ratio * total)) clamped to [0, 1], 0 when the
  total is unknown.
- dspark: position k (0..K-1) predicts token anchor+k+1; eval mask = keep * in range *
  loss_mask, cut at the first unsupervised position of the block; w = eval * exp(-k/gamma);
  logits = base + Markov bias of the previous token (the anchor, then the true tokens);
  L1 = sum_v |softmax(draft) - softmax(teacher)|, the teacher being the target lm_head on the
  captured final hidden state at anchor+k; accept = clamp(1 - L1/2, 0, 1); confidence =
  BCE(confidence logit, accept); loss = world * (a_ce CE + a_l1 L1 + a_conf conf) . w /
  sum over ranks of sum(w).
Logits are computed `chunk_blocks` blocks at a time (activation-checkpointed when training;
`fused=True`, the CUDA path, forms their gradient in the forward instead: dflash_fused.py).

Metrics (detached): per drafted position j (the j-th token after the anchor) correct_j,
denom_j, acc_j, ploss_j; accuracy; accept_len (mean over blocks of the accepted prefix + 1);
sim_accept_len = sum_j prod_{i<=j} acc_i; loss, loss_denom; plus each objective's own terms.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from specbus.core.errors import ConfigError
from specbus.core.strategies.base import Metrics, StepContext
from specbus.core.strategies.dflash_blocks import (  # noqa: F401  (part of this module's API)
    accept_prefix,
    block_mask,
    draft_blocks,
    gather_blocks,
    head_logits,
    rows_linear,
    sample_anchors,
)
from specbus.core.strategies.eagle3 import unwrap
from torch import nn


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


def _ce(logits_BNKV: torch.Tensor, target_BNK: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits_BNKV.reshape(-1, logits_BNKV.shape[-1]).float(),
        target_BNK.reshape(-1),
        reduction="none",
    ).view_as(target_BNK)


# ---------------------------------------------------------------------------------------------
# DFlash


def block_targets(
    input_ids_BL: torch.Tensor, loss_mask_BL: torch.Tensor, anchors_BN: torch.Tensor,
    keep_BN: torch.Tensor, block_size: int, gamma: float | None, shift: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(target, mask, weights), each [B, N, K], of the blocks at `anchors_BN`. Not shifted:
    position k predicts token anchor+k, k > 0 counts, weight exp(-(k-1)/gamma); `shift`:
    position k predicts anchor+k+1, every k counts, weight exp(-k/gamma) (Domino's
    `shift_label`). A kept block's position counts when its label is in range and supervised;
    weights are 1 without `gamma`."""
    device = input_ids_BL.device
    positions = torch.arange(block_size, device=device)
    offsets = positions + 1 if shift else positions
    target, in_range, _ = gather_blocks(input_ids_BL, anchors_BN, offsets)
    lm, _, _ = gather_blocks(loss_mask_BL.float(), anchors_BN, offsets)
    mask = keep_BN[:, :, None].float() * in_range.float()
    if not shift:
        mask = mask * (offsets > 0).float()
    mask = mask * lm
    first = 0 if shift else 1  # the position of the first drafted token
    decay = (
        torch.exp(-(positions - first).clamp(min=0).float() / gamma)
        if gamma
        else torch.ones(block_size, device=device)
    )
    return target, mask, mask * decay


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
    target, mask, weights = block_targets(input_ids_BL, loss_mask_BL, anchors_BN, keep_BN,
                                          block_size, gamma)  # fmt: skip

    def terms(h, tgt, m, w):
        logits = head_logits(h, lm_head_VH)
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

    if fused:
        from specbus.core.strategies.dflash_fused import dflash_chunk_terms, fused_head

        def fused_terms(z, tgt, m, w):
            grad, *sums = dflash_chunk_terms(z, tgt, m, w)
            return grad, tuple(sums), ()

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
    shift = draft.config.shift_label
    target, mask, weights = block_targets(input_ids_BL, loss_mask_BL, anchors_BN, keep_BN,
                                          block_size, gamma, shift=shift)  # fmt: skip
    # the tokens the GRU reads: the block's own (anchor+0..K-1) when labels are shifted, else
    # the labels (whose first is the anchor token)
    prev = target
    if shift:
        own = torch.arange(block_size, device=input_ids_BL.device)
        prev = gather_blocks(input_ids_BL, anchors_BN, own)[0]

    def terms(h, prv, tgt, m, w):
        base = head_logits(h, lm_head_VH)
        final = draft.domino_logits(base, h, F.embedding(prv, embed_VH))
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
     correct_K, den_K, ce_K) = chunked_sum(terms, hidden, prev, target, mask, weights,
                                           chunk=chunk_blocks)  # fmt: skip
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
    _position_metrics(metrics, correct_K, den_K, ce_K, first=0 if shift else 1)
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
        base = head_logits(h, lm_head_VH)
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
                t_logits = head_logits(th, lm_head_VH)
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
        from specbus.core.strategies.dflash_fused import TeacherTable, _dspark_fused

        teacher = teacher_h
        if need_teacher and b * seq <= b * n * block_size:
            # positions repeat across overlapping blocks: the teacher's logits once per position
            # of the sequence, gathered per block row (fewer rows through the vocabulary matmul)
            with torch.no_grad():
                teacher = TeacherTable(
                    head_logits(target_BLH, lm_head_VH), (safe - 1).clamp(min=0).view(b, n, -1)
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
