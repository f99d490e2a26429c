"""Build and run one trainer rank (`specbus train`, also under torchrun), either mode.

`deployment.mode: disaggregated`: the rank leases SampleRefs from the "trainers" group and
reads tensors from the store the refs name. `live`: the same, the refs published by the live
intake (no feeder: the intake writes the manifest; the data never ends, training does at a
stop signal, `training.max_steps` or `training.max_minutes`). `colocated`: the rank leases PromptTasks from the
"producers" group and captures them itself into a `mem://` store bounded to one window.
Everything after the source (loader, lockstep, trainer, checkpoints, resume) is shared.

Wiring, in order: the process group (gloo on CPU, NCCL on GPU; from the torchrun environment
RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT), the bus, the run manifest (written by the feeder:
plan, target fingerprints, vocab mapping), the target's frozen heads, the strategy and its
draft, the optimizer and schedule, the checkpoint (`resume=True`: restore it and reposition the
trainers' consumer at its cursor; no checkpoint yet: replay from the start), then the loop.
At the end rank 0 writes the final checkpoint and marks the run's training complete, which
releases the producers.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from specbus.bus.connection import connect
from specbus.bus.lag import lag
from specbus.bus.lease import Leases
from specbus.bus.replay import reposition
from specbus.bus.subjects import PRODUCERS, TRAINERS
from specbus.bus.topology import declare
from specbus.consumers.bus_source import BusSource
from specbus.consumers.checkpoint import CheckpointManager
from specbus.consumers.ledger import Ledger
from specbus.consumers.loader import Loader
from specbus.consumers.lockstep import control_group, init_control_group, reset_control_group
from specbus.consumers.loop_thread import LoopThread
from specbus.consumers.parallel import broadcast_parameters, shard
from specbus.consumers.shutdown import stop_on_signals
from specbus.consumers.trainer import Trainer, TrainResult, TrainState
from specbus.core.config import RunConfig
from specbus.core.errors import CheckpointError, ConfigError
from specbus.core.models.target import load_target_heads, load_target_info, resolve_target_dir
from specbus.core.store import open_store
from specbus.core.strategies.base import build_strategy
from specbus.core.telemetry import setup_tracing
from specbus.core.training import build_optimizer, build_scheduler
from specbus.producers.colocated import ColocatedSource, join_island, validate_colocated
from specbus.producers.engines.registry import build_engine
from specbus.producers.feeder import vocab_from_manifest

log = logging.getLogger("specbus.train")


def dist_env() -> tuple[int, int, int]:
    """(rank, world, local_rank) from the torchrun environment (1 process when unset)."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )


def init_distributed(cfg: RunConfig, rank: int, world: int, local_rank: int) -> torch.device:
    use_cuda = torch.cuda.is_available() and cfg.training.backend != "gloo"
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        backend = (
            cfg.training.backend
            if cfg.training.backend != "auto"
            else ("nccl" if use_cuda else "gloo")
        )
        # A rank blocked on the bus through an outage (its confirmed acks) keeps the others
        # waiting in a collective: they must outlast the bus's give-up, not die first.
        timeout = timedelta(seconds=max(600.0, cfg.bus.outage_give_up_s + 120.0))
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
        init_control_group()  # before any other group: gloo for lockstep and lineage
    return device


def autocast_dtype(cfg: RunConfig, device: torch.device) -> torch.dtype | None:
    """bf16 compute with fp32 master weights on GPU (training.dtype auto/bfloat16); fp32 on CPU."""
    if device.type == "cuda" and cfg.training.dtype in ("auto", "bfloat16"):
        return torch.bfloat16
    return None


