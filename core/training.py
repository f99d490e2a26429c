"""Optimizer, schedules, one optimizer step, and the single-process baseline loop.

The pieces (`build_optimizer`, `build_scheduler`, `train_step`) are what the bus trainer
reuses; `train_local` is the "no bus, no store" baseline: capture with the engine -> collate
-> loss -> step, in one process. None of this imports the bus or a store.

Schedules (per optimizer step, factor on `training.lr`): linear warmup over
`ceil(warmup_ratio * total)` steps from 0, then
- cosine: half-cosine from 1 to 0 at `total`;
- wsd: 1 until the last `decay_ratio * total` steps, then linear to 0;
- constant: 1.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from specbus.core.config import RunConfig, TrainingConfig
from specbus.core.data.datasets import Record, load_source, split_holdout
from specbus.core.data.templates import detect_template, get_template
from specbus.core.data.tokenize import TokenizedSample, tokenize_record
from specbus.core.data.vocab import VocabMapping, build_vocab_mapping, count_tokens
from specbus.core.errors import ConfigError
from specbus.core.models.target import load_target_heads
from specbus.core.strategies.base import StepContext, Strategy, TrainBatch, build_strategy
from torch import nn


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
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
    warmup = math.ceil(cfg.warmup_ratio * total)
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
    optimizer: torch.optim.Optimizer, cfg: TrainingConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    if total_steps < 1:
        raise ConfigError(f"the schedule needs total_steps >= 1, got {total_steps}")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total_steps, cfg))


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    metrics: dict[str, float] = field(default_factory=dict)


def _host_values(values: list[Any]) -> list[float]:
    """`float(v)` of every value, with one device-to-host copy per (device, dtype) group of
    tensors instead of one synchronising `.item()` each (a step has ~100-200 metrics)."""
    out: list[float | None] = [None] * len(values)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            groups.setdefault((v.device, v.dtype), []).append(i)
        else:
            out[i] = float(v)
    for idx in groups.values():
        flat = torch.stack([values[i].detach().reshape(()) for i in idx]).tolist()
        for i, x in zip(idx, flat, strict=True):
            out[i] = float(x)
    return out  # type: ignore[return-value]


def _mean_metrics(all_metrics: list[dict], extra: list[Any] = ()) -> dict[str, float]:
    """Average per-micro-batch figures; counts (correct/denom) are summed and acc recomputed.
    `extra` values come back (as floats) under "_extra" in the same device-to-host copy."""
    out: dict[str, float] = {}
    keys = list(all_metrics[0])
    host = iter(_host_values([m[key] for key in keys for m in all_metrics] + list(extra)))
    for key in keys:
        values = [next(host) for _ in all_metrics]
        out[key] = (
            sum(values)
            if key.startswith(("correct_", "denom_", "loss_denom"))
            else sum(values) / len(values)
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


def train_step(
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
) -> StepResult:
    """One optimizer step over `batches` (gradient accumulation: each loss scaled by 1/len).

    `reduce_gradients(params)` runs after the last backward (data-parallel averaging; an FSDP
    model reduces its own gradients, on the last micro-step only). Clips
    the global grad norm of the trainable parameters to `grad_clip`, steps the
    optimizer and the scheduler, zeroes the gradients. Returns loss/metrics averaged over
    the micro-batches, the pre-clip grad norm and the lr used.
    """
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
        (loss / len(batches)).backward()
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
    metrics = _mean_metrics(all_metrics, extra=[grad_norm])  # the step's one host sync
    (grad_norm,) = metrics.pop("_extra")
    return StepResult(loss=metrics["loss"], grad_norm=grad_norm, lr=lr, metrics=metrics)


# ---------------------------------------------------------------------------------------------
# The single-process baseline


def tokenize_records(records: list[Record], tokenizer, cfg: RunConfig) -> list[TokenizedSample]:
    """Tokenise with the tokenizer's template; drops samples with fewer than 2 supervised tokens
    (collate zeroes each sample's last loss position)."""
    if cfg.data.chat_template:
        template = get_template(cfg.data.chat_template)
    else:  # pre-tokenised records need no template (a weights-only target has no tokenizer)
        template = detect_template(tokenizer) if tokenizer is not None else None
    samples = [
        tokenize_record(
            r,
            tokenizer,
            template,
            max_length=cfg.data.max_length,
            last_turn_only=cfg.data.last_turn_only,
        )
        for r in records
    ]
    return [s for s in samples if int(s.loss_mask.sum()) >= 2]


@dataclass
class LocalRun:
    """What `train_local` produced."""

    draft: nn.Module
    strategy: Strategy
    vocab: VocabMapping
    held_out: list[Record]
    history: list[dict[str, Any]]
    steps: int
    samples: int
    tokens: int
    capture_s: float
    train_s: float
    elapsed_s: float

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.train_s if self.train_s > 0 else 0.0


def train_local(
    cfg: RunConfig,
    engine,
    *,
    records: list[Record] | None = None,
    cache_features: bool = False,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    draft: nn.Module | None = None,
) -> LocalRun:
    """Train a draft in this process: tokenise -> vocab mapping -> (capture -> collate -> step)*.

    `engine` is a `TargetEngine` (producers.engines); `records` default to `cfg.data.source`
    minus the held-back tail. `cache_features` keeps each sample's captured features for
    later epochs (the target is frozen, so they are identical). `on_step` receives each step's
    log record. Steps = ceil(epochs * samples / (micro_batch * accumulation)), capped by
    `training.max_steps`; the schedule spans `training.total_steps` or that count.
    """
    started = time.perf_counter()
    tcfg = cfg.training
    torch.manual_seed(tcfg.seed)
    held: list[Record] = []
    if records is None:
        records, held = split_holdout(
            load_source(cfg.data.source), cfg.data.holdout, cfg.data.limit
        )
    samples = tokenize_records(records, engine.tokenizer, cfg)
    if not samples:
        raise ConfigError("no training sample has supervised tokens")
    heads = load_target_heads(engine.path)
    strategy = build_strategy(
        cfg.strategy, engine.info, heads=heads, aux_layers=cfg.target.aux_layers
    )
    vocab = build_vocab_mapping(
        count_tokens((s.input_ids, s.loss_mask) for s in samples),
        strategy.draft_vocab_size,
        engine.info.vocab_size,
    )
    device = engine.device
    if draft is None:
        draft = strategy.build_model(engine.info, heads, vocab)
    draft = draft.to(device)
    contract = strategy.feature_contract(engine.info)
    per_step = tcfg.micro_batch * tcfg.accumulation
    available = math.ceil(cfg.data.epochs * len(samples) / per_step)
    steps = min(tcfg.max_steps or available, available)
    optimizer = build_optimizer(draft, tcfg)
    scheduler = build_scheduler(optimizer, tcfg, tcfg.total_steps or steps)
    autocast = (
        torch.bfloat16 if device.type == "cuda" and tcfg.dtype in ("auto", "bfloat16") else None
    )

    cache: dict[int, dict[str, torch.Tensor]] = {}
    history: list[dict[str, Any]] = []
    capture_s = train_s = 0.0
    tokens = done = 0
    order = [
        i
        for epoch in range(cfg.data.epochs)
        for i in _permutation(len(samples), cfg.data.seed + epoch)
    ]
    for step_index in range(steps):
        window = order[step_index * per_step : (step_index + 1) * per_step]
        t0 = time.perf_counter()
        features = _features(engine, contract, samples, window, cache if cache_features else None)
        t1 = time.perf_counter()
        batches = [
            strategy.collate(features[i : i + tcfg.micro_batch], max_length=cfg.data.max_length).to(
                device
            )
            for i in range(0, len(features), tcfg.micro_batch)
        ]
        result = train_step(
            strategy,
            draft,
            batches,
            optimizer,
            scheduler,
            grad_clip=tcfg.grad_clip,
            step=StepContext(step_index, tcfg.total_steps or steps),
            autocast_dtype=autocast,
        )
        t2 = time.perf_counter()
        capture_s += t1 - t0
        train_s += t2 - t1
        tokens += sum(b.num_tokens for b in batches)
        done += 1
        record = {
            "step": step_index + 1,
            "lr": result.lr,
            "grad_norm": result.grad_norm,
            **result.metrics,
            "capture_s": t1 - t0,
            "train_s": t2 - t1,
        }
        history.append(record)
        if on_step is not None:
            on_step(record)
    return LocalRun(
        draft=draft,
        strategy=strategy,
        vocab=vocab,
        held_out=held,
        history=history,
        steps=done,
        samples=len(samples),
        tokens=tokens,
        capture_s=capture_s,
        train_s=train_s,
        elapsed_s=time.perf_counter() - started,
    )


def _permutation(n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=generator).tolist()


def _features(engine, contract, samples, window, cache):
    missing = [i for i in window if cache is None or i not in cache]
    if missing:
        captured = engine.capture(
            [samples[i].input_ids for i in missing],
            [samples[i].loss_mask for i in missing],
            contract,
        )
        if cache is None:
            return captured
        cache.update(zip(missing, captured, strict=True))
    return [cache[i] for i in window]
