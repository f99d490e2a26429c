"""P-EAGLE (parallel EAGLE): feature contract, collate, COD sampling and the objective (speculators
0.9.0 semantics: `speculators.models.peagle`).

Shape legend: B samples, T packed tokens, S rows, H hidden, A aux width, V target vocab,
Vd draft vocab, D depths (`strategy.peagle.num_depths`).

Collate (speculators' `shift_batch` per sample, then its packing): each sample of length L
becomes L-1 rows, row p = (token p+1, aux features of p, target's final hidden state at p+1,
loss mask of p+1); the samples are concatenated into one sequence `[1, T]` with `document_ids`
(the sample's index). Positions are the packed indices, as the reference's (the rotary
embedding is relative: a sample's offset changes nothing but rounding).

COD sampling (`sample_cod`, the reference's `generate_cod_sample_indices`, drawn from an
explicit generator): depth 0 keeps every row; seeds are the supervised rows (at most
`max_anchors`, drawn without replacement); depth d draws int((#seeds - d) * max(r^d, r_min))
of the previous depth's candidates (all of them when fewer), sorted, and the next candidates
are those positions + 1 that are supervised (position 0, the wrap-around, excluded). A
depth-d row at position p belongs to the chain anchored at p - d.

Objective (`peagle_loss`, pure): the draft runs every row at once (core/models/peagle.py);
teacher = softmax of the target lm_head's draft-vocabulary rows on the captured final hidden
state at the row's position; per row KL(teacher || draft); loss = sum(KL * mask) / (sum(mask)
+ 1e-5), mask = the loss mask at the row's position, every depth weighted alike. Metrics per
depth d: correct_d / denom_d (draft argmax == teacher argmax, masked), acc_d, ploss_d (mean
KL), acceptance_rate_d (mean of sum_v min(p_teacher, p_draft)), sim_accept_len; loss,
loss_denom.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from specbus.core.config import StrategyConfig
from specbus.core.data.vocab import VocabMapping
from specbus.core.errors import ConfigError
from specbus.core.models.peagle import PEagleConfig, PEagleDraft, peagle_allow
from specbus.core.models.target import TargetHeads, TargetInfo
from specbus.core.strategies.base import (
    FeatureContract,
    FeatureField,
    Metrics,
    StepContext,
    TrainBatch,
)
from specbus.core.strategies.dflash import hash_seed
from specbus.core.strategies.eagle3 import unwrap
from torch import nn

_EPS = 1e-5  # the reference's loss-reduction epsilon


def sample_cod(
    loss_mask_T: torch.Tensor,
    num_depths: int = 8,
    ratio: float = 0.7,
    ratio_min: float = 0.2,
    max_anchors: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(anchor_S, depth_S)` of the sampled rows (module doc); row s sits at anchor + depth."""
    seq = loss_mask_T.shape[0]
    device = loss_mask_T.device
    valid = torch.where(loss_mask_T == 1)[0]
    seeds = valid
    if max_anchors is not None and valid.shape[0] > max_anchors:
        pick = torch.randperm(valid.shape[0], generator=generator)[:max_anchors].to(device)
        seeds = valid[pick].sort()[0]
    anchors, depths = (
        [torch.arange(seq, device=device)],
        [torch.zeros(seq, dtype=torch.long, device=device)],
    )
    prev = seeds
    for d in range(1, num_depths):
        size = int(max(0, seeds.shape[0] - d) * max(ratio**d, ratio_min))
        if size <= 0:
            break
        if prev.shape[0] >= size:
            pick = torch.randperm(prev.shape[0], generator=generator)[:size].to(device)
            sampled = prev[pick].sort()[0]
        else:
            sampled = prev
        nxt = (sampled + 1) % seq
        nxt = nxt[nxt != 0]
        prev = nxt[torch.isin(nxt, valid)]
        anchors.append(sampled - d)
        depths.append(torch.full((sampled.shape[0],), d, dtype=torch.long, device=device))
    return torch.cat(anchors), torch.cat(depths)


