"""Weights & Biases scalars of the trainer's log rows (rank 0), when `telemetry.wandb` is on.

The same scalars as TensorBoard, under the same tags (`core.tensorboard.tag_of`:
`train/loss`, `throughput/samples_per_s`, `bus/lag_refs`, ...) at the row's step, in one W&B
run named after the specbus run, with the run's config. Off by default, and optional: `pip
install specbus[wandb]` (W&B's client, no torch of its own). `telemetry.wandb_mode`:
`offline` (the default: the run is written under `<wandb_dir>/wandb/offline-run-*`, `wandb
sync` uploads it later; nothing leaves the machine) or `online` (needs `WANDB_API_KEY`).
`read_offline_scalars(run_dir)` reads an offline run's scalars back (tests, tools).
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import time
from pathlib import Path
from typing import Any

from specbus.core.tensorboard import tag_of

log = logging.getLogger("specbus.wandb")


class WandbWriter:
    """Writes log rows as W&B scalars (see the module doc)."""

    def __init__(self, directory: Path, *, project: str, name: str, mode: str,
                 entity: str | None = None, config: dict[str, Any] | None = None):  # fmt: skip
        os.environ.setdefault("WANDB_SILENT", "true")  # no banner in the trainer's console
        import wandb

        Path(directory).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=project, entity=entity, name=name, dir=str(directory),
                               mode=mode, config=config or {}, reinit="create_new")  # fmt: skip
        self.directory = Path(self._run.dir).parent  # the run's own directory

    def write(self, row: dict[str, Any], step: int | None = None) -> None:
        """Every scalar of `row` at `step` (default `row["step"]`)."""
        step = int(row.get("step", 0) if step is None else step)
        scalars = {}
        for key, value in row.items():
            tag = tag_of(key)
            if tag is None or not isinstance(value, int | float) or math.isnan(value):
                continue
            scalars[tag] = float(value)
        if scalars:
            self._run.log(scalars, step=step)

    def close(self) -> None:
        """Finish the run (flushes what is queued). Idempotent."""
        if self._run is not None:
            self._run.finish()
            self._run = None


def open_wandb(directory: Path, *, enabled: bool, project: str, name: str, mode: str,
               entity: str | None = None, config: dict[str, Any] | None = None,
               ) -> WandbWriter | None:  # fmt: skip
    """A writer, or None when disabled or `wandb` is not installed (said once: it is an
    optional extra, `pip install specbus[wandb]`)."""
    if not enabled:
        return None
    try:
        writer = WandbWriter(directory, project=project, name=name, mode=mode, entity=entity,
                             config=config)  # fmt: skip
    except ImportError:
        log.warning("telemetry.wandb is on but wandb is not installed: pip install specbus[wandb]")
        return None
    log.info("Weights & Biases run (%s) in %s", mode, writer.directory)
    return writer


# An offline run's `run-<id>.wandb` is a LevelDB-style log (32 KiB blocks; records of a 7-byte
# header: crc, length, type FULL/FIRST/MIDDLE/LAST) of `wandb_internal_pb2.Record`s, after a
# 7-byte file header (":W&B", magic, version).
_BLOCK, _HEADER = 32768, 7


def _records(data: bytes):
    pos, parts = _HEADER, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a header: padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # zero padding to the block's end
            pos += left
            continue
        if pos + 7 + length > len(data):  # a record still being written: the file's end
            return
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            parts = chunk
        elif kind == 3:
            parts += chunk
        elif kind == 4:
            yield parts + chunk
            parts = b""


def read_offline_scalars(run_dir: str | Path, *, wait_s: float = 0.0) -> list[dict[str, float]]:
    """The history rows (tag -> value, and `_step`) an offline W&B run directory holds. With
    `wait_s`, a finished run's: waits up to that long for the run's exit record and raises
    TimeoutError without it (W&B's service process writes the file's last records after
    `finish()` has returned in the run's process: ~40 ms later on a loaded 2-core machine, where
    an immediate read once found no history)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = Path(run_dir).glob("run-*.wandb")
    deadline = time.monotonic() + wait_s
    while True:
        rows, finished = [], False
        for raw in _records(path.read_bytes()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            finished |= kind == "exit"
            if kind == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})  # fmt: skip
        if finished or wait_s <= 0:
            return rows
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{path} has no exit record after {wait_s} s: the run is not finished"
            )
        time.sleep(0.05)
