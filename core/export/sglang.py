"""Export an EAGLE3 draft as the directory SGLang loads (`--speculative-draft-model-path`).

The directory holds `config.json` (`LlamaForCausalLMEagle3`, one layer, widths, vocab sizes,
rope, `eagle_config.eagle_aux_hidden_state_layer_ids`) and `model.safetensors` with exactly the
names in `LlamaEagle3Draft.EXPORT_KEYS`: no `embed_tokens` (SGLang shares the target's), no
prefixes. SGLang's loader silently skips names it does not know, so a missing or extra name
would load a half-initialised draft without error: `export_state_dict` refuses both
(`ExportError`). The directory is written to a temp sibling and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from specbus.core.errors import ExportError
from specbus.core.models.llama_eagle3 import Eagle3Config, LlamaEagle3Draft

EXPORT_KEYS = frozenset(LlamaEagle3Draft.EXPORT_KEYS)
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def check_keys(names) -> None:
    """Raise `ExportError` unless `names` are exactly the EAGLE3 export names."""
    names = set(names)
    missing, extra = EXPORT_KEYS - names, names - EXPORT_KEYS
    if missing or extra:
        raise ExportError(
            f"EAGLE3 export refused: missing {sorted(missing)}, extra {sorted(extra)}"
        )


def export_state_dict(
    state: dict[str, torch.Tensor],
    config: Eagle3Config,
    out_dir: str | Path,
    dtype: str = "bfloat16",
) -> Path:
    """Write `state` (exactly the export names) + config.json to `out_dir` atomically.

    Float tensors are cast to `dtype`; `d2t` stays int64 and `t2d` bool.
    """
    check_keys(state)
    if dtype not in _DTYPES:
        raise ExportError(f"export dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    tensors = {}
    for name, t in state.items():
        t = t.detach().cpu()
        tensors[name] = (t.to(_DTYPES[dtype]) if t.is_floating_point() else t).contiguous()
    if tensors["d2t"].dtype != torch.int64 or tensors["t2d"].dtype != torch.bool:
        raise ExportError(
            f"d2t must be int64 and t2d bool, got {tensors['d2t'].dtype} / {tensors['t2d'].dtype}"
        )
    return write_draft_dir(out_dir, config.to_hf_dict() | {"torch_dtype": dtype}, tensors)


def write_draft_dir(out_dir: str | Path, hf_config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """Write `config.json` and `model.safetensors` to a temp sibling, then rename it into place
    (replacing an older export). Files are 0644 and the directory 0755 under the usual umask,
    like any file the user writes: `mkdtemp` makes the directory 0700 and safetensors the file
    0600, which left an export other users (an SGLang server's account) could not read."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    try:
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for path in tmp.iterdir():
            path.chmod(0o666 & ~umask)
        tmp.chmod(0o777 & ~umask)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def export_draft(draft: LlamaEagle3Draft, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Export a trained draft (unwrap DDP/FSDP first); its frozen embedding is left out."""
    state = {k: v for k, v in draft.state_dict().items() if k != "embed_tokens.weight"}
    return export_state_dict(state, draft.config, out_dir, dtype)


def load_export(
    path: str | Path, embed_tokens: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> LlamaEagle3Draft:
    """Load an exported directory back into a `LlamaEagle3Draft` (names checked both ways).

    `embed_tokens` (the target's `[V, H]` embedding) is needed to decode with it.
    """
    path = Path(path)
    try:
        config = Eagle3Config.from_hf_dict(json.loads((path / "config.json").read_text()))
        tensors = load_file(str(path / "model.safetensors"))
    except (OSError, KeyError, ValueError) as e:
        raise ExportError(f"{str(path)!r} is not an EAGLE3 export: {e}") from e
    check_keys(tensors)
    draft = LlamaEagle3Draft(config)
    missing, unexpected = draft.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) != {"embed_tokens.weight"}:
        raise ExportError(f"{str(path)!r}: missing {missing}, unexpected {unexpected}")
    if embed_tokens is not None:
        draft.load_embedding(embed_tokens)
    return draft.to(dtype)
