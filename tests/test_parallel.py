"""Data parallelism over 2 gloo ranks: FSDP gives the DDP result, checkpoints are full states.

Each rank trains its own half of the samples (accumulation 2). The replicated draft (one flat
all-reduce per step) and the FSDP-sharded draft (one reduce-scatter per step) must produce the
same losses and the same weights, and both must equal one process training on all samples
(the mean of the ranks' gradients). The FSDP checkpoint is the full state: a plain draft loads
it, and an FSDP draft loaded from it continues identically.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from specbus.core.config import TrainingConfig
from specbus.core.strategies import StepContext
from specbus.core.training import build_optimizer, train_step
from specbus.ops.services.common import free_port

from tests.test_eagle3_training import tiny

STEPS = 3


def _train(strategy, draft, samples_per_step, wrap_grads=None, device="cpu"):
    optimizer = build_optimizer(draft, TrainingConfig(lr=1e-2, grad_clip=1e9))
    losses = []
    for step, samples in enumerate(samples_per_step):
        batches = [strategy.collate([s], max_length=16).to(device) for s in samples]
        result = train_step(strategy, draft, batches, optimizer, None, grad_clip=1e9,
                            step=StepContext(step, STEPS), reduce_gradients=wrap_grads)  # fmt: skip
        losses.append(result.loss)
    return optimizer, losses


def _rank(rank: int, world: int, port: int, wrap: str, out, backend: str = "gloo") -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        from specbus.consumers.parallel import average_gradients, full_state, load_full_state, shard

        strategy, draft, samples = tiny()  # same seed: same draft and samples on every rank
        draft = draft.to(device)
        mine = [samples[rank * 2 : rank * 2 + 2]] * STEPS  # this rank's 2 micro-batches
        if wrap == "fsdp":
            draft = shard(draft, device)
            assert type(draft).__name__.startswith("FSDP")
            optimizer, losses = _train(strategy, draft, mine, device=device)
        else:
            optimizer, losses = _train(strategy, draft, mine, average_gradients, device=device)
        model_sd, optim_sd = full_state(draft, optimizer)  # collective under FSDP
        # Reload into a fresh model of the same wrap and take one more step.
        _, again, _ = tiny()
        again = again.to(device)
        if wrap == "fsdp":
            again = shard(again, device)
        optimizer2 = build_optimizer(again, TrainingConfig(lr=1e-2, grad_clip=1e9))
        load_full_state(again, optimizer2, model_sd, optim_sd)
        batches = [strategy.collate([s], max_length=16).to(device) for s in mine[0]]
        extra = train_step(strategy, again, batches, optimizer2, None, grad_clip=1e9,
                           step=StepContext(STEPS, STEPS + 1),
                           reduce_gradients=None if wrap == "fsdp" else average_gradients)  # fmt: skip
        out[rank] = {
            "losses": losses,
            "model": {k: v.detach().cpu().clone() for k, v in model_sd.items()},
            "extra_loss": extra.loss,
            "after": {
                k: v.detach().cpu().clone() for k, v in full_state(again, optimizer2)[0].items()
            },
        }
    finally:
        dist.destroy_process_group()


def _spawn(wrap: str, backend: str = "gloo") -> dict:
    ctx = mp.get_context("spawn")
    with ctx.Manager() as m:
        out = m.dict()
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, 2, port, wrap, out, backend)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0, f"{wrap} rank exited {p.exitcode}"
        return dict(out)


def test_fsdp_matches_replicated_data_parallel_and_one_process():
    _check(_spawn("ddp"), _spawn("fsdp"), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_fsdp_matches_replicated_data_parallel_over_nccl():
    # cuBLAS kernels and NCCL's reduction order: looser than the gloo/CPU check.
    _check(_spawn("ddp", "nccl"), _spawn("fsdp", "nccl"), rtol=2e-3, atol=2e-4)


def _check(ddp: dict, fsdp: dict, *, rtol: float, atol: float) -> None:
    # One process on all 4 samples per step = the mean over ranks of 2 samples each.
    strategy, draft, samples = tiny()
    _, losses = _train(strategy, draft, [samples] * STEPS)
    single = draft.state_dict()
    for run in (ddp, fsdp):
        assert set(run[0]["model"]) == set(single)  # FSDP: the full state lands on rank 0
        for key, value in single.items():
            torch.testing.assert_close(run[0]["model"][key], value, rtol=rtol, atol=atol)
        for a, b, one in zip(run[0]["losses"], run[1]["losses"], losses, strict=True):
            assert (a + b) / 2 == pytest.approx(one, rel=rtol, abs=atol)
    # Resume from the full state: the next step is the same under both wraps.
    assert abs(ddp[0]["extra_loss"] - fsdp[0]["extra_loss"]) < 10 * atol
    for key, value in ddp[0]["after"].items():
        torch.testing.assert_close(fsdp[0]["after"][key], value, rtol=rtol, atol=atol)
    assert any(not torch.equal(ddp[0]["after"][k], ddp[0]["model"][k]) for k in single)


# ---------------------------------------------------------------- the ragged last step
# (wrap, micro_batch, samples kept per rank): an empty rank, a short micro-batch, uneven ranks
RAGGED = [("ddp", 2, [3, 0]), ("ddp", 2, [1, 2]), ("fsdp", 2, [3, 0]), ("fsdp", 1, [1, 2])]


def _equal_length_samples(n: int) -> list[dict]:
    """`n` samples of 8 positions: a micro-batch's loss (a mean over its positions) is then
    the mean of its samples' losses, whatever the grouping."""
    torch.manual_seed(1)
    return [
        {"input_ids": torch.randint(0, 30, (8,)), "loss_mask": torch.ones(8, dtype=torch.long),
         "hidden_states": torch.randn(8, 48), "target": torch.randn(8, 16)}
        for _ in range(n)
    ]  # fmt: skip