def plan_of_training(cfg: RunConfig, manifest: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint must agree with to be resumed by this run.

    The world size is not part of it: a checkpoint holds the full model and optimizer state
    (gathered under FSDP) and a global cursor and lineage, so a run resumes with more or fewer
    trainer ranks (elastic restart). The schedule is re-planned for the new world size from the
    step reached."""
    return {
        "manifest_plan": manifest["plan_hash"],
        "strategy": cfg.strategy.model_dump(mode="json"),
        "micro_batch": cfg.training.micro_batch,
        "accumulation": cfg.training.accumulation,
        "tp": cfg.target.tp_size,
        "mode": cfg.deployment.mode,
        "wrap": cfg.training.wrap,  # the optimizer state's layout differs
    }


def wait_for_manifest(
    loop: LoopThread, kv, run: str, timeout_s: float, stop: threading.Event, live: bool = False
) -> dict[str, Any] | None:
    """The run's manifest, once the feeder (live mode: the intake) wrote it; None if a stop
    was asked for first."""
    writer = "the intake (`specbus intake`)" if live else "the feeder (`specbus feed`)"
    deadline = time.monotonic() + timeout_s
    said = False
    while time.monotonic() < deadline:
        manifest = loop.call(kv.get_manifest())
        if manifest is not None:
            return manifest
        if not said:
            log.info("waiting for %s of run %r to write its manifest", writer, run)
            said = True
        if stop.wait(0.2):
            return None
    raise ConfigError(
        f"run {run!r} has no manifest after {timeout_s:.0f}s: start {writer} for this run"
    )


def check_live_manifest(cfg: RunConfig, manifest: dict[str, Any]) -> None:
    """Live mode: trainers and manifest agree on the mode, and the schedule has a length (live
    traffic has no count: `training.total_steps` or `training.max_steps`)."""
    live_manifest = manifest.get("mode") == "live"
    if (cfg.deployment.mode == "live") != live_manifest:
        raise ConfigError(
            f"run {cfg.run!r} was started {'live (by an intake)' if live_manifest else 'by a feeder'}; "
            f"these trainers run deployment.mode={cfg.deployment.mode}"
        )
    if live_manifest and not (cfg.training.total_steps or cfg.training.max_steps):
        raise ConfigError(
            "deployment.mode=live trains on traffic of no known size: set training.total_steps "
            "(the schedule's length) or training.max_steps"
        )


def run_trainer(
    cfg: RunConfig,
    *,
    bus_url: str | None,
    resume: bool = False,
    manifest_timeout_s: float = 600.0,
    on_log=None,
) -> TrainResult | None:
    """Run one trainer rank to the end of the data, `training.max_steps`, or a SIGINT/SIGTERM
    (then it stops at a step boundary with every rank, saves and returns). Returns None when
    stopped before training started."""
    with stop_on_signals() as stop:
        return _run_trainer(cfg, bus_url, resume, manifest_timeout_s, on_log, stop)


def _best_effort_lag(loop: LoopThread, bus, run: str, timeout_s: float = 2.0):
    """The trainers' lag for a log row, or NaNs when the broker does not answer in time (a log
    line must not hold up training during a broker outage)."""

    class _Unknown:
        messages = bytes = math.nan

    future = loop.submit(lag(bus, run))
    try:
        return future.result(timeout_s)
    except Exception:  # noqa: BLE001 - an outage, a timeout: the row says unknown
        future.cancel()
        return _Unknown()


def sweep_trained(cfg: RunConfig, ledger: Ledger, timeout_s: float | None = None) -> None:
    """Remove from the run's store every sample the ledger holds as trained, whatever its
    generation (releases a killed process had queued, refused for a read lease, die with it;
    they are re-derived here). Best effort: a store that cannot be reached is logged."""
    try:
        store = open_store(cfg.store)
        try:
            freed = store.sweep(ledger.trained_sample, timeout_s=timeout_s)
        finally:
            store.close()
    except Exception as e:  # noqa: BLE001 - the next sweep (resume, end of run) retries
        log.warning("could not sweep trained samples from %s: %s", cfg.store.uri, e)
        return
    if freed:
        log.info("swept %d bytes of trained samples from %s", freed, cfg.store.uri)


def _run_trainer(cfg, bus_url, resume, manifest_timeout_s, on_log, stop) -> TrainResult | None:
    rank, world, local_rank = dist_env()
    if cfg.telemetry.otel:
        setup_tracing(f"{cfg.telemetry.service_name}-trainer")
    islands = None
    if cfg.deployment.mode == "colocated":  # refuse an impossible setup before anything starts
        islands = validate_colocated(
            cfg,
            load_target_info(resolve_target_dir(cfg.target.model), name=cfg.target.model),
            world,
        )
    device = init_distributed(cfg, rank, world, local_rank)
    torch.manual_seed(cfg.training.seed)
    loop = LoopThread(f"specbus-bus-r{rank}")
    bus = loop.call(connect(cfg.bus, bus_url, name=f"specbus-trainer-{rank}"))
    source = None
    try:
        topo = loop.call(declare(bus, cfg.bus, cfg.run))
        live = cfg.deployment.mode == "live"
        manifest = wait_for_manifest(loop, topo.kv, cfg.run, manifest_timeout_s, stop, live)
        if manifest is None:
            log.warning("stopped before the run's manifest appeared: nothing trained")
            return None
        check_live_manifest(cfg, manifest)
        if manifest["strategy"] != cfg.strategy.name:
            raise ConfigError(
                f"run {cfg.run!r} was fed for strategy {manifest['strategy']!r}, not {cfg.strategy.name!r}"
            )
        path = resolve_target_dir(cfg.target.model)
        info = load_target_info(path, name=cfg.target.model)
        heads = load_target_heads(path)
        strategy = build_strategy(cfg.strategy, info, heads=heads, aux_layers=cfg.target.aux_layers)
        model = strategy.build_model(info, heads, vocab_from_manifest(manifest)).to(device)
        broadcast_parameters(model)
        if cfg.training.wrap == "fsdp" and world > 1:
            model = shard(model, device)
        optimizer = build_optimizer(model, cfg.training)
        per_step = world * cfg.training.micro_batch * cfg.training.accumulation
        total_steps = cfg.training.total_steps or max(
            1, (manifest["planned_tasks"] or cfg.training.max_steps * per_step) // per_step
        )  # live: planned_tasks is None and max_steps is set (check_live_manifest)
        if cfg.training.max_steps:
            total_steps = min(total_steps, cfg.training.max_steps)
        scheduler = build_scheduler(optimizer, cfg.training, total_steps)

        colocated = cfg.deployment.mode == "colocated"
        group_name = PRODUCERS if colocated else TRAINERS
        ckpt_dir = cfg.training.checkpoint_dir or (cfg.resolved_run_dir / "checkpoints")
        checkpoints = CheckpointManager(
            ckpt_dir, plan_of_training(cfg, manifest), keep=cfg.training.keep_checkpoints
        )
        state, ledger = TrainState(), Ledger()
        if resume:
            if checkpoints.resolve("latest") is not None:
                saved = checkpoints.load("latest")
                state = Trainer.restore(model, optimizer, scheduler, saved)
                ledger.load_state_dict(saved)
                log.info(
                    "rank %d resumed at step %d (cursor floor %d, %d samples trained)",
                    rank, state.step, ledger.cursor.floor, len(ledger),
                )  # fmt: skip
            if rank == 0:  # everything above the floor comes again; the ledger skips what is in
                loop.call(reposition(bus, cfg.run, group_name, ledger.cursor.floor + 1))
                loop.call(topo.kv.clear_train_complete())  # producers capture again
                if not colocated:  # releases a killed rank had queued: re-derived, before prefetch
                    sweep_trained(cfg, ledger, timeout_s=0)
        elif checkpoints.resolve("latest") is not None:
            raise CheckpointError(
                f"{Path(ckpt_dir)} already holds checkpoints of run {cfg.run!r}: pass --resume to continue it, "
                "or use another run name / training.checkpoint_dir"
            )
        if dist.is_initialized():
            dist.barrier(group=control_group())

        group = loop.call(Leases.join(bus, cfg.run, group_name))
        contract = strategy.feature_contract(info)
        if colocated:
            # Target-TP islands: every rank builds the TP mesh and the island groups here, at
            # the same point (groups are matched by creation order), then its engine shard.
            island = join_island(islands, rank, device.type)
            engine = build_engine(
                cfg.target.model_copy(update={"device": str(device)}),
                **({"tp_mesh": island.tp_mesh} if island.tp > 1 else {}),
            )
            store = open_store(cfg.store.model_copy(update={"uri": "mem://"}))
            source = ColocatedSource(
                bus, cfg.run, group, topo.kv, engine, contract, store, cfg.bus, trained=ledger,
                capture_device=device if device.type == "cuda" else None, island=island,
            )  # fmt: skip
            # 0: capture the next window only after the last one is released (one window
            # resident); > 0: the capture of the next window overlaps this step
            prefetch = cfg.deployment.colocated_prefetch
        else:
            source = BusSource(
                bus, cfg.run, group, topo.kv,
                strategy=strategy.name,
                features=contract.names,
                target_fingerprint=manifest["target"]["fingerprint"],
                tokenizer_fingerprint=manifest["target"]["tokenizer_fingerprint"],
                trained=ledger,
                live=live,  # no end of data: a stop signal, max_steps or max_minutes ends it
            )  # fmt: skip
            prefetch = cfg.training.prefetch
        loader = Loader(
            source, loop, lambda samples: strategy.collate(samples, cfg.data.max_length),
            micro_batch=cfg.training.micro_batch,
            accumulation=cfg.training.accumulation,
            ledger=ledger,
            prefetch=prefetch,
            heartbeat_s=min(cfg.bus.heartbeat_s, cfg.bus.ack_wait_s / 3),
            fetch_timeout_s=cfg.bus.fetch_timeout_s,
            stop_after_s=cfg.training.max_minutes * 60 if cfg.training.max_minutes else None,
            stop=stop,
        )  # fmt: skip
        trainer = Trainer(
            model=model,
            strategy=strategy,
            optimizer=optimizer,
            scheduler=scheduler,
            loader=loader,
            checkpoints=checkpoints,
            state=state,
            total_steps=total_steps,
            grad_clip=cfg.training.grad_clip,
            max_steps=cfg.training.max_steps,
            checkpoint_every=cfg.training.checkpoint_every,
            log_every=cfg.training.log_every,
            rank=rank,
            on_log=on_log,
            lag=lambda: _best_effort_lag(loop, bus, cfg.run),
            device=device,
            autocast_dtype=autocast_dtype(cfg, device),
            profile_step=cfg.training.profile_step,
            profile_dir=cfg.resolved_run_dir / "profile",
        )
        result = trainer.fit()
        if rank == 0 and not colocated:  # nothing trained stays in the store
            sweep_trained(cfg, ledger)
        if result.stopped:
            log.warning(
                "rank %d stopped at step %d (checkpoint %s): resume with --resume",
                rank, result.steps, result.checkpoint,
            )  # fmt: skip
        elif rank == 0:
            loop.call(
                topo.kv.mark_train_complete(
                    {
                        "steps": result.steps,
                        "samples": result.samples,
                        "checkpoint": result.checkpoint,
                    }
                )
            )
        return result
    finally:
        if source is not None:
            source.close()
        try:
            loop.call(bus.close(), timeout=10)
        finally:
            loop.close()
        if dist.is_initialized():
            dist.destroy_process_group()
            reset_control_group()
