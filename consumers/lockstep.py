"""Lockstep agreement between data-parallel ranks: one decision per step, the same on every rank.

Before each step the ranks exchange a status (FULL / WAITING / ENDED / EXPIRED / STOPPING),
how many items they hold, their view of the broker's unacked count and their unsettled leases,
and all take the same `Decision` (`decide`): TRAIN, WAIT, REBALANCE (a rank holding more than
a window at the end gives back its surplus), RAGGED (the end of the data: every rank trains
what it still holds in one last step), END, or STOP. The exchange runs on a gloo control
group. docs/architecture.md, "Lockstep".
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class Status(enum.IntEnum):
    """What one rank reports before a step."""

    ENDED = 0  # window not full and the data is over (as this rank sees it)
    WAITING = 1  # window not full, more may come
    FULL = 2
    STOPPING = 3  # asked to stop (a signal): every rank stops at this step
    EXPIRED = 4  # the time budget is spent: every rank ends here and gives back what it holds


class Decision(enum.Enum):
    """What every rank does next, the same on all of them."""

    TRAIN = "train"
    WAIT = "wait"
    REBALANCE = "rebalance"
    RAGGED = "ragged"  # the data is over: every rank trains what it holds (<= a window), once
    END = "end"
    STOP = "stop"


def decide(
    statuses: Iterable[Status],
    held: Iterable[int] | None = None,
    need: int = 1,
    *,
    ack_pending: Iterable[int] | None = None,
    unsettled: Iterable[int] | None = None,
) -> Decision:
    """The step every rank takes (see the module doc). `held[r]`: items rank r could train
    now (derived from the statuses when None); `need`: one window per rank; `ack_pending[r]`:
    the broker's delivered-and-unacked count on the ranks' group as rank r saw it when it
    concluded the end (-1: no view); `unsettled[r]`: leases rank r holds.

    A stop (any STOPPING) or a spent time budget (any EXPIRED) ends training now: what the
    ranks hold is given back, not trained. When every rank is full, they train. When the data
    is over for some ranks and every other one is full, the end is near: a rank holding more
    than one window gives back its surplus first (REBALANCE: a rank with room takes it, so
    what is left fits one step); deliveries held by nobody are waited for (a lost ack, a dead
    member's lease); then the ranks train what they hold in one RAGGED step (fewer items than
    a window, none on some ranks), or END when nobody holds anything."""
    statuses = list(statuses)
    if any(s == Status.STOPPING for s in statuses):
        return Decision.STOP
    if any(s == Status.EXPIRED for s in statuses):
        return Decision.END
    if held is None:
        held = [need if s == Status.FULL else 0 for s in statuses]
    held = list(held)
    if all(s == Status.FULL for s in statuses):
        return Decision.TRAIN
    over = all(s in (Status.ENDED, Status.FULL) for s in statuses)
    if over and any(s == Status.ENDED for s in statuses):
        if any(h > need for h in held):
            return Decision.REBALANCE
        held_by_nobody = (
            ack_pending is not None
            and unsettled is not None
            and max(ack_pending, default=-1) > sum(unsettled)
        )
        if held_by_nobody:
            return Decision.WAIT  # a lost ack or a dead member's lease: it will come back
        return Decision.RAGGED if sum(held) > 0 else Decision.END
    return Decision.WAIT


@dataclass(frozen=True)
class RaggedShape:
    """How one rank runs the last, ragged step (see `ragged_shape`).

    `sizes`: samples in each of its micro-batches, in order; `weights`: the factor on each
    micro-step's loss (its micro-batches', then 0.0 for each pad); `pads`: zero-weight
    micro-steps after them, so that every rank runs as many micro-steps; `template_from`: the
    rank whose first sample pads the ranks that hold nothing (None: no rank needs one)."""

    sizes: list[int]
    weights: list[float]
    pads: int = 0
    template_from: int | None = None


def ragged_shape(
    kept: Sequence[int], rank: int, micro_batch: int, *, equal_micro_steps: bool
) -> RaggedShape:
    """Rank `rank`'s part of a last step in which rank r trains `kept[r]` samples (at most a
    window each, at least one in all), the same arithmetic on every rank.

    Weights: a micro-batch's loss is a mean over its samples' positions, and the gradients are
    then averaged over the ranks (the collective divides by the world size). A micro-batch of
    `b` samples is weighted `world * b / N` (N: the samples of the step, every rank's), so
    that every sample weighs 1/N in the step's gradient: the mean over the samples actually
    trained, as in a full step (where `b = micro_batch`, `N = world * micro_batch *
    accumulation`, and the weight is the plain 1/accumulation), not diluted by the empty
    ranks and micro-steps. `equal_micro_steps` (FSDP, whose forward and backward are
    collectives): every rank runs as many micro-steps as the busiest one, the missing ones
    padded with zero-weight micro-steps (on a rank that holds nothing: a sample of
    `template_from`, broadcast)."""
    total, world, mine = sum(kept), len(kept), kept[rank]
    if total < 1:
        raise ValueError("a ragged step needs at least one sample")
    sizes = [min(micro_batch, mine - at) for at in range(0, mine, micro_batch)]
    weights = [world * b / total for b in sizes]
    if not equal_micro_steps:
        return RaggedShape(sizes, weights)
    pads = max(math.ceil(k / micro_batch) for k in kept) - len(sizes)
    template_from = next(r for r, k in enumerate(kept) if k) if 0 in kept else None
    return RaggedShape(sizes, weights + [0.0] * pads, pads, template_from)


def distributed() -> bool:
    """True in a process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


_control: Any = None  # the gloo group of every rank, when the default group is NCCL


def init_control_group() -> None:
    """Create the control-plane group. Every rank calls it once, right after
    `init_process_group` and before any other `new_group` (groups are matched by order).

    Lockstep statuses and lineage travel on gloo (CPU) even when gradients use NCCL: they are
    tiny, need no GPU sync, and the colocated capture thread may run NCCL collectives of the
    target's TP group at the same time (two threads issuing NCCL kernels on one GPU can
    deadlock; gloo and NCCL cannot)."""
    global _control
    if distributed() and dist.get_backend() != "gloo" and _control is None:
        _control = dist.new_group(backend="gloo")


def control_group() -> Any:
    """The group for control-plane collectives (None: the default group, which is gloo)."""
    if _control is None and distributed() and dist.get_backend() != "gloo":
        raise RuntimeError("the default group is not gloo: call init_control_group() first")
    return _control


def reset_control_group() -> None:
    """Forget the control group (after `destroy_process_group`)."""
    global _control
    _control = None


def agree(
    status: Status, held: int = 0, need: int = 1, *, ack_pending: int = -1, unsettled: int = 0
) -> Decision:
    """All ranks call this with their status, held count and end view (see `decide`) and get
    the same decision."""
    if not distributed():
        return decide([status], [held], need, ack_pending=[ack_pending], unsettled=[unsettled])
    # Four ints per rank, on the gloo control group (CPU).
    mine = torch.tensor([int(status), held, ack_pending, unsettled], dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine, group=control_group())
    rows = [t.tolist() for t in gathered]
    return decide(
        [Status(r[0]) for r in rows],
        [r[1] for r in rows],
        need,
        ack_pending=[r[2] for r in rows],
        unsettled=[r[3] for r in rows],
    )


def rank() -> int:
    """This process's rank (0 when not distributed)."""
    return dist.get_rank() if distributed() else 0


def broadcast_object(obj: Any, src: int) -> Any:
    """Rank `src`'s `obj` (picklable; CPU tensors only), on every rank."""
    if not distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=control_group())
    return box[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` (a small picklable value), on every rank."""
    if not distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=control_group())
    return out
