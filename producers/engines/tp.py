"""Tensor-parallel sharding of a transformers decoder (Llama / Qwen / Mistral layout) over a TP mesh.

Per decoder layer (Megatron layout, as torchtitan and transformers' `base_model_tp_plan` do):
- `self_attn.q_proj/k_proj/v_proj`, `mlp.gate_proj/up_proj`: column-parallel (each TP rank
  holds `heads / tp` query heads, `kv_heads / tp` key/value heads, `intermediate / tp`
  MLP columns); their outputs stay local shards;
- `self_attn.o_proj`, `mlp.down_proj`: row-parallel; their partial outputs are all-reduced,
  so every layer's output (and so every captured aux / final hidden state) is the full,
  replicated `[B, L, H]` tensor on every TP rank, as a plain local tensor.
Embeddings, norms and rotary tables stay replicated; the lm_head is never run by the capture.
HF attention reshapes to `(-1, head_dim)` and its GQA ratio is unchanged by the split, so the
local head counts need no patching.

Weights: the sharded projections are scattered from the TP group's first rank; the replicated
parameters and buffers are broadcast from it, so the ranks need not have built identical
random weights. Works on CPU (gloo) and CUDA (NCCL): DTensor runs on both.

Raises `ConfigError` naming `target.tp_size` and the dimension that does not divide.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from specbus.core.errors import ConfigError
from specbus.core.models.target import decoder_layers

_COLWISE = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
)
_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def check_tp_shapes(tp: int, *, num_attention_heads: int, num_key_value_heads: int,
                    intermediate_size: int) -> None:  # fmt: skip
    """Raise `ConfigError` unless every split dimension divides by `tp`."""
    for name, value in (
        ("num_attention_heads", num_attention_heads),
        ("num_key_value_heads", num_key_value_heads),
        ("intermediate_size", intermediate_size),
    ):
        if value % tp:
            raise ConfigError(f"target.tp_size={tp} does not divide the target's {name}={value}")


def shard_decoder(model: torch.nn.Module, tp_mesh) -> torch.nn.Module:
    """Shard `model`'s decoder layers in place over the 1-D `tp_mesh` (see module doc).

    Every rank of the mesh must call it (collectives). Returns `model`.
    """
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    heads = int(config.num_attention_heads)
    check_tp_shapes(
        tp,
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        intermediate_size=int(config.intermediate_size),
    )
    group = tp_mesh.get_group()
    src = dist.get_global_rank(group, 0)
    sharded = {f"{p}.weight" for p in (*_COLWISE, *_ROWWISE)} | {
        f"{p}.bias" for p in (*_COLWISE, *_ROWWISE)
    }
    # Replicated state first (the sharded weights are scattered from the same rank below).
    with torch.no_grad():
        for layer_name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if any(layer_name.endswith(s) for s in sharded) and ".layers." in layer_name:
                continue
            dist.broadcast(tensor.data, src=src, group=group)
    plan = {name: ColwiseParallel() for name in _COLWISE} | {
        name: RowwiseParallel() for name in _ROWWISE
    }
    for layer in decoder_layers(model):
        parallelize_module(layer, tp_mesh, plan)
    return model
