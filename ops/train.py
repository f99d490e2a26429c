"""`specbus train`: the composition root of one trainer rank (also under torchrun), any mode.

`run_trainer` reads top to bottom: the mode's refusals, the process group, the bus, the run's
manifest, the parts (draft, strategy, optimizer, schedule), the checkpoint (resume = replay
from its ledger), the mode's source, the loader, the trainer; at the end rank 0 sweeps the
store and marks the run's training complete. docs/architecture.md describes the semantics.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from specbus.bus.connection import connect
from specbus.bus.run import RunBus, declare
from specbus.consumers.checkpoint import CheckpointManager
from specbus.consumers.ledger import Ledger
from specbus.consumers.loader import Loader
from specbus.consumers.lockstep import control_group, init_control_group, reset_control_group
from specbus.consumers.loop_thread import LoopThread
from specbus.consumers.parallel import broadcast_parameters, is_sharded, shard
from specbus.consumers.shutdown import stop_on_signals
from specbus.consumers.trainer import Trainer, TrainerHooks, TrainParts, TrainResult, TrainState
from specbus.core.config import BusConfig, RunConfig, TrainingConfig
from specbus.core.contracts import Manifest
from specbus.core.data.vocab import VocabMapping
from specbus.core.errors import CheckpointError, ConfigError
from specbus.core.models.target import (
    TargetInfo,
    load_target_heads,
    load_target_info,
    resolve_target_dir,
)
from specbus.core.registry import MODES
from specbus.core.telemetry import setup_tracing
from specbus.core.training import build_optimizer, build_scheduler
from specbus.ops.elastic import Formation, Member
from specbus.ops.modes import Mode, RankContext
from specbus.ops.observe import reporter

log = logging.getLogger("specbus.train")


def run_trainer(
    cfg: RunConfig,
    *,
    bus_url: str | None,
    resume: bool = False,
    manifest_timeout_s: float = 600.0,
    on_log=None,
) -> TrainResult | None:
    """Run one trainer rank to the end of the data, `training.max_steps`, or a SIGINT/SIGTERM
    (then every rank stops at a step boundary and saves). Returns None when stopped before
    the run's manifest appeared. Raises `ConfigError` (a setup the mode refuses, a run fed for
    another strategy), `CheckpointError` (checkpoints without `resume`, or of another plan)."""
    with stop_on_signals() as stop:
        rank, world, local_rank = dist_env()
        if cfg.telemetry.otel:
            setup_tracing(f"{cfg.telemetry.service_name}-trainer")
        mode: Mode = MODES.get(cfg.deployment.mode)
        info = target_info(cfg)
        plan = mode.check(cfg, info, world)  # refuse an impossible setup before anything starts
        device = init_distributed(cfg.training, cfg.bus, rank, world, local_rank)
        torch.manual_seed(cfg.training.seed)
        loop = LoopThread(f"specbus-bus-r{rank}")
        bus = loop.call(connect(cfg.bus, bus_url, name=f"specbus-trainer-{rank}"))
        source = None
        try:
            run = loop.call(declare(bus, cfg.bus, cfg.run))
            manifest = wait_for_manifest(loop, run, cfg, manifest_timeout_s, stop)
            if manifest is None:
                log.warning("stopped before the run's manifest appeared: nothing trained")
                return None
            checkpoints = CheckpointManager(checkpoint_dir(cfg), plan_of_training(cfg, manifest),
                                            keep=cfg.training.keep_checkpoints)  # fmt: skip
            schedule = plan_schedule(cfg.training, manifest.planned_tasks, world,
                                     checkpoints.latest_meta() if resume else None)  # fmt: skip
            parts = build_parts(cfg, info, manifest, device, world, schedule.total_steps,
                                offset=schedule.offset)  # fmt: skip
            state, ledger = restore(parts, checkpoints, resume, cfg.run)
            if resume and rank == 0:
                replay_from_checkpoint(loop, run, mode, ledger, cfg)
            formation = Formation(loop, run, checkpoints.directory, world=world, rank=rank,
                                  from_step=state.step)  # fmt: skip
            if dist.is_initialized():
                dist.barrier(group=control_group())
            ctx = RankContext(cfg, rank, device, run, loop, parts.strategy, info, manifest,
                              ledger, plan)  # fmt: skip
            source, prefetch = mode.source(ctx)
            loader = build_loader(cfg, mode, source, loop, parts, ledger, prefetch, stop)
            hooks = TrainerHooks(reporter(cfg, on_log, rank, loop=loop, run=run),
                                 lambda: best_effort_lag(loop, run), cfg.resolved_run_dir / "profile",
                                 on_checkpoint=lambda p: point_at(loop, run, p),
                                 on_first_step=formation.first_step)  # fmt: skip
            trainer = Trainer(parts, loader, cfg.training, total_steps=schedule.end_step,
                              checkpoints=checkpoints, state=state, hooks=hooks)  # fmt: skip
            result = fit_in_world(trainer, formation)
            finish(loop, run, mode, ledger, result, cfg, rank)
            return result
        finally:
            close(loop, bus, source)


def build_loader(
    cfg: RunConfig, mode: Mode, source, loop: LoopThread, parts: TrainParts, ledger: Ledger,
    prefetch: int, stop: threading.Event,
) -> Loader:  # fmt: skip
    """The rank's loader over its mode's `source` (lockstep windows of the run's geometry)."""
    return Loader(
        source, loop, lambda samples: parts.strategy.collate(samples, cfg.data.max_length),
        micro_batch=cfg.training.micro_batch, accumulation=cfg.training.accumulation,
        ledger=ledger, prefetch=prefetch,
        heartbeat_s=min(cfg.bus.heartbeat_s, cfg.bus.ack_wait_s / 3),
        fetch_timeout_s=cfg.bus.fetch_timeout_s,
        stop_after_s=cfg.training.max_minutes * 60 if cfg.training.max_minutes else None,
        stop=stop, hold_limit_bytes=mode.hold_limit_bytes(cfg),
        equal_micro_steps=is_sharded(parts.model),
    )  # fmt: skip


def fit_in_world(trainer: Trainer, formation: Formation) -> TrainResult:
    """`trainer.fit()`, recording in the run's KV how this rank's world ended when it ends
    other than at the end of the data (ops/elastic.py `Formation`)."""
    try:
        result = trainer.fit()
    except Exception as e:
        formation.end(trainer.state.step, f"failed: {type(e).__name__}: {str(e)[:200]}")
        raise
    if result.stopped:
        formation.end(result.steps, "stopped" if result.stopped_here else "stopped by a peer")
    return result


def dist_env() -> tuple[int, int, int]:
    """(rank, world, local_rank) from the torchrun environment (1 process when unset)."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )


def target_info(cfg: RunConfig) -> TargetInfo:
    """The target's shapes (the embedded default is converted and cached once)."""
    return load_target_info(resolve_target_dir(cfg.target.model), name=cfg.target.model)


def init_distributed(
    training: TrainingConfig, bus: BusConfig, rank: int, world: int, local_rank: int
) -> torch.device:
    """This rank's device, and the process group when `world > 1` (NCCL on GPU unless
    `training.backend` says otherwise, gloo on CPU) plus the gloo control group. Under an
    elastic agent the ranks wait `training.elastic_init_timeout_s` for each other at init (a
    rank that died while the world formed must not hold the others for the collective
    timeout: they fail, and their agents form the next world)."""
    use_cuda = torch.cuda.is_available() and training.backend != "gloo"
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        backend = (
            training.backend if training.backend != "auto" else ("nccl" if use_cuda else "gloo")
        )
        # A rank blocked on the bus through an outage (its confirmed acks) keeps the others
        # waiting in a collective: they must outlast the bus's give-up, not die first.
        timeout = timedelta(seconds=max(600.0, bus.outage_give_up_s + 120.0))
        elastic = Member.from_env() is not None
        init = timedelta(seconds=training.elastic_init_timeout_s) if elastic else timeout
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=init)
        init_control_group()  # before any other group: gloo for lockstep and lineage
        if elastic:  # formed: the collectives' own timeout from now on
            for group in {None, control_group()}:
                dist.distributed_c10d._set_pg_timeout(timeout, group)
    return device


