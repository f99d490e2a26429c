"""Checkpoints: full resume state, atomic writes, rotation, `latest` and `best`.

A checkpoint is a directory `step-XXXXXXXX/` holding `state.pt` (model, optimizer,
scheduler, RNG, step, the ledger: SAMPLES cursor, settled tasks, recent ids, and how much of
the lineage file is its lineage) and `meta.json` (step, score, plan). The lineage file
(`lineage.jsonl`, consumers/lineage.py) sits beside the checkpoints: `save` appends the ids
trained since the last one before writing `state.pt`. The
`plan` is the part of the run config a resume must agree with (strategy, draft, target
fingerprint, data, batch geometry, world size): `load()` refuses a checkpoint whose plan
differs and names the differing keys, so a resume never silently trains something else.
Writes go to a temporary directory renamed into place; `latest`/`best` are small files
replaced atomically; everything is fsynced before `save` returns (a live run frees trained
tensors once a checkpoint covers them: it must survive the host). A kill at any moment leaves
the previous checkpoint intact.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from specbus.consumers import lineage
from specbus.core.errors import CheckpointError


def _fsync(path: Path) -> None:
    """Flush a file's or a directory's (its entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    _fsync(tmp)
    os.replace(tmp, path)
    _fsync(path.parent)


def rng_state() -> dict[str, Any]:
    """This process's RNG states (torch, python, numpy, CUDA when present)."""
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def plan_diff(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two plans, with both values."""
    diffs = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += plan_diff(a, b, name + ".")
        elif a != b:
            diffs.append(f"{name}: checkpoint has {a!r}, this run has {b!r}")
    return diffs


class CheckpointManager:
    """Checkpoints of one run under `directory` (see the module doc); `plan` is what a resume must
    agree with, `keep` how many to keep (latest and best always are)."""

    def __init__(self, directory: str | Path, plan: dict[str, Any], keep: int = 3):
        self.directory = Path(directory)
        self.plan = json.loads(json.dumps(plan, default=str))  # what meta.json will hold
        self.keep = keep
        # the last save: step, seconds, bytes of its directory, the lineage file's length
        self.last_save: dict[str, float] | None = None

    @property
    def lineage_path(self) -> Path:
        """The lineage file of these checkpoints."""
        return self.directory / lineage.LINEAGE_FILE

    def _append_lineage(self, state: dict[str, Any]) -> dict[str, Any]:
        """Append the ledger's new ids to the lineage file (cut at the previous checkpoint's
        length first: a save killed after its append left lines no checkpoint counts); the
        state to write, which counts them instead of holding them."""
        lin = state.get("lineage")
        if not isinstance(lin, dict) or "append" not in lin:
            return state
        base_count, base_bytes = lin["base"]
        end = lineage.append(self.lineage_path, int(base_bytes), lin["append"])
        if end != lin["bytes"] or base_count + len(lin["append"]) != lin["count"]:
            raise CheckpointError(f"lineage file {self.lineage_path}: {end} bytes written, the "
                                  f"ledger counts {lin['bytes']}")  # fmt: skip
        kept = {"file": lin["file"], "count": lin["count"], "bytes": end}
        return {**state, "lineage": kept}

    def save(self, step: int, state: dict[str, Any], score: float | None = None) -> Path:
        """Write a checkpoint for `step`; update `latest` (and `best` when `score` is higher)."""
        t0 = time.perf_counter()
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"step-{step:08d}"
        final = self.directory / name
        tmp = self.directory / f".{name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        state = self._append_lineage(state)
        torch.save(state, tmp / "state.pt")
        (tmp / "meta.json").write_text(
            json.dumps(
                {"step": step, "samples": state.get("samples"), "score": score, "plan": self.plan},
                indent=1,
            )  # fmt: skip
        )
        for path in (tmp / "state.pt", tmp / "meta.json", tmp):
            _fsync(path)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        current = self.latest_step()
        if current is None or step >= current:  # never back (survivors a step apart, see claim)
            _atomic_write(self.directory / "latest", name)
        best = self._meta(self.directory / "best")
        if score is not None and (
            best is None or best.get("score") is None or score > best["score"]
        ):
            _atomic_write(self.directory / "best", name)
        self._rotate()
        lin = state.get("lineage")
        self.last_save = {
            "step": float(step),
            "seconds": time.perf_counter() - t0,
            "bytes": float(sum(p.stat().st_size for p in final.iterdir())),
            "lineage_bytes": float(lin["bytes"]) if isinstance(lin, dict) else 0.0,
        }
        return final

    def latest_meta(self) -> dict[str, Any] | None:
        """The `latest` checkpoint's meta.json (step, samples, score, plan); None when there
        is none."""
        return self._meta(self.directory / "latest")

    def latest_step(self) -> int | None:
        """The step of the `latest` checkpoint (None when there is none)."""
        pointer = self.directory / "latest"
        try:
            return int(pointer.read_text().strip().split("-")[1])
        except (OSError, IndexError, ValueError):
            return None

    def claim(self, step: int) -> bool:
        """Whether this process is the one to save `step` after a failure: no checkpoint at or
        past it exists, and no other process claimed it (the claim is a directory created
        atomically, so of several surviving ranks exactly one saves, and a survivor that is a
        step behind another never moves `latest` back)."""
        latest = self.latest_step()
        if latest is not None and latest >= step:
            return False
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(self.directory / f".claim-step-{step:08d}")
        except FileExistsError:
            return False
        return True

    def _meta(self, pointer: Path) -> dict[str, Any] | None:
        try:
            return json.loads(
                (self.directory / pointer.read_text().strip() / "meta.json").read_text()
            )
        except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
            return None

    def _rotate(self) -> None:
        protected = {
            p.read_text().strip()
            for p in (self.directory / "latest", self.directory / "best")
            if p.exists()
        }
        steps = sorted(p for p in self.directory.glob("step-*") if p.is_dir())
        for old in steps[: max(0, len(steps) - self.keep)]:
            if old.name not in protected:
                shutil.rmtree(old, ignore_errors=True)
        latest = self.latest_step()
        for claim in self.directory.glob(".claim-step-*"):  # claims of saved or older steps
            with contextlib.suppress(ValueError, OSError):
                if latest is not None and int(claim.name.rsplit("-", 1)[1]) <= latest:
                    claim.rmdir()

    def resolve(self, which: str | Path = "latest") -> Path | None:
        """`latest`, `best`, or a checkpoint directory -> its path (None when there is none)."""
        if str(which) in ("latest", "best"):
            pointer = self.directory / str(which)
            return self.directory / pointer.read_text().strip() if pointer.exists() else None
        return Path(which)

    def load(
        self, which: str | Path = "latest", map_location: str | torch.device = "cpu"
    ) -> dict[str, Any]:
        """Load a checkpoint's state. Raises CheckpointError if absent, corrupt, or of another plan."""
        path = self.resolve(which)
        if path is None or not (path / "state.pt").exists():
            raise CheckpointError(f"no checkpoint {str(which)!r} under {self.directory}")
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"checkpoint {path} has no readable meta.json") from e
        diffs = plan_diff(meta.get("plan", {}), self.plan)
        if diffs:
            raise CheckpointError(
                f"refusing to resume from {path}: its run plan differs from this run's:\n  "
                + "\n  ".join(diffs)
                + "\nStart a new run (another run name or checkpoint dir), or restore the original settings."
            )
        try:
            return torch.load(path / "state.pt", map_location=map_location, weights_only=False)
        except Exception as e:
            raise CheckpointError(f"checkpoint {path}/state.pt cannot be read: {e}") from e


def frozen_names(model: torch.nn.Module) -> set[str]:
    """The state-dict names of `model`'s frozen parameters (e.g. EAGLE3's copy of the
    target's embedding): rebuilt from the target, never saved."""
    return {name for name, p in model.named_parameters() if not p.requires_grad}


def trainable_state(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """`state` (a full model state dict of `model`) without its frozen parameters."""
    frozen = frozen_names(model)
    return {k: v for k, v in state.items() if k not in frozen}


def with_frozen_state(model: torch.nn.Module, saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's model state completed with `model`'s own frozen parameters (loaded from
    the target when it was built), full tensors (collective under FSDP: every rank calls it)."""
    missing = sorted(frozen_names(model) - set(saved))
    if not missing:
        return saved
    own = model.state_dict()
    full = dict(saved)
    for name in missing:
        value = own[name]
        full[name] = value.full_tensor() if hasattr(value, "full_tensor") else value
    return full
