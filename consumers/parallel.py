"""Data-parallel gradient averaging: one all-reduce per optimizer step.

The draft is replicated on every rank. After the window's micro-steps have accumulated their
gradients locally (no communication), `average_gradients` flattens every gradient into one
buffer, all-reduces it once and scatters the average back. That is the DDP result with
`no_sync` on all but the last micro-step, without requiring the loss to call the wrapped
module's `forward()` (the TTT loss drives the draft's submodules directly).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from consumers.lockstep import distributed


def average_gradients(params: list[torch.nn.Parameter]) -> None:
    """Average `.grad` over all ranks in one collective (no-op on a single rank)."""
    if not distributed():
        return
    grads = []
    for p in params:
        if p.grad is None:  # a parameter unused this step still takes part (zeros)
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for g, avg in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(avg)


def broadcast_parameters(module: torch.nn.Module) -> None:
    """Start every rank from rank 0's weights."""
    if not distributed():
        return
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, src=0)
