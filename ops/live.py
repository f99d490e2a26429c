"""Live mode's composition roots and commands: `specbus intake`, `specbus serve`, `specbus traffic`.

- `run_intake(cfg, bus_url)`: connect and declare the run, write the live manifest (vocab
  prior from `live.vocab_source`, the capture handshake), hold the run's store open, serve the
  intake on `live.host:live.port` until SIGINT/SIGTERM. A driven run (`deployment.mode:
  disaggregated`, `target.engine: sglang_server`, docs/sglang.md): the feeder owns the
  manifest; the intake waits for it, checks its plan is this config's, and serves driven
  captures only (handshake rate 0, other records refused).
- `run_serve(cfg, ...)`: the hf engine behind the OpenAI-compatible server, capturing through a
  `CaptureSink` pointed at the intake (`--no-capture`: none); with `--speculative` it decodes with the run's draft, reloaded at every checkpoint
  (`ops/reload.py`, `producers/live/speculative.py`), its served acceptance in `/metrics` and
  TensorBoard (`<tensorboard_dir>/serve`).
- `specbus traffic`: `ops/traffic.py`.

Where serving servers find the intake and its token, and what a driven run is:
`ops/intake_endpoint.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from specbus.core.config import RunConfig
from specbus.core.errors import ConfigError
from specbus.ops.args import add_common, config_of, resolve_url
from specbus.ops.intake_endpoint import (
    TOKEN_ENV,
    intake_token,
    is_driven,
    read_endpoint,
    write_endpoint,
)

log = logging.getLogger("specbus.live")


def trusting(ca: Path | None):
    """httpx's `verify` for an https intake: a context trusting `ca`, or the system's CAs."""
    import ssl

    return ssl.create_default_context(cafile=str(ca)) if ca else True


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready socket (SO_REUSEADDR: a restart right after a kill -9 rebinds)."""
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and an
    # accepted connection inherits it; without, every answer waited ~40 ms (Nagle + delayed ACK)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e}") from e
    return sock


# An idle keep-alive connection is closed by the server only after the clients' pools let go
# of it: httpx (the openai client) reuses a connection idle up to 5 s, aiohttp 15 s. uvicorn's
# default, 5 s, races httpx's: a request sent on a connection the server is closing fails
# with "Server disconnected" (a user-visible APIConnectionError, seen in CI's closed loop).
KEEP_ALIVE_S = 75


def http_config(app, tls: tuple[Path, Path] | None = None):
    """The uvicorn config of the intake and `specbus serve` (quiet, keep-alive above the
    clients', a 5 s graceful stop). `tls`: (certificate, key) to serve HTTPS."""
    import uvicorn

    cert, key = tls if tls else (None, None)
    return uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                          timeout_graceful_shutdown=5, timeout_keep_alive=KEEP_ALIVE_S,
                          ssl_certfile=cert, ssl_keyfile=key)  # fmt: skip


async def _serve_http(app, sock: socket.socket, tls: tuple[Path, Path] | None = None) -> None:
    """uvicorn on `sock` until SIGINT/SIGTERM: a graceful stop (a second signal: at once),
    then the caller's cleanup runs (uvicorn's own handlers would re-raise the signal after
    its shutdown, killing the process before it). `tls`: (certificate, key) to serve HTTPS."""
    import contextlib
    import signal

    import uvicorn

    server = uvicorn.Server(http_config(app, tls))
    server.capture_signals = contextlib.nullcontext  # ours, below

    def stop() -> None:
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    try:
        await server.serve(sockets=[sock])
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def float_dtype(cfg: RunConfig) -> str:
    """The float dtype of captured features: the engine's (auto: bf16 on GPU, fp32 on CPU)."""
    from specbus.producers.engines.hf import resolve_device, resolve_dtype

    dtype = resolve_dtype(cfg.target.dtype, resolve_device(cfg.target.device))
    return str(dtype).removeprefix("torch.")


