"""EAGLE3: feature contract, collate, and the TTT objective (SpecForge 0.2.0 semantics).

Shape legend: B batch, L sequence, H target hidden, V target vocab, Vd draft vocab, K TTT steps.

Teacher (no grad): input ids and the captured final hidden state are shifted left by one
(zero at the end); logits_BLV = target lm_head(hidden) in fp32; `target_p` = softmax over the
draft-vocab columns (renormalised); `target_p_on_draft` = full-softmax mass of those columns;
`position_mask` = loss_mask * t2d[argmax logits]. The loss mask itself is not shifted.

Step k = 0..K-1: emb(ids_k) with hidden = fc(aux) at k = 0, else the previous step's pre-norm
output; logits = lm_head(norm(midlayer(...))). The teacher is read at offset k; ids, loss mask
and position mask shift left by one after each step.
- ploss_k = -sum(position_mask * target_p * log_softmax(logits)) / (B * L)
- loss = sum_k step_weight^k * ploss_k
- acc_k = #(d2t-mapped argmax == full-target argmax, over loss_mask) / max(#loss_mask, 1e-6)
- acceptance_rate_k = masked mean over position_mask of sum_v min(target_p_on_draft, softmax(logits))
- sim_accept_len = sum_k prod_{j<=k} acc_j (this batch)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from specbus.core.config import StrategyConfig
from specbus.core.data.vocab import VocabMapping
from specbus.core.errors import ConfigError
from specbus.core.models.kernels import causal_kernel, compiled, upcast
from specbus.core.models.llama_eagle3 import shift_left
from specbus.core.models.registry import build_draft
from specbus.core.models.target import TargetHeads, TargetInfo
from specbus.core.strategies.base import (
    FeatureContract,
    FeatureField,
    Metrics,
    StepContext,
    TrainBatch,
    pad_right,
)
from specbus.core.strategies.eagle3_fused import compute_logit_teacher, fused_steps, step_accuracy
from specbus.core.strategies.eagle3_long import TTTHead, long_teacher
from torch import nn


@dataclass(frozen=True)
class Teacher:
    """Per-position teacher tensors, padded with K positions at the end."""

    target_p_BLVd: torch.Tensor
    target_p_on_draft_BLVd: torch.Tensor
    target_ids_BL: torch.Tensor
    position_mask_BL1: torch.Tensor


@torch.no_grad()
def compute_teacher(
    target_logits_BLV: torch.Tensor,
    t2d_V: torch.Tensor,
    loss_mask_BL1: torch.Tensor,
    ttt_length: int,
    draft_ids_Vd: torch.Tensor | None = None,
) -> Teacher:
    """The TTT teacher from the target's logits: its distribution renormalised over the draft
    vocabulary, its probability mass on each draft token, its argmax ids, and the supervised
    positions whose argmax the draft can emit; padded by `ttt_length` for the shifted steps.
    `draft_ids_Vd` = `t2d_V.nonzero()` (ascending), when the caller has it: the same columns
    as the boolean index, without its device-to-host sync (`draft_columns`); then the whole
    teacher is one compiled function on CUDA (`teacher_tensors`)."""
    if draft_ids_Vd is not None:
        return Teacher(
            *teacher_tensors(target_logits_BLV, t2d_V, loss_mask_BL1, ttt_length, draft_ids_Vd)
        )
    logits = upcast(target_logits_BLV)
    target_ids = logits.argmax(-1)
    position_mask = t2d_V[target_ids][..., None].int() * loss_mask_BL1
    draft_logits = logits[..., t2d_V]
    target_p = torch.softmax(draft_logits, dim=2)
    target_p_on_draft = torch.exp(draft_logits - torch.logsumexp(logits, dim=-1, keepdim=True))
    return Teacher(
        target_p_BLVd=F.pad(target_p, (0, 0, 0, ttt_length), value=1 / target_p.shape[-1]),
        target_p_on_draft_BLVd=F.pad(target_p_on_draft, (0, 0, 0, ttt_length), value=0.0),
        target_ids_BL=F.pad(target_ids, (0, ttt_length), value=0),
        position_mask_BL1=position_mask,
    )


@compiled
def teacher_tensors(target_logits_BLV, t2d_V, loss_mask_BL1, ttt_length: int, draft_ids_Vd):
    """`compute_teacher`'s tensors with the draft columns given by index (compiled on CUDA)."""
    logits = upcast(target_logits_BLV)
    target_ids = logits.argmax(-1)
    position_mask = t2d_V[target_ids][..., None].int() * loss_mask_BL1
    draft_logits = logits.index_select(-1, draft_ids_Vd)
    target_p = torch.softmax(draft_logits, dim=2)
    target_p_on_draft = torch.exp(draft_logits - torch.logsumexp(logits, dim=-1, keepdim=True))
    return (
        F.pad(target_p, (0, 0, 0, ttt_length), value=1 / target_p.shape[-1]),
        F.pad(target_p_on_draft, (0, 0, 0, ttt_length), value=0.0),
        F.pad(target_ids, (0, ttt_length), value=0),
        position_mask,
    )


