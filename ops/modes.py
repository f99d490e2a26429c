"""Deployment modes: how a trainer rank gets its data (`deployment.mode`).

A `Mode` names the consumer group trainer ranks lease from, whether trained samples sit in the
run's shared store (swept at resume and at the end), the refusals that need the target and
the world size (those known from the config alone are `RunConfig` validators), and how a rank
builds its `Source`. Modes are registered in `core.registry.MODES`; a new mode is a `Mode`
and a line there. docs/architecture.md describes each (live mode: docs/live.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from specbus.bus.run import RunBus
from specbus.bus.subjects import PRODUCERS, TRAINERS, Group
from specbus.consumers.bus_source import BusSource, LiveSource
from specbus.consumers.loop_thread import LoopThread
from specbus.core.audit import CaptureAudit
from specbus.core.config import RunConfig, TargetConfig
from specbus.core.contracts import Manifest
from specbus.core.errors import ConfigError
from specbus.core.islands import IslandPlan
from specbus.core.models.target import TargetInfo
from specbus.core.source import Source, Trained
from specbus.core.strategies.base import Strategy
from specbus.producers.colocated import ColocatedSource
from specbus.producers.engines.registry import build_engine
from specbus.producers.engines.tp import check_tp_shapes
from specbus.producers.island import join_island


@dataclass
class RankContext:
    """What a mode needs to build one trainer rank's source: the run config, the rank and its
    device, the run's bus and loop, the built strategy and target, the manifest, the loader's
    ledger, and the mode's plan (`Mode.check`'s result)."""

    cfg: RunConfig
    rank: int
    device: torch.device
    run: RunBus
    loop: LoopThread
    strategy: Strategy
    info: TargetInfo
    manifest: Manifest
    trained: Trained
    plan: Any = None


def _no_check(cfg: RunConfig, info: TargetInfo, world: int) -> None:
    return None


@dataclass(frozen=True)
class Mode:
    """One deployment mode, as the trainer ranks see it."""

    name: str
    group: Group  # the consumer group trainer ranks lease from
    sweeps_store: bool  # trained samples sit in the run's store: swept at resume and at the end
    # (ctx) -> (the rank's source, its prefetch in windows); joins `group` itself
    source: Callable[[RankContext], tuple[Source, int]]
    # Refuse, by name, what cannot run with this target and world (ConfigError); returns the
    # mode's rank plan, if it has one.
    check: Callable[[RunConfig, TargetInfo, int], IslandPlan | None] = _no_check
    # who writes the run's manifest (what the trainers wait for, named in their messages)
    manifest_writer: str = "the feeder (`specbus feed`)"
    # The source holds trained tensors in the store until a checkpoint covers them (they
    # cannot be captured again): (cfg) -> the store bytes of trained windows at which the
    # trainers checkpoint early. None: freed at the ack.
    held_until_checkpoint: Callable[[RunConfig], int] | None = None

    def hold_limit_bytes(self, cfg: RunConfig) -> int | None:
        """The loader's `hold_limit_bytes` for this mode (None: nothing is held)."""
        return self.held_until_checkpoint(cfg) if self.held_until_checkpoint else None


def capture_audit(ctx: RankContext) -> CaptureAudit | None:
    """The rank's capture audit (core/audit.py): rank 0 only (one reference per run, however
    many ranks; it audits `audit.rate` of the samples it leases), None when `audit.rate` is 0.
    Its reference is the hf engine on the run's target in float32 on `audit.device` (in FP8
    with `target.quantize: fp8`: the audit checks the capture path, not the precision), built
    at the first audited sample."""
    cfg = ctx.cfg
    if cfg.audit.rate <= 0 or ctx.rank != 0:
        return None
    contract = ctx.strategy.feature_contract(ctx.info)

    def make_reference():
        device = str(ctx.device) if cfg.audit.device == "auto" else cfg.audit.device
        target = TargetConfig(engine="hf", model=cfg.target.model, device=device, dtype="float32",
                              cache_dir=cfg.target.cache_dir,
                              context_length=cfg.target.context_length,
                              quantize=cfg.target.quantize)  # fmt: skip
        engine = build_engine(target)
        return lambda ids: engine.capture([ids], None, contract)[0]

    return CaptureAudit(cfg.audit.rate, make_reference, contract, cfg.audit.tolerance,
                        name=f"rank{ctx.rank}", engines=tuple(cfg.audit.engines))  # fmt: skip


