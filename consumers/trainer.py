"""The trainer loop: lockstep windows -> accumulation -> optimizer step -> commit.

One `Trainer` per rank, built from its parts (`TrainParts`), its loader and `cfg.training`.
Each step trains one window of the loader, runs one gradient collective, steps, then commits
the window (ledger, ack, release); checkpoints hold the model, optimizer and the loader's
ledger; once one is written every rank lets its source free what it held back for it (live
mode: trained tensors wait for the checkpoint that covers them, and one comes early when they
reach the loader's limit, `Loader.checkpoint_due`). On a stop it saves the last step; after a
failure (a peer gone) a surviving rank saves it when it can alone: the first survivor to claim
the step (`CheckpointManager.claim`), so the step is saved whichever rank died, rank 0
included. The semantics (exactly once, stop and failure, elastic re-formation):
docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from specbus.consumers.checkpoint import (
    CheckpointManager,
    rng_state,
    set_rng_state,
    trainable_state,
    with_frozen_state,
)
from specbus.consumers.loader import Loader, Window
from specbus.consumers.lockstep import control_group, distributed, rank
from specbus.consumers.parallel import average_gradients, full_state, is_sharded, load_full_state
from specbus.consumers.profiling import profiled_step
from specbus.core.config import TrainingConfig
from specbus.core.strategies.base import StepContext, Strategy
from specbus.core.telemetry import span
from specbus.core.training import PendingStep, launch_step

log = logging.getLogger("specbus.trainer")


@dataclass
class TrainState:
    """What a resume restores besides the model, optimizer and the loader's ledger."""

    step: int = 0
    history: list[dict[str, float]] = field(default_factory=list)  # one row per log interval


@dataclass
class TrainParts:
    """What a trainer steps: the draft (wrapped for data parallelism), its strategy, optimizer
    and schedule, the device, and the autocast dtype (None: full precision)."""

    model: torch.nn.Module
    strategy: Strategy
    optimizer: torch.optim.Optimizer
    scheduler: Any
    device: torch.device
    autocast_dtype: torch.dtype | None = None


@dataclass
class TrainerHooks:
    """What a trainer reports to: `on_log(row)` on rank 0 per log interval, `lag()` (the
    trainers' lag for a row, or None), `profile_dir` (for `training.profile_step`),
    `on_checkpoint(pointer)` on rank 0 after each checkpoint is written (step, path, samples,
    score; best effort: it must not raise); `on_first_step(step)` on every rank after the first
    optimizer step of this process (the world's first: elastic re-formations are timed to it;
    best effort: it must not raise)."""

    on_log: Callable[[dict[str, float]], None] | None = None
    lag: Callable[[], Any] | None = None
    profile_dir: Path | None = None
    on_checkpoint: Callable[[dict[str, Any]], None] | None = None
    on_first_step: Callable[[int], None] | None = None


@dataclass
class TrainResult:
    """How `Trainer.fit` ended: steps and samples trained, the metric history, the last
    checkpoint, whether a stop request ended it and whether it was this rank's own (a signal to
    this process) or a peer's (`stopped` without `stopped_here`: the world stopped under this
    rank, e.g. an elastic re-formation), and the ledger (`lineage`: the sample ids in training
    order, read from the lineage file when asked for)."""

    steps: int
    samples: int
    history: list[dict[str, float]]
    checkpoint: str | None
    stopped: bool = False  # ended by a stop request, not by the end of data or max_steps
    stopped_here: bool = False  # the stop request was this rank's (a signal to this process)
    recording: bool = False  # trained from a recording (no TASKS, no dead letters to count)
    # the run's dead letters at the end, {"tasks"|"samples": {"explicit"|"max_deliveries": n}}
    # (rank 0, ops/train.py; None: not counted)
    dead_letters: dict[str, dict[str, int]] | None = None
    ledger: Any = field(default=None, repr=False)

    @property
    def lineage(self) -> list[str]:
        """The sample ids in the model, in training order (read on demand)."""
        return self.ledger.lineage if self.ledger is not None else []


def _scalar(v: Any) -> float:
    return float(v.detach().float().mean()) if isinstance(v, torch.Tensor) else float(v)