async def run_intake(cfg: RunConfig, *, bus_url: str | None, host: str | None = None,
                     port: int | None = None) -> int:  # fmt: skip
    """`specbus intake` (module doc). Returns the exit code."""
    from specbus.bus.connection import connect
    from specbus.bus.run import declare
    from specbus.core.models.target import load_target_info, resolve_target_dir
    from specbus.producers.feeder import prepare
    from specbus.producers.live.intake import Intake, build_app
    from specbus.producers.live.manifest import capture_config, ensure_manifest, live_manifest

    driven = is_driven(cfg)
    if cfg.deployment.mode != "live" and not driven:
        raise ConfigError(
            f"specbus intake serves live runs (deployment.mode=live) and driven ones "
            f"(deployment.mode=disaggregated with target.engine sglang_server or vllm_server); run {cfg.run!r} "
            f"is {cfg.deployment.mode} on target.engine={cfg.target.engine}"
        )
    host = host or cfg.live.host
    port = cfg.live.port if port is None else port
    sock = bind(host, port)
    vocab_cfg = cfg.model_copy(deep=True)
    if driven:  # the feeder's data and plan; captures of driven requests only
        vocab_cfg.live.sample_rate = 0.0
    else:
        vocab_cfg.data.source = cfg.live.vocab_source or cfg.data.source
    prepared = await asyncio.to_thread(prepare, vocab_cfg)
    info = load_target_info(resolve_target_dir(cfg.target.model), name=cfg.target.model)
    strategy = cfg.strategy.build(info, aux_layers=cfg.target.aux_layers)
    store = cfg.store.build()  # held open for the run: samples outlive their writers
    try:
        capture = capture_config(
            vocab_cfg if driven else cfg, strategy.feature_contract(info), store_uri=store.uri,
            store_id=store.store_id, float_dtype=float_dtype(cfg),
            target_fingerprint=prepared.target_fingerprint,
            tokenizer_fingerprint=prepared.tokenizer_fingerprint,
        )  # fmt: skip
        async with await connect(cfg.bus, bus_url, name="specbus-intake") as bus:
            run = await declare(bus, cfg.bus, cfg.run)
            if not driven:
                await ensure_manifest(run.kv, live_manifest(cfg, prepared, capture))
            elif not await feeder_manifest(run, cfg, prepared):
                print("specbus intake stopped before the run's manifest appeared", flush=True)
                return 0
            token = intake_token(cfg)
            intake = Intake(cfg, run, store, capture, token, driven_only=driven)
            await intake.start()
            bound = sock.getsockname()
            tls = (cfg.live.tls_cert, cfg.live.tls_key) if cfg.live.tls_cert else None
            url = f"{'https' if tls else 'http'}://{bound[0]}:{bound[1]}"
            path = write_endpoint(cfg, url, token)
            print(f"specbus intake: run {cfg.run} on {url} (token in {path}; store {store.uri}; "
                  f"{capture.strategy} layers {list(capture.aux_layers)}, rate "
                  f"{capture.sample_rate:g})", flush=True)  # fmt: skip
            try:
                await _serve_http(build_app(intake), sock, tls)
            finally:
                await intake.stop()
        m = intake.metrics
        print(f"specbus intake stopped: {m.total(200, 'accepted')} accepted, "
              f"{m.total(200, 'duplicate')} duplicates, {m.total(429)} shed, "
              f"{sum(n for (c, _), n in m.answers.items() if 400 <= c < 500 and c != 429)} "
              "rejected", flush=True)  # fmt: skip
        return 0
    finally:
        store.close(timeout_s=0)
        sock.close()