def autocast_dtype(training: TrainingConfig, device: torch.device) -> torch.dtype | None:
    """bf16 compute with fp32 master weights on GPU (training.dtype auto/bfloat16); fp32 on CPU."""
    if device.type == "cuda" and training.dtype in ("auto", "bfloat16"):
        return torch.bfloat16
    return None


@dataclass(frozen=True)
class Schedule:
    """The LR schedule's length in its own steps, and where optimizer steps sit on it:
    optimizer step `s` is the schedule's step `s - offset` (0 but for a world re-planned
    mid-run). `end_step`: the optimizer step at which the schedule ends."""

    total_steps: int
    offset: float = 0.0

    @property
    def end_step(self) -> int:
        return max(1, math.ceil(self.offset + self.total_steps))


def plan_schedule(
    training: TrainingConfig, planned_tasks: int | None, world: int, resumed: dict | None = None
) -> Schedule:
    """The schedule of a world of `world` ranks resuming from the checkpoint whose meta is
    `resumed` (its `step` and `samples`; None: a fresh start).

    The schedule is over the planned samples: the whole data at this world's step size
    (`schedule_length`), the optimizer steps placed on it by the samples already trained.
    A world of another size than the checkpoint's (an elastic re-formation) thus goes on
    from the learning rate it stopped at, and its schedule ends when the data does: step `s`
    is the schedule's step `s - offset`, `offset = step - samples / per_step` (0 when the
    world is the checkpoint's: nothing changes). `training.total_steps` (a schedule given
    in steps) and live runs (no planned data) are not re-planned."""
    total = schedule_length(training, planned_tasks, world)
    samples = (resumed or {}).get("samples")
    if planned_tasks is None or training.total_steps or samples is None:
        return Schedule(total)
    per_step = world * training.micro_batch * training.accumulation
    offset = resumed["step"] - samples / per_step
    if abs(offset) < 1e-9:
        return Schedule(total)
    if training.max_steps:  # the schedule still ends by max_steps
        total = max(1, min(total, math.ceil(training.max_steps - offset)))
    return Schedule(total, offset)


