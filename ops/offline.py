"""`specbus train --from-recording REC`: train from a recording, epoch after epoch (W1).

REC is a directory (a recording `specbus capture` wrote, or an offline dump in SpecForge's
layout) or the name of a recording run on the broker. The trainer is the online one (loader,
lockstep, ledger, checkpoints, `--resume`, several ranks under torchrun); only the source
differs (`consumers.recording.RecordingSource`): `data.epochs` passes over the recording,
epoch 0 in recorded order, later ones in a permutation seeded by `data.seed` and the epoch.
No lease, no release, no broker writes: the control plane is a no-op (the broker is only read,
for a run name). `cfg.run` names the training run (its run dir holds the checkpoints); it may
be the recording's own name.

Resume is a replay: the checkpoint's cursor floor is a position in the epochs (`floor //
samples` is the epoch), and the ranks take the positions above it again, the ledger skipping
what it holds. A checkpoint of another recording, sample count or shuffle seed is refused.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist
from specbus.bus.connection import connect
from specbus.consumers.checkpoint import CheckpointManager
from specbus.consumers.ledger import Ledger
from specbus.consumers.loader import Loader
from specbus.consumers.lockstep import control_group, reset_control_group
from specbus.consumers.loop_thread import LoopThread
from specbus.consumers.parallel import broadcast_parameters, shard
from specbus.consumers.recording import RecordingSource, is_run_name, open_recording
from specbus.consumers.shutdown import stop_on_signals
from specbus.consumers.trainer import Trainer, TrainResult, TrainState
from specbus.core.config import RunConfig
from specbus.core.errors import CaptureError, CheckpointError, ConfigError
from specbus.core.models.target import load_target_heads, load_target_info, resolve_target_dir
from specbus.core.strategies.base import build_strategy
from specbus.core.training import build_optimizer, build_scheduler
from specbus.ops.train import autocast_dtype, dist_env, init_distributed, plan_of_training
from specbus.producers.feeder import vocab_from_manifest

log = logging.getLogger("specbus.train")


def run_recording_trainer(
    cfg: RunConfig, recording: str, *, bus_url: str | None, resume: bool = False, on_log=None
) -> TrainResult | None:
    """Train one rank from `recording` to the end of its epochs, `training.max_steps`, or a
    SIGINT/SIGTERM (then every rank stops at a step boundary with a checkpoint)."""
    with stop_on_signals() as stop:
        return _run(cfg, recording, bus_url, resume, on_log, stop)


def _run(cfg, spec, bus_url, resume, on_log, stop) -> TrainResult | None:
    if cfg.deployment.mode != "disaggregated":
        raise ConfigError(
            f"--from-recording trains from recorded features; deployment.mode={cfg.deployment.mode!r} "
            "does not apply"
        )
    rank, world, local_rank = dist_env()
    device = init_distributed(cfg, rank, world, local_rank)
    torch.manual_seed(cfg.training.seed)
    loop = LoopThread(f"specbus-recording-r{rank}")
    bus = None
    source = None
    try:
        if is_run_name(spec):
            bus = loop.call(connect(cfg.bus, bus_url, name=f"specbus-trainer-{rank}"))
        recording = loop.call(open_recording(spec, bus, cfg))
        manifest = recording.manifest
        if manifest["strategy"] != cfg.strategy.name:
            raise ConfigError(
                f"recording {recording.name} holds {manifest['strategy']!r} features, not "
                f"{cfg.strategy.name!r} (strategy.name)"
            )
        path = resolve_target_dir(cfg.target.model)
        info = load_target_info(path, name=cfg.target.model)
        heads = load_target_heads(path)
        strategy = build_strategy(cfg.strategy, info, heads=heads, aux_layers=cfg.target.aux_layers)
        contract = strategy.feature_contract(info)
        _check_first_sample(loop, recording, contract)
        model = strategy.build_model(info, heads, vocab_from_manifest(manifest)).to(device)
        broadcast_parameters(model)
        if cfg.training.wrap == "fsdp" and world > 1:
            model = shard(model, device)
        optimizer = build_optimizer(model, cfg.training)
        need = cfg.training.micro_batch * cfg.training.accumulation
        epochs = cfg.data.epochs
        total_steps = cfg.training.total_steps or max(1, epochs * recording.count // (world * need))
        if cfg.training.max_steps:
            total_steps = min(total_steps, cfg.training.max_steps)
        scheduler = build_scheduler(optimizer, cfg.training, total_steps)
        plan = {
            **plan_of_training(cfg, manifest),
            "mode": "recording",
            "recording": {"samples": recording.count, "seed": cfg.data.seed},
        }
        ckpt_dir = cfg.training.checkpoint_dir or (cfg.resolved_run_dir / "checkpoints")
        checkpoints = CheckpointManager(ckpt_dir, plan, keep=cfg.training.keep_checkpoints)
        state, ledger = TrainState(), Ledger()
        if resume and checkpoints.resolve("latest") is not None:
            saved = checkpoints.load("latest")
            state = Trainer.restore(model, optimizer, scheduler, saved)
            ledger.load_state_dict(saved)
            epoch, at = divmod(ledger.cursor.floor, recording.count)
            log.info(
                "rank %d resumed at step %d: epoch %d, position %d of %d (%d samples trained)",
                rank, state.step, epoch, at, recording.count, len(ledger),
            )  # fmt: skip
        elif not resume and checkpoints.resolve("latest") is not None:
            raise CheckpointError(
                f"{Path(ckpt_dir)} already holds checkpoints of run {cfg.run!r}: pass --resume "
                "to continue it, or use another run name / training.checkpoint_dir"
            )
        if dist.is_initialized():
            dist.barrier(group=control_group())
        source = RecordingSource(
            recording, features=contract.names, epochs=epochs, seed=cfg.data.seed,
            rank=rank, world=world, need=need, trained=ledger,
        )  # fmt: skip
        loader = Loader(
            source, loop, lambda samples: strategy.collate(samples, cfg.data.max_length),
            micro_batch=cfg.training.micro_batch,
            accumulation=cfg.training.accumulation,
            ledger=ledger,
            prefetch=cfg.training.prefetch,
            fetch_timeout_s=cfg.bus.fetch_timeout_s,
            stop_after_s=cfg.training.max_minutes * 60 if cfg.training.max_minutes else None,
            stop=stop,
        )  # fmt: skip
        trainer = Trainer(
            model=model, strategy=strategy, optimizer=optimizer, scheduler=scheduler,
            loader=loader, checkpoints=checkpoints, state=state, total_steps=total_steps,
            grad_clip=cfg.training.grad_clip, max_steps=cfg.training.max_steps,
            checkpoint_every=cfg.training.checkpoint_every, log_every=cfg.training.log_every,
            rank=rank, on_log=on_log, device=device, autocast_dtype=autocast_dtype(cfg, device),
            profile_step=cfg.training.profile_step, profile_dir=cfg.resolved_run_dir / "profile",
        )  # fmt: skip
        result = trainer.fit()
        if result.stopped:
            log.warning(
                "rank %d stopped at step %d (checkpoint %s): resume with --resume",
                rank, result.steps, result.checkpoint,
            )  # fmt: skip
        return result
    finally:
        if source is not None:
            source.close()
        try:
            if bus is not None:
                loop.call(bus.close(), timeout=10)
        finally:
            loop.close()
        if dist.is_initialized():
            dist.destroy_process_group()
            reset_control_group()


def _check_first_sample(loop: LoopThread, recording, contract) -> None:
    """Refuse a recording whose features do not fit this strategy and target, by name."""
    _, _, tensors = loop.call(recording.load(0, contract.names))
    try:
        contract.verify(tensors)
    except CaptureError as e:
        raise ConfigError(
            f"recording {recording.name} does not fit strategy {contract.strategy!r} on this "
            f"target (hidden size {contract.hidden_size}): {e}"
        ) from e
