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
