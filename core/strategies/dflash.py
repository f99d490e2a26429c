"""DFlash, Domino and DSpark as strategies: feature contract, collate, draft, objective.

One adapter class for the family (`projector` picks the objective); the objectives
themselves, with the shape legend and their semantics, are pure functions in
dflash_loss.py (re-exported here). docs/dflash.md describes what they match.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from specbus.core.config import StrategyConfig
from specbus.core.errors import ConfigError
from specbus.core.models.dflash import DFlashConfig, DFlashDraft
from specbus.core.models.target import TargetHeads, TargetInfo
from specbus.core.strategies.base import (
    FeatureContract,
    FeatureField,
    Metrics,
    StepContext,
    TrainBatch,
    pad_right,
)
from specbus.core.strategies.dflash_loss import (
    block_mask,
    dflash_loss,
    domino_lambda,
    domino_loss,
    draft_blocks,
    dspark_loss,
    sample_anchors,
)
from specbus.core.strategies.eagle3 import unwrap
from torch import nn

# ---------------------------------------------------------------------------------------------
# The strategies


@dataclass(frozen=True)
class Heads:
    """The target's frozen embedding and lm_head, as the objectives take them."""

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
        if cfg.attention == "flash":  # EAGLE3's TTT attention (core/models/ttt_flash.py)
            raise ConfigError(
                f"strategy.attention 'flash' is EAGLE3's; {cfg.name} takes auto, sdpa or flex"
            )
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
        """The draft's vocabulary: the target's (DFlash drafts through the target lm_head)."""
        return self.target.vocab_size  # the target's own lm_head: no reduced vocabulary

    def feature_contract(self, target: TargetInfo | None = None) -> FeatureContract:
        """input_ids, loss_mask, hidden_states (the chosen target layers), and the final hidden state
        for DSpark."""
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
        """The draft's config: the target's widths unless `strategy.draft` sets them."""
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
            shift_label=self.projector == "domino" and domino.shift_label,
            pure_draft_prefix_len=domino.pure_draft_prefix_len if self.projector == "domino" else 0,
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
        """The objective's inputs for one micro-batch (anchors drawn from `generator(step)`
        unless the batch carries fixed ones)."""
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
        """The DFlash objective and metrics of one micro-batch."""
        return dflash_loss(
            model, **self.loss_kwargs(batch, step), **_rank_pooling(), fused=self.fused(batch)
        )

    def export(self, model: nn.Module, out_dir, dtype: str = "bfloat16"):
        """Write the draft as an SGLang DFLASH / DSPARK directory."""
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
    """Domino: DFlash plus a correction head, its loss weight decaying with the schedule."""

    projector = "domino"
    SECTIONS = ("domino",)

    def lambda_base(self, step: StepContext | None) -> float:
        """The base-loss weight at `step`."""
        d = self.cfg.domino
        return domino_lambda(step, d.lambda_start, d.lambda_decay_ratio)

    def forward_loss(self, model, batch, step=None):
        """The Domino objective and metrics of one micro-batch."""
        return domino_loss(
            model, **self.loss_kwargs(batch, step), lambda_base=self.lambda_base(step)
        )


class DSparkStrategy(DFlashFamilyStrategy):
    """DSpark: Markov and confidence heads, CE + L1 + confidence loss pooled over ranks."""

    projector = "dspark"
    SECTIONS = ("dspark",)

    def forward_loss(self, model, batch, step=None):
        """The DSpark objective and metrics of one micro-batch."""
        d = self.cfg.dspark
        return dspark_loss(
            model, **self.loss_kwargs(batch, step), target_BLH=batch.tensors["target"],
            ce_alpha=d.ce_alpha, l1_alpha=d.l1_alpha, confidence_alpha=d.confidence_alpha,
            **_rank_pooling(), fused=self.fused(batch),
        )  # fmt: skip


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