def _sgd_step(strategy, draft, batches, weights, reduce):
    """One train_step with SGD at lr 1: the weights move by exactly minus the gradient."""
    optimizer = torch.optim.SGD([p for p in draft.parameters() if p.requires_grad], lr=1.0)
    return train_step(strategy, draft, batches, optimizer, None, grad_clip=1e9,
                      step=StepContext(0, 1), reduce_gradients=reduce, weights=weights)  # fmt: skip


def _ragged_rank(rank: int, world: int, port: int, out) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from specbus.consumers.lockstep import broadcast_object, ragged_shape
        from specbus.consumers.parallel import average_gradients, full_state, shard

        results = []
        for wrap, micro_batch, kept in RAGGED:
            strategy, draft, _ = tiny()
            samples = _equal_length_samples(sum(kept))
            mine = samples[sum(kept[:rank]) : sum(kept[: rank + 1])]
            shape = ragged_shape(kept, rank, micro_batch, equal_micro_steps=wrap == "fsdp")
            batches, at = [], 0
            for size in shape.sizes:
                batches.append(strategy.collate(mine[at : at + size]))
                at += size
            if shape.template_from is not None:  # as the loader: a sample of a busy rank
                first = mine[0] if rank == shape.template_from else None
                template = strategy.collate([broadcast_object(first, shape.template_from)])
            if shape.pads:
                batches += [batches[0] if batches else template] * shape.pads
            if wrap == "fsdp":
                draft = shard(draft, torch.device("cpu"))
            result = _sgd_step(strategy, draft, batches, shape.weights,
                               None if wrap == "fsdp" else average_gradients)  # fmt: skip
            model_sd, _ = full_state(draft, torch.optim.SGD(draft.parameters(), lr=1.0))
            results.append({"model": {k: v.detach().clone() for k, v in model_sd.items()},
                            "loss": result.loss, "metrics": sorted(result.metrics)})  # fmt: skip
        out[rank] = results
    finally:
        dist.destroy_process_group()


def test_ragged_last_step_is_the_mean_over_the_samples_it_trains():
    """The last step of a run trains what each rank holds (fewer samples, none on a rank):
    its update equals one plain world-1 step over the same samples, for the replicated and
    the sharded draft (whose empty micro-steps are padded at weight 0)."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as m:
        out = m.dict()
        port = free_port()
        procs = [ctx.Process(target=_ragged_rank, args=(r, 2, port, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(180)
            assert p.exitcode == 0, f"rank exited {p.exitcode}"
        out = dict(out)
    for case, (wrap, _, kept) in enumerate(RAGGED):
        strategy, draft, _ = tiny()
        samples = _equal_length_samples(sum(kept))
        plain = _sgd_step(strategy, draft, [strategy.collate(samples)], None, None)
        for key, value in draft.state_dict().items():
            got = out[0][case]["model"][key]  # FSDP: the full state lands on rank 0
            torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-6, msg=f"{wrap} {kept} {key}")
        for rank, n in enumerate(kept):  # a rank that trained nothing reports no loss
            loss = out[rank][case]["loss"]
            assert (loss == loss) == (n > 0), (wrap, kept, rank, loss)
            assert ("loss" in out[rank][case]["metrics"]) == (n > 0)
        assert plain.loss == plain.loss
