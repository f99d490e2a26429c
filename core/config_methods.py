"""The per-method sections of `strategy` (Domino, DSpark, P-EAGLE) and the strict `Section` base
every config section derives from (`core/config.py` composes them; re-exported there)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Section(BaseModel):
    """A config section: strict (`extra="forbid"`: a typo is an error) and validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DominoConfig(Section):
    """Domino's correction head, its label layout and its schedule-dependent loss weight.

    The defaults are SpecForge's Domino recipe (and what SGLang 0.5.23 serves: it refuses a
    `pure_draft_prefix_len` other than 1). `shift_label`: block position k predicts token
    anchor+k+1 (else anchor+k, position 0 unsupervised); `pure_draft_prefix_len`: the first
    drafted tokens of a block that take the base logits alone (no GRU correction)."""

    lambda_start: float = Field(1.0, ge=0, le=1)  # base-loss weight at step 0
    lambda_decay_ratio: float = Field(0.5, gt=0, le=1)  # reaches 0 after this fraction of steps
    emb_dim: int = Field(256, ge=1)  # embed_proj width
    gru_hidden_dim: int = Field(256, ge=1)
    shift_label: bool = True
    pure_draft_prefix_len: int = Field(1, ge=0)


class DSparkConfig(Section):
    """DSpark's Markov and confidence heads and its loss mix (CE + L1 + confidence)."""

    ce_alpha: float = Field(0.1, ge=0)
    l1_alpha: float = Field(0.9, ge=0)
    confidence_alpha: float = Field(1.0, ge=0)
    markov_rank: int = Field(128, ge=0)  # 0: no Markov head (SGLang's DSPARK needs one)
    markov_head_type: Literal["vanilla", "gated", "rnn"] = "vanilla"
    confidence_head: bool = True
    confidence_with_markov: bool = False


class PEagleSection(Section):
    """P-EAGLE's parallel depths, COD sampling and draft layer (defaults: speculators 0.9's
    `speculators train --speculator-type peagle`)."""

    num_depths: int = Field(8, ge=1)  # tokens drafted in parallel (depth 0 + D-1 mask rows)
    down_sample_ratio: float = Field(0.7, gt=0, le=1)  # COD: depth d keeps r^d of the seeds
    down_sample_ratio_min: float = Field(0.2, gt=0, le=1)  # ... at least this fraction
    max_anchors: int | None = Field(512, ge=1)  # COD seeds per micro-batch (None: every row)
    layer_type: Literal["llama", "qwen3"] = "qwen3"  # qwen3: q/k RMSNorm per head
    norm_before_residual: bool = True  # the first layer's residual is the normed hidden
    sliding_window: int | None = Field(2048, ge=1)  # every draft layer; None: full attention
