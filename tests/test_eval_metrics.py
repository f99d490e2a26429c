"""Eval-set aggregation: per-position accuracy from summed counts, simulated acceptance length."""

import torch
from specbus.core.eval.metrics import EvalAccumulator, evaluate
from specbus.core.strategies.eagle3 import simulated_accept_length


def metrics(correct, denom, rate, ploss, loss, loss_denom):
    out = {"loss": torch.tensor(loss), "loss_denom": torch.tensor(loss_denom)}
    for k, (c, d, r, p) in enumerate(zip(correct, denom, rate, ploss, strict=True)):
        out |= {
            f"correct_{k}": torch.tensor(c),
            f"denom_{k}": torch.tensor(d),
            f"acceptance_rate_{k}": torch.tensor(r),
            f"ploss_{k}": torch.tensor(p),
            f"acc_{k}": torch.tensor(c / d),
        }
    return out


def test_accuracy_pools_counts_and_rates_weight_by_batch_size():
    acc = EvalAccumulator()
    assert acc.result() == {}
    acc.add(metrics([8.0, 4.0], [10.0, 10.0], [0.5, 0.4], [1.0, 2.0], 3.0, 20.0))
    acc.add(metrics([1.0, 0.0], [10.0, 10.0], [0.9, 0.8], [3.0, 4.0], 5.0, 60.0))
    out = acc.result()
    assert out["per_position_acc"] == [0.45, 0.2]
    assert out["avg_acc"] == 0.45
    assert out["simulated_acc_len"] == 0.45 + 0.45 * 0.2
    assert abs(out["acceptance_rate_0"] - (0.5 * 20 + 0.9 * 60) / 80) < 1e-6
    assert abs(out["ploss_1"] - (2.0 * 20 + 4.0 * 60) / 80) < 1e-6
    assert abs(out["avg_loss"] - (3.0 * 20 + 5.0 * 60) / 80) < 1e-6


def test_simulated_acceptance_length_is_the_sum_of_running_products():
    assert simulated_accept_length([1.0, 1.0, 1.0]) == 3.0
    assert simulated_accept_length([0.5, 0.5]) == 0.75
    assert simulated_accept_length([0.0, 1.0]) == 0.0


def test_evaluate_runs_without_gradients_and_restores_train_mode():
    class Fixed:
        def forward_loss(self, model, batch, step):
            assert not torch.is_grad_enabled() and not model.training
            return torch.tensor(1.0), metrics([batch], [4.0], [0.5], [1.0], 1.0, 4.0)

    model = torch.nn.Linear(1, 1)
    out = evaluate(Fixed(), model, [1.0, 3.0])
    assert model.training and out["per_position_acc"] == [0.5]