def peagle_loss(
    model: nn.Module,
    *,
    input_ids_1T: torch.Tensor,
    hidden_states_1TA: torch.Tensor,
    target_1TH: torch.Tensor,
    loss_mask_1T: torch.Tensor,
    document_ids_1T: torch.Tensor,
    lm_head_VH: torch.Tensor,
    mask_token_id: int,
    num_depths: int = 8,
    ratio: float = 0.7,
    ratio_min: float = 0.2,
    max_anchors: int | None = None,
    cod: tuple[torch.Tensor, torch.Tensor] | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """The P-EAGLE objective and metrics (module doc). `cod` = (anchor_S, depth_S) or drawn by
    `sample_cod` with `generator`; `model` is the draft or a DDP wrapper (called once)."""
    draft = unwrap(model)
    loss_mask = loss_mask_1T[0]
    anchor, depth = cod or sample_cod(
        loss_mask, num_depths, ratio, ratio_min, max_anchors, generator
    )
    position = anchor + depth
    is_mask = depth > 0
    ids = torch.where(is_mask, torch.full_like(position, mask_token_id), input_ids_1T[0, position])
    allow = peagle_allow(anchor, depth, document_ids_1T[0], draft.config.sliding_window)
    logits = model(ids[None], hidden_states_1TA[:, position], is_mask, position[None], allow)
    with torch.no_grad():
        head = lm_head_VH[draft.t2d.to(lm_head_VH.device)]
        teacher = F.linear(target_1TH.to(head.dtype), head)[:, position]
    logp = F.log_softmax(logits, dim=-1, dtype=torch.float32)
    target_p = F.softmax(teacher, dim=-1, dtype=torch.float32)
    kl = F.kl_div(logp, target_p, reduction="none", log_target=False).sum(-1)  # [1, S]
    mask = loss_mask[position].to(kl.dtype)[None]
    den = mask.sum()
    loss = ((kl * mask).sum(dim=1) / (mask.sum(dim=1) + _EPS)).mean()
    metrics: Metrics = {"loss": loss.detach(), "loss_denom": den.detach()}
    with torch.no_grad():
        hit = (logits.argmax(-1) == teacher.argmax(-1)).float()[0] * mask[0]
        overlap = torch.minimum(logp.exp(), target_p).sum(-1)[0] * mask[0]
        one_hot = F.one_hot(depth, num_depths).to(mask.dtype) * mask[0, :, None]  # [S, D]
        correct_D, denom_D = hit @ one_hot, one_hot.sum(0)
        kl_D, overlap_D = kl.detach()[0] @ one_hot, overlap @ one_hot
        acc_D = correct_D / denom_D.clamp_min(1e-6)
        for d in range(num_depths):
            metrics[f"correct_{d}"] = correct_D[d]
            metrics[f"denom_{d}"] = denom_D[d]
            metrics[f"acc_{d}"] = acc_D[d]
            metrics[f"ploss_{d}"] = kl_D[d] / denom_D[d].clamp_min(1e-6)
            metrics[f"acceptance_rate_{d}"] = overlap_D[d] / denom_D[d].clamp_min(1e-6)
        metrics["sim_accept_len"] = acc_D.cumprod(0).sum()
    return loss, metrics


class PEagleStrategy:
    """Adapter of `peagle_loss` to the strategy registry.

    Keys it reads: strategy.{mask_token_id, anchor_seed, peagle, draft.{num_layers,
    hidden_size (the target's), intermediate_size, num_attention_heads, num_key_value_heads,
    draft_vocab_size}}; any other key that differs from its default is refused by name.
    """

    name = "peagle"
    KEYS = frozenset({"name", "mask_token_id", "anchor_seed", "peagle", "draft"})
    DRAFT_KEYS = frozenset({"num_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                            "num_key_value_heads", "draft_vocab_size"})  # fmt: skip

    def __init__(
        self,
        cfg: StrategyConfig,
        target: TargetInfo,
        *,
        heads: TargetHeads | None = None,
        aux_layers: list[int] | None = None,
    ):
        from specbus.core.strategies.dflash import DFlashFamilyStrategy

        self.cfg, self.target, self.heads = cfg, target, heads
        self._refuse_unused(cfg)
        if cfg.draft.hidden_size not in (None, target.hidden_size):
            raise ConfigError(f"strategy.draft.hidden_size={cfg.draft.hidden_size}: a P-EAGLE draft "
                              f"embeds with the target's width ({target.hidden_size})")  # fmt: skip
        self.aux_layers = list(aux_layers) if aux_layers is not None else target.default_aux_layers
        if any(not 0 <= i < target.num_layers for i in self.aux_layers) or not self.aux_layers:
            raise ConfigError(f"target.aux_layers {self.aux_layers} must be layer indices in "
                              f"0..{target.num_layers - 1}")  # fmt: skip
        self.mask_token_id = DFlashFamilyStrategy._mask_token(cfg, target)
        self._lm_head: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._micro = (-1, 0)

    def _refuse_unused(self, cfg: StrategyConfig) -> None:
        default = StrategyConfig()
        unused = [f"strategy.{k}" for k in StrategyConfig.model_fields
                  if k not in self.KEYS and getattr(cfg, k) != getattr(default, k)]  # fmt: skip
        unused += [f"strategy.draft.{k}" for k in type(cfg.draft).model_fields
                   if k not in self.DRAFT_KEYS | {"architecture"}
                   and getattr(cfg.draft, k) != getattr(default.draft, k)]  # fmt: skip
        if cfg.draft.architecture not in (default.draft.architecture, "peagle"):
            unused.append(f"strategy.draft.architecture={cfg.draft.architecture}")
        if unused:
            raise ConfigError(f"strategy 'peagle' does not use {', '.join(unused)}: remove it")

    @property
    def draft_vocab_size(self) -> int:
        """The draft vocabulary size (clamped to the target's)."""
        return min(self.cfg.draft.draft_vocab_size, self.target.vocab_size)

    def feature_contract(self, target: TargetInfo | None = None) -> FeatureContract:
        """input_ids, loss_mask, hidden_states (the aux layers concatenated), target (the final
        post-norm hidden state: the teacher)."""
        target = target or self.target
        h = target.hidden_size
        return FeatureContract(
            strategy=self.name,
            fields=(
                FeatureField("input_ids", ("L",), "int64"),
                FeatureField("loss_mask", ("L",), "int64|bool"),
                FeatureField("hidden_states", ("L", len(self.aux_layers) * h), "float"),
                FeatureField("target", ("L", h), "float"),
            ),
            aux_layers=tuple(self.aux_layers),
            hidden_size=h,
        )

    def collate(
        self, samples: list[dict[str, torch.Tensor]], max_length: int | None = None
    ) -> TrainBatch:
        """Truncate each sample to `max_length`, shift it (module doc) and pack them into one
        sequence `[1, T]` with `document_ids`; a sample shorter than 2 tokens adds no row."""
        if not samples:
            raise ConfigError("cannot collate an empty batch")
        contract = self.feature_contract()
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("input_ids", "loss_mask", "hidden_states", "target", "document_ids")}  # fmt: skip
        tokens = 0
        for i, s in enumerate(samples):
            n = contract.verify(s)
            n = min(n, max_length) if max_length is not None else n
            tokens += n
            if n < 2:
                continue
            parts["input_ids"].append(s["input_ids"][1:n])
            parts["hidden_states"].append(s["hidden_states"][: n - 1])
            parts["target"].append(s["target"][1:n])
            parts["loss_mask"].append(s["loss_mask"][1:n].to(torch.long))
            parts["document_ids"].append(torch.full((n - 1,), i, dtype=torch.long))
        if not parts["input_ids"]:
            raise ConfigError("every sample of the batch is shorter than 2 tokens")
        tensors = {k: torch.cat(v)[None] for k, v in parts.items()}
        return TrainBatch(tensors=tensors, num_samples=len(samples), num_tokens=tokens,
                          num_loss_tokens=int(tensors["loss_mask"].sum()))  # fmt: skip

    def model_config(self, target: TargetInfo | None = None) -> PEagleConfig:
        """The draft's config: the target's widths unless `strategy.draft` sets them."""
        target = target or self.target
        d, p = self.cfg.draft, self.cfg.peagle
        heads = d.num_attention_heads or target.num_attention_heads
        eos = (
            list(target.eos_token_ids)
            if len(target.eos_token_ids) > 1
            else (target.eos_token_ids or [None])[0]
        )
        return PEagleConfig(
            hidden_size=target.hidden_size, intermediate_size=d.intermediate_size or target.intermediate_size,
            num_layers=d.num_layers, num_attention_heads=heads,
            num_key_value_heads=d.num_key_value_heads or target.num_key_value_heads,
            head_dim=target.head_dim if d.num_attention_heads is None else target.hidden_size // heads,
            vocab_size=target.vocab_size, draft_vocab_size=self.draft_vocab_size,
            aux_layers=list(self.aux_layers), mask_token_id=self.mask_token_id,
            num_depths=p.num_depths, layer_type=p.layer_type,
            norm_before_residual=p.norm_before_residual, sliding_window=p.sliding_window,
            rms_norm_eps=target.rms_norm_eps, hidden_act=target.hidden_act,
            max_position_embeddings=target.max_position_embeddings, rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling, bos_token_id=target.bos_token_id, eos_token_id=eos,
            pad_token_id=target.pad_token_id,
        )  # fmt: skip

    def build_model(self, target: TargetInfo | None = None, heads: TargetHeads | None = None,
                    vocab: VocabMapping | None = None) -> nn.Module:  # fmt: skip
        """A fresh draft: `vocab` loaded, then the target's embedding and lm_head rows."""
        target, heads = target or self.target, heads or self.heads
        draft = PEagleDraft(self.model_config(target))
        if vocab is not None:
            draft.load_vocab_mapping(vocab.d2t, vocab.t2d)
        elif draft.config.draft_vocab_size != target.vocab_size:
            raise ConfigError(f"draft vocab {draft.config.draft_vocab_size} < target vocab "
                              f"{target.vocab_size}: a vocab mapping is required")  # fmt: skip
        if heads is not None:
            draft.load_target_heads(heads.embed_tokens, heads.lm_head)
        return draft

    def lm_head(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The target's frozen lm_head on `device` in `dtype` (the teacher's; cached)."""
        if self.heads is None:
            raise ConfigError(
                "peagle computes its teacher with the target lm_head: build_strategy(..., heads=...)"
            )
        key = (torch.device(device), dtype)
        if key not in self._lm_head:
            self._lm_head[key] = self.heads.lm_head.to(device=device, dtype=dtype)
        return self._lm_head[key]

    def generator(self, step: StepContext | None) -> torch.Generator:
        """A CPU generator seeded by (anchor_seed, global step, rank, micro-batch of the step)."""
        global_step = step.global_step if step is not None else 0
        last, micro = self._micro
        micro = micro + 1 if last == global_step else 0
        self._micro = (global_step, micro)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return torch.Generator().manual_seed(
            hash_seed(self.cfg.anchor_seed, global_step, rank, micro)
        )

    def forward_loss(self, model: nn.Module, batch: TrainBatch, step: StepContext | None = None
                     ) -> tuple[torch.Tensor, Metrics]:  # fmt: skip
        """The P-EAGLE objective and metrics of one micro-batch (fixed rows when the batch
        carries `cod_anchor` / `cod_depth`: tests, the reference comparison)."""
        t, p = batch.tensors, self.cfg.peagle
        cod = (t["cod_anchor"], t["cod_depth"]) if "cod_anchor" in t else None
        return peagle_loss(
            model, input_ids_1T=t["input_ids"], hidden_states_1TA=t["hidden_states"],
            target_1TH=t["target"], loss_mask_1T=t["loss_mask"], document_ids_1T=t["document_ids"],
            lm_head_VH=self.lm_head(t["input_ids"].device, t["target"].dtype),
            mask_token_id=self.mask_token_id, num_depths=p.num_depths, ratio=p.down_sample_ratio,
            ratio_min=p.down_sample_ratio_min, max_anchors=p.max_anchors, cod=cod,
            generator=None if cod is not None else self.generator(step),
        )  # fmt: skip

    def export(self, model: nn.Module, out_dir, dtype: str = "bfloat16", *, verifier=None):
        """Write the draft as a speculators P-EAGLE directory vLLM serves (core/export/peagle.py)."""
        from specbus.core.export.peagle import export_peagle

        return export_peagle(
            unwrap(model), out_dir, verifier=verifier or self.target.path, dtype=dtype
        )