class Trainer:
    """One rank's training loop (see the module doc). `fit()` runs it to the end of the data,
    `cfg.max_steps` or a stop; `total_steps` is the schedule's length (for objectives that
    depend on it); `checkpoints` None trains without saving; `state` is a resumed one."""

    def __init__(
        self,
        parts: TrainParts,
        loader: Loader,
        cfg: TrainingConfig,
        *,
        total_steps: int,
        checkpoints: CheckpointManager | None = None,
        state: TrainState | None = None,
        hooks: TrainerHooks | None = None,
    ):
        self.parts, self.model, self.strategy = parts, parts.model, parts.strategy
        self.optimizer, self.scheduler = parts.optimizer, parts.scheduler
        self.loader, self.cfg, self.total_steps = loader, cfg, total_steps
        self.checkpoints, self.state = checkpoints, state if state is not None else TrainState()
        self.hooks = hooks if hooks is not None else TrainerHooks()
        self.rank = rank()
        self.sharded = is_sharded(self.model)
        self._window_metrics: dict[str, list[float]] = defaultdict(list)
        self._interval = self._new_interval()
        # The last step, queued on the GPU and not waited for (`_settle`), with its window;
        # and the log row its interval closed, emitted once that step's figures are in.
        self._pending: list[tuple[int, PendingStep, Window]] = []  # (step number, ...)
        self._due_row: dict[str, float] | None = None
        overlap = cfg.overlap_steps
        self._overlap = parts.device.type == "cuda" if overlap is None else overlap
        self._last_checkpoint: str | None = None
        self._last_checkpoint_step = self.state.step
        if checkpoints is not None:  # the ledger's lineage goes to the file beside them
            loader.ledger.lineage_path = checkpoints.lineage_path
        self._first_step = True

    @staticmethod
    def _new_interval() -> dict[str, float]:
        """Counters of one log interval (reset after each log row)."""
        return {
            "t0": time.perf_counter(),
            "wait": 0.0,
            "bus": 0.0,
            "samples": 0,
            "tokens": 0,
            "steps": 0,
        }

    @property
    def samples(self) -> int:
        """Samples in the model (the ledger's lineage)."""
        return len(self.loader.ledger)

    # -- state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's content: full model and optimizer state (collective under FSDP)
        and the loader's ledger (`cursor`, `ledger`, `lineage`: the ids since the last
        checkpoint, which `CheckpointManager.save` appends to the lineage file)."""
        model_sd, optim_sd = full_state(self.model, self.optimizer)
        return {
            "model": trainable_state(getattr(self.model, "module", self.model), model_sd),
            "optimizer": optim_sd,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "rng": rng_state(),
            "step": self.state.step,
            "samples": self.samples,
            **self.loader.state_dict(),
            "history": list(self.state.history),
        }

    @staticmethod
    def restore(parts: TrainParts, saved: dict[str, Any]) -> TrainState:
        """Load model, optimizer, scheduler and RNG from a checkpoint; the ledger part
        (`cursor`, `lineage`) is the loader's (`Loader.load_state_dict(saved)`)."""
        model_sd = with_frozen_state(getattr(parts.model, "module", parts.model), saved["model"])
        load_full_state(parts.model, parts.optimizer, model_sd, saved["optimizer"])
        if parts.scheduler is not None and saved.get("scheduler") is not None:
            parts.scheduler.load_state_dict(saved["scheduler"])
        set_rng_state(saved["rng"])
        return TrainState(step=saved["step"], history=list(saved.get("history", [])))

    # -- loop --------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        """Train until the loader's data ends, `max_steps`, or a stop (see the module doc).
        Raises what failed (a collective, `BrokerUnavailable`) after the failure save, unless
        a stop had been asked for (then returns with `stopped`)."""
        cfg, profile_dir = self.cfg, self.hooks.profile_dir
        try:
            while cfg.max_steps is None or self.state.step < cfg.max_steps:
                if self._pending and not self.loader.has_window():
                    # the next window needs takes, and they may need room the pending step's
                    # window holds (`capacity` counts it until released): settle it first
                    self._settle()
                window = self.loader.next_window()
                if window is None:
                    break
                profiled = self.state.step == cfg.profile_step and profile_dir is not None
                with (
                    profiled_step(profile_dir, self.state.step, self.rank)
                    if profiled
                    else contextlib.nullcontext()
                ):
                    self._step(window)
                if self._first_step:
                    self._first_step = False
                    self._report_first_step()
                if self.state.step % cfg.log_every == 0:
                    self._log()
                if self.checkpoints is not None and self._checkpoint_due():
                    self.save()
        except BaseException as e:
            # The model and the ledger are at the last optimizer step (a failed step never
            # reached optimizer.step(); a finished one is recorded right after it).
            with contextlib.suppress(Exception):
                self._settle()
            with contextlib.suppress(Exception):
                self.loader.close()
            self._save_alone()
            if not (isinstance(e, Exception) and self.loader.stop.is_set()):
                raise
            # Asked to stop, and a peer is gone (torchrun stops the survivors of a dead rank):
            # the step is abandoned, the last one saved, the leases given back.
            log.warning("rank %d abandoned step %d on stop: %s", self.rank, self.state.step, e)
            return self._result(stopped=True)
        self._settle()
        self.loader.close()
        if self._interval["steps"]:
            self._log()
        if self.checkpoints is not None and self._last_checkpoint_step != self.state.step:
            self.save()
        # Every trained window is in the last checkpoint (or there are none): what the source
        # still holds (duplicates settled since) is freed.
        self.loader.checkpointed()
        return self._result(stopped=self.loader.stopped)

    def _result(self, *, stopped: bool) -> TrainResult:
        return TrainResult(
            self.state.step,
            self.samples,
            self.state.history,
            self._last_checkpoint,
            stopped=stopped,
            ledger=self.loader.ledger,
            stopped_here=stopped and self.loader.stop.is_set(),
        )

    def _step(self, window: Window) -> None:
        links = [link for item in window.items for link in item.links if link is not None]
        ctx = StepContext(global_step=self.state.step, total_steps=self.total_steps)
        # the step continues the trace of its window's first item and links every item's
        with span("train_step", parent=links[0].context if links else None, links=links,
                  attributes={"step": self.state.step, "samples": len(window.items)}):  # fmt: skip
            device = self.parts.device
            batches = [batch.to(device, non_blocking=True) for batch in window.micro_batches]
            pending = launch_step(
                self.strategy, self.model, batches, self.optimizer, self.scheduler,
                grad_clip=self.cfg.grad_clip, step=ctx, autocast_dtype=self.parts.autocast_dtype,
                # the step's one all-reduce (ddp); FSDP reduce-scatters inside the backward
                reduce_gradients=None if self.sharded else average_gradients,
                weights=window.weights,  # the ragged last step's (None: a full window)
            )  # fmt: skip
            # The step is applied (queued on the device, in order: what reads the model runs
            # after it): record it (the window's keys were agreed before the step, on every
            # rank), then confirm it upstream. Nothing that can fail comes between. Its
            # tensors are freed once the GPU is done with it, in the next step's `_settle`.
            t_bus = time.perf_counter()
            self.state.step += 1
            self.loader.commit(window, release=False)
            bus_s = time.perf_counter() - t_bus
            # Only now wait for the previous step: this one is queued behind it, so the GPU
            # never drains between steps while the host plans, acks and logs.
            self._pending.append((self.state.step, pending, window))
            self._settle(keep=1 if self._overlap else 0)
        iv = self._interval
        iv["wait"] += window.wait_s
        iv["bus"] += bus_s
        iv["samples"] += len(window.items)
        iv["tokens"] += window.num_tokens
        iv["steps"] += 1

    def _report_first_step(self) -> None:
        if self.hooks.on_first_step is None:
            return
        try:
            self.hooks.on_first_step(self.state.step)
        except Exception as e:  # noqa: BLE001 - a report never stops training
            log.warning("could not report the first step %d: %s", self.state.step, e)

    def _settle(self, keep: int = 0) -> None:
        """Wait for the pending steps but the last `keep` (their figures reach the host), free
        their windows, and emit the log row they closed. With `keep=0`, everything trained is
        settled after it."""
        while len(self._pending) > keep:
            _, pending, window = self._pending.pop(0)
            result = pending.result()
            for k, v in {**result.metrics, "grad_norm": result.grad_norm}.items():
                self._window_metrics[k].append(_scalar(v))
            self.loader.release(window)
            if self.checkpoints is None:  # no checkpoint will ever cover it: free it now
                self.loader.checkpointed()
        self._emit_due_row()

    def _emit_due_row(self) -> None:
        """The closed interval's row, once every step it covers is settled."""
        due = self._due_row
        if due is not None and not (self._pending and self._pending[0][0] <= due["step"]):
            row, self._due_row = due, None
            row.update({k: sum(v) / len(v) for k, v in self._window_metrics.items() if v})
            self._window_metrics.clear()
            self.state.history.append(row)
            if self.hooks.on_log is not None and self.rank == 0:
                self.hooks.on_log(row)

    def _log(self) -> None:
        """Close the log interval: its row is emitted (history, `on_log`) with the interval's
        step figures once the last step is settled (at once when nothing is pending)."""
        iv = self._interval
        elapsed = max(time.perf_counter() - iv["t0"], 1e-9)
        row: dict[str, float] = {"step": float(self.state.step)}
        row["lr"] = float(self.optimizer.param_groups[0]["lr"])
        row["samples_per_s"] = iv["samples"] / elapsed  # this rank's
        # the world's: every rank trains the same number of samples per step (lockstep)
        world = torch.distributed.get_world_size() if distributed() else 1
        row["world_samples_per_s"] = row["samples_per_s"] * world
        row["world"] = float(world)
        row["tokens_per_s"] = iv["tokens"] / elapsed
        row["steps_per_s"] = iv["steps"] / elapsed
        row["data_wait_frac"] = iv["wait"] / elapsed
        row["bus_s_per_step"] = iv["bus"] / max(iv["steps"], 1)
        row["redeliveries"] = float(self.loader.stats["redeliveries"])
        row["duplicates"] = float(self.loader.stats["duplicates"])
        row.update({k: float(v) for k, v in self.loader.source.stats.items()})
        if self.hooks.lag is not None:
            lag = self.hooks.lag()
            row["lag_refs"] = float(lag.messages)
            row["lag_bytes"] = float(lag.bytes)
        usage = self.loader.source.usage()
        if usage is not None:
            row["store_bytes"] = float(usage.resident_bytes)
            row["store_peak_bytes"] = float(usage.peak_bytes)
        if torch.cuda.is_available():
            row["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        saved = self.checkpoints.last_save if self.checkpoints is not None else None
        if saved is not None:  # the last checkpoint: its step, write time and size
            row.update({f"checkpoint_{k}": v for k, v in saved.items()})
        self._due_row = row
        self._interval = self._new_interval()
        self._emit_due_row()

    def score(self) -> float | None:
        """Checkpoint score: the simulated acceptance length of the last interval, measured
        on windows before the model trained on them (progressive validation)."""
        for row in reversed(self.state.history):
            if "sim_accept_len" in row and not math.isnan(row["sim_accept_len"]):
                return row["sim_accept_len"]
        return None

    def _checkpoint_due(self) -> bool:
        """Every `checkpoint_every` steps, or early when the loader's source holds as much as
        it may for the next checkpoint (`Loader.checkpoint_due`: the same on every rank)."""
        if self.state.step % self.cfg.checkpoint_every == 0:
            return True
        if not self.loader.checkpoint_due:
            return False
        if self.rank == 0:
            log.info(
                "checkpoint at step %d, before checkpoint_every=%d: the %d steps since the last "
                "one hold %d bytes in the store until a checkpoint covers them (limit %d)",
                self.state.step, self.cfg.checkpoint_every,
                self.state.step - self._last_checkpoint_step, self.loader.held_bytes,
                self.loader.hold_limit_bytes,
            )  # fmt: skip
        return True

    def save(self) -> None:
        """Rank 0 writes the checkpoint; every rank agrees on the step before moving on, then
        lets its source free what it held for this checkpoint (the barrier comes after rank 0's
        write: past it, the checkpoint is on disk). Under FSDP every rank takes part in
        gathering the full state."""
        self._settle()  # the last step's row goes into the checkpoint's history
        if self.checkpoints is not None and (self.rank == 0 or self.sharded):
            state = self.state_dict()
            if self.rank == 0:
                path = self.checkpoints.save(self.state.step, state, score=self.score())
                self._last_checkpoint = str(path)
                self._announce_checkpoint(path)
        self._last_checkpoint_step = self.state.step
        if distributed():
            torch.distributed.barrier(group=control_group())
        self.loader.checkpointed()

    def _save_alone(self) -> None:
        """After a failure: save the last optimizer step when this rank can do so without its
        peers (the draft is replicated, not sharded). Every surviving rank tries, the first to
        claim the step writes it (`CheckpointManager.claim`: none when a checkpoint at or past
        it exists), so it is saved whichever rank died. Never raises."""
        if self.checkpoints is None or self.state.step in (0, self._last_checkpoint_step):
            return
        if self.sharded and distributed():
            if self.rank == 0:
                log.warning(
                    "step %d not saved after the failure: the sharded draft needs every rank "
                    "(the run resumes from step %d)", self.state.step, self._last_checkpoint_step
                )  # fmt: skip
            return
        try:
            if not self.checkpoints.claim(self.state.step):
                return  # another survivor saves it (or a checkpoint at or past it exists)
            path = self.checkpoints.save(self.state.step, self.state_dict(), score=self.score())
        except Exception as e:  # noqa: BLE001 - the original failure is what propagates
            log.warning("could not save step %d after the failure: %s", self.state.step, e)
            return
        self._last_checkpoint, self._last_checkpoint_step = str(path), self.state.step
        log.warning("rank %d saved the checkpoint of step %d after the failure: %s", self.rank,
                    self.state.step, path)  # fmt: skip
        self._announce_checkpoint(path)
        try:  # this rank's held tensors are covered now (the others' are swept at the resume)
            self.loader.checkpointed()
        except Exception as e:  # noqa: BLE001 - the original failure is what propagates
            log.warning("could not free the tensors held for step %d: %s", self.state.step, e)

    def _announce_checkpoint(self, path: Path) -> None:
        if self.hooks.on_checkpoint is None:
            return
        pointer = {"step": self.state.step, "path": str(path), "samples": self.samples,
                   "score": self.score(),
                   "floor": self.loader.ledger.cursor.floor}  # a resume replays above it  # fmt: skip
        try:
            self.hooks.on_checkpoint(pointer)
        except Exception as e:  # noqa: BLE001 - a pointer is advice; the checkpoint is on disk
            log.warning("could not publish the checkpoint pointer of step %d: %s",
                        self.state.step, e)  # fmt: skip
