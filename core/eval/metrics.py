"""Offline evaluation: per-position accuracy and simulated acceptance length over many batches.

Aggregation (SpecForge 0.2.0 evaluator): per TTT position, accuracy = sum(correct_k) /
sum(denom_k) over all batches; acceptance_rate_k and ploss_k are averaged weighted by the
batch's loss denominator (B*L); `simulated_acc_len` = sum_k prod_{j<=k} acc_j over the
eval-set-wide accuracies — the quantity used to pick the best checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from specbus.core.strategies.base import StepContext, Strategy, TrainBatch
from specbus.core.strategies.eagle3 import simulated_accept_length
from torch import nn


class EvalAccumulator:
    """Sums per-step counts from `forward_loss` metrics; `result()` gives the eval-set figures."""

    def __init__(self) -> None:
        self.correct: list[float] = []
        self.denom: list[float] = []
        self.rate_w: list[float] = []
        self.ploss_w: list[float] = []
        self.loss_w = 0.0
        self.weight = 0.0
        self.batches = 0

    def add(self, metrics: dict) -> None:
        """Accumulate one batch's metrics: counts summed, rates and losses weighted by its
        `loss_denom`."""
        steps = sum(1 for k in metrics if k.startswith("correct_"))
        if not self.correct:
            self.correct, self.denom = [0.0] * steps, [0.0] * steps
            self.rate_w, self.ploss_w = [0.0] * steps, [0.0] * steps
        w = float(metrics["loss_denom"])
        for k in range(steps):
            self.correct[k] += float(metrics[f"correct_{k}"])
            self.denom[k] += float(metrics[f"denom_{k}"])
            self.rate_w[k] += float(metrics[f"acceptance_rate_{k}"]) * w
            self.ploss_w[k] += float(metrics[f"ploss_{k}"]) * w
        self.loss_w += float(metrics["loss"]) * w
        self.weight += w
        self.batches += 1

    def result(self) -> dict[str, float | list[float]]:
        """Empty dict when nothing was added (never fabricated zeros)."""
        if self.batches == 0:
            return {}
        acc = [c / max(d, 1.0) for c, d in zip(self.correct, self.denom, strict=True)]
        out: dict[str, float | list[float]] = {
            "avg_loss": self.loss_w / self.weight,
            "avg_acc": acc[0],
            "per_position_acc": acc,
            "simulated_acc_len": simulated_accept_length(acc),
        }
        for k in range(len(acc)):
            out[f"acceptance_rate_{k}"] = self.rate_w[k] / self.weight
            out[f"ploss_{k}"] = self.ploss_w[k] / self.weight
        return out


@torch.no_grad()
def evaluate(
    strategy: Strategy,
    model: nn.Module,
    batches: Iterable[TrainBatch],
    step: StepContext | None = None,
) -> dict:
    """Run `forward_loss` without gradients over `batches` and aggregate (see module docstring)."""
    acc = EvalAccumulator()
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            _, metrics = strategy.forward_loss(model, batch, step or StepContext())
            acc.add(metrics)
    finally:
        model.train(was_training)
    return acc.result()
