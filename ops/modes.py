"""Deployment modes: how a trainer rank gets its data (`deployment.mode`).

A `Mode` names the consumer group trainer ranks lease from, whether trained samples sit in the
run's shared store (swept at resume and at the end), and the refusals that need the target
and the world size (those known from the config alone are `RunConfig` validators). Modes are
registered in `core.registry.MODES`; docs/architecture.md describes each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specbus.bus.subjects import PRODUCERS, TRAINERS, Group
from specbus.core.config import RunConfig
from specbus.core.errors import ConfigError
from specbus.core.islands import IslandPlan
from specbus.core.models.target import TargetInfo
from specbus.producers.engines.tp import check_tp_shapes


def _no_check(cfg: RunConfig, info: TargetInfo, world: int) -> None:
    return None


@dataclass(frozen=True)
class Mode:
    """One deployment mode, as the trainer ranks see it."""

    name: str
    group: Group  # the consumer group trainer ranks lease from
    sweeps_store: bool  # trained samples sit in the run's store: swept at resume and at the end
    # Refuse, by name, what cannot run with this target and world (ConfigError); returns the
    # mode's rank plan, if it has one.
    check: Callable[[RunConfig, TargetInfo, int], IslandPlan | None] = _no_check


def check_colocated(cfg: RunConfig, info: TargetInfo, world: int) -> IslandPlan:
    """Colocated refusals that need the target's shapes or the world size; returns the
    target-TP island plan. Raises `ConfigError` naming the key and the value."""
    context = cfg.target.context_length or info.max_position_embeddings
    if cfg.data.max_length > context:
        raise ConfigError(
            f"data.max_length={cfg.data.max_length} leaves no headroom in the target's context "
            f"of {context} tokens"
        )
    plan = IslandPlan(world=world, tp=cfg.target.tp_size, micro_batch=cfg.training.micro_batch,
                      accumulation=cfg.training.accumulation)  # fmt: skip
    if cfg.target.tp_size > 1:
        if cfg.training.wrap == "fsdp" and world > 1:
            # FSDP's checkpoint gathers are NCCL collectives on the training thread; they
            # could interleave with the island's TP capture on its worker thread.
            raise ConfigError(
                f"target.tp_size={cfg.target.tp_size} with training.wrap='fsdp' is not supported "
                "in colocated mode: use training.wrap=ddp"
            )
        check_tp_shapes(
            cfg.target.tp_size,
            num_attention_heads=info.num_attention_heads,
            num_key_value_heads=info.num_key_value_heads,
            intermediate_size=info.intermediate_size,
        )
    need = plan.island_batch * cfg.data.max_length
    if cfg.target.max_total_tokens is not None and cfg.target.max_total_tokens < need:
        raise ConfigError(
            f"target.max_total_tokens={cfg.target.max_total_tokens} cannot hold one island batch "
            f"({plan.island_batch} samples x data.max_length {cfg.data.max_length} = {need} tokens)"
        )
    return plan


DISAGGREGATED = Mode("disaggregated", TRAINERS, sweeps_store=True)
COLOCATED = Mode("colocated", PRODUCERS, sweeps_store=False, check=check_colocated)
