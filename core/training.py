"""Optimizer, schedules and one optimizer step: what every training loop runs.

The bus trainer (consumers/trainer.py) and the benchmarks' single-process loop
(ops/bench/local_loop.py) both call `train_step`. None of this imports the bus or a store.

Schedules (per optimizer step, factor on `training.lr`): linear warmup over
`floor(warmup_ratio * total)` steps (SpecForge's `int(warmup_ratio * total_steps)`; speculators
rounds the same way), factor (step + 1) / warmup, then
- cosine: half-cosine from 1 to 0 at `total`;
- wsd: 1 until the last `decay_ratio * total` steps, then linear to 0;
- constant: 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from specbus.core.config import TrainingConfig
from specbus.core.errors import ConfigError
from specbus.core.strategies.base import StepContext, Strategy, TrainBatch
from torch import nn


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that require grad (frozen embedding and heads excluded)."""
    return [p for p in model.parameters() if p.requires_grad]


def build_optimizer(model: nn.Module, cfg: TrainingConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters only (frozen embedding/heads never enter it)."""
    params = trainable_parameters(model)
    if not params:
        raise ConfigError("the model has no trainable parameters")
    # The fused CUDA kernel: one launch instead of a few per parameter (the GPU profile's AdamW).
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=fused or None
    )


def lr_factor(step: int, total: int, cfg: TrainingConfig) -> float:
    """The schedule's multiplier at optimizer step `step` (0-based) of `total`."""
    warmup = int(cfg.warmup_ratio * total)  # floor, as the references (none below 1/ratio)
    if step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    decay = max(1, math.ceil(cfg.decay_ratio * total))
    if step < total - decay:
        return 1.0
    return max(0.0, (total - step) / decay)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainingConfig, total_steps: int, offset: float = 0.0
) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR schedule of `cfg.schedule` over `total_steps` optimizer steps (module doc); `ConfigError`
    for `total_steps < 1`. `offset`: optimizer step `s` is the schedule's step `s - offset` (a
    world re-planned mid-run: the steps before it were of another size, see
    `ops/train.plan_schedule`)."""
    if total_steps < 1:
        raise ConfigError(f"the schedule needs total_steps >= 1, got {total_steps}")
    if not offset:
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(s, total_steps, cfg)
        )
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(max(0.0, s - offset), total_steps, cfg)
    )


@dataclass
class StepResult:
    """One optimizer step: its loss, pre-clip grad norm, the lr used and the averaged metrics."""

    loss: float
    grad_norm: float
    lr: float
    metrics: dict[str, float] = field(default_factory=dict)


class HostValues:
    """`float(v)` of every value, with one device-to-host copy per (device, dtype) group of
    tensors instead of one synchronising `.item()` each (a step has ~100-200 metrics).

    The copies start here, on the current stream, into pinned memory on CUDA, and nothing
    waits for them until `get()`: a training loop can queue its next step first and read
    these afterwards, so the GPU never drains between steps (`PendingStep`)."""

    def __init__(self, values: list[Any]):
        self._values: list[float | None] = [None] * len(values)
        self._groups: list[tuple[list[int], torch.Tensor]] = []
        self._events: list[torch.cuda.Event] = []
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, v in enumerate(values):
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                groups.setdefault((v.device, v.dtype), []).append(i)
            else:
                self._values[i] = float(v)
        for (device, _), idx in groups.items():
            flat = torch.stack([values[i].detach().reshape(()) for i in idx])
            if device.type == "cuda":
                host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                host.copy_(flat, non_blocking=True)
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                self._events.append(event)
                flat = host
            self._groups.append((idx, flat))

    def get(self) -> list[float]:
        """The values as floats; waits for the copies (not for work queued after them)."""
        for event in self._events:
            event.synchronize()
        self._events = []
        for idx, flat in self._groups:
            for i, x in zip(idx, flat.tolist(), strict=True):
                self._values[i] = float(x)
        self._groups = []
        return self._values  # type: ignore[return-value]


def _host_values(values: list[Any]) -> list[float]:
    """`float(v)` of every value in one device-to-host copy per group (`HostValues`)."""
    return HostValues(values).get()


def _mean_metrics(all_metrics: list[dict], extra: list[Any] = ()) -> dict[str, float]:
    """Average per-micro-batch figures; counts (correct/denom) are summed and acc recomputed
    (none: {}). `extra` values come back (as floats) under "_extra" in the same
    device-to-host copy."""
    return _averaged(all_metrics, _host_values(_metric_values(all_metrics, extra)), extra)


def _metric_values(all_metrics: list[dict], extra: Sequence[Any]) -> list[Any]:
    keys = list(all_metrics[0]) if all_metrics else []
    return [m[key] for key in keys for m in all_metrics] + list(extra)


def _averaged(all_metrics: list[dict], values: list[float], extra: Sequence[Any]) -> dict:
    out: dict[str, float] = {}
    keys = list(all_metrics[0]) if all_metrics else []
    host = iter(values)
    for key in keys:
        per_batch = [next(host) for _ in all_metrics]
        out[key] = (
            sum(per_batch)
            if key.startswith(("correct_", "denom_", "loss_denom"))
            else sum(per_batch) / len(per_batch)
        )
    steps = sum(1 for k in out if k.startswith("correct_"))
    for k in range(steps):
        out[f"acc_{k}"] = out[f"correct_{k}"] / max(out[f"denom_{k}"], 1e-6)
    if steps:
        from specbus.core.strategies.eagle3 import simulated_accept_length

        out["sim_accept_len"] = simulated_accept_length([out[f"acc_{k}"] for k in range(steps)])
    if extra:
        out["_extra"] = list(host)  # type: ignore[assignment]
    return out


class PendingStep:
    """An optimizer step whose work is queued (`launch_step`) and whose figures are on their
    way to the host. `result()` waits for them: for the step's last kernels, not for anything
    queued after it."""

    def __init__(self, all_metrics: list[dict], grad_norm: Any, lr: float):
        self._metrics, self._lr = all_metrics, lr
        self._host = HostValues(_metric_values(all_metrics, [grad_norm]))
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        if self._result is None:
            metrics = _averaged(self._metrics, self._host.get(), [None])
            (grad_norm,) = metrics.pop("_extra")
            self._result = StepResult(loss=metrics.get("loss", math.nan), grad_norm=grad_norm,
                                      lr=self._lr, metrics=metrics)  # fmt: skip
            self._metrics = []
        return self._result


def train_step(*args, **kwargs) -> StepResult:
    """`launch_step(...).result()`: one optimizer step, its figures on the host when it
    returns (one host sync)."""
    return launch_step(*args, **kwargs).result()


def launch_step(
    strategy: Strategy,
    model: nn.Module,
    batches: list[TrainBatch],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    *,
    grad_clip: float,
    step: StepContext,
    autocast_dtype: torch.dtype | None = None,
    reduce_gradients: Callable[[list[nn.Parameter]], None] | None = None,
    weights: Sequence[float] | None = None,
) -> PendingStep:
    """One optimizer step over `batches` (gradient accumulation: each loss scaled by 1/len,
    or by `weights[i]`).

    `weights` (the last, ragged step of a data-parallel run, `lockstep.ragged_shape`): the
    factor on each micro-batch's loss; a 0.0 is a pad micro-step, run only so that every
    rank's collectives match (FSDP), and left out of the metrics. `batches` may be empty (a
    rank that holds nothing in that step: it contributes zero gradients to the collective).
    `reduce_gradients(params)` runs after the last backward (data-parallel averaging; an FSDP
    model reduces its own gradients, on the last micro-step only). Clips
    the global grad norm of the trainable parameters to `grad_clip`, steps the
    optimizer and the scheduler, zeroes the gradients. Returns loss/metrics averaged over
    the micro-batches (NaN loss and no metrics when none was trained here), the pre-clip grad
    norm and the lr used, as a `PendingStep`: on CUDA this returns once the step's work is
    queued, without waiting for it (`PendingStep.result()` does).
    """
    assert weights is None or len(weights) == len(batches), "one weight per micro-batch"
    model.train()
    all_metrics = []
    # FSDP (consumers/parallel.py): reduce-scatter gradients on the last micro-step only.
    sharded = hasattr(model, "set_requires_gradient_sync")
    for i, batch in enumerate(batches):
        if sharded:
            model.set_requires_gradient_sync(i == len(batches) - 1)
        device_type = batch.tensors["input_ids"].device.type
        with torch.autocast(
            device_type=device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None
        ):
            loss, metrics = strategy.forward_loss(model, batch, step)
        weight = None if weights is None else weights[i]
        (loss / len(batches) if weight is None else loss * weight).backward()
        if weight is None or weight > 0:
            all_metrics.append(metrics)
    params = trainable_parameters(model)
    if reduce_gradients is not None:  # data parallel: the step's one all-reduce
        reduce_gradients(params)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
        grad_norm = grad_norm.full_tensor()
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return PendingStep(all_metrics, grad_norm, lr)  # the step's one host sync, deferred
