import os

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from specbus.consumers.lockstep import Decision, Status, agree, decide
from specbus.ops.services.common import free_port

E, W, F = Status.ENDED, Status.WAITING, Status.FULL


@pytest.mark.parametrize(
    "statuses, decision",
    [
        ([F, F], Decision.TRAIN),
        ([F, W], Decision.WAIT),  # a rank still filling: nobody trains, nobody ends
        ([F, E], Decision.END),  # data over, one window can never fill: partial windows are nak'd
        ([E, E], Decision.END),
        ([W, E], Decision.WAIT),  # a rank still sees data coming
        ([F], Decision.TRAIN),
        ([E], Decision.END),
    ],
)
def test_decide(statuses, decision):
    assert decide(statuses) == decision


@pytest.mark.parametrize(
    "statuses, held, decision",
    [
        ([F, E], [6, 0], Decision.REBALANCE),  # prefetch left one rank with the others' share
        ([F, E], [3, 0], Decision.END),  # not enough for another step: the partial window ends
        ([F, E, E], [4, 1, 1], Decision.REBALANCE),
        ([F, F], [6, 2], Decision.TRAIN),
        ([F, W], [6, 0], Decision.WAIT),
    ],
)
def test_decide_with_held_counts(statuses, held, decision):
    assert decide(statuses, held, need=2) == decision


def _rank(rank, world, port, statuses, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out[rank] = agree(statuses[rank]).value
    finally:
        dist.destroy_process_group()


def test_agree_gives_every_rank_the_same_decision_over_gloo():
    ctx = mp.get_context("spawn")
    with ctx.Manager() as m:
        out = m.dict()
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, 2, port, [F, E], out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        assert dict(out) == {0: "end", 1: "end"}
