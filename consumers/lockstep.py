"""Lockstep agreement between data-parallel ranks: one decision per step, the same on every rank.

Before each step the ranks exchange a status (FULL / WAITING / ENDED / STOPPING), how many
items they hold, their view of the broker's unacked count and their unsettled leases, and all
take the same `Decision` (`decide`): TRAIN, WAIT, REBALANCE (uneven ranks at the end give back
their surplus), END, or STOP. The exchange runs on a gloo control group. docs/architecture.md,
"Lockstep".
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist


class Status(enum.IntEnum):
    """What one rank reports before a step."""

    ENDED = 0  # window not full and the data is over (as this rank sees it)
    WAITING = 1  # window not full, more may come
    FULL = 2
    STOPPING = 3  # asked to stop (a signal): every rank stops at this step


class Decision(enum.Enum):
    """What every rank does next, the same on all of them."""

    TRAIN = "train"
    WAIT = "wait"
    REBALANCE = "rebalance"
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
    """`held[r]`: items rank r could train now; `need`: one window per rank.
    `ack_pending[r]`: the broker's delivered-and-unacked count on the ranks' group as rank r
    saw it when it concluded the end (-1: no view); `unsettled[r]`: leases rank r holds."""
    statuses = list(statuses)
    if any(s == Status.STOPPING for s in statuses):
        return Decision.STOP
    if held is None:
        held = [need if s == Status.FULL else 0 for s in statuses]
    held = list(held)
    if all(s == Status.FULL for s in statuses):
        return Decision.TRAIN
    over = all(s in (Status.ENDED, Status.FULL) for s in statuses)
    if over and any(s == Status.ENDED for s in statuses):
        uneven = any(h > need for h in held)
        if uneven and sum(held) >= need * len(statuses):
            return Decision.REBALANCE
        held_by_nobody = (
            ack_pending is not None
            and unsettled is not None
            and max(ack_pending, default=-1) > sum(unsettled)
        )
        if held_by_nobody:
            return Decision.WAIT  # a lost ack or a dead member's lease: it will come back
        return Decision.END
    return Decision.WAIT


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


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` (a small picklable value), on every rank."""
    if not distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=control_group())
    return out
