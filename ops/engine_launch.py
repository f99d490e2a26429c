"""What starting a stock serving engine (SGLang, vLLM) with specbus's capture layer shares:
the layer's environment, the command printed with the intake's token hidden, and the exec.

The layer in the server (`patches/`) reads its settings from the environment
(`producers/live/sink_env.py`): the sample rate, its queue, where the intake is (`live.url`
or the `--intake-url`, else the endpoint file the intake writes on this host, read at every
handshake, so the two start in any order) and the CA of an HTTPS intake. The token travels
in the environment too, never on the printed command line.
"""

from __future__ import annotations

import os
import shlex

from specbus.core.config import RunConfig
from specbus.ops.intake_endpoint import TOKEN_ENV, endpoint_file
from specbus.producers.live import sink_env


def capture_environment(cfg: RunConfig, *, sample_rate: float, intake_url: str | None) -> dict:
    """The capture layer's environment for a server of `cfg`'s run (module doc)."""
    env = {sink_env.ENV_RATE: f"{sample_rate:g}", sink_env.ENV_QUEUE: str(cfg.live.queue)}
    url = intake_url or cfg.live.url
    if url:
        env[sink_env.ENV_URL] = url
    else:  # same host: the intake's URL and token file (read at every handshake)
        env[sink_env.ENV_ENDPOINT] = str(endpoint_file(cfg))
    if cfg.live.tls_ca:
        env[sink_env.ENV_CA] = str(cfg.live.tls_ca)
    return env


def _token(cfg: RunConfig, token: str | None) -> str | None:
    """The intake's token the server gets: `--token`, `live.token`, else the environment's."""
    return token or cfg.live.token or os.environ.get(TOKEN_ENV)


def print_command(cfg: RunConfig, env: dict, argv: list[str], token: str | None) -> None:
    """The server's command line as a shell would run it, the token shown as a placeholder
    (when one will be passed: given, configured, or inherited for a remote intake)."""
    shown = dict(env)
    if token or cfg.live.token or (env.get(sink_env.ENV_URL) and TOKEN_ENV in os.environ):
        shown[TOKEN_ENV] = "<the intake's token>"  # never printed
    print(" ".join(f"{k}={shlex.quote(v)}" for k, v in shown.items()), shlex.join(argv), flush=True)


def exec_server(exe: str, argv: list[str], env: dict, cfg: RunConfig, token: str | None) -> None:
    """Replace this process with the server (`exe`, `argv`), the capture environment and the
    token added to ours. Does not return."""
    secret = _token(cfg, token)
    os.execve(exe, argv, {**os.environ, **env, **({TOKEN_ENV: secret} if secret else {})})
