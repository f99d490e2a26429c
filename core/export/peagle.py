"""Export a P-EAGLE draft in the `speculators` format: the directory vLLM serves with parallel
drafting and speculators 0.9 loads (`PEagleDraftModel.from_pretrained`).

vLLM 0.33 reads it as `--speculative-config '{"model": DIR}'`: its `SpeculatorsConfig`
(`transformers_utils/configs/speculators`) maps `speculators_model_type: peagle` to
`method: eagle3, parallel_drafting: true`, the architecture to `PeagleQwen3ForCausalLM` /
`PeagleLlamaForCausalLM` by `transformer_layer_config.model_type`, `mask_token_id` (required)
to its `pard_token`, and the draft length to `proposal_methods[0].speculative_tokens`; its
loader requires `mask_hidden` among the weights. The fields follow speculators'
`PEagleSpeculatorConfig` (an `Eagle3SpeculatorConfig`):

config.json: `speculators_model_type` peagle, `architectures` [PEagleDraftModel],
`transformer_layer_config` (qwen3 or llama: widths, heads, `head_dim`, eps, `rope_parameters`,
`layer_types` and `sliding_window` as trained), `draft_vocab_size`, `target_hidden_size`,
`eagle_aux_hidden_state_layer_ids` (vLLM's ids, one more than specbus's `aux_layers`:
vLLM's id k is the hidden state entering layer k; ascending, the order vLLM concatenates them
in, so `fc`'s column blocks and `mask_hidden`'s are permuted to it), `norm_before_residual`,
`norm_before_fc` / `fc_norm` / `norm_output` false, `embed_requires_grad` true,
`mask_token_id`, `speculators_config` {algorithm peagle, greedy proposal of `num_depths`
tokens, the verifier's directory and architectures}.

model.safetensors: `embed_tokens` (trained), `fc`, `mask_hidden`, `layers.*`, `norm`,
`lm_head`, `d2t`, `t2d`, exactly (a missing or extra name raises `ExportError`: loaders skip
unknown names silently). Written to a temp sibling and renamed into place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from specbus.core.errors import ExportError
from specbus.core.export.sglang import write_draft_dir
from specbus.core.export.speculators import ascending  # vLLM's aux-layer order, shared
from specbus.core.models.peagle import PEagleConfig, PEagleDraft

SPECULATORS_VERSION = "0.9.0"  # the release whose format this writes (and is tested against)
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def layer_config(cfg: PEagleConfig, dtype: str) -> dict[str, Any]:
    """The `transformer_layer_config` (transformers 5 spelling of rope and layer types)."""
    rope = dict(cfg.rope_scaling or {"rope_type": "default"})
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    kind = "sliding_attention" if cfg.sliding_window is not None else "full_attention"
    return {
        "architectures": ["Qwen3ForCausalLM" if cfg.layer_type == "qwen3" else "LlamaForCausalLM"],
        "model_type": cfg.layer_type,
        "num_hidden_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_parameters": {**rope, "rope_theta": float(cfg.rope_theta)},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": cfg.initializer_range,
        "layer_types": [kind] * cfg.num_layers,
        "use_sliding_window": cfg.sliding_window is not None,
        "sliding_window": cfg.sliding_window,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "dtype": dtype,
    }


def peagle_config(
    cfg: PEagleConfig, *, verifier: str | Path, dtype: str = "bfloat16"
) -> dict[str, Any]:
    """The speculators `config.json` of a P-EAGLE draft with this config (module doc)."""
    path = Path(verifier)
    try:
        archs = list(json.loads((path / "config.json").read_text()).get("architectures") or [])
    except (OSError, ValueError) as e:
        raise ExportError(
            f"the verifier (target) {str(path)!r} has no readable config.json: {e}"
        ) from e
    order = ascending(cfg.aux_layers)
    return {
        "architectures": ["PEagleDraftModel"],
        "speculators_model_type": "peagle",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer_config(cfg, dtype),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "eagle_aux_hidden_state_layer_ids": [int(cfg.aux_layers[j]) + 1 for j in order],
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": True,
        "mask_token_id": cfg.mask_token_id,
        "tie_word_embeddings": False,
        "dtype": dtype,
        "speculators_config": {
            "algorithm": "peagle",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": cfg.num_depths,
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],  # fmt: skip
            "verifier": {"name_or_path": str(path), "architectures": archs},
        },
    }


def _permute(t: torch.Tensor, order: list[int], width: int) -> torch.Tensor:
    return torch.cat([t[..., j * width : (j + 1) * width] for j in order], dim=-1)


def peagle_tensors(draft: PEagleDraft) -> dict[str, torch.Tensor]:
    """The draft's tensors under speculators' names, aux blocks in ascending layer order."""
    state = {k: v.detach().cpu() for k, v in draft.state_dict().items()}
    expected = set(PEagleDraft(draft.config).state_dict())
    missing, extra = expected - set(state), set(state) - expected
    if missing or extra:
        raise ExportError(
            f"P-EAGLE export refused: missing {sorted(missing)}, extra {sorted(extra)}"
        )
    order, width = ascending(draft.config.aux_layers), draft.config.hidden_size
    state["fc.weight"] = _permute(state["fc.weight"], order, width)
    state["mask_hidden"] = _permute(state["mask_hidden"], order, width)
    return state


def export_peagle(draft: PEagleDraft, out_dir: str | Path, *, verifier: str | Path,
                  dtype: str = "bfloat16") -> Path:  # fmt: skip
    """Write `draft` (unwrapped) as a speculators P-EAGLE directory `out_dir`, atomically;
    `verifier` is the target's directory."""
    if dtype not in _DTYPES:
        raise ExportError(f"export dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    config = peagle_config(draft.config, verifier=verifier, dtype=dtype)
    tensors = {
        k: (v.to(_DTYPES[dtype]) if v.is_floating_point() else v).contiguous()
        for k, v in peagle_tensors(draft).items()
    }
    return write_draft_dir(out_dir, config, tensors)


def config_from_dict(d: dict[str, Any]) -> PEagleConfig:
    """Our config of an exported directory (aux layers back in ascending specbus ids)."""
    layer = d["transformer_layer_config"]
    rope = dict(layer.get("rope_parameters") or {})
    theta = float(rope.pop("rope_theta", 10000.0))
    heads = int(layer["num_attention_heads"])
    return PEagleConfig(
        hidden_size=int(layer["hidden_size"]), intermediate_size=int(layer["intermediate_size"]),
        num_layers=int(layer["num_hidden_layers"]), num_attention_heads=heads,
        num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or int(layer["hidden_size"]) // heads),
        vocab_size=int(layer["vocab_size"]), draft_vocab_size=int(d["draft_vocab_size"]),
        aux_layers=[int(i) - 1 for i in d["eagle_aux_hidden_state_layer_ids"]],
        mask_token_id=int(d["mask_token_id"]),
        num_depths=int(d["speculators_config"]["proposal_methods"][0]["speculative_tokens"]),
        layer_type=str(layer["model_type"]), norm_before_residual=bool(d["norm_before_residual"]),
        sliding_window=layer.get("sliding_window") if layer.get("use_sliding_window") else None,
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        hidden_act=str(layer.get("hidden_act", "silu")),
        max_position_embeddings=int(layer.get("max_position_embeddings", 2048)), rope_theta=theta,
        rope_scaling=None if rope.get("rope_type", "default") == "default" else rope,
        bos_token_id=layer.get("bos_token_id"), eos_token_id=layer.get("eos_token_id"),
        pad_token_id=layer.get("pad_token_id"),
    )  # fmt: skip


def load_peagle_export(path: str | Path, dtype: torch.dtype = torch.float32) -> PEagleDraft:
    """Load an exported directory back into a `PEagleDraft` (names checked both ways)."""
    path = Path(path)
    try:
        cfg = config_from_dict(json.loads((path / "config.json").read_text()))
        tensors = load_file(str(path / "model.safetensors"))
    except (OSError, KeyError, ValueError) as e:
        raise ExportError(f"{str(path)!r} is not a P-EAGLE speculators export: {e}") from e
    draft = PEagleDraft(cfg)
    expected = set(draft.state_dict())
    if set(tensors) != expected:
        raise ExportError(f"{str(path)!r}: missing {sorted(expected - set(tensors))}, "
                          f"extra {sorted(set(tensors) - expected)}")  # fmt: skip
    draft.load_state_dict(tensors)
    return draft.to(dtype)
