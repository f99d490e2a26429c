import os

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from specbus.consumers.lockstep import Decision, Status, agree, decide, ragged_shape
from specbus.ops.services.common import free_port

E, W, F, S, X = Status.ENDED, Status.WAITING, Status.FULL, Status.STOPPING, Status.EXPIRED


@pytest.mark.parametrize(
    "statuses, decision",
    [
        ([F, F], Decision.TRAIN),
        ([F, W], Decision.WAIT),  # a rank still filling: nobody trains, nobody ends
        ([F, E], Decision.RAGGED),  # data over, one window can never fill: train what is held
        ([E, E], Decision.END),  # data over, nothing held
        ([W, E], Decision.WAIT),  # a rank still sees data coming
        ([F], Decision.TRAIN),
        ([E], Decision.END),
        ([F, X], Decision.END),  # a spent time budget ends like max_steps: nothing more trained
        ([X, S], Decision.STOP),
    ],
)
def test_decide(statuses, decision):
    assert decide(statuses) == decision


@pytest.mark.parametrize(
    "statuses, held, decision",
    [
        ([F, E], [6, 0], Decision.REBALANCE),  # prefetch left one rank with the others' share
        # less than a step left, but one rank holds more than a window: spread it first, so
        # that one ragged step takes it all
        ([F, E], [3, 0], Decision.REBALANCE),
        ([F, E, E], [4, 1, 1], Decision.REBALANCE),
        ([F, E], [2, 1], Decision.RAGGED),  # less than a step: every rank trains what it holds
        ([E, E], [1, 0], Decision.RAGGED),
        ([E, E, E], [0, 0, 1], Decision.RAGGED),
        ([E, E], [0, 0], Decision.END),
        ([F, F], [6, 2], Decision.TRAIN),
        ([F, W], [6, 0], Decision.WAIT),
        ([E, W], [1, 0], Decision.WAIT),  # a rank still sees data coming: no ragged step yet
        ([F, X], [2, 1], Decision.END),  # out of time: given back, not trained
    ],
)
def test_decide_with_held_counts(statuses, held, decision):
    assert decide(statuses, held, need=2) == decision


@pytest.mark.parametrize(
    "kept, micro_batch, equal, sizes, pads, template_from",
    [
        ([3, 0], 2, False, [[2, 1], []], [0, 0], None),  # an empty rank joins the all-reduce
        ([3, 0], 2, True, [[2, 1], []], [0, 2], 0),  # FSDP: it runs 2 pad micro-steps of rank 0's
        ([1, 2], 1, True, [[1], [1, 1]], [1, 0], None),  # pads from its own first micro-batch
        ([0, 0, 5], 2, True, [[], [], [2, 2, 1]], [3, 3, 0], 2),
        ([2, 2], 2, False, [[2], [2]], [0, 0], None),
    ],
)
def test_ragged_shape_weighs_every_sample_alike(kept, micro_batch, equal, sizes, pads,
                                                 template_from):  # fmt: skip
    world, total = len(kept), sum(kept)
    shapes = [ragged_shape(kept, r, micro_batch, equal_micro_steps=equal) for r in range(world)]
    assert [s.sizes for s in shapes] == sizes
    assert [s.pads for s in shapes] == pads
    assert {s.template_from for s in shapes} == {template_from}
    steps = {len(s.weights) for s in shapes}
    assert len(steps) == 1 or not equal  # FSDP: as many micro-steps on every rank
    for shape in shapes:
        real, padded = shape.weights[: len(shape.sizes)], shape.weights[len(shape.sizes) :]
        assert padded == [0.0] * shape.pads
        # the collective averages over the ranks, a micro-batch's loss over its samples: each
        # sample then weighs 1/N, as in a plain step over the N samples
        for w, b in zip(real, shape.sizes, strict=True):
            assert w / world / b == pytest.approx(1 / total)


def test_ragged_shape_of_a_full_step_is_the_plain_mean():
    # 2 ranks x micro-batch 2 x accumulation 3: the weights a full window gets implicitly
    assert ragged_shape([6, 6], 1, 2, equal_micro_steps=True).weights == pytest.approx([1 / 3] * 3)
    with pytest.raises(ValueError):
        ragged_shape([0, 0], 0, 2, equal_micro_steps=False)


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