def schedule_length(training: TrainingConfig, planned_tasks: int | None, world: int) -> int:
    """Optimizer steps the schedule spans: `training.total_steps`, else the planned tasks over
    one global window, rounded up (a remainder is the ragged last step, which must not run at
    the schedule's end: a learning rate of 0); a live run has none: `training.max_steps`,
    which its mode's check requires then; never beyond `training.max_steps`."""
    per_step = world * training.micro_batch * training.accumulation
    if planned_tasks is None:
        total = training.total_steps or training.max_steps
    else:
        total = training.total_steps or max(1, math.ceil(planned_tasks / per_step))
    return min(total, training.max_steps) if training.max_steps else total


def build_parts(
    cfg: RunConfig,
    info: TargetInfo,
    manifest: Manifest,
    device: torch.device,
    world: int,
    total_steps: int,
    offset: float = 0.0,
) -> TrainParts:
    """The strategy and its draft (vocab from the manifest; replicated from rank 0, sharded
    under `training.wrap=fsdp`), the optimizer and the schedule (`offset`: see `Schedule`).
    Raises `ConfigError` when the run was fed for another strategy, or started live and
    trained driven (or the reverse)."""
    check_manifest_mode(cfg, manifest)
    if manifest.strategy != cfg.strategy.name:
        raise ConfigError(
            f"run {cfg.run!r} was fed for strategy {manifest.strategy!r}, not {cfg.strategy.name!r}"
        )
    heads = load_target_heads(resolve_target_dir(cfg.target.model))
    strategy = cfg.strategy.build(info, heads=heads, aux_layers=cfg.target.aux_layers)
    vocab = VocabMapping.from_d2t(manifest.vocab.d2t, manifest.vocab.target_vocab_size)
    model = strategy.build_model(info, heads, vocab).to(device)
    broadcast_parameters(model)
    if cfg.training.wrap == "fsdp" and world > 1:
        model = shard(model, device)
    optimizer = build_optimizer(model, cfg.training)
    scheduler = build_scheduler(optimizer, cfg.training, total_steps, offset)
    return TrainParts(model, strategy, optimizer, scheduler, device,
                      autocast_dtype(cfg.training, device))  # fmt: skip


