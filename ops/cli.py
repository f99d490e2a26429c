"""The `specbus` command line.

    specbus up                     embedded nats-server in the foreground (Ctrl-C stops it)
    specbus status [run=NAME]      streams, consumers, lag, KV markers, dead-letter count
    specbus dead   [run=NAME]      dead letters with reasons
    specbus feed|produce|train|export|demo ...   the pipeline (ops/commands.py)

Every subcommand takes the run config: `--config run.yaml`, dotted overrides as positional
`key=value` words or `-o key=value` (`specbus status run=demo bus.ack_wait_s=30`), and
`--url` for the broker (else `bus.url`, else the URL `specbus up` wrote under the run dir).

Subcommands live in a table of registrars (`REGISTRARS`): "module:function" strings, each
function taking the subparsers object and adding its commands with `add_common` and
`set_defaults(func=...)`, where `func(args) -> int` is the exit code. Modules are imported
when the parser is built, so keep their heavy imports (torch, transformers) inside `func`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from core.config import RunConfig, load_config
from core.errors import SpecbusError

log = logging.getLogger("specbus")

REGISTRARS = ["ops.cli:add_bus_commands", "ops.commands:add_pipeline_commands"]
URL_FILE = "url"  # <run_dir>/nats/url, written by `specbus up`
DEFAULT_PORT = 4222


# ---------------------------------------------------------------- shared by every subcommand
def add_common(p: argparse.ArgumentParser) -> None:
    """--config, --url, -o and positional key=value overrides (merged by `main`)."""
    p.add_argument("--config", "-c", default=None, help="run config YAML")
    p.add_argument(
        "--url", default=None, help="broker URL (default: bus.url, else the one `specbus up` wrote)"
    )
    p.add_argument(
        "-o",
        "--set",
        dest="set_overrides",
        action="append",
        default=[],
        metavar="key=value",
        help="dotted config override (repeatable)",
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")


def config_of(args: argparse.Namespace) -> RunConfig:
    return load_config(args.config, args.overrides)


def broker_dir(cfg: RunConfig) -> Path:
    return cfg.resolved_run_dir / "nats"


def resolve_url(args: argparse.Namespace, cfg: RunConfig) -> str | None:
    """--url, else `bus.url`, else the URL file of a `specbus up` for this run dir."""
    if getattr(args, "url", None):
        return args.url
    if cfg.bus.url:
        return cfg.bus.url
    url_file = broker_dir(cfg) / URL_FILE
    return url_file.read_text().strip() if url_file.exists() else None


# ---------------------------------------------------------------- specbus up
def cmd_up(args: argparse.Namespace) -> int:
    from ops.services.common import LOOPBACK, ServiceError
    from ops.services.nats import NatsServer

    cfg = config_of(args)
    store = Path(args.store_dir) if args.store_dir else broker_dir(cfg)
    if args.host != LOOPBACK:
        log.warning(
            "binding the broker to %s: anyone who can reach it can use it (configure auth, see ops/)",
            args.host,
        )
    server = NatsServer(store, host=args.host, port=_port(args.host, args.port))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start()
    except ServiceError as e:
        print(f"specbus up: {e}", file=sys.stderr)
        return 1
    url_file = store / URL_FILE
    mooncake = None
    try:
        if args.store == "mooncake":
            from ops.services.mooncake import start_mooncake

            mooncake, store_cfg = start_mooncake(cfg.store, cfg.resolved_run_dir)
            print(f"mooncake store ready: store.uri={store_cfg.uri}", flush=True)
        url_file.write_text(server.url + "\n")
        if not args.no_declare:
            asyncio.run(_declare(cfg, server.url))
        print(f"nats-server ready at {server.url} (pid {server.pid}, store {store})", flush=True)
        if not args.no_declare:
            print(f"run {cfg.run!r} declared: streams, consumers, KV bucket", flush=True)
        print("Ctrl-C to stop", flush=True)
        while not stop.wait(0.5):
            if server.proc.poll() is not None:
                print(
                    f"nats-server exited with {server.proc.returncode}; see {server.log_path}",
                    file=sys.stderr,
                )
                return 1
        return 0
    finally:
        if mooncake is not None:
            mooncake.stop()
        server.stop()  # by PID: SIGTERM, then SIGKILL if it lingers
        url_file.unlink(missing_ok=True)


def _port(host: str, wanted: int) -> int:
    """`wanted` if free (0: any free port); 4222 falls back to a free port when taken."""
    import socket

    from ops.services.common import free_port

    if wanted == 0:
        return free_port(host)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, wanted))
            return wanted
        except OSError:
            if wanted != DEFAULT_PORT:
                raise SpecbusError(f"--port {wanted} is in use on {host}") from None
    port = free_port(host)
    log.warning("port %d is in use on %s; using %d", DEFAULT_PORT, host, port)
    return port


async def _declare(cfg: RunConfig, url: str) -> None:
    from bus.connection import connect
    from bus.topology import declare

    bus = await connect(cfg.bus, url, name="specbus-up")
    try:
        await declare(bus, cfg.bus, cfg.run)
    finally:
        await bus.close()


# ---------------------------------------------------------------- specbus status
def cmd_status(args: argparse.Namespace) -> int:
    from bus.status import run_status

    cfg = config_of(args)
    status = asyncio.run(
        _with_bus(cfg, resolve_url(args, cfg), lambda bus: run_status(bus, cfg.run))
    )
    if args.json:
        print(json.dumps(status, indent=2, default=str))
    else:
        print(format_status(status))
    return 0 if status["declared"] else 1


async def _with_bus(cfg: RunConfig, url: str | None, work) -> Any:
    from bus.connection import connect

    bus = await connect(cfg.bus, url, name="specbus-cli")
    try:
        return await work(bus)
    finally:
        await bus.close()


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_status(s: dict[str, Any]) -> str:
    lines = [f"run {s['run']} @ {s['url']}"]
    if not s["declared"]:
        lines.append(
            "  not declared on this broker (run `specbus up`, or start a feeder/producer/trainer)"
        )
    lines.append("streams")
    for name, st in s["streams"].items():
        if st is None:
            lines.append(f"  {name:<34} missing")
        else:
            lines.append(
                f"  {name:<34} {st['messages']:>8} msgs {_size(st['bytes']):>10}  seq {st['first_seq']}..{st['last_seq']}"
            )
    lines.append("consumers")
    for group, c in s["consumers"].items():
        if c is None:
            lines.append(f"  {group:<10} missing")
            continue
        start = f", from seq {c['opt_start_seq']}" if c.get("opt_start_seq") else ""
        lines.append(
            f"  {group:<10} pending {c['pending']}  in flight {c['ack_pending']}  redelivered {c['redelivered']}  "
            f"waiting pulls {c['waiting']}  ack floor {c['ack_floor_seq']}  "
            f"(ack_wait {c['ack_wait_s']:g}s, max_deliver {c['max_deliver']}, max_ack_pending {c['max_ack_pending']}{start})"
        )
    lines.append("lag")
    for group, lag in s["lag"].items():
        if lag is None:
            continue
        size = (
            ""
            if lag["bytes_method"] == "empty"
            else f", {_size(lag['bytes'])} of tensors ({lag['bytes_method']})"
        )
        lines.append(
            f"  {group:<10} {lag['messages']} messages ({lag['pending']} pending + {lag['ack_pending']} in flight){size}"
        )
    kv = s["kv"]
    if kv is not None:
        lines.append("markers")
        lines.append(
            f"  manifest        {'missing' if kv['manifest'] is None else ', '.join(kv['manifest'])}"
        )
        lines.append(
            f"  feed complete   {'no' if kv['feed_complete'] is None else str(kv['feed_complete']) + ' tasks'}"
        )
        lines.append(
            f"  train complete  {'no' if kv['train_complete'] is None else json.dumps(kv['train_complete'])}"
        )
        lines.append(
            f"  checkpoint      {'none' if kv['checkpoint'] is None else json.dumps(kv['checkpoint'])}"
        )
    if s["dead_letters"] is not None:
        lines.append(
            f"dead letters     {s['dead_letters']}"
            + (" (specbus dead)" if s["dead_letters"] else "")
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- specbus dead
def cmd_dead(args: argparse.Namespace) -> int:
    from bus.dead import list_dead

    cfg = config_of(args)
    entries = asyncio.run(
        _with_bus(
            cfg, resolve_url(args, cfg), lambda bus: list_dead(bus, cfg.run, limit=args.limit)
        )
    )
    if args.json:
        rows = []
        for d in entries:
            row = {k: v for k, v in d.__dict__.items() if k != "data"}
            row["data"] = None if d.data is None else d.data.decode("utf-8", "replace")
            rows.append(row)
        print(json.dumps(rows, indent=2))
        return 0
    if not entries:
        print(f"run {cfg.run}: no dead letters")
        return 0
    print(f"run {cfg.run}: {len(entries)} dead letter(s)")
    for d in entries:
        print(
            f"  #{d.dead_seq:<5} {d.kind:<14} {d.reason:<16} {d.stream}#{d.seq} "
            f"deliveries {d.deliveries} consumer {d.consumer or '-'}"
            + (f"\n         {d.detail}" if d.detail else "")
        )
        if args.payload:
            shown = (
                "(original no longer stored)"
                if d.data is None
                else d.data[: args.payload].decode("utf-8", "replace")
            )
            print(f"         {shown}")
    return 0


def add_bus_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "up",
        help="run the embedded nats-server in the foreground (loopback, store under the run dir)",
    )
    add_common(p)
    p.add_argument("--host", default="127.0.0.1", help="listen address (default loopback only)")
    p.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help="port (0: any free port; 4222 falls back to a free one)",
    )
    p.add_argument("--store-dir", default=None, help="JetStream store (default <run_dir>/nats)")
    p.add_argument(
        "--store",
        choices=["shm", "mooncake"],
        default="shm",
        help="mooncake: also start mooncake_master + a store node on loopback (shm needs no server)",
    )
    p.add_argument(
        "--no-declare", action="store_true", help="do not declare the run's streams/consumers/KV"
    )
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("status", help="streams, consumers, lag and markers of a run")
    add_common(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("dead", help="dead letters of a run, with reasons")
    add_common(p)
    p.add_argument("--limit", type=int, default=None, help="only the last N")
    p.add_argument(
        "--payload",
        type=int,
        nargs="?",
        const=200,
        default=0,
        metavar="BYTES",
        help="show the original payload (first BYTES)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output (with payloads)")
    p.set_defaults(func=cmd_dead)


# ---------------------------------------------------------------- entry point
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specbus", description="online speculative-decoding draft training on NATS JetStream"
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING...")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for spec in REGISTRARS:
        module_name, func_name = spec.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:  # the module exists but one of its imports is missing
                raise
            continue
        getattr(module, func_name)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    if hasattr(args, "overrides"):
        args.overrides = [*getattr(args, "set_overrides", []), *args.overrides]
    try:
        return args.func(args)
    except SpecbusError as e:
        print(f"specbus {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
