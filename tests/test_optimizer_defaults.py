"""The optimizer and schedule defaults are the references' (SpecForge 0.2.0's `BF16Optimizer` and
`CosineAnnealingWarmupLR`; speculators 0.9's AdamW): AdamW betas (0.9, 0.999), eps 1e-8, no
weight decay, warmup of floor(warmup_ratio * total) steps rising as (step + 1) / warmup."""

from __future__ import annotations

import math

import pytest
import torch
from specbus.core.config import TrainingConfig
from specbus.core.training import build_optimizer, build_scheduler, lr_factor


def reference_cosine(step: int, total: int, ratio: float) -> float:
    """SpecForge's schedule, written out: `warmup_steps=int(warmup_ratio * total_steps)`, linear
    warmup (last_epoch + 1) / warmup, then `CosineAnnealingLR(T_max=total - warmup)`."""
    warmup = int(ratio * total)
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def test_adamw_defaults_are_the_references():
    opt = build_optimizer(torch.nn.Linear(3, 2), TrainingConfig())
    group = opt.param_groups[0]
    assert group["betas"] == (0.9, 0.999) and group["eps"] == 1e-8
    assert group["weight_decay"] == 0.0


@pytest.mark.parametrize(("total", "ratio"), [(100, 0.015), (1000, 0.015), (50, 0.02), (7, 0.5)])
def test_cosine_warmup_rounds_down_as_the_reference(total, ratio):
    """0.015 * 100 = 1.5 warmup steps: one (SpecForge's int()), not two."""
    cfg = TrainingConfig(warmup_ratio=ratio)
    ours = [lr_factor(s, total, cfg) for s in range(total)]
    assert ours == pytest.approx([reference_cosine(s, total, ratio) for s in range(total)])
    sched = build_scheduler(build_optimizer(torch.nn.Linear(3, 2), cfg), cfg, total)
    assert sched.get_last_lr()[0] == pytest.approx(cfg.lr * reference_cosine(0, total, ratio))