async def feeder_manifest(run, cfg: RunConfig, prepared, timeout_s: float = 600.0) -> bool:
    """A driven run's intake: wait for the feeder's manifest (as trainers do) and check its plan
    is this config's. False: SIGINT/SIGTERM came first. Raises `ConfigError` for another plan,
    a live manifest, or none after `timeout_s`."""
    import signal

    from specbus.producers.feeder import plan_hash, plan_of

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def waiting(_left: float) -> None:
        print(f"specbus intake: waiting for the feeder (`specbus feed`) of run {cfg.run} to "
              "write its manifest", flush=True)  # fmt: skip

    try:
        manifest = await run.kv.wait_manifest(timeout_s, stop.is_set, waiting)
    except TimeoutError:
        raise ConfigError(f"run {cfg.run!r} has no manifest after {timeout_s:.0f}s: start the "
                          "feeder (`specbus feed`) for this run") from None  # fmt: skip
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    if manifest is None:
        return False
    want = plan_hash(plan_of(cfg, prepared))
    if manifest.mode != "driven" or manifest.plan_hash != want:
        raise ConfigError(
            f"run {cfg.run!r} has a manifest of another plan ({manifest.plan_hash}, mode "
            f"{manifest.mode}; this config's: {want}): the intake of a driven run needs the "
            "feeder's data/strategy/target settings"
        )
    return True


def run_serve(cfg: RunConfig, *, intake_url: str | None = None, token: str | None = None,
              host: str | None = None, port: int | None = None, capture: bool = True,
              model_name: str | None = None, bus_url: str | None = None,
              spec: SpecOptions | None = None) -> int:  # fmt: skip
    """`specbus serve` (module doc); `spec`: decode speculatively (`bus_url`: the broker whose
    run KV it follows; None: the checkpoint directory). Returns the exit code."""
    import torch
    from specbus.core.prometheus import Metrics
    from specbus.producers.engines.registry import build_engine
    from specbus.producers.live.generate import Generator
    from specbus.producers.live.serve import Server, build_app
    from specbus.producers.live.sink import CaptureSink

    if cfg.target.engine != "hf":
        raise ConfigError(
            f"specbus serve runs the hf engine, not target.engine={cfg.target.engine!r}"
        )
    if os.environ.get("SPECBUS_THREADS"):
        torch.set_num_threads(int(os.environ["SPECBUS_THREADS"]))
    host = host or cfg.live.serve_host
    port = cfg.live.serve_port if port is None else port
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per capture record
    sock = bind(host, port)
    engine = build_engine(cfg.target)
    sink = None
    if capture:

        def url_of() -> str | None:  # noqa: E306 - asked at every handshake attempt
            return intake_url or cfg.live.url or (read_endpoint(cfg) or {}).get("url")

        def token_of() -> str | None:
            return (token or cfg.live.token or os.environ.get(TOKEN_ENV)
                    or (read_endpoint(cfg) or {}).get("token"))  # fmt: skip

        sink = CaptureSink(url_of, token_of, server_id=f"{socket.gethostname()}-{os.getpid()}",
                           # a wave's captures arrive together: room for two waves
                           engine=engine.name, queue_size=max(cfg.live.queue, 2 * cfg.live.serve_batch),
                           verify=trusting(cfg.live.tls_ca)).start()  # fmt: skip
    metrics = Metrics()
    drafts = Speculation(cfg, engine, metrics, bus_url, spec) if spec else None
    generator = Generator(engine, sink, max_new_tokens=cfg.live.max_new_tokens,
                          max_batch=cfg.live.serve_batch, drafts=drafts and drafts.slot,
                          num_draft_tokens=spec.num_draft_tokens if spec else 3,
                          spec_stats=drafts and drafts.stats)  # fmt: skip
    server = Server(generator, model_name or cfg.target.model, metrics)
    bound = sock.getsockname()
    drafting = f"; speculative, draft {drafts.describe()}" if drafts else ""
    print(f"specbus serve: {cfg.target.model} on http://{bound[0]}:{bound[1]}/v1 (capture "
          f"{'on' if capture else 'off'}{drafting})", flush=True)  # fmt: skip
    from specbus.ops.served import register

    announced = register(cfg, f"http://{bound[0]}:{bound[1]}")  # `specbus top` finds it
    try:
        asyncio.run(_serve_http(build_app(server), sock))
    finally:
        announced.unlink(missing_ok=True)
        generator.close()
        if drafts is not None:
            drafts.close()
        if sink is not None:
            sink.close(timeout_s=10)
            print(f"capture: {dict(sorted(sink.counts.items()))}", flush=True)
        engine.close()
        sock.close()
    return 0


