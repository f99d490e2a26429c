"""TensorBoard scalars of the trainer's log rows (rank 0), when `tensorboard` is installed.

One event file under `telemetry.tensorboard_dir` (default `<run_dir>/tb`); every key of a log
row (docs/architecture.md, "Metrics") becomes a scalar at the row's step, grouped by what it
measures: `train/loss`, `train/acc_0`, `acceptance/sim_accept_len`, `optim/lr`,
`throughput/samples_per_s`, `time/data_wait_frac`, `store/resident_bytes`, `bus/lag_refs`,
`bus/dead_letters`, ... (`tag_of`). View them with `tensorboard --logdir <run_dir>/tb`.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger("specbus.tensorboard")

# key (or key prefix before `_<k>`) -> tag; anything else is `train/<key>`
_GROUPS: dict[str, str] = {
    "loss": "train/loss",
    "ploss": "train/ploss",
    "acc": "train/acc",
    "acceptance_rate": "acceptance/rate",
    "sim_accept_len": "acceptance/sim_accept_len",
    "lr": "optim/lr",
    "grad_norm": "optim/grad_norm",
    "samples_per_s": "throughput/samples_per_s",  # rank 0's own
    "world_samples_per_s": "throughput/world_samples_per_s",  # every rank's
    "tokens_per_s": "throughput/tokens_per_s",
    "steps_per_s": "throughput/steps_per_s",
    "data_wait_frac": "time/data_wait_frac",
    "bus_s_per_step": "time/bus_s_per_step",
    "store_bytes": "store/resident_bytes",
    "store_peak_bytes": "store/peak_bytes",
    "lag_refs": "bus/lag_refs",
    "lag_bytes": "bus/lag_bytes",
    "redeliveries": "bus/redeliveries",
    "duplicates": "bus/duplicates",
    "recaptures": "bus/recaptures",
    "dead_letters": "bus/dead_letters",
    "skipped": "bus/skipped",
    "missing": "bus/missing",
    "gpu_peak_gib": "device/gpu_peak_gib",
    # `specbus serve --speculative` (<tensorboard_dir>/serve): per request (step = requests
    # served) and per draft version (step = the version's checkpoint step)
    "request_accept_length": "served/request_accept_length",
    "request_tokens_per_s": "served/request_tokens_per_s",
    "draft_version": "served/draft_version",
    "served_accept_length": "served/accept_length_by_version",
    "served_tokens_per_s": "served/tokens_per_s_by_version",
    "served_requests": "served/requests_by_version",
    "checkpoint_step": "checkpoint/step",  # the last checkpoint's
    "checkpoint_seconds": "checkpoint/write_seconds",
    "checkpoint_bytes": "checkpoint/bytes",
    "checkpoint_lineage_bytes": "checkpoint/lineage_bytes",
}
_SKIP = {"step"}


def tag_of(key: str) -> str | None:
    """The TensorBoard tag of a log row's key (None: not a scalar of its own).

    Per-position keys keep their index (`acc_2` -> `train/acc_2`); the raw counts behind the
    accuracies (`correct_k`, `denom_k`) are left out."""
    if key in _SKIP or key.startswith(("correct_", "denom_")):
        return None
    if key in _GROUPS:
        return _GROUPS[key]
    head, _, tail = key.rpartition("_")
    if tail.isdigit() and head in _GROUPS:
        return f"{_GROUPS[head]}_{tail}"
    return f"train/{key}"


class ScalarWriter:
    """Writes log rows as scalars into one TensorBoard event file under `logdir`."""

    def __init__(self, logdir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = Path(logdir)
        self._writer = SummaryWriter(log_dir=str(self.logdir))

    def write(self, row: dict[str, Any], step: int | None = None, flush: bool = True) -> None:
        """Every scalar of `row` at `step` (default `row["step"]`), flushed to disk (unless
        `flush` is False: then within the writer's flush interval, or at `close`)."""
        step = int(row.get("step", 0) if step is None else step)
        for key, value in row.items():
            tag = tag_of(key)
            if tag is None or not isinstance(value, int | float) or math.isnan(value):
                continue
            self._writer.add_scalar(tag, float(value), step)
        if flush:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


def open_writer(logdir: Path, *, enabled: bool = True) -> ScalarWriter | None:
    """A writer for `logdir`, or None when disabled or `tensorboard` is not installed
    (said once, at INFO: it is optional, `pip install tensorboard`)."""
    if not enabled:
        return None
    try:
        writer = ScalarWriter(logdir)
    except ImportError:
        log.info("tensorboard is not installed: no TensorBoard scalars (pip install tensorboard)")
        return None
    log.info("TensorBoard scalars in %s (tensorboard --logdir %s)", logdir, logdir)
    return writer
