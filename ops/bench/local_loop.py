"""The single-process training loop: capture -> collate -> step in one process, no bus, no store.

The benchmarks' baseline (ops/bench/eagle3_cpu.py, dflash_cpu.py, pipeline.py) and the slow
SmolLM2 test run it; the product's loop is consumers/trainer.py. Both call
`core.training.train_step`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from specbus.core.config import RunConfig
from specbus.core.data.datasets import Record, load_source, split_holdout
from specbus.core.data.tokenize import tokenize_records
from specbus.core.data.vocab import VocabMapping, build_vocab_mapping, count_tokens
from specbus.core.errors import ConfigError
from specbus.core.models.target import load_target_heads
from specbus.core.strategies.base import StepContext, Strategy, build_strategy
from specbus.core.training import build_optimizer, build_scheduler, train_step
from torch import nn


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
    samples = tokenize_records(records, engine.tokenizer, cfg.data)
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
