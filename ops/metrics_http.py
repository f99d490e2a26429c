"""`/metrics` of the long-running processes with no HTTP server of their own: trainer rank 0,
the producers, the feeder while it runs (the intake and `specbus serve` answer `/metrics` on
their own port).

`serve_metrics(metrics, cfg, role)` serves a `core.prometheus.Metrics` registry (plus the
process's own `process_*` series: RSS, open fds, CPU seconds) with prometheus-client's HTTP
server on `telemetry.metrics_host` (loopback by default) and `telemetry.metrics_port` (0: a
free port; None: none), and announces it for Prometheus' file-based discovery in
`<run_dir>/metrics/<role>-<pid>.json` (`file_sd_configs`: `[{"targets": ["127.0.0.1:P"],
"labels": {"run", "role"}}]`), removed at `close()`.

`RowCollector` turns the trainer's log row (the TensorBoard scalars) into Prometheus series
at scrape time: counts are `specbus_trainer_<what>_total`, rates `_per_second`, times
`_seconds`, sizes `_bytes`, fractions `_ratio`, the per-position ones labelled
`position="k"` (`ROW_SERIES`; docs/architecture.md, "Metrics").
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from prometheus_client import ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from specbus.core.config import RunConfig
from specbus.core.prometheus import Metrics

log = logging.getLogger("specbus.metrics")

# log row key -> (series name without the process prefix, kind, scale, help)
ROW_SERIES: dict[str, tuple[str, str, float, str]] = {
    "step": ("steps", "counter", 1.0, "optimizer steps taken"),
    "loss": ("loss", "gauge", 1.0, "training loss (mean over the log interval)"),
    "sim_accept_len": ("simulated_acceptance_length", "gauge", 1.0,
                       "simulated acceptance length, on windows before training on them"),
    "lr": ("learning_rate", "gauge", 1.0, "learning rate"),
    "grad_norm": ("grad_norm", "gauge", 1.0, "gradient norm before clipping"),
    "samples_per_s": ("samples_per_second", "gauge", 1.0, "rank 0's samples per second"),
    "world_samples_per_s": ("world_samples_per_second", "gauge", 1.0, "every rank's samples per second"),
    "tokens_per_s": ("tokens_per_second", "gauge", 1.0, "rank 0's tokens per second"),
    "steps_per_s": ("steps_per_second", "gauge", 1.0, "optimizer steps per second"),
    "data_wait_frac": ("data_wait_ratio", "gauge", 1.0, "fraction of the time waiting for data"),
    "bus_s_per_step": ("bus_seconds_per_step", "gauge", 1.0, "gather and confirmed ack per step"),
    "redeliveries": ("redeliveries", "counter", 1.0, "deliveries that were redeliveries"),
    "duplicates": ("duplicates", "counter", 1.0, "deliveries settled as already trained"),
    "recaptures": ("recaptures", "counter", 1.0, "recaptures asked for (tensors gone)"),
    "dead_letters": ("dead_letters", "counter", 1.0, "refs dead-lettered by the trainers"),
    "skipped": ("skipped", "counter", 1.0, "refs skipped at take time (already trained)"),
    "missing": ("missing", "counter", 1.0, "recorded samples whose features were missing"),
    "store_bytes": ("store_resident_bytes", "gauge", 1.0, "store residency"),
    "store_peak_bytes": ("store_peak_bytes", "gauge", 1.0, "store residency peak"),
    "lag_refs": ("lag_refs", "gauge", 1.0, "the trainers' lag in refs"),
    "lag_bytes": ("lag_bytes", "gauge", 1.0, "the trainers' lag in bytes of tensors"),
    "gpu_peak_gib": ("gpu_peak_bytes", "gauge", float(1 << 30), "accelerator peak memory"),
    "checkpoint_step": ("checkpoint_step", "gauge", 1.0, "the last checkpoint's step"),
    "checkpoint_seconds": ("checkpoint_write_seconds", "gauge", 1.0, "the last checkpoint's write time"),
    "checkpoint_bytes": ("checkpoint_bytes", "gauge", 1.0, "the last checkpoint's size"),
    "checkpoint_lineage_bytes": ("lineage_file_bytes", "gauge", 1.0, "the lineage file's length"),
}  # fmt: skip
# per-position keys: key prefix -> (series, help)
POSITION_SERIES = {
    "ploss": ("position_loss", "loss per TTT position / block position"),
    "acc": ("position_accuracy", "accuracy per position"),
    "acceptance_rate": ("acceptance_rate", "simulated acceptance rate per position"),
}
_POSITION = re.compile(r"^(ploss|acc|acceptance_rate)_(\d+)$")
_SKIP = re.compile(r"^(correct|denom)_\d+$")  # the raw counts behind the accuracies


def series_name(prefix: str, key: str) -> tuple[str, str, float] | None:
    """(name, kind, scale) of a log row key's series (None: not one of its own)."""
    if _SKIP.match(key) or _POSITION.match(key):
        return None
    if key in ROW_SERIES:
        name, kind, scale, _ = ROW_SERIES[key]
        return f"{prefix}_{name}", kind, scale
    return f"{prefix}_{re.sub(r'[^a-zA-Z0-9_]', '_', key)}", "gauge", 1.0


