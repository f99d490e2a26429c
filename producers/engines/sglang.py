"""The `sglang` target engine (SGLang 0.5.23, pinned in `pins.py`; its capture layer is `patches/sglang/`); `sglang_server` is in
`sglang_server.py` (driven capture through a running server's capture layer).

It refuses at construction, with the install command, when SGLang is absent or another
version. What it does with SGLang present:

- `sglang` (in-process, driven/colocated capture): an `sglang.Engine` started with upstream's
  capture-only aux mode (`enable_return_aux_hidden_states`, the contract's layer ids, the
  strategy's convention, no radix cache) and prefill-only requests with
  `return_hidden_states=True`: upstream returns the aux rows in the response (its JSON path,
  the slow one; fine for driven capture, not for serving traffic). Upstream keeps the final
  post-norm state out of responses, so a contract with a final feature (EAGLE3's target) is
  refused with `CaptureError`: capture those with the capture layer (live mode).
  NOT RUN on these machines (no CUDA SGLang installs here): compiled and refusal-tested only.
"""

from __future__ import annotations

import torch
from specbus.core.config import TargetConfig
from specbus.core.errors import CaptureError, ConfigError
from specbus.core.models.target import (
    load_target_info,
    load_tokenizer,
    resolve_target_dir,
    target_fingerprint,
    tokenizer_fingerprint,
)
from specbus.core.strategies.base import FeatureContract
from specbus.producers.engines.pins import CONVENTIONS, SGLANG_VERSION

INSTALL = f"pip install sglang=={SGLANG_VERSION} (a CUDA machine), then `specbus sglang apply`"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def require_sglang(engine: str):
    """The `sglang` module; `ConfigError` naming the install command when it is absent or
    another version."""
    try:
        import sglang
    except ImportError as e:
        raise ConfigError(f"target.engine={engine} needs SGLang {SGLANG_VERSION}: {INSTALL}") from e
    version = getattr(sglang, "__version__", "?")
    if version != SGLANG_VERSION:
        raise ConfigError(f"target.engine={engine} is built for SGLang {SGLANG_VERSION}, "
                          f"not {version}: {INSTALL}")  # fmt: skip
    return sglang


class SGLangEngine:
    """A frozen target in an in-process SGLang engine (module doc; not run here)."""

    name = "sglang"

    def __init__(self, cfg: TargetConfig, *, tp_mesh=None, **_):
        self._sglang = require_sglang(self.name)
        self.cfg = cfg
        self.path = resolve_target_dir(cfg.model, cfg.cache_dir)
        self.info = load_target_info(self.path, name=cfg.model)
        self.tokenizer = load_tokenizer(self.path)
        self.target_fingerprint = target_fingerprint(self.path)
        self.tokenizer_fingerprint = tokenizer_fingerprint(self.tokenizer)
        self.dtype = _DTYPES.get(cfg.dtype, torch.bfloat16)
        self._engine, self._layers = None, None

    def _engine_for(self, contract: FeatureContract):
        if self._layers != contract.aux_layers:
            self.close()
            self._engine = self._sglang.Engine(
                model_path=str(self.path), tp_size=self.cfg.tp_size,
                enable_return_aux_hidden_states=True, disable_radix_cache=True,
                speculative_algorithm=CONVENTIONS.get(contract.strategy, "DFLASH"),
                return_aux_hidden_state_layer_ids=list(contract.aux_layers),
            )  # fmt: skip
            self._layers = contract.aux_layers
        return self._engine

    def capture(self, input_ids, loss_masks, contract: FeatureContract, *, device=None):
        """One feature dict per sequence (the `TargetEngine` contract); see module doc."""
        if contract.final_feature is not None:
            raise CaptureError(f"{contract.strategy} needs the final hidden state, which SGLang "
                               "keeps out of responses: capture it with the SGLang capture layer "
                               "(live mode, docs/sglang.md)")  # fmt: skip
        seqs = [torch.as_tensor(ids, dtype=torch.long).flatten() for ids in input_ids]
        outs = self._engine_for(contract).generate(
            input_ids=[s.tolist() for s in seqs], return_hidden_states=True,
            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
        )  # fmt: skip
        samples = []
        for i, (ids, out) in enumerate(zip(seqs, outs, strict=True)):
            rows = torch.tensor(out["meta_info"]["hidden_states"][0], dtype=torch.float32)
            if rows.shape[0] != ids.numel():
                raise CaptureError(f"sequence {i}: {rows.shape[0]} rows for {ids.numel()} tokens")
            mask = torch.ones_like(ids) if loss_masks is None else torch.as_tensor(loss_masks[i])
            sample = {"input_ids": ids, "loss_mask": mask.flatten().long(),
                      contract.aux_feature: rows.to(self.dtype)}  # fmt: skip
            sample = {k: v.to(device or "cpu").contiguous() for k, v in sample.items()}
            contract.verify(sample)
            samples.append(sample)
        return samples

    def close(self) -> None:
        """Shut the SGLang engine down; idempotent."""
        if self._engine is not None:
            self._engine.shutdown()
        self._engine, self._layers = None, None