def step_loss(
    logits_BLVd: torch.Tensor, target_p_BLVd: torch.Tensor, position_mask_BL1: torch.Tensor
) -> torch.Tensor:
    """-sum(position_mask * target_p * log_softmax(logits)) averaged over all B*L positions."""
    logp = torch.log_softmax(upcast(logits_BLVd), dim=2)
    return -torch.sum(position_mask_BL1 * (target_p_BLVd * logp), 2).mean()


@torch.no_grad()
def acceptance_rate(
    logits_BLVd: torch.Tensor, target_p_on_draft_BLVd: torch.Tensor, position_mask_BL1: torch.Tensor
) -> torch.Tensor:
    """The expected acceptance of one TTT step: sum over the draft vocabulary of
    min(p_target, p_draft), averaged over the supervised positions."""
    draft_p = torch.softmax(upcast(logits_BLVd), dim=-1).to(target_p_on_draft_BLVd.dtype)
    per_token = torch.minimum(target_p_on_draft_BLVd, draft_p).sum(-1)
    mask = position_mask_BL1.squeeze(-1).to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp_min(1e-8)


def simulated_accept_length(accs: list[float] | torch.Tensor) -> float:
    """tau = sum_k prod_{j<=k} acc_j."""
    total, running = 0.0, 1.0
    for a in accs:
        running *= float(a)
        total += running
    return total


def draft_columns(draft: nn.Module) -> torch.Tensor:
    """The target ids of the draft vocabulary, `t2d.nonzero()` ascending, cached on the draft
    until its `t2d` buffer changes (one host sync per mapping instead of one per step)."""
    t2d = draft.t2d
    key = (t2d.device, t2d.data_ptr(), t2d._version)
    cached = draft.__dict__.get("_draft_columns")
    if cached is None or cached[0] != key:
        cached = (key, t2d.nonzero().squeeze(-1))
        draft.__dict__["_draft_columns"] = cached
    return cached[1]


