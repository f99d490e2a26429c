"""Where a run's serving servers and producers find its intake, and what a driven run is.

On one host with no configuration: the intake (`specbus intake`, ops/live.py) writes
`<run_dir>/live/intake.json` (its URL and bearer token, mode 0600: `write_endpoint`) when it
starts; `specbus serve` with the same run config reads it (`read_endpoint`, again at every
handshake attempt, so the two start in any order), and so does a driven run's producer; a
stock SGLang or vLLM server is pointed at the file (`endpoint_file`). Across hosts: `live.url`
and `live.token` (or `$SPECBUS_INTAKE_TOKEN`) on both sides. The token (`intake_token`):
`live.token`, else `$SPECBUS_INTAKE_TOKEN`, else the one in intake.json from an earlier start
(a restarted intake keeps it: running servers go on), else a new random one.

A driven run (`is_driven`: a feeder's tasks, captured by a serving SGLang or vLLM server) has
an intake that takes driven captures only (its handshake's sample rate 0, other records
refused); its vLLM server is started with sample rate 0 (ops/vllm.py).
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from specbus.core.config import RunConfig

TOKEN_ENV = "SPECBUS_INTAKE_TOKEN"
DRIVEN_ENGINES = ("sglang_server", "vllm_server")  # target engines that drive a serving server


def endpoint_file(cfg: RunConfig) -> Path:
    """Where the intake writes its URL and token: `<run_dir>/live/intake.json`."""
    return cfg.resolved_run_dir / "live" / "intake.json"


def read_endpoint(cfg: RunConfig) -> dict[str, Any] | None:
    """The intake's `{"url", "token"}` of this run on this host, or None (not written yet)."""
    try:
        return json.loads(endpoint_file(cfg).read_text())
    except (OSError, ValueError):
        return None


def intake_token(cfg: RunConfig) -> str:
    """The intake's bearer token (see module doc)."""
    if cfg.live.token:
        return cfg.live.token
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    known = read_endpoint(cfg)
    if known and known.get("token"):
        return known["token"]
    return secrets.token_urlsafe(32)


def write_endpoint(cfg: RunConfig, url: str, token: str) -> Path:
    """Write the intake's URL and token (atomically, mode 0600); returns the file."""
    path = endpoint_file(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": url, "token": token, "pid": os.getpid(), "run": cfg.run}, f)
    os.replace(tmp, path)
    return path


def is_driven(cfg: RunConfig) -> bool:
    """A driven run: tasks from a feeder, captured by a serving SGLang or vLLM server
    (docs/sglang.md, docs/vllm.md)."""
    return cfg.deployment.mode == "disaggregated" and cfg.target.engine in DRIVEN_ENGINES
