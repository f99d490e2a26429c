"""What rank 0 reports each log interval besides the console: TensorBoard scalars
(core/tensorboard.py), Weights & Biases scalars (core/wandb_log.py, `telemetry.wandb`), the
same as Prometheus series at its `/metrics` (ops/metrics_http.py, `telemetry.metrics_port`)
and the run's progress in its KV (read by `specbus top`).

`reporter(cfg, on_log, rank, ...)` composes them into the trainer's `on_log` hook; neither can
stop training (a failed write is logged once; a progress write never waits for the broker).

Beside the console line, `specbus train` appends each row to `<run_dir>/logs/metrics.jsonl`
(`MetricsFile`, ending with a "final" row); the demo and tests read it back (`read_metrics`).
"""

from __future__ import annotations

import atexit
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from specbus.core.config import RunConfig
from specbus.core.tensorboard import open_writer
from specbus.core.wandb_log import open_wandb

log = logging.getLogger("specbus.train")

Row = dict[str, float]


def reporter(
    cfg: RunConfig,
    on_log: Callable[[Row], None] | None,
    rank: int,
    *,
    loop: Any = None,
    run: Any = None,
) -> Callable[[Row], None] | None:
    """`on_log` plus, on rank 0, TensorBoard scalars (`telemetry.tensorboard`, when installed)
    and, with a bus (`loop`, `run`), the row as the run's progress in the KV."""
    if rank != 0:
        return on_log
    writer = open_writer(cfg.resolved_tensorboard_dir, enabled=cfg.telemetry.tensorboard)
    wandb = _wandb(cfg)
    progress = _ProgressWriter(loop, run) if run is not None else None
    failed: set[str] = set()
    last: dict[str, Row] = {}
    _metrics(cfg, lambda: last.get("row"))

    def report(row: Row) -> None:
        last["row"] = row  # what /metrics serves until the next one
        if on_log is not None:
            on_log(row)
        for name, sink in (("tensorboard", writer), ("wandb", wandb), ("progress", progress)):
            if sink is None:
                continue
            try:
                sink.write(row)
            except Exception as e:  # noqa: BLE001 - reporting never stops training
                if name not in failed:
                    failed.add(name)
                    log.warning("could not write %s: %s", name, e)

    return report


def _wandb(cfg: RunConfig) -> Any:
    """The W&B writer of `telemetry.wandb` (None: off, not installed, or it failed to start:
    reporting never stops training), finished at exit."""
    t = cfg.telemetry
    if not t.wandb:
        return None
    try:
        writer = open_wandb(t.wandb_dir or cfg.resolved_run_dir, enabled=True,
                            project=t.wandb_project, entity=t.wandb_entity, name=cfg.run,
                            mode=t.wandb_mode, config=cfg.model_dump(mode="json"))  # fmt: skip
    except Exception as e:  # noqa: BLE001 - a tracker that cannot start is logged, not fatal
        log.warning("could not start the Weights & Biases run: %s", e)
        return None
    if writer is not None:
        _TRACKERS.append(writer)
    return writer


def _metrics(cfg: RunConfig, row: Callable[[], Row | None]) -> None:
    """Trainer rank 0's `/metrics`: the last log row's scalars as Prometheus series
    (ops/metrics_http.py), closed at exit."""
    from specbus.core.prometheus import Metrics
    from specbus.ops.metrics_http import RowCollector, serve_metrics

    metrics = Metrics()
    metrics.registry.register(RowCollector("specbus_trainer", row))
    server = serve_metrics(metrics, cfg, "trainer")
    if server is not None:
        _TRACKERS.append(server)


_TRACKERS: list[Any] = []  # W&B runs and /metrics servers this process opened: closed at exit


@atexit.register
def finish_trackers() -> None:
    """Finish the W&B runs and stop the `/metrics` servers this process opened (at exit; an
    in-process caller that is done with a run, a test, may call it earlier). Idempotent."""
    while _TRACKERS:
        try:
            _TRACKERS.pop().close()
        except Exception as e:  # noqa: BLE001 - the process is ending anyway
            log.warning("could not finish the Weights & Biases run: %s", e)


class _ProgressWriter:
    """Puts each row into the run's KV from the bus loop, one write in flight at most (during a
    broker outage rows are dropped, not queued)."""

    def __init__(self, loop: Any, run: Any):
        self.loop, self.run = loop, run
        self._pending: Future | None = None

    def write(self, row: Row) -> None:
        if self._pending is not None and not self._pending.done():
            return
        self._pending = self.loop.submit(self.run.kv.put_progress({**row, "time": time.time()}))


def samples_rate(row: dict[str, float]) -> str:
    """The world's samples/s of a log row, with the rank's own beside it on several ranks."""
    mine = row["samples_per_s"]
    world = row.get("world_samples_per_s", mine)
    if abs(world - mine) <= 1e-9 * max(world, 1.0):
        return f"{mine:.1f} samples/s"
    return f"{world:.1f} samples/s ({mine:.1f}/rank)"


def tensorboard_hint(cfg: RunConfig) -> str | None:
    """The command that shows the run's TensorBoard scalars (None when none are written)."""
    import importlib.util

    if not cfg.telemetry.tensorboard or importlib.util.find_spec("tensorboard") is None:
        return None
    return f"TensorBoard: tensorboard --logdir {cfg.resolved_tensorboard_dir}"


METRICS_FILE = "metrics.jsonl"  # <run_dir>/logs/: rank 0's log rows, then a "final" row


class MetricsFile:
    """Rank 0's log rows as JSON lines (appended: a resumed run continues the file); the demo
    reads them for its progress and summary."""

    def __init__(self, path):
        self.path = path

    def write(self, row: dict) -> None:
        """Append one row (best effort: a full disk must not stop training)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        except OSError as e:
            log.warning("could not write %s: %s", self.path, e)


def read_metrics(path) -> list[dict]:
    """The rows of a metrics file (a torn last line is skipped); [] when there is none."""
    rows = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return rows
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows
