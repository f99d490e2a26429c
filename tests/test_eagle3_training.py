"""Optimizer and schedules; one optimizer step with accumulation and clipping."""

import math

import pytest
import torch
from specbus.core.config import DraftConfig, StrategyConfig, TrainingConfig
from specbus.core.errors import ConfigError
from specbus.core.models.target import TargetHeads, TargetInfo
from specbus.core.strategies import StepContext, build_strategy
from specbus.core.training import build_optimizer, build_scheduler, lr_factor, train_step


def test_cosine_warms_up_linearly_then_decays_to_zero():
    cfg = TrainingConfig(schedule="cosine", warmup_ratio=0.1)
    factors = [lr_factor(s, 100, cfg) for s in range(100)]
    assert factors[:10] == [pytest.approx((s + 1) / 10) for s in range(10)]
    assert factors[10] == pytest.approx(1.0)
    assert factors[55] == pytest.approx(0.5 * (1 + math.cos(math.pi * 45 / 90)))
    assert lr_factor(100, 100, cfg) == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(factors[10:], factors[11:], strict=False))


def test_wsd_holds_then_decays_linearly_and_constant_stays():
    cfg = TrainingConfig(schedule="wsd", warmup_ratio=0.0, decay_ratio=0.2)
    assert [lr_factor(s, 10, cfg) for s in (0, 7, 8, 9)] == [1.0, 1.0, 1.0, 0.5]
    assert lr_factor(10, 10, cfg) == 0.0
    constant = TrainingConfig(schedule="constant", warmup_ratio=0.5)
    assert [lr_factor(s, 4, constant) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]


def tiny():
    torch.manual_seed(0)
    target = TargetInfo(
        name="t",
        path=".",
        model_type="llama",
        num_layers=6,
        hidden_size=16,
        vocab_size=30,
        intermediate_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        max_position_embeddings=64,
        rope_theta=1e4,
    )
    heads = TargetHeads(torch.randn(30, 16), torch.randn(30, 16))
    strategy = build_strategy(
        StrategyConfig(ttt_length=2, draft=DraftConfig(draft_vocab_size=30)), target, heads=heads
    )
    samples = [
        {
            "input_ids": torch.randint(0, 30, (n,)),
            "loss_mask": torch.ones(n, dtype=torch.long),
            "hidden_states": torch.randn(n, 48),
            "target": torch.randn(n, 16),
        }
        for n in (8, 5, 6, 7)
    ]
    return strategy, strategy.build_model(), samples


def test_optimizer_holds_only_trainable_parameters():
    _, draft, _ = tiny()
    optimizer = build_optimizer(draft, TrainingConfig())
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert id(draft.embed_tokens.weight) not in held
    assert held == {id(p) for p in draft.parameters() if p.requires_grad}
    with pytest.raises(ConfigError):
        build_optimizer(torch.nn.Linear(2, 2).requires_grad_(False), TrainingConfig())


def test_accumulated_step_equals_one_step_on_the_mean_loss_and_clips():
    strategy, draft, samples = tiny()
    twin = strategy.build_model()
    twin.load_state_dict(draft.state_dict())
    cfg = TrainingConfig(lr=1e-2, warmup_ratio=0.0, schedule="constant", grad_clip=0.05)
    opt_a, opt_b = build_optimizer(draft, cfg), build_optimizer(twin, cfg)
    sched_a = build_scheduler(opt_a, cfg, 10)
    halves = [strategy.collate(samples[:2]), strategy.collate(samples[2:])]
    result = train_step(
        strategy, draft, halves, opt_a, sched_a, grad_clip=cfg.grad_clip, step=StepContext(0, 10)
    )
    # by hand: mean of the two micro-batch losses, clip, step
    loss = sum(strategy.forward_loss(twin, b, StepContext())[0] for b in halves) / 2
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_([p for p in twin.parameters() if p.requires_grad], 0.05)
    opt_b.step()
    assert result.grad_norm == pytest.approx(float(norm), rel=1e-5) and result.grad_norm > 0.05
    assert result.loss == pytest.approx(float(loss.detach()), rel=1e-5)
    assert result.metrics["denom_0"] == sum(float(b.tensors["loss_mask"].sum()) for b in halves)
    for (name, a), b in zip(draft.state_dict().items(), twin.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    assert all(p.grad is None for p in draft.parameters())