def unwrap(model: nn.Module) -> nn.Module:
    """The draft inside a DDP/FSDP/compile wrapper (for its buffers)."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = getattr(model, "module", None) or model._orig_mod
    return model


def eagle3_ttt_loss(
    model: nn.Module,
    *,
    input_ids_BL: torch.Tensor,
    attention_mask_BL: torch.Tensor,
    loss_mask_BL: torch.Tensor,
    hidden_states_BL3H: torch.Tensor,
    target_BLH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    ttt_length: int = 7,
    step_weight: float = 0.8,
    attention: str = "eager",
    fused: bool = False,
    chunk: int | None = None,
    checkpoint: bool = False,
) -> tuple[torch.Tensor, Metrics]:
    """The EAGLE3 TTT objective (module docstring). Pure: reads `model`, writes nothing.
    `fused`: each step's loss and acceptance rate through `_FusedStepLoss` (the CUDA path;
    the same function, rounded differently), else the reference's arithmetic.
    `chunk`: a sequence longer than this takes the long-context path
    (`core/strategies/eagle3_long.py`: the teacher and the loss `chunk` positions at a time,
    the eager attention `chunk` queries at a time); `checkpoint`: every TTT step recomputed in
    the backward. Both compute the same function as the plain path.

    `model` is the draft or a DDP/FSDP wrapper of it (called once). Returns the weighted loss
    (grad flows to the draft's trainable parameters only) and detached per-step metrics:
    ploss_k, acc_k, acceptance_rate_k, correct_k, denom_k, plus loss, loss_denom (B*L) and
    sim_accept_len.
    """
    draft = unwrap(model)
    batch, seq = input_ids_BL.shape
    if chunk is not None and seq > chunk:
        return _long_ttt_loss(
            model, draft, input_ids_BL, attention_mask_BL, loss_mask_BL, hidden_states_BL3H,
            target_BLH, lm_head_VH, ttt_length, step_weight, attention, fused, chunk, checkpoint,
        )  # fmt: skip
    with torch.no_grad():
        input_ids = shift_left(input_ids_BL)
        target_hidden = shift_left(target_BLH)
        loss_mask = loss_mask_BL[..., None]
        target_logits = F.linear(target_hidden.to(lm_head_VH.dtype), lm_head_VH)
        teacher = (compute_logit_teacher if fused else compute_teacher)(
            target_logits, draft.t2d, loss_mask, ttt_length, draft_columns(draft)
        )
        del target_logits
    # step k reads the masks shifted left k times (zeros entering at the end): views of them
    # padded with K zeros once, not 2 x K shifts
    position_masks = F.pad(teacher.position_mask_BL1, (0, 0, 0, ttt_length))
    loss_masks = F.pad(loss_mask, (0, 0, 0, ttt_length))
    if fused:  # every step's logits, loss and metrics at once
        losses, metrics = fused_steps(
            model, input_ids, hidden_states_BL3H, attention_mask_BL, teacher, position_masks,
            loss_masks, draft.d2t, ttt_length=ttt_length, attention=attention,
            checkpoint=checkpoint,
        )  # fmt: skip
    else:  # the reference's arithmetic, step by step
        losses, metrics = _reference_steps(
            model(
                input_ids, hidden_states_BL3H, attention_mask_BL, ttt_length=ttt_length,
                attention=attention, checkpoint=checkpoint,
            ),
            teacher, position_masks, loss_masks, draft.d2t, seq,
        )  # fmt: skip
    loss = sum(step_weight**k * p for k, p in enumerate(losses))
    return loss, _totals(metrics, loss, batch, seq, ttt_length)


def _reference_steps(step_logits, teacher: Teacher, position_masks, loss_masks, d2t, seq):
    """(each step's loss, the metrics) of `eagle3_ttt_loss`'s unfused path."""
    losses, metrics = [], {}
    for k, logits in enumerate(step_logits):
        position_mask = position_masks[:, k : k + seq]
        ploss = step_loss(logits, teacher.target_p_BLVd[:, k : k + seq], position_mask)
        with torch.no_grad():
            correct, denom = step_accuracy(
                logits, d2t, teacher.target_ids_BL[:, k : k + seq], loss_masks[:, k : k + seq]
            )
            metrics[f"ploss_{k}"] = ploss.detach()
            metrics[f"acc_{k}"] = correct / denom
            metrics[f"correct_{k}"] = correct
            metrics[f"denom_{k}"] = denom
            metrics[f"acceptance_rate_{k}"] = acceptance_rate(
                logits, teacher.target_p_on_draft_BLVd[:, k : k + seq], position_mask
            )
        losses.append(ploss)
    return losses, metrics


def _totals(metrics: Metrics, loss: torch.Tensor, batch: int, seq: int, ttt_length: int):
    metrics["loss"] = loss.detach()
    metrics["loss_denom"] = torch.tensor(float(batch * seq))
    # tau = sum_k prod_{j<=k} acc_j, kept on device (no host sync per step)
    metrics["sim_accept_len"] = (
        torch.stack([metrics[f"acc_{k}"] for k in range(ttt_length)]).cumprod(0).sum()
    )
    return metrics


def _long_ttt_loss(model, draft, input_ids_BL, attention_mask_BL, loss_mask_BL,
                   hidden_states_BL3H, target_BLH, lm_head_VH, ttt_length, step_weight,
                   attention, fused, chunk, checkpoint):  # fmt: skip
    """`eagle3_ttt_loss` through `eagle3_long` (its doc): the same loss and metrics."""
    batch, seq = input_ids_BL.shape
    loss_mask = loss_mask_BL[..., None]
    teacher = long_teacher(
        shift_left(target_BLH), lm_head_VH, draft.t2d, draft_columns(draft), loss_mask, chunk
    )
    head = TTTHead(teacher, loss_mask, draft.d2t, step_weight, chunk, fused)
    loss, stats = model(
        shift_left(input_ids_BL), hidden_states_BL3H, attention_mask_BL, ttt_length=ttt_length,
        attention=attention, block=chunk, checkpoint=checkpoint, head=head,
    )  # fmt: skip
    metrics: Metrics = {}
    dtype = loss.dtype
    for k in range(ttt_length):
        ploss, correct, denom, accepted, supervised = stats[k].unbind()
        metrics[f"ploss_{k}"] = ploss.to(dtype)
        denom = denom.float()  # the plain path's dtypes: a long count clamped to a float
        metrics[f"acc_{k}"] = correct.to(torch.long) / denom
        metrics[f"correct_{k}"] = correct.to(torch.long)
        metrics[f"denom_{k}"] = denom
        metrics[f"acceptance_rate_{k}"] = (accepted / supervised.clamp_min(1e-8)).to(dtype)
    return loss, _totals(metrics, loss, batch, seq, ttt_length)


class Eagle3Strategy:
    """Adapter of `eagle3_ttt_loss` to the strategy registry."""

    name = "eagle3"

    def __init__(
        self,
        cfg: StrategyConfig,
        target: TargetInfo,
        *,
        heads: TargetHeads | None = None,
        aux_layers: list[int] | None = None,
    ):
        self.cfg = cfg
        self.target = target
        self.heads = heads
        self.aux_layers = list(aux_layers) if aux_layers is not None else target.default_aux_layers
        if len(self.aux_layers) != 3 or any(
            not 0 <= i < target.num_layers for i in self.aux_layers
        ):
            raise ConfigError(
                f"target.aux_layers {self.aux_layers} must be three layer indices in 0..{target.num_layers - 1}"
            )
        self._lm_head: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    @property
    def draft_vocab_size(self) -> int:
        """The draft vocabulary size (clamped to the target's)."""
        return min(self.cfg.draft.draft_vocab_size, self.target.vocab_size)

    def feature_contract(self, target: TargetInfo | None = None) -> FeatureContract:
        """input_ids, loss_mask, hidden_states (3 aux layers concatenated) and target (the final hidden
        state)."""
        target = target or self.target
        h = target.hidden_size
        return FeatureContract(
            strategy=self.name,
            fields=(
                FeatureField("input_ids", ("L",), "int64"),
                FeatureField("loss_mask", ("L",), "int64|bool"),
                FeatureField("hidden_states", ("L", 3 * h), "float"),
                FeatureField("target", ("L", h), "float"),
            ),
            aux_layers=tuple(self.aux_layers),
            hidden_size=h,
        )

    def collate(
        self, samples: list[dict[str, torch.Tensor]], max_length: int | None = None
    ) -> TrainBatch:
        """Truncate to `max_length`, zero each sample's last loss-mask position (the reference's
        data normaliser does, since its teacher is the zero-padded shift), right-pad with zeros.
        """
        if not samples:
            raise ConfigError("cannot collate an empty batch")
        contract = self.feature_contract()
        lengths = [contract.verify(s) for s in samples]
        if max_length is not None:
            lengths = [min(n, max_length) for n in lengths]
        seq = max(lengths)
        masks = []
        for s, n in zip(samples, lengths, strict=True):
            m = s["loss_mask"][:n].to(torch.long).clone()
            m[-1] = 0
            masks.append(m)
        tensors = {
            "input_ids": pad_right(
                [s["input_ids"][:n] for s, n in zip(samples, lengths, strict=True)], seq
            ),
            "loss_mask": pad_right(masks, seq),
            "hidden_states": pad_right(
                [s["hidden_states"][:n] for s, n in zip(samples, lengths, strict=True)], seq
            ),
            "target": pad_right(
                [s["target"][:n] for s, n in zip(samples, lengths, strict=True)], seq
            ),
            "attention_mask": pad_right([torch.ones(n, dtype=torch.long) for n in lengths], seq),
        }
        return TrainBatch(
            tensors=tensors,
            num_samples=len(samples),
            num_tokens=sum(lengths),
            num_loss_tokens=int(tensors["loss_mask"].sum()),
        )

    def build_model(
        self,
        target: TargetInfo | None = None,
        heads: TargetHeads | None = None,
        vocab: VocabMapping | None = None,
    ) -> nn.Module:
        """A fresh draft with the target's frozen embedding and `vocab` loaded (if given)."""
        target = target or self.target
        heads = heads or self.heads
        draft = build_draft(self.cfg.draft.architecture, self.cfg.draft, target, self.aux_layers)
        if heads is not None:
            draft.load_embedding(heads.embed_tokens)
        if vocab is not None:
            draft.load_vocab_mapping(vocab.d2t, vocab.t2d)
        elif draft.config.draft_vocab_size != target.vocab_size:
            raise ConfigError(
                f"draft vocab {draft.config.draft_vocab_size} < target vocab {target.vocab_size}: a vocab mapping is required"
            )
        return draft

    def lm_head(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The target's frozen lm_head on `device` in `dtype` (cached)."""
        if self.heads is None:
            raise ConfigError(
                "eagle3 recomputes the teacher from the target lm_head: build_strategy(..., heads=...)"
            )
        key = (torch.device(device), dtype)
        if key not in self._lm_head:
            self._lm_head[key] = self.heads.lm_head.to(device=device, dtype=dtype)
        return self._lm_head[key]

    def resolve_attention(self, device: torch.device, seq_len: int) -> str:
        """ "auto" on CUDA: "flash" where its causal part runs cuDNN's kernel (from
        `kernels.CUDNN_ATTENTION_TOKENS`: 7 steps forward and backward at 32k tokens 490 ms
        against flex's 722 on an H200), flex from 2048 tokens (3x less memory at 4096 than
        eager), eager below and off CUDA. "sdpa" is the eager reference arithmetic. "flash"
        (CUDA): a causal kernel plus the diagonal keys, merged (`ttt_flash.py`)."""
        if self.cfg.attention == "auto":
            if device.type != "cuda" or seq_len < 2048:
                return "eager"
            return "flash" if causal_kernel(device, seq_len) == "cudnn" else "flex"
        if self.cfg.attention in ("flex", "flash") and device.type != "cuda":
            raise ConfigError(f"strategy.attention={self.cfg.attention} needs a CUDA device")
        return "eager" if self.cfg.attention == "sdpa" else self.cfg.attention

    def forward_loss(
        self, model: nn.Module, batch: TrainBatch, step: StepContext | None = None
    ) -> tuple[torch.Tensor, Metrics]:
        """The TTT loss and metrics of one micro-batch (docs/eagle3.md)."""
        t = batch.tensors
        device = t["input_ids"].device
        # The reference runs its frozen head in the feature dtype (bf16 on GPU) and upcasts logits.
        head_dtype = t["target"].dtype
        return eagle3_ttt_loss(
            model,
            input_ids_BL=t["input_ids"],
            attention_mask_BL=t["attention_mask"],
            loss_mask_BL=t["loss_mask"],
            hidden_states_BL3H=t["hidden_states"],
            target_BLH=t["target"],
            lm_head_VH=self.lm_head(device, head_dtype),
            ttt_length=self.cfg.ttt_length,
            step_weight=self.cfg.step_weight,
            attention=self.resolve_attention(device, t["input_ids"].shape[1]),
            fused=self.fused(batch),
            chunk=self.cfg.chunk_tokens,
            checkpoint=self.checkpoint(batch),
        )

    def checkpoint(self, batch: TrainBatch) -> bool:
        """Whether the TTT steps are recomputed in the backward: from `checkpoint_tokens`
        positions per micro-batch (B * L, padding included: what the activations hold)."""
        limit = self.cfg.checkpoint_tokens
        return limit is not None and batch.tensors["input_ids"].numel() >= limit

    @staticmethod
    def fused(batch: TrainBatch) -> bool:
        """`_FusedStepLoss` on CUDA; the CPU keeps the reference's arithmetic (bitwise)."""
        return batch.tensors["input_ids"].device.type == "cuda"
