"""The run config's `telemetry` section (a module of its own: core/config.py stays under the
size limit): logs, traces, TensorBoard, Weights & Biases, Prometheus `/metrics`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from specbus.core.config_methods import Section


class TelemetryConfig(Section):
    """Logs and traces: OpenTelemetry exporters come from the standard OTEL_* variables."""

    service_name: str = "specbus"
    # TensorBoard scalars of rank 0's log rows, when `tensorboard` is installed (core/tensorboard.py)
    tensorboard: bool = True
    tensorboard_dir: Path | None = None  # None: <run_dir>/tb
    otel: bool = True  # exporters come from the standard OTEL_* environment variables
    # Weights & Biases: the same scalars as TensorBoard (core/wandb_log.py); off by default,
    # `pip install specbus[wandb]`. offline: written under <wandb_dir>/wandb (`wandb sync`
    # uploads it); online: needs WANDB_API_KEY.
    wandb: bool = False
    wandb_project: str = "specbus"
    wandb_entity: str | None = None
    wandb_mode: Literal["offline", "online"] = "offline"
    wandb_dir: Path | None = None  # None: <run_dir>
    # Prometheus `/metrics` of trainer rank 0, the producers and the feeder (ops/metrics_http.py;
    # the intake and serve answer it on their own port): 0 a free port, announced for file-based
    # discovery in <run_dir>/metrics/<role>-<pid>.json; None: none; a port: that one (one such
    # process per host).
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = Field(0, ge=0, le=65535)