def check_manifest_mode(cfg: RunConfig, manifest: Manifest) -> None:
    """Trainers and manifest agree on live vs driven: a run an intake started is trained with
    `deployment.mode=live`, a feeder's run with another mode. Raises `ConfigError`."""
    live_manifest = manifest.mode == "live"
    if (cfg.deployment.mode == "live") != live_manifest:
        started = "live (by an intake)" if live_manifest else "by a feeder"
        raise ConfigError(
            f"run {cfg.run!r} was started {started}; these trainers run "
            f"deployment.mode={cfg.deployment.mode}"
        )


def checkpoint_dir(cfg: RunConfig) -> Path:
    """`training.checkpoint_dir`, else `<run_dir>/checkpoints`."""
    return cfg.training.checkpoint_dir or (cfg.resolved_run_dir / "checkpoints")


def plan_of_training(cfg: RunConfig, manifest: Manifest) -> dict[str, Any]:
    """What a checkpoint must agree with to be resumed by this run.

    The world size is not part of it: a checkpoint holds the full model and optimizer state
    (gathered under FSDP) and a global cursor and lineage, so a run resumes with more or fewer
    trainer ranks (elastic restart). The schedule is re-planned for the new world size from the
    step reached."""
    return {
        "manifest_plan": manifest.plan_hash,
        "strategy": cfg.strategy.model_dump(mode="json"),
        "micro_batch": cfg.training.micro_batch,
        "accumulation": cfg.training.accumulation,
        "tp": cfg.target.tp_size,
        "mode": cfg.deployment.mode,
        "wrap": cfg.training.wrap,  # the optimizer state's layout differs
    }


def wait_for_manifest(
    loop: LoopThread, run: RunBus, cfg: RunConfig, timeout_s: float, stop: threading.Event
) -> Manifest | None:
    """The run's manifest, once the feeder (a live run: the intake) wrote it; None if a stop
    was asked for first. Raises `ConfigError` after `timeout_s` without one."""
    writer = MODES.get(cfg.deployment.mode).manifest_writer

    def waiting(left: float) -> None:
        log.info("waiting for %s of run %r to write its manifest; giving up in %.0fs",
                 writer, cfg.run, left)  # fmt: skip

    try:
        return loop.call(run.kv.wait_manifest(timeout_s, stop.is_set, waiting))
    except TimeoutError:
        raise ConfigError(
            f"run {cfg.run!r} has no manifest after {timeout_s:.0f}s: start {writer} for this run"
        ) from None


def restore(
    parts: TrainParts, checkpoints: CheckpointManager, resume: bool, run: str
) -> tuple[TrainState, Ledger]:
    """The state and ledger to start from: the latest checkpoint's with `resume` (fresh when
    there is none yet), else fresh. Raises `CheckpointError` for checkpoints without
    `resume`, or of another plan."""
    state, ledger = TrainState(), Ledger(lineage_path=checkpoints.lineage_path)
    latest = checkpoints.resolve("latest")
    if resume and latest is not None:
        saved = checkpoints.load("latest")
        state = Trainer.restore(parts, saved)
        ledger.load_state_dict(saved)
        log.info("rank %d resumed at step %d (cursor floor %d, %d samples trained)",
                 dist.get_rank() if dist.is_initialized() else 0, state.step,
                 ledger.cursor.floor, len(ledger))  # fmt: skip
    elif latest is not None:
        raise CheckpointError(
            f"{checkpoints.directory} already holds checkpoints of run {run!r}: pass --resume to "
            "continue it, or use another run name / training.checkpoint_dir"
        )
    return state, ledger


def replay_from_checkpoint(
    loop: LoopThread, run: RunBus, mode: Mode, ledger: Ledger, cfg: RunConfig
) -> None:
    """Rank 0 of a resumed run: everything above the ledger's floor comes again (the ledger
    skips what is in), producers capture again, and releases a killed rank had queued are
    re-derived before prefetch."""
    loop.call(run.reposition(mode.group, ledger.cursor.floor + 1))
    log.info("replaying %s from stream seq %d (what is above it and not in the checkpoint "
             "trains again)", mode.group, ledger.cursor.floor + 1)  # fmt: skip
    loop.call(run.kv.clear_train_complete())
    if mode.sweeps_store:
        sweep_trained(cfg, ledger, timeout_s=0)


