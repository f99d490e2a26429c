"""The `TargetEngine` boundary: token sequences in, the features a strategy asks for out.

Guarantees of every engine:
- `capture` returns one tensor dict per input sequence, in input order, with exactly the
  contract's feature names, each verified against the contract's shapes and dtypes
  (`CaptureError` otherwise); padding used for batching never reaches a sample;
- tensors are on CPU unless a device is requested;
- `target_fingerprint` / `tokenizer_fingerprint` identify the weights (with `+fp8` when
  `target.quantize` runs them in FP8) and the tokenizer (they ride in every SampleRef, so a
  trainer can refuse features of another target).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from specbus.core.models.target import TargetInfo
from specbus.core.strategies.base import FeatureContract


@runtime_checkable
class TargetEngine(Protocol):
    """A frozen target behind `core.registry.ENGINES` (see the module doc for the guarantees every
    engine keeps)."""

    name: str
    info: TargetInfo
    tokenizer: object
    target_fingerprint: str
    tokenizer_fingerprint: str

    def capture(
        self,
        input_ids: list[torch.Tensor],
        loss_masks: list[torch.Tensor] | None,
        contract: FeatureContract,
        *,
        device: torch.device | str | None = None,
    ) -> list[dict[str, torch.Tensor]]:
        """One feature dict per sequence, in input order, verified against `contract`
        (`CaptureError` otherwise); on `device` when given, else CPU."""

    def close(self) -> None:
        """Free the target (GPU memory, its shards' process groups); idempotent."""
