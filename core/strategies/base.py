"""The strategy boundary: what an algorithm needs from the target, how it batches, its loss.

A strategy (eagle3, dflash, domino, dspark) declares
- `feature_contract(target)`: which tensors a captured sample carries, their shapes in terms of
  the sample length L, their dtypes, and which target layers feed them;
- `collate(samples, max_length=...)`: per-sample tensor dicts -> a padded `TrainBatch`;
- `build_model(target, heads, vocab)`: the draft to train (frozen parts loaded and frozen);
- `forward_loss(model, batch, step)`: `(loss, metrics)`; `step` carries the schedule position
  for schedule-dependent objectives.
Strategies import neither the bus nor a store: the pipeline composes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from specbus.core.errors import CaptureError
from specbus.core.models.target import TargetHeads, TargetInfo
from specbus.core.registry import STRATEGIES
from torch import nn

if TYPE_CHECKING:  # the config builds strategies (`StrategyConfig.build`): annotation only
    from specbus.core.config import StrategyConfig

_DTYPES = {"int64": torch.int64, "bool": torch.bool}
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class FeatureField:
    """One tensor of a sample: `shape` entries are ints or the symbol "L" (sample length).

    `dtype` is "int64", "bool", "int64|bool" (either) or "float" (the engine's float dtype:
    bf16 on GPU, fp32 on CPU).
    """

    name: str
    shape: tuple[int | str, ...]
    dtype: str

    def resolve(self, seq_len: int) -> tuple[int, ...]:
        """The concrete shape for a sample of `seq_len` tokens."""
        return tuple(seq_len if d == "L" else int(d) for d in self.shape)

    def accepts(self, dtype: torch.dtype) -> bool:
        """Whether a tensor of `dtype` satisfies this field."""
        if self.dtype == "float":
            return dtype in FLOAT_DTYPES
        return any(_DTYPES[d] == dtype for d in self.dtype.split("|"))


@dataclass(frozen=True)
class FeatureContract:
    """What a strategy needs captured per sample.

    `aux_layers`: 0-based decoder layers whose *outputs* are concatenated (in this order) into
    `aux_feature`; `final_feature` (or None) names the target's final post-norm hidden state.
    """

    strategy: str
    fields: tuple[FeatureField, ...]
    aux_layers: tuple[int, ...]
    hidden_size: int
    aux_feature: str = "hidden_states"
    final_feature: str | None = "target"

    @property
    def names(self) -> tuple[str, ...]:
        """The feature names, in contract order."""
        return tuple(f.name for f in self.fields)

    def field(self, name: str) -> FeatureField:
        """The field called `name`; `KeyError` if the contract has none."""
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)

    def verify(self, sample: dict[str, torch.Tensor]) -> int:
        """Check names, shapes and dtypes of one sample; return L. Raises `CaptureError`."""
        missing = set(self.names) - set(sample)
        extra = set(sample) - set(self.names)
        if missing or extra:
            raise CaptureError(
                f"{self.strategy} sample: missing {sorted(missing)}, unexpected {sorted(extra)}"
            )
        seq_len = int(sample[self.fields[0].name].shape[0])
        for f in self.fields:
            t = sample[f.name]
            if tuple(t.shape) != f.resolve(seq_len):
                raise CaptureError(
                    f"{self.strategy} feature {f.name!r}: shape {tuple(t.shape)} != {f.resolve(seq_len)}"
                )
            if not f.accepts(t.dtype):
                raise CaptureError(
                    f"{self.strategy} feature {f.name!r}: dtype {t.dtype} is not {f.dtype}"
                )
        return seq_len


@dataclass
class TrainBatch:
    """A padded micro-batch: `tensors` by name (batch-major), plus counts for logging."""

    tensors: dict[str, torch.Tensor]
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TrainBatch:
        """A copy with every tensor on `device` (counts and meta kept). With `non_blocking`
        to a GPU, host tensors are staged through pinned memory: a copy from pageable memory
        would first wait for everything queued on the stream (CUDA's rule for pageable
        copies), draining the GPU between training steps."""
        pin = non_blocking and torch.device(device).type == "cuda"

        def staged(v: torch.Tensor) -> torch.Tensor:
            return v.pin_memory() if pin and v.device.type == "cpu" and not v.is_pinned() else v

        moved = {
            k: staged(v).to(device, non_blocking=non_blocking) for k, v in self.tensors.items()
        }
        return TrainBatch(
            moved, self.num_samples, self.num_tokens, self.num_loss_tokens, dict(self.meta)
        )


@dataclass(frozen=True)
class StepContext:
    """Where training is: objectives that depend on the schedule read it (Domino)."""

    global_step: int = 0
    total_steps: int | None = None


Metrics = dict[str, float | torch.Tensor]


@runtime_checkable
class Strategy(Protocol):
    """An algorithm (eagle3, dflash, ...) behind `core.registry.STRATEGIES`: what it needs captured,
    how it batches, its draft and its loss (see the module doc). Strategies import neither the bus
    nor a store."""

    name: str

    def feature_contract(self, target: TargetInfo) -> FeatureContract:
        """The tensors a captured sample must carry for this target."""

    def collate(
        self, samples: list[dict[str, torch.Tensor]], max_length: int | None = None
    ) -> TrainBatch:
        """Per-sample tensor dicts -> one padded `TrainBatch` (truncated to `max_length`)."""

    def build_model(
        self, target: TargetInfo, heads: TargetHeads | None, vocab: Any | None
    ) -> nn.Module:
        """A fresh draft for `target`: frozen parts from `heads`, its vocabulary from `vocab`."""

    def forward_loss(
        self, model: nn.Module, batch: TrainBatch, step: StepContext
    ) -> tuple[torch.Tensor, Metrics]:
        """`(loss, metrics)` of one micro-batch; `step` is the schedule position."""


StrategyFactory = Callable[..., Strategy]


def register_strategy(name: str) -> Callable[[StrategyFactory], StrategyFactory]:
    """Decorator: register a strategy factory `(cfg, target, *, heads, aux_layers)` under
    `name` (`core.registry.STRATEGIES`; built-ins are listed there)."""

    def wrap(factory: StrategyFactory) -> StrategyFactory:
        STRATEGIES.register(name, factory)
        return factory

    return wrap


def available_strategies() -> list[str]:
    """The registered strategy names, sorted."""
    return STRATEGIES.names()


def build_strategy(
    cfg: StrategyConfig,
    target: TargetInfo,
    *,
    heads: TargetHeads | None = None,
    aux_layers: list[int] | None = None,
) -> Strategy:
    """Instantiate the strategy `cfg.name` for `target`.

    `heads` (the target's frozen embedding/lm_head) is needed by `build_model` and by losses
    that recompute the teacher; `aux_layers` overrides the strategy's default capture layers.
    Raises `ConfigError` for an unregistered name.
    """
    factory = STRATEGIES.get(cfg.name)
    return factory(cfg, target, heads=heads, aux_layers=aux_layers)


def pad_right(tensors: list[torch.Tensor], length: int) -> torch.Tensor:
    """Stack `[L_i, ...]` tensors into `[B, length, ...]`, zero-filled on the right."""
    out = tensors[0].new_zeros((len(tensors), length, *tensors[0].shape[1:]))
    for i, t in enumerate(tensors):
        out[i, : t.shape[0]] = t[:length]
    return out
