"""`specbus export`: a checkpoint -> the directory SGLang (EAGLE3, DFLASH, DSPARK) or vLLM
(`--format speculators`: EAGLE3, DFlash, DSpark) loads as a draft."""

from __future__ import annotations

from pathlib import Path

from specbus.consumers.checkpoint import CheckpointManager, with_frozen_state
from specbus.core.config import RunConfig
from specbus.core.data.vocab import VocabMapping
from specbus.core.errors import CheckpointError, ExportError
from specbus.core.export.sglang import export_draft
from specbus.core.models.target import load_target_heads, load_target_info, resolve_target_dir
from specbus.core.strategies.base import build_strategy


def load_trained_draft(cfg: RunConfig, checkpoint: str | Path = "latest"):
    """The draft of a checkpoint, rebuilt from the run config (vocab mapping from its buffers)."""
    ckpt_dir = cfg.training.checkpoint_dir or (cfg.resolved_run_dir / "checkpoints")
    manager = CheckpointManager(ckpt_dir, plan={})
    path = manager.resolve(checkpoint)
    if path is None or not (path / "state.pt").exists():
        raise CheckpointError(f"no checkpoint {str(checkpoint)!r} under {ckpt_dir}")
    import torch

    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)["model"]
    target_path = resolve_target_dir(cfg.target.model)
    info = load_target_info(target_path, name=cfg.target.model)
    heads = load_target_heads(target_path)
    strategy = build_strategy(cfg.strategy, info, heads=heads, aux_layers=cfg.target.aux_layers)
    vocab = (  # EAGLE3's reduced vocabulary; DFlash-family drafts use the target's lm_head
        VocabMapping(d2t=state["d2t"].long(), t2d=state["t2d"].bool()) if "d2t" in state else None
    )
    draft = strategy.build_model(info, heads, vocab)
    draft.load_state_dict(with_frozen_state(draft, state))
    return draft.eval()


FORMATS = ("sglang", "speculators")  # `specbus export --format`; sglang is the default


def export_checkpoint(cfg: RunConfig, checkpoint: str | Path, out: str | Path,
                      fmt: str = "sglang") -> Path:  # fmt: skip
    """Export checkpoint `checkpoint` (latest, best, a path) of the run as a draft directory
    `out`; returns it. `fmt`: "sglang" (EAGLE3, DFLASH, DSPARK: what SGLang loads) or
    "speculators" (what vLLM serves and vLLM's `speculators` loads: core/export/speculators.py).
    A P-EAGLE draft is always written in the speculators format (vLLM serves it, SGLang does
    not)."""
    draft = load_trained_draft(cfg, checkpoint)
    if fmt not in FORMATS:
        raise ExportError(f"export format {fmt!r} is not one of {list(FORMATS)}")
    from specbus.core.models.peagle import PEagleDraft

    if isinstance(draft, PEagleDraft):  # vLLM serves it (speculators format), SGLang does not
        from specbus.core.export.peagle import export_peagle

        return export_peagle(draft, out, verifier=resolve_target_dir(cfg.target.model))
    if fmt == "speculators":
        from specbus.core.export.speculators import export_speculators

        kw = {}  # a DFlash-family draft's length follows from its block size
        if getattr(getattr(draft, "config", None), "projector", None) is None:
            kw["speculative_tokens"] = getattr(cfg.strategy, "ttt_length", None) or 3  # trained
        return export_speculators(draft, out, verifier=resolve_target_dir(cfg.target.model), **kw)
    if hasattr(draft, "config") and getattr(draft.config, "projector", None) is not None:
        from specbus.core.export.dflash import export_dflash

        return export_dflash(draft, out)
    return export_draft(draft, out)