class RowCollector:
    """The series of the latest log row `row()` returns (None: no row yet), at scrape time."""

    def __init__(self, prefix: str, row: Callable[[], dict[str, float] | None]):
        self.prefix, self.row = prefix, row

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable:
        row = self.row() or {}
        positions: dict[str, list[tuple[str, float]]] = {}
        for key, value in sorted(row.items()):
            if not isinstance(value, int | float) or value != value:  # NaN: unknown
                continue
            if m := _POSITION.match(key):
                positions.setdefault(m.group(1), []).append((m.group(2), float(value)))
                continue
            named = series_name(self.prefix, key)
            if named is None:
                continue
            name, kind, scale = named
            doc = ROW_SERIES[key][3] if key in ROW_SERIES else f"log row key {key}"
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc)
            family.add_metric([], float(value) * scale)
            yield family
        for head, values in positions.items():
            name, doc = POSITION_SERIES[head]
            family = GaugeMetricFamily(f"{self.prefix}_{name}", doc, labels=["position"])
            for position, value in values:
                family.add_metric([position], value)
            yield family


class MetricsServer:
    """A running `/metrics` endpoint and its discovery file (see the module doc)."""

    def __init__(self, server: Any, thread: Any, url: str, announce: Path | None):
        self._server, self._thread, self.url, self.announce = server, thread, url, announce

    def close(self) -> None:
        """Stop serving and remove the discovery file. Idempotent."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self.announce is not None:
            self.announce.unlink(missing_ok=True)
            self.announce = None


def with_process(metrics: Metrics) -> Metrics:
    """Add this process's `process_*` series (RSS, open fds, CPU seconds, start time)."""
    ProcessCollector(registry=metrics.registry)
    return metrics


def announce(cfg: RunConfig, role: str, url: str) -> Path | None:
    """Write the file-based discovery entry of `role`'s `/metrics` at `url` (best effort)."""
    host_port = url.split("://", 1)[-1].split("/", 1)[0]
    path = cfg.resolved_run_dir / "metrics" / f"{role}-{os.getpid()}.json"
    entry = [{"targets": [host_port], "labels": {"run": cfg.run, "role": role}}]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(entry))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not announce %s's /metrics in %s: %s", role, path, e)
        return None
    return path


def serve_metrics(metrics: Metrics, cfg: RunConfig, role: str) -> MetricsServer | None:
    """Serve `metrics` (with the process series) at `/metrics` (see the module doc); None when
    `telemetry.metrics_port` is None. A port that cannot be bound is logged, never fatal."""
    from prometheus_client import start_http_server

    t = cfg.telemetry
    if t.metrics_port is None:
        return None
    with_process(metrics)
    try:
        server, thread = start_http_server(t.metrics_port, addr=t.metrics_host,
                                           registry=metrics.registry)  # fmt: skip
    except OSError as e:
        log.warning("no /metrics for %s: cannot bind %s:%s: %s", role, t.metrics_host,
                    t.metrics_port, e)  # fmt: skip
        return None
    host, port = server.server_address[:2]
    url = f"http://{host}:{port}/metrics"
    log.info("%s metrics at %s", role, url)
    return MetricsServer(server, thread, url, announce(cfg, role, url))
