"""Export a draft in the `speculators` format: the directory vLLM serves as a draft and
vLLM's `speculators` package (0.9) loads.

vLLM reads it with `vllm serve TARGET --speculative-config '{"model": DIR, ...}'`: its
`SpeculatorsConfig` turns `config.json` into the draft's model config (the algorithm from
`speculators_model_type`, the decoder layer from `transformer_layer_config`, the draft
length from `speculators_config.proposal_methods[0].speculative_tokens`); speculators reads
it with `SpeculatorModel.from_pretrained(DIR)`. Checked against both (`tests/test_speculators_export.py`).

One function per draft kind (`EXPORTERS`, chosen by `export_speculators` from `draft_kind`;
DFlash and DSpark share one); each writes
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

DFlash (`dflash`, `DFlashDraftModel`) and DSpark (`dspark`, `DSparkDraftModel`), one exporter
for the family (`export_dflash_family`; which one from the draft's `config.projector`):
- tensors: exactly the draft's own (`layers.i.*`, `fc`, `hidden_norm`, `norm`; DSpark's
  `markov_head.*` and `confidence_head.proj`): speculators' names are specbus's (and SGLang's).
  No `embed_tokens`, `lm_head`, `d2t`/`t2d`: the draft drafts through the target's full
  vocabulary, so `draft_vocab_size` is the target's and speculators reloads both from the
  verifier (it saves neither for a full-vocabulary draft; vLLM shares the target's);
- `aux_hidden_state_layer_ids`: vLLM's ids (specbus's `target_layer_ids` + 1: vLLM's DFlash
  config maps them back with `- 1`), ascending, `fc`'s column blocks permuted to match;
- `sample_from_anchor`: false for DFlash (block position 0 is the anchor, positions 1..K-1
  draft: `block_size - 1` speculative tokens), true for DSpark (position k drafts anchor+k+1,
  the Markov head reading the token at anchor+k: `block_size` tokens);
- `sliding_window_non_causal: true`: no effect in speculators (no sliding-window layer), but
  vLLM turns its negation into `dflash_config.causal` for every layer, and the blocks attend
  bidirectionally;
- DSpark: `markov_rank` (0: no Markov head), `markov_head_type`, `enable_confidence_head`,
  `confidence_head_with_markov` as trained. vLLM 0.33's `Qwen3DSparkModel` builds only the
  vanilla Markov head (a draft trained with `gated` or `rnn`, or without a Markov head, loads in
  speculators but not in vLLM: a warning says so).
Domino has no speculators format (0.9 has dflash, dflash2, dspark: no GRU correction head):
refused with `ExportError` (`--format sglang` serves it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from specbus.core.errors import ExportError
from specbus.core.export.sglang import write_draft_dir
from specbus.core.models.dflash import DFlashConfig, DFlashDraft
from specbus.core.models.llama_eagle3 import Eagle3Config, LlamaEagle3Draft

log = logging.getLogger("specbus.export")

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
        "speculators_config": _speculators_config("eagle3", speculative_tokens, verifier),
    }


def _speculators_config(algorithm: str, tokens: int, verifier: str | Path) -> dict[str, Any]:
    """`speculators_config`: greedy proposals of `tokens` tokens, the verifier."""
    greedy = {"proposal_type": "greedy", "speculative_tokens": int(tokens),
              "accept_tolerance": 0.0, "verifier_accept_k": 1}  # fmt: skip
    return {"algorithm": algorithm, "default_proposal_method": "greedy",
            "proposal_methods": [greedy], "verifier": _verifier(verifier)}  # fmt: skip


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


DFLASH_ALGORITHMS = ("dflash", "dspark")  # the DFlash-family formats written here


def dflash_config(cfg: DFlashConfig, *, verifier: str | Path,
                  dtype: str = "bfloat16") -> dict[str, Any]:  # fmt: skip
    """The speculators `config.json` of a DFlash or DSpark draft with this config (module doc)."""
    algorithm = cfg.projector
    if algorithm not in DFLASH_ALGORITHMS:
        raise ExportError(
            f"no speculators format for a {algorithm} draft: speculators {SPECULATORS_VERSION} has "
            f"dflash, dflash2 and dspark, none with Domino's GRU correction head "
            f"(`--format sglang` exports it for SGLang's DFLASH)"
        )
    ascending(cfg.target_layer_ids)
    layer = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
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
        "rope_parameters": _rope(cfg.rope_theta, cfg.rope_scaling),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_types": ["full_attention"] * cfg.num_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "initializer_range": cfg.initializer_range,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "dtype": dtype,
    }
    from_anchor = algorithm == "dspark"  # DSpark's position 0 drafts; DFlash's is the anchor
    out: dict[str, Any] = {
        "architectures": [{"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel"}[algorithm]],
        "speculators_model_type": algorithm,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.vocab_size,  # the target's: no reduced vocabulary
        "target_hidden_size": cfg.hidden_size,
        "block_size": cfg.block_size,
        "aux_hidden_state_layer_ids": vllm_layer_ids(sorted(cfg.target_layer_ids)),
        "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": True,  # vLLM: dflash_config.causal = not this (module doc)
        "sample_from_anchor": from_anchor,
        "tie_word_embeddings": False,
        "dtype": dtype,
        "speculators_config": _speculators_config(
            algorithm, cfg.block_size if from_anchor else cfg.block_size - 1, verifier
        ),
    }
    if algorithm == "dspark":
        out.update(markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_head_type,
                   enable_confidence_head=cfg.confidence_head,
                   confidence_head_with_markov=cfg.confidence_with_markov)  # fmt: skip
    return out


def dflash_tensors(draft: DFlashDraft) -> dict[str, torch.Tensor]:
    """The draft's tensors under speculators' names (its own), `fc`'s column blocks in
    ascending layer order; `ExportError` when the names are not exactly those of a fresh
    draft of its config (a loader skips unknown names silently)."""
    state = dict(draft.state_dict())
    expected = set(DFlashDraft(draft.config).state_dict())
    missing, extra = expected - set(state), set(state) - expected
    if missing or extra:
        raise ExportError(f"{draft.config.projector} speculators export refused: missing "
                          f"{sorted(missing)}, extra {sorted(extra)}")  # fmt: skip
    width = draft.config.hidden_size
    fc = state["fc.weight"]
    state["fc.weight"] = torch.cat([fc[:, j * width : (j + 1) * width]
                                    for j in ascending(draft.config.target_layer_ids)], dim=1)  # fmt: skip
    return state


def export_dflash_family(draft: DFlashDraft, out_dir: str | Path, *, verifier: str | Path,
                         dtype: str = "bfloat16") -> Path:  # fmt: skip
    """Write a DFlash or DSpark draft (unwrapped) as a speculators directory `out_dir` (module
    doc); `verifier` is the target's directory. Domino: `ExportError` (no speculators format)."""
    cfg = draft.config
    config = dflash_config(cfg, verifier=verifier, dtype=dtype)
    if cfg.projector == "dspark" and (cfg.markov_rank <= 0 or cfg.markov_head_type != "vanilla"):
        log.warning("this DSpark draft (markov_rank %d, markov_head_type %s) loads in speculators "
                    "but vLLM 0.33 serves only a vanilla Markov head", cfg.markov_rank,
                    cfg.markov_head_type)  # fmt: skip
    return _write(out_dir, config, dflash_tensors(draft), dtype)


