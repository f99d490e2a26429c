"""Export a draft in the `speculators` format: the directory vLLM serves as a draft and
vLLM's `speculators` package (0.9) loads.

vLLM reads it with `vllm serve TARGET --speculative-config '{"model": DIR, ...}'`: its
`SpeculatorsConfig` turns `config.json` into the draft's model config (the algorithm from
`speculators_model_type`, the decoder layer from `transformer_layer_config`, the draft
length from `speculators_config.proposal_methods[0].speculative_tokens`); speculators reads
it with `SpeculatorModel.from_pretrained(DIR)`. Checked against both (`tests/test_speculators_export.py`).

One function per draft kind (`EXPORTERS`, chosen by `export_speculators`); each writes
`config.json` and `model.safetensors` into a temp sibling and renames it into place.

EAGLE3 (`speculators_model_type: eagle3`, `Eagle3DraftModel`):
- tensors: `layers.0.*` (specbus's `midlayer.*`), `fc`, `norm`, `lm_head`, `d2t`, `t2d` and
  `embed_tokens` (the frozen copy of the target's, as speculators saves it); exactly these
  names (a missing or extra one raises `ExportError`: loaders skip unknown names silently);
- `norm_before_residual: false` (specbus's layer keeps the un-normed hidden state as the
  residual; vLLM's default for EAGLE3 is true, so it is always written), no `fc` norms;
- `eagle_aux_hidden_state_layer_ids`: vLLM's ids, one more than specbus's `aux_layers`
  (vLLM's id `k` is the hidden state entering decoder layer `k`, i.e. the output of layer
  `k - 1`; specbus and SGLang's exports name the layer whose output it is), ascending: vLLM
  captures each layer once and concatenates them in ascending order, so `fc`'s column blocks
  are permuted to that order, and a draft trained on a repeated layer is refused;
- `speculators_config.verifier`: the target's directory and architectures (speculators loads
  the verifier's embedding and head from it; vLLM uses the served target).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from specbus.core.errors import ExportError
from specbus.core.models.llama_eagle3 import Eagle3Config, LlamaEagle3Draft

SPECULATORS_VERSION = "0.9.0"  # the speculators release the format was read from and tested on
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def vllm_layer_ids(aux_layers) -> list[int]:
    """specbus's aux layers (0-based layer outputs) as vLLM's `eagle_aux_hidden_state_layer_ids`."""
    return [int(i) + 1 for i in aux_layers]


def _rope(theta: float, scaling: dict[str, Any] | None) -> dict[str, Any]:
    """transformers 5's `rope_parameters` (speculators 0.9 and vLLM 0.33 need transformers 5)."""
    params = dict(scaling or {"rope_type": "default"})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    return {**params, "rope_theta": float(theta)}


def _verifier(verifier: str | Path) -> dict[str, Any]:
    path = Path(verifier)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ExportError(
            f"the verifier (target) {str(path)!r} has no readable config.json: {e}"
        ) from e
    return {"name_or_path": str(path), "architectures": list(config.get("architectures") or [])}


def eagle3_config(cfg: Eagle3Config, *, verifier: str | Path, speculative_tokens: int = 3,
                  dtype: str = "bfloat16") -> dict[str, Any]:  # fmt: skip
    """The speculators `config.json` of an EAGLE3 draft with this config."""
    if not cfg.aux_layers:
        raise ExportError("EAGLE3 speculators export refused: the draft records no aux layers")
    ascending(cfg.aux_layers)
    layer = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_parameters": _rope(cfg.rope_theta, cfg.rope_scaling),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "initializer_range": cfg.initializer_range,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "dtype": dtype,
    }
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": vllm_layer_ids(sorted(cfg.aux_layers)),
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "dtype": dtype,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(speculative_tokens),
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],  # fmt: skip
            "verifier": _verifier(verifier),
        },
    }


def ascending(aux_layers) -> list[int]:
    """The order vLLM concatenates `aux_layers` in: positions of the layers, ascending
    (`ExportError` for a repeated layer: vLLM captures each once)."""
    layers = [int(a) for a in aux_layers]
    if len(set(layers)) != len(layers):
        raise ExportError(f"speculators export refused: the draft was trained on aux layers "
                          f"{layers}, with a repeat; vLLM captures each layer once "
                          "(train with distinct target.aux_layers)")  # fmt: skip
    return sorted(range(len(layers)), key=layers.__getitem__)


def eagle3_tensors(draft: LlamaEagle3Draft) -> dict[str, torch.Tensor]:
    """The draft's tensors under speculators' names, `fc`'s column blocks in ascending layer
    order (module doc); `ExportError` when the draft's names are not exactly the EAGLE3 ones."""
    state = draft.state_dict()
    expected = set(LlamaEagle3Draft.EXPORT_KEYS) | {"embed_tokens.weight"}
    missing, extra = expected - set(state), set(state) - expected
    if missing or extra:
        raise ExportError(f"EAGLE3 speculators export refused: missing {sorted(missing)}, "
                          f"extra {sorted(extra)}")  # fmt: skip
    width = draft.config.target_hidden_size
    fc = state["fc.weight"]
    state["fc.weight"] = torch.cat([fc[:, j * width : (j + 1) * width]
                                    for j in ascending(draft.config.aux_layers)], dim=1)  # fmt: skip
    return {k.replace("midlayer.", "layers.0.", 1): v for k, v in state.items()}


def export_eagle3(draft: LlamaEagle3Draft, out_dir: str | Path, *, verifier: str | Path,
                  speculative_tokens: int = 3, dtype: str = "bfloat16") -> Path:  # fmt: skip
    """Write an EAGLE3 draft (unwrapped) as a speculators directory `out_dir` (module doc);
    `verifier` is the target's directory."""
    config = eagle3_config(draft.config, verifier=verifier, speculative_tokens=speculative_tokens,
                           dtype=dtype)  # fmt: skip
    return _write(out_dir, config, eagle3_tensors(draft), dtype)


EXPORTERS: dict[type, Callable[..., Path]] = {LlamaEagle3Draft: export_eagle3}


def export_speculators(draft, out_dir: str | Path, *, verifier: str | Path, **kw) -> Path:
    """Export `draft` with the exporter of its kind; `ExportError` for a kind speculators has
    no exporter for here (the SGLang export, `specbus export`, covers it)."""
    for kind, exporter in EXPORTERS.items():
        if isinstance(draft, kind):
            return exporter(draft, out_dir, verifier=verifier, **kw)
    raise ExportError(f"no speculators export for a {type(draft).__name__} draft (built: "
                      f"{', '.join(k.__name__ for k in EXPORTERS)}); `--format sglang` exports it")  # fmt: skip


def _write(out_dir: str | Path, config: dict, state: dict[str, torch.Tensor], dtype: str) -> Path:
    if dtype not in _DTYPES:
        raise ExportError(f"export dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    tensors = {
        k: (
            v.detach().cpu().to(_DTYPES[dtype]) if v.is_floating_point() else v.detach().cpu()
        ).contiguous()
        for k, v in state.items()
    }
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
