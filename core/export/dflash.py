"""Export a DFlash-family draft as the directory SGLang loads (`--speculative-draft-model-path`).

`--speculative-algorithm DFLASH` (dflash; domino through `dflash_config.projector_type`) reads
`DFlashDraftModel`; `--speculative-algorithm DSPARK` reads `DSparkDraftModel`. Checked against
SGLang's `models/dflash.py`, `models/dspark.py`, `speculative/dflash_utils.py` and
`speculative/dspark_components/dspark_config.py`:

config.json: `architectures`, `model_type` qwen3, widths, head counts, `head_dim`, eps, rope,
`vocab_size`, `num_hidden_layers`, `layer_types` (all full attention), `block_size`,
`num_target_layers`, `dflash_config` {`target_layer_ids`, `mask_token_id`, `block_size`,
`projector_type`; Domino: `emb_dim`, `gru_hidden_dim`, `shift_label` and
`pure_draft_prefix_len` as trained (SGLang 0.5.23 serves only `pure_draft_prefix_len` 1, the
default: another value is refused here); DSpark: `markov_rank`, `markov_head_type`}; DSpark also top-level
`markov_rank`, `markov_head_type`, `mask_token_id`, `enable_confidence_head`,
`confidence_head_with_markov`, `sample_from_anchor` true (position 0 drafts the first token).

model.safetensors: exactly the draft's parameters (`layers.i.*`, `fc`, `hidden_norm`, `norm`,
Domino's `prefix_gru`/`embed_proj`, DSpark's `markov_head`/`confidence_head`); no embedding
and no lm_head (SGLang shares the target's). SGLang's loader skips names it does not know and
fails late on missing heads, so a missing or extra name raises `ExportError` and nothing is
written. Refused: a DSpark draft without a Markov head (SGLang's DSPARK requires
markov_rank > 0) or without a confidence head (SGLang builds one and requires its weights).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from specbus.core.errors import ExportError
from specbus.core.export.sglang import write_draft_dir
from specbus.core.models.dflash import DFlashConfig, DFlashDraft

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ARCHITECTURES = {
    "dflash": "DFlashDraftModel",
    "domino": "DFlashDraftModel",
    "dspark": "DSparkDraftModel",
}


def export_keys(cfg: DFlashConfig) -> set[str]:
    """The exact tensor names of an export of a draft with this config."""
    return set(DFlashDraft(cfg).state_dict())


def config_dict(cfg: DFlashConfig, dtype: str = "bfloat16") -> dict[str, Any]:
    """The SGLang `config.json` of a DFlash-family draft."""
    dflash: dict[str, Any] = {
        "target_layer_ids": list(cfg.target_layer_ids),
        "mask_token_id": cfg.mask_token_id,
        "block_size": cfg.block_size,
    }
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[cfg.projector]],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": cfg.initializer_range,
        "layer_types": ["full_attention"] * cfg.num_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "torch_dtype": dtype,
        "dflash_config": dflash,
    }
    if cfg.projector == "domino":
        dflash.update(
            projector_type="domino", emb_dim=cfg.emb_dim, gru_hidden_dim=cfg.gru_hidden_dim,
            shift_label=cfg.shift_label, pure_draft_prefix_len=cfg.pure_draft_prefix_len,
        )  # fmt: skip
    if cfg.projector == "domino" and cfg.pure_draft_prefix_len != 1:
        raise ExportError(
            f"Domino export refused: SGLang serves pure_draft_prefix_len 1 only, the draft was "
            f"trained with {cfg.pure_draft_prefix_len} (strategy.domino.pure_draft_prefix_len)"
        )
    if cfg.projector == "dspark":
        if cfg.markov_rank <= 0:
            raise ExportError(
                "DSPARK export refused: SGLang's DSpark draft requires a Markov head "
                "(strategy.dspark.markov_rank > 0)"
            )
        if not cfg.confidence_head:
            raise ExportError(
                "DSPARK export refused: SGLang builds a confidence head and requires its weights "
                "(strategy.dspark.confidence_head: true)"
            )
        dflash.update(projector_type="dspark", markov_rank=cfg.markov_rank,
                      markov_head_type=cfg.markov_head_type)  # fmt: skip
        out.update(
            markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_head_type,
            mask_token_id=cfg.mask_token_id, enable_confidence_head=True,
            confidence_head_with_markov=cfg.confidence_with_markov, sample_from_anchor=True,
        )  # fmt: skip
    return out


def config_from_dict(d: dict[str, Any]) -> DFlashConfig:
    """Read back an exported config.json (what `load_dflash_export` builds)."""
    dflash = d.get("dflash_config") or {}
    projector = dflash.get("projector_type") or "dflash"
    return DFlashConfig(
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_attention_heads=int(d["num_attention_heads"]),
        num_key_value_heads=int(d["num_key_value_heads"]),
        head_dim=int(d["head_dim"]),
        vocab_size=int(d["vocab_size"]),
        target_layer_ids=[int(i) for i in dflash["target_layer_ids"]],
        num_target_layers=int(d["num_target_layers"]),
        block_size=int(dflash.get("block_size", d.get("block_size", 16))),
        mask_token_id=int(dflash["mask_token_id"]),
        projector=projector,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        hidden_act=str(d.get("hidden_act", "silu")),
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        rope_theta=float(d.get("rope_theta", 10000.0)),
        rope_scaling=d.get("rope_scaling"),
        initializer_range=float(d.get("initializer_range", 0.02)),
        emb_dim=int(dflash.get("emb_dim", 256)),
        gru_hidden_dim=int(dflash.get("gru_hidden_dim", 256)),
        shift_label=bool(dflash.get("shift_label", False)) and projector == "domino",
        pure_draft_prefix_len=int(dflash.get("pure_draft_prefix_len", 0) or 0)
        if projector == "domino"
        else 0,
        markov_rank=int(d.get("markov_rank", dflash.get("markov_rank", 0)) or 0),
        markov_head_type=str(d.get("markov_head_type", "vanilla")),
        confidence_head=bool(d.get("enable_confidence_head", False)),
        confidence_with_markov=bool(d.get("confidence_head_with_markov", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
        pad_token_id=d.get("pad_token_id"),
    )


def export_dflash(draft: DFlashDraft, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Write `draft` (unwrapped) as an SGLang DFLASH/DSPARK draft directory, atomically."""
    if dtype not in _DTYPES:
        raise ExportError(f"export dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    cfg = draft.config
    hf = config_dict(cfg, dtype)
    state = {k: v.detach().cpu() for k, v in draft.state_dict().items()}
    expected = export_keys(cfg)
    missing, extra = expected - set(state), set(state) - expected
    if missing or extra:
        raise ExportError(
            f"{cfg.projector} export refused: missing {sorted(missing)}, extra {sorted(extra)}"
        )
    tensors = {
        k: (v.to(_DTYPES[dtype]) if v.is_floating_point() else v).contiguous()
        for k, v in state.items()
    }
    return write_draft_dir(out_dir, hf, tensors)


def load_dflash_export(path: str | Path, dtype: torch.dtype = torch.float32) -> DFlashDraft:
    """Load an exported directory back into a `DFlashDraft` (names checked both ways)."""
    path = Path(path)
    try:
        cfg = config_from_dict(json.loads((path / "config.json").read_text()))
        tensors = load_file(str(path / "model.safetensors"))
    except (OSError, KeyError, ValueError) as e:
        raise ExportError(f"{str(path)!r} is not a DFlash-family export: {e}") from e
    expected = export_keys(cfg)
    if set(tensors) != expected:
        raise ExportError(
            f"{str(path)!r}: missing {sorted(expected - set(tensors))}, extra {sorted(set(tensors) - expected)}"
        )
    draft = DFlashDraft(cfg)
    draft.load_state_dict(tensors)
    return draft.to(dtype)