@dataclass
class SpecOptions:
    """`specbus serve --speculative`: drafts per round of an EAGLE3 chain (a DFlash-family
    block drafts its own count) and how often the checkpoint pointer is read."""

    num_draft_tokens: int = 3
    reload_poll_s: float = 1.0


class Speculation:
    """A speculative server's draft side: the slot, the served-acceptance stats (in `metrics`
    and TensorBoard) and the reload thread following the run's checkpoints."""

    def __init__(self, cfg: RunConfig, engine, metrics, bus_url: str | None, opts: SpecOptions):
        from specbus.core.tensorboard import open_writer
        from specbus.ops.reload import DraftFollower, DraftLoader, pointer_source
        from specbus.producers.live.speculative import DraftSlot, SpecStats

        if cfg.strategy.name == "peagle":  # parallel drafting is decoded by core/eval/peagle.py
            raise ConfigError(
                "specbus serve --speculative decodes EAGLE3 chains and DFlash-family blocks; a "
                "P-EAGLE draft is served by vLLM (`specbus export`, docs/peagle.md)"
            )
        self.writer = open_writer(cfg.resolved_tensorboard_dir / "serve",
                                  enabled=cfg.telemetry.tensorboard)  # fmt: skip
        writer = self.writer
        self.slot = DraftSlot()
        self.stats = SpecStats(
            metrics,
            on_request=writer and (lambda row: writer.write(row, flush=False)),
            on_version=writer and writer.write,
        )  # fmt: skip
        self.pointers = pointer_source(cfg, bus_url)
        loader = DraftLoader(cfg, engine.device, engine.dtype)
        self.follower = DraftFollower(loader, self.pointers, self.slot, self.stats,
                                      opts.reload_poll_s).start()  # fmt: skip
        self.follower.ready.wait(120)  # the first draft before the first request, if there is one
        self.source = f"run KV at {bus_url}" if bus_url else "the checkpoint directory"

    def describe(self) -> str:
        version = self.slot.version
        now = "none yet" if version is None else f"version {version}"
        return f"{now}, following {self.source}"

    def close(self) -> None:
        self.follower.stop()
        if self.writer is not None:
            self.writer.close()


# ---------------------------------------------------------------- commands
def cmd_intake(args: argparse.Namespace) -> int:
    """`specbus intake`."""
    cfg = config_of(args)
    return asyncio.run(run_intake(cfg, bus_url=resolve_url(args, cfg), host=args.host,
                                  port=args.port))  # fmt: skip


def cmd_serve(args: argparse.Namespace) -> int:
    """`specbus serve`."""
    cfg = config_of(args)
    if args.draft_tokens < 1 or args.reload_poll <= 0:
        raise ConfigError("--draft-tokens must be at least 1 and --reload-poll above 0")
    if args.engine == "sglang":
        from specbus.ops.sglang import run_sglang_serve

        return run_sglang_serve(cfg, intake_url=args.intake_url, token=args.token,
                                host=args.host, port=args.port, dry_run=args.dry_run,
                                speculative=args.speculative, draft_dir=args.draft_dir,
                                num_draft_tokens=args.draft_tokens)  # fmt: skip
    if args.engine == "vllm":
        from specbus.ops.vllm import run_vllm_serve

        return run_vllm_serve(cfg, intake_url=args.intake_url, token=args.token,
                              host=args.host, port=args.port, dry_run=args.dry_run)  # fmt: skip
    bus_url = args.url or cfg.bus.url  # explicit only: a speculative server follows its run KV
    return run_serve(cfg, intake_url=args.intake_url, token=args.token, host=args.host,
                     port=args.port, capture=not args.no_capture,
                     model_name=args.model_name, bus_url=bus_url,
                     spec=SpecOptions(args.draft_tokens, args.reload_poll)
                     if args.speculative else None)  # fmt: skip


