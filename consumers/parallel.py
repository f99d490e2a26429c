"""Data parallelism of the draft: `training.wrap` ddp (replicated) or fsdp (sharded).

- ddp: the draft is replicated on every rank. After the window's micro-steps have accumulated
  their gradients locally (no communication), `average_gradients` flattens every gradient into
  one buffer, all-reduces it once and scatters the average back. That is DDP's result with
  `no_sync` on all but the last micro-step, in exactly one collective per optimizer step.
- fsdp: the draft's trainable parameters, gradients and AdamW state are sharded over the ranks
  (torch FSDP2 `fully_shard`; the frozen embedding stays replicated). Parameters are
  all-gathered for the forward and backward; gradients are reduce-scattered once per optimizer
  step (`set_requires_gradient_sync` is off on all but the last micro-step). Checkpoints hold
  the full (gathered) state, so they load into any world size.

The TTT loss calls the draft's `forward()` once per micro-step (all TTT steps inside), which is
what FSDP's hooks need.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from specbus.consumers.lockstep import distributed
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard


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


def is_sharded(model: nn.Module) -> bool:
    """True for a model wrapped by `shard` (FSDP2)."""
    return isinstance(model, FSDPModule)


def shard(model: nn.Module, device: torch.device) -> nn.Module:
    """FSDP2 over every rank of the default group (in place; returns `model`). Frozen
    parameters (the target's embedding) are left out: replicated, never gathered."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    frozen = {p for p in model.parameters() if not p.requires_grad}
    fully_shard(model, mesh=mesh, ignored_params=frozen or None)
    return model


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state dicts with full tensors on CPU. Collective under FSDP (every
    rank must call it; only rank 0 receives the tensors, the others get empty dicts); plain
    `state_dict()`s otherwise."""
    if not is_sharded(model):
        module = getattr(model, "module", model)
        return dict(module.state_dict()), optimizer.state_dict()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return (
        get_model_state_dict(model, options=options),
        get_optimizer_state_dict(model, optimizer, options=options),
    )


def load_full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict
) -> None:
    """Inverse of `full_state`. Under FSDP every rank calls it and rank 0's full state is
    broadcast and sharded (the other ranks' dicts may be empty)."""
    if not is_sharded(model):
        module = getattr(model, "module", model)
        module.load_state_dict(model_sd)
        optimizer.load_state_dict(optim_sd)
        return
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    # Copies: the loaders write the distributed tensors back into the dicts they are given.
    set_model_state_dict(model, dict(model_sd), options=options)
    set_optimizer_state_dict(model, optimizer, copy.deepcopy(optim_sd), options=options)
