"""`specbus train --from-recording REC`: train from a recording, epoch after epoch (W1).

REC is a directory (a recording `specbus capture` wrote, or an offline dump in vLLM
speculators' or SpecForge's layout) or the name of a recording run on the broker. The trainer is the online one (loader,
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

import torch
import torch.distributed as dist
from specbus.bus.connection import connect
from specbus.consumers.checkpoint import CheckpointManager
from specbus.consumers.loader import Loader
from specbus.consumers.lockstep import control_group
from specbus.consumers.loop_thread import LoopThread
from specbus.consumers.parallel import is_sharded
from specbus.consumers.recording import RecordingSource, is_run_name
from specbus.consumers.recording_formats import open_recording
from specbus.consumers.shutdown import stop_on_signals
from specbus.consumers.trainer import Trainer, TrainerHooks, TrainResult
from specbus.core.config import RunConfig
from specbus.core.errors import CaptureError, ConfigError
from specbus.core.strategies.base import FeatureContract
from specbus.ops.observe import reporter
from specbus.ops.train import (
    build_parts,
    checkpoint_dir,
    close,
    dist_env,
    init_distributed,
    plan_of_training,
    restore,
    schedule_length,
    target_info,
)

log = logging.getLogger("specbus.train")


def run_recording_trainer(
    cfg: RunConfig, recording: str, *, bus_url: str | None, resume: bool = False, on_log=None
) -> TrainResult | None:
    """Train one rank from `recording` to the end of its epochs, `training.max_steps`, or a
    SIGINT/SIGTERM (then every rank stops at a step boundary with a checkpoint). Raises
    `ConfigError` (another mode, a recording of another strategy or that does not fit the
    target, one that does not exist), `CheckpointError` (as `specbus train`)."""
    if cfg.deployment.mode != "disaggregated":
        raise ConfigError(
            f"--from-recording trains from recorded features; deployment.mode={cfg.deployment.mode!r} "
            "does not apply"
        )
    with stop_on_signals() as stop:
        rank, world, local_rank = dist_env()
        device = init_distributed(cfg.training, cfg.bus, rank, world, local_rank)
        torch.manual_seed(cfg.training.seed)
        loop = LoopThread(f"specbus-recording-r{rank}")
        bus = source = rec = None
        try:
            if is_run_name(recording):  # the broker is only read
                bus = loop.call(connect(cfg.bus, bus_url, name=f"specbus-trainer-{rank}"))
            rec = loop.call(open_recording(recording, bus, cfg.strategy, cfg.target))
            if rec.manifest.strategy != cfg.strategy.name:
                raise ConfigError(
                    f"recording {rec.name} holds {rec.manifest.strategy!r} features, not "
                    f"{cfg.strategy.name!r} (strategy.name)"
                )
            info = target_info(cfg)
            total_steps = schedule_length(cfg.training, cfg.data.epochs * rec.count, world)
            parts = build_parts(cfg, info, rec.manifest, device, world, total_steps)
            contract = parts.strategy.feature_contract(info)
            check_first_sample(loop, rec, contract)
            plan = {**plan_of_training(cfg, rec.manifest), "mode": "recording",
                    "recording": {"samples": rec.count, "seed": cfg.data.seed}}  # fmt: skip
            checkpoints = CheckpointManager(checkpoint_dir(cfg), plan,
                                            keep=cfg.training.keep_checkpoints)  # fmt: skip
            state, ledger = restore(parts, checkpoints, resume, cfg.run)
            if state.step:
                epoch, at = divmod(ledger.cursor.floor, rec.count)
                log.info("rank %d goes on in epoch %d, position %d of %d",
                         rank, epoch, at, rec.count)  # fmt: skip
            if dist.is_initialized():
                dist.barrier(group=control_group())
            need = cfg.training.micro_batch * cfg.training.accumulation
            source = RecordingSource(rec, features=contract.names, epochs=cfg.data.epochs,
                                     seed=cfg.data.seed, rank=rank, world=world, need=need,
                                     trained=ledger)  # fmt: skip
            loader = Loader(
                source, loop, lambda samples: parts.strategy.collate(samples, cfg.data.max_length),
                micro_batch=cfg.training.micro_batch, accumulation=cfg.training.accumulation,
                ledger=ledger, prefetch=cfg.training.prefetch,
                fetch_timeout_s=cfg.bus.fetch_timeout_s,
                stop_after_s=cfg.training.max_minutes * 60 if cfg.training.max_minutes else None,
                stop=stop, equal_micro_steps=is_sharded(parts.model),
            )  # fmt: skip
            hooks = TrainerHooks(
                reporter(cfg, on_log, rank), None, cfg.resolved_run_dir / "profile"
            )
            result = Trainer(parts, loader, cfg.training, total_steps=total_steps,
                             checkpoints=checkpoints, state=state, hooks=hooks).fit()  # fmt: skip
            result.recording = True
            if result.stopped:
                log.warning("rank %d stopped at step %d (checkpoint %s): resume with --resume",
                            rank, result.steps, result.checkpoint)  # fmt: skip
            return result
        finally:
            if source is None and rec is not None:  # the source closes it otherwise
                rec.close()
            close(loop, bus, source)


def check_first_sample(loop: LoopThread, recording, contract: FeatureContract) -> None:
    """Refuse a recording whose features do not fit this strategy and target, by name."""
    _, _, tensors = loop.call(recording.load(0, contract.names))
    try:
        contract.verify(tensors)
    except CaptureError as e:
        raise ConfigError(
            f"recording {recording.name} does not fit strategy {contract.strategy!r} on this "
            f"target (hidden size {contract.hidden_size}): {e}"
        ) from e