def cmd_traffic(args: argparse.Namespace) -> int:
    """`specbus traffic`."""
    from specbus.ops.traffic import load_prompts, run_traffic

    prompts = load_prompts(args.data, limit=args.limit, holdout=args.holdout)
    report = asyncio.run(run_traffic(
        args.server, prompts, qps=args.qps, concurrency=args.concurrency,
        duration_s=args.duration, requests=args.requests, loop=args.loop,
        stream=not args.no_stream, max_tokens=args.max_tokens, temperature=args.temperature,
        seed=args.seed, api_key=args.api_key, model=args.model,
    ))  # fmt: skip
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.summary(), flush=True)
    return 0 if not report.errors or args.allow_errors else 1


def add_live_commands(sub: argparse._SubParsersAction) -> None:
    """Register `intake`, `serve` and `traffic` (a registrar of `ops/cli.py`)."""
    p = sub.add_parser(
        "intake", help="the intake of a live or driven run (capture handshake + records -> SAMPLES)"
    )
    add_common(p)
    p.add_argument("--host", default=None, help="listen address (default live.host, loopback)")
    p.add_argument("--port", type=int, default=None, help="port (default live.port; 0: a free one)")
    p.set_defaults(func=cmd_intake)

    p = sub.add_parser(
        "serve", help="live mode: an OpenAI-compatible server on the hf engine, capturing"
    )
    add_common(p)
    p.add_argument("--host", default=None, help="listen address (default live.serve_host)")
    p.add_argument("--port", type=int, default=None, help="port (default live.serve_port)")
    p.add_argument(
        "--intake-url",
        default=None,
        help="the intake (default live.url, else <run_dir>/live/intake.json)",
    )
    p.add_argument(
        "--token", default=None, help=f"the intake's bearer token (default ${TOKEN_ENV})"
    )
    p.add_argument("--no-capture", action="store_true", help="serve without capturing")
    p.add_argument("--model-name", default=None, help="the model id clients send")
    p.add_argument("--engine", choices=["hf", "sglang", "vllm"], default="hf",
                   help="hf: serve here; sglang / vllm: print and start a stock SGLang / vLLM "
                   "server with the capture layer (docs/sglang.md, docs/vllm.md)")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="--engine sglang|vllm: only print it")
    p.add_argument("--speculative", action="store_true",
                   help="decode with the run's draft, reloaded at every checkpoint (--engine "
                   "sglang: SGLang's speculative flags with the exported draft)")  # fmt: skip
    p.add_argument("--draft-tokens", type=int, default=3,
                   help="--speculative: drafts per round of an EAGLE3 chain (k)")  # fmt: skip
    p.add_argument("--reload-poll", type=float, default=1.0,
                   help="--speculative: seconds between looks at the checkpoint pointer")  # fmt: skip
    p.add_argument("--draft-dir", default=None,
                   help="--engine sglang --speculative: the exported draft (default "
                   "<run_dir>/export)")  # fmt: skip
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("traffic", help="replay prompts against an OpenAI-compatible server")
    p.add_argument("--server", default="http://127.0.0.1:8000/v1", help="base URL (with /v1)")
    p.add_argument("--data", default="gsm8k", help="gsm8k, sharegpt, or a JSONL path")
    p.add_argument("--qps", type=float, default=1.0, help="Poisson arrival rate")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")
    p.add_argument("--duration", type=float, default=None, help="seconds of arrivals")
    p.add_argument("--requests", type=int, default=None, help="requests to send")
    p.add_argument("--loop", action="store_true", help="cycle through the prompts")
    p.add_argument("--no-stream", action="store_true", help="non-streaming requests")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--limit", type=int, default=None, help="prompts to load at most")
    p.add_argument(
        "--holdout",
        type=int,
        default=50,
        help="prompts kept out at the end of the source (the demo evaluates on them)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default="specbus")
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--allow-errors", action="store_true", help="exit 0 even when users saw errors")
    p.set_defaults(func=cmd_traffic)


if __name__ == "__main__":  # pragma: no cover
    from specbus.ops.cli import main

    sys.exit(main())