def finish(
    loop: LoopThread,
    run: RunBus,
    mode: Mode,
    ledger: Ledger,
    result: TrainResult,
    cfg: RunConfig,
    rank: int,
) -> None:
    """After `fit`: rank 0 sweeps what was trained from the store and, unless stopped, marks
    the run's training complete (which releases the producers)."""
    if rank == 0 and mode.sweeps_store:
        sweep_trained(cfg, ledger)
    if rank == 0 and not result.stopped:  # a stop must not wait for the broker (elastic
        result.dead_letters = count_dead_letters(loop, run)  # re-formation, outages)
    if result.stopped:
        log.warning("rank %d stopped at step %d (checkpoint %s): resume with --resume",
                    rank, result.steps, result.checkpoint)  # fmt: skip
    elif rank == 0:
        summary = {"steps": result.steps, "samples": result.samples,
                   "checkpoint": result.checkpoint, "dead_letters": result.dead_letters,
                   "time": time.time()}  # fmt: skip
        loop.call(run.kv.mark_train_complete(summary))


def count_dead_letters(loop: LoopThread, run: RunBus, timeout_s: float = 30.0) -> dict | None:
    """The run's dead letters (TASKS and SAMPLES, the broker's max-deliveries ones included:
    `bus.dead.count_dead`), None when the broker does not answer in time."""
    from specbus.bus.dead import count_dead

    try:
        return loop.call(count_dead(run.bus, run.run), timeout=timeout_s)
    except Exception as e:  # noqa: BLE001 - a summary must not fail the run
        log.warning("could not count the run's dead letters: %s", e)
        return None


def close(loop: LoopThread, bus, source) -> None:
    """Let go of the source, the connection (None: none was opened), the loop and the
    process groups."""
    try:
        if source is not None:
            source.close()
        if bus is not None:
            try:
                loop.call(bus.close(), timeout=10)
            except Exception as e:  # noqa: BLE001 - leaving: the run's state is saved already
                log.warning("broker connection not closed cleanly (an outage?): %s", e)
    finally:
        loop.close()
        if dist.is_initialized():
            dist.destroy_process_group()
            reset_control_group()


def point_at(loop: LoopThread, run: RunBus, pointer: dict) -> None:
    """Publish the checkpoint pointer to the run's KV (`specbus status` shows it) without
    waiting: a broker outage must not hold up training; a failed put is logged and the next
    checkpoint's pointer replaces it."""

    def done(future) -> None:
        if not future.cancelled() and future.exception() is not None:
            log.warning("checkpoint pointer of step %s not published: %s", pointer["step"],
                        future.exception())  # fmt: skip

    loop.submit(run.kv.put_checkpoint(pointer)).add_done_callback(done)


def best_effort_lag(loop: LoopThread, run: RunBus, timeout_s: float = 2.0):
    """The trainers' lag for a log row, or NaNs when the broker does not answer in time (a log
    line must not hold up training during a broker outage)."""

    class _Unknown:
        messages = bytes = math.nan

    future = loop.submit(run.lag())
    try:
        return future.result(timeout_s)
    except Exception:  # noqa: BLE001 - an outage, a timeout: the row says unknown
        future.cancel()
        return _Unknown()


def sweep_trained(cfg: RunConfig, ledger: Ledger, timeout_s: float | None = None) -> None:
    """Remove from the run's store every sample the ledger holds as trained, whatever its
    generation (releases a killed process had queued, refused for a read lease, die with it;
    they are re-derived here). Best effort: a store that cannot be reached is logged."""
    if cfg.store.uri.startswith("http://"):  # each producer releases what was acked (W3')
        return
    try:
        store = cfg.store.build()
        try:
            # What the store holds is bounded by its budget, the lineage by nothing: list the
            # store's samples first (sweeping the recent ones), then stream the lineage file
            # once for the rest.
            held: set[str] = set()
            freed = store.sweep(lambda sid: held.add(sid) or ledger.trained_sample(sid),
                                timeout_s=0)  # fmt: skip
            older = ledger.trained_among(held)
            freed += store.sweep(older.__contains__, timeout_s=timeout_s)
        finally:
            store.close()
    except Exception as e:  # noqa: BLE001 - the next sweep (resume, end of run) retries
        log.warning("could not sweep trained samples from %s: %s", cfg.store.uri, e)
        return
    if freed:
        log.info("swept %d bytes of trained samples from %s", freed, cfg.store.uri)
