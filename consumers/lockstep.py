"""Lockstep agreement between data-parallel ranks.

Every optimizer step consumes exactly `world * micro_batch * accumulation` samples and every
rank runs the same number of micro-steps, so collectives never mismatch. Before each step the
ranks exchange one small status each and all take the same decision:

- TRAIN when every rank holds a full window;
- END when no rank can complete its window and every rank sees the end of data (then the
  partial windows are nak'd, not trained);
- WAIT otherwise (keep filling, keep the leases alive).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist


class Status(enum.IntEnum):
    ENDED = 0  # window not full and the data is over (as this rank sees it)
    WAITING = 1  # window not full, more may come
    FULL = 2


class Decision(enum.Enum):
    TRAIN = "train"
    WAIT = "wait"
    END = "end"


def decide(statuses: Iterable[Status]) -> Decision:
    statuses = list(statuses)
    if all(s == Status.FULL for s in statuses):
        return Decision.TRAIN
    if all(s in (Status.ENDED, Status.FULL) for s in statuses) and any(
        s == Status.ENDED for s in statuses
    ):
        return Decision.END
    return Decision.WAIT


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agree(status: Status) -> Decision:
    """All ranks call this with their own status and get the same decision back."""
    if not distributed():
        return decide([status])
    # One int per rank; gloo and NCCL both take a CPU/GPU tensor of the backend's device.
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    mine = torch.tensor([int(status)], dtype=torch.int32, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return decide(Status(int(t.item())) for t in gathered)


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` (a small picklable value), on every rank."""
    if not distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
