"""Draft architecture registry: `build_draft(name, cfg, target_info)`.

An architecture is a function `(DraftConfig, TargetInfo, aux_layers) -> nn.Module` registered
under a name. Algorithms (strategies) and architectures are separate axes: a strategy asks for
an architecture by name (`strategy.draft.architecture`).
"""

from __future__ import annotations

from collections.abc import Callable

from specbus.core.config import DraftConfig
from specbus.core.errors import ConfigError
from specbus.core.models.llama_eagle3 import Eagle3Config, LlamaEagle3Draft
from specbus.core.models.target import TargetInfo
from torch import nn

DraftBuilder = Callable[[DraftConfig, TargetInfo, list[int]], nn.Module]
_DRAFTS: dict[str, DraftBuilder] = {}


def register_draft(name: str) -> Callable[[DraftBuilder], DraftBuilder]:
    """Decorator: register a draft builder `(DraftConfig, TargetInfo, aux_layers) -> nn.Module` under
    `name`; `ConfigError` for a taken name."""

    def wrap(builder: DraftBuilder) -> DraftBuilder:
        if name in _DRAFTS:
            raise ConfigError(f"draft architecture {name!r} is already registered")
        _DRAFTS[name] = builder
        return builder

    return wrap


def available_drafts() -> list[str]:
    """The registered draft architectures, sorted."""
    return sorted(_DRAFTS)


def build_draft(
    name: str, cfg: DraftConfig, target: TargetInfo, aux_layers: list[int]
) -> nn.Module:
    """Build a freshly initialised draft. Raises `ConfigError` for an unknown name."""
    try:
        builder = _DRAFTS[name]
    except KeyError as e:
        raise ConfigError(
            f"strategy.draft.architecture {name!r} is unknown; known: {available_drafts()}"
        ) from e
    return builder(cfg, target, aux_layers)


def eagle3_config(cfg: DraftConfig, target: TargetInfo, aux_layers: list[int]) -> Eagle3Config:
    """The draft's architecture: the target's widths unless overridden; Vd <= V.

    `draft_vocab_size` is clamped to the target vocabulary (32000 does not fit a small target).
    """
    if cfg.num_layers != 1:
        raise ConfigError(
            f"strategy.draft.num_layers={cfg.num_layers}: llama_eagle3 has exactly one layer"
        )
    hidden = cfg.hidden_size or target.hidden_size
    heads = cfg.num_attention_heads or target.num_attention_heads
    return Eagle3Config(
        hidden_size=hidden,
        intermediate_size=cfg.intermediate_size or target.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=cfg.num_key_value_heads or target.num_key_value_heads,
        head_dim=target.head_dim
        if cfg.hidden_size is None and cfg.num_attention_heads is None
        else hidden // heads,
        vocab_size=target.vocab_size,
        draft_vocab_size=min(cfg.draft_vocab_size, target.vocab_size),
        target_hidden_size=target.hidden_size,
        rms_norm_eps=target.rms_norm_eps,
        hidden_act=target.hidden_act,
        max_position_embeddings=target.max_position_embeddings,
        rope_theta=target.rope_theta,
        rope_scaling=target.rope_scaling,
        aux_layers=list(aux_layers),
        bos_token_id=target.bos_token_id,
        eos_token_id=list(target.eos_token_ids)
        if len(target.eos_token_ids) > 1
        else (target.eos_token_ids or [None])[0],
        pad_token_id=target.pad_token_id,
    )


@register_draft("llama_eagle3")
def _llama_eagle3(cfg: DraftConfig, target: TargetInfo, aux_layers: list[int]) -> nn.Module:
    return LlamaEagle3Draft(eagle3_config(cfg, target, aux_layers))