# the exporter of each draft kind (`draft_kind`): speculators_model_type -> writer
EXPORTERS: dict[str, Callable[..., Path]] = {
    "eagle3": export_eagle3,
    "dflash": export_dflash_family,
    "dspark": export_dflash_family,
}


def draft_kind(draft) -> str | None:
    """The kind of `draft` as `EXPORTERS` names it: eagle3, or a DFlash-family draft's projector
    (dflash, domino, dspark: one class); None for anything else."""
    if isinstance(draft, LlamaEagle3Draft):
        return "eagle3"
    if isinstance(draft, DFlashDraft):
        return draft.config.projector
    return None


def export_speculators(draft, out_dir: str | Path, *, verifier: str | Path, **kw) -> Path:
    """Export `draft` with the exporter of its kind; `ExportError` for a kind speculators has
    no format for (Domino) or that has no exporter here (the SGLang export covers it). `kw`
    goes to the exporter: `speculative_tokens` is EAGLE3's only (a DFlash-family draft's
    follows from its block size)."""
    kind = draft_kind(draft)
    if kind == "domino":
        dflash_config(draft.config, verifier=verifier)  # raises, naming what speculators has
    if kind not in EXPORTERS:
        raise ExportError(f"no speculators export for a {type(draft).__name__} draft (built: "
                          f"{', '.join(EXPORTERS)}); `--format sglang` exports it")  # fmt: skip
    return EXPORTERS[kind](draft, out_dir, verifier=verifier, **kw)


def _write(out_dir: str | Path, config: dict, state: dict[str, torch.Tensor], dtype: str) -> Path:
    if dtype not in _DTYPES:
        raise ExportError(f"export dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    tensors = {
        k: (
            v.detach().cpu().to(_DTYPES[dtype]) if v.is_floating_point() else v.detach().cpu()
        ).contiguous()
        for k, v in state.items()
    }
    return write_draft_dir(out_dir, config, tensors)  # atomic, 0644 like the SGLang export