def disaggregated_source(ctx: RankContext, cls: type[BusSource] = BusSource) -> tuple[Source, int]:
    """SampleRefs from the "trainers" group, tensors from the store each ref names, a sampled
    fraction audited (`capture_audit`)."""
    group = ctx.loop.call(ctx.run.join(TRAINERS))
    target = ctx.manifest.target
    source = cls(
        ctx.run, group,
        strategy=ctx.strategy.name,
        features=ctx.strategy.feature_contract(ctx.info).names,
        target_fingerprint=target.fingerprint,
        tokenizer_fingerprint=target.tokenizer_fingerprint,
        trained=ctx.trained,
        store=ctx.cfg.store,
        audit=capture_audit(ctx),
    )  # fmt: skip
    return source, ctx.cfg.training.prefetch


def live_source(ctx: RankContext) -> tuple[Source, int]:
    """The refs the live intake published from serving traffic: the disaggregated source
    without an end of data or recapture, trained tensors held until a checkpoint covers them
    (`LiveSource`)."""
    return disaggregated_source(ctx, LiveSource)


def live_held_bytes(cfg: RunConfig) -> int:
    """The trained-and-held store bytes at which a live run's trainers checkpoint early: half
    the intake's shed watermark of the store budget. Held tensors are resident and the intake
    sheds on residency at `live.shed_watermark x store.budget_bytes`; the step that reaches
    this checkpoints at once (freeing what is held), so while the trainers wait for traffic
    what they hold stays under half the watermark and the other half takes the captures."""
    return int(cfg.live.shed_watermark * cfg.store.budget_bytes / 2)


def check_live(cfg: RunConfig, info: TargetInfo, world: int) -> None:
    """Live traffic has no count: the schedule needs a length (`training.total_steps` or
    `training.max_steps`). Raises `ConfigError`. (Refused at the trainers, not at load: the
    intake and `specbus serve` read the same config and need no schedule.)"""
    if not (cfg.training.total_steps or cfg.training.max_steps):
        raise ConfigError(
            "deployment.mode=live trains on traffic of no known size: set training.total_steps "
            "(the schedule's length) or training.max_steps"
        )


def colocated_source(ctx: RankContext) -> tuple[Source, int]:
    """PromptTasks from the "producers" group, captured by this rank's engine into `mem://`.
    Every rank builds its island's groups here, at the same point (groups are matched by
    creation order), then its engine shard."""
    cfg, device = ctx.cfg, ctx.device
    group = ctx.loop.call(ctx.run.join(PRODUCERS))
    island = join_island(ctx.plan, ctx.rank, device.type)
    engine = build_engine(
        cfg.target.model_copy(update={"device": str(device)}),
        **({"tp_mesh": island.tp_mesh} if island.tp > 1 else {}),
    )
    source = ColocatedSource(
        ctx.run, group, engine, ctx.strategy.feature_contract(ctx.info),
        cfg.store.build(uri="mem://"), trained=ctx.trained,
        capture_device=device if device.type == "cuda" else None, island=island,
        window=cfg.training.micro_batch * cfg.training.accumulation,
    )  # fmt: skip
    # 0: capture the next window only after the last one is released (one window resident);
    # > 0: the capture of the next window overlaps this step
    return source, cfg.deployment.colocated_prefetch


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


DISAGGREGATED = Mode("disaggregated", TRAINERS, sweeps_store=True, source=disaggregated_source)
COLOCATED = Mode(
    "colocated", PRODUCERS, sweeps_store=False, source=colocated_source, check=check_colocated
)
LIVE = Mode(
    "live", TRAINERS, sweeps_store=True, source=live_source, check=check_live,
    manifest_writer="the intake (`specbus intake`)", held_until_checkpoint=live_held_bytes,
)  # fmt: skip
