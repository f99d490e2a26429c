"""The launch environment of a capture layer inside a serving server (SGLang's plugin, vLLM's
connector): which intake, which token, the sample rate, the queue, the CA of an https intake.

A server is started with these variables (`specbus serve --engine sglang|vllm --dry-run` prints
them for a run); the layer builds its `CaptureSink` from them with `sink_from_env`. The intake's
URL and token are asked again at every handshake attempt, so an intake started later on the
same host (which writes both into `<run_dir>/live/intake.json`) is found without a restart.

- `SPECBUS_CAPTURE_INTAKE_URL` or `SPECBUS_CAPTURE_ENDPOINT` (the intake.json path): capture
  is on only when one is set (`configured`);
- `SPECBUS_INTAKE_TOKEN`: the bearer token (else the endpoint file's);
- `SPECBUS_CAPTURE_SAMPLE_RATE`: the launch-time rate of user requests (`launch_rate`; the
  same on every rank; driven requests are always captured);
- `SPECBUS_CAPTURE_QUEUE`: captures waiting for the sink's writer at most;
- `SPECBUS_CAPTURE_TLS_CA`: the CA file of an https intake.
"""

from __future__ import annotations

import json
import os
import socket

ENV_URL, ENV_ENDPOINT = "SPECBUS_CAPTURE_INTAKE_URL", "SPECBUS_CAPTURE_ENDPOINT"
ENV_RATE, ENV_TOKEN = "SPECBUS_CAPTURE_SAMPLE_RATE", "SPECBUS_INTAKE_TOKEN"
ENV_QUEUE, ENV_CA = "SPECBUS_CAPTURE_QUEUE", "SPECBUS_CAPTURE_TLS_CA"


def configured() -> bool:
    """Whether the environment asks for capture (an intake URL or an intake.json path)."""
    return bool(os.environ.get(ENV_URL) or os.environ.get(ENV_ENDPOINT))


def launch_rate(default: float = 1.0) -> float:
    """The launch-time sample rate of user requests."""
    return float(os.environ.get(ENV_RATE, default))


def _endpoint() -> dict:
    path = os.environ.get(ENV_ENDPOINT)
    if not path:
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def intake_url() -> str | None:
    """The intake's URL now: the variable, else the endpoint file's."""
    return os.environ.get(ENV_URL) or _endpoint().get("url")


def intake_token() -> str | None:
    """The intake's token now: the variable, else the endpoint file's."""
    return os.environ.get(ENV_TOKEN) or _endpoint().get("token")


def tls_verify():
    """httpx's `verify` for the intake: an SSL context of the CA file, or True (system CAs)."""
    ca = os.environ.get(ENV_CA)
    if not ca:
        return True
    import ssl

    return ssl.create_default_context(cafile=ca)


def sink_from_env(engine: str):
    """A started `CaptureSink` of this server process, configured from the environment."""
    from specbus.producers.live.sink import CaptureSink

    return CaptureSink(
        intake_url, intake_token, server_id=f"{socket.gethostname()}-{os.getpid()}",
        engine=engine, queue_size=int(os.environ.get(ENV_QUEUE, "32")), verify=tls_verify(),
    ).start()  # fmt: skip
