"""The `specbus` command line.

    specbus up                     embedded nats-server in the foreground (Ctrl-C stops it)
    specbus store                  Mooncake master + store node in the foreground
    specbus status [run=NAME]      streams, consumers, lag, KV markers, dead-letter count
    specbus top    [run=NAME]      live view: lag, in-flight leases, steps/s, store, dead letters
    specbus dead   [run=NAME]      dead letters with reasons
    specbus feed|produce|train|export|demo ...   the pipeline (ops/commands.py)
    specbus intake|serve|traffic ...             live mode (ops/live.py)

Every subcommand takes the run config: `--config run.yaml`, dotted overrides as positional
`key=value` words or `-o key=value` (`specbus status run=demo bus.ack_wait_s=30`), and
`--url` for the broker (else `bus.url`, else the run's own `specbus up`, else the machine's
shared one: see `resolve_url`) and `--wait` to wait for a broker that does not answer yet
(`add_common`, `config_of`, `resolve_url`: ops/args.py).

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
import sys
import time
from pathlib import Path
from typing import Any

from specbus.core.config import RunConfig
from specbus.core.errors import SpecbusError
from specbus.ops.args import add_common, config_of, resolve_url
from specbus.ops.runview import size

log = logging.getLogger("specbus")

REGISTRARS = [
    "specbus.ops.cli:add_bus_commands",
    "specbus.ops.commands:add_pipeline_commands",
    "specbus.ops.live:add_live_commands",  # intake, serve, traffic (live mode)
    "specbus.ops.auth:add_auth_commands",
    "specbus.ops.sglang:add_sglang_commands",  # the SGLang capture layer
    "specbus.ops.vllm:add_vllm_commands",  # the vLLM capture connector
]


# ---------------------------------------------------------------- specbus up / store
def cmd_up(args: argparse.Namespace) -> int:
    """`specbus up`: the embedded broker in the foreground (ops/up.py)."""
    from specbus.ops.up import run_up

    return run_up(args, config_of(args))


def cmd_store(args: argparse.Namespace) -> int:
    """`specbus store`: the Mooncake store in the foreground, or `--stop` it."""
    from specbus.ops.up import run_store

    return run_store(args, config_of(args))


# ---------------------------------------------------------------- specbus status
def cmd_status(args: argparse.Namespace) -> int:
    """`specbus status`: the run's broker state; exit 1 when the run is not declared."""
    cfg = config_of(args)
    url = resolve_url(args, cfg)
    from specbus.ops.runview import purge_command, store_now
    from specbus.ops.top import snapshot

    status = asyncio.run(_with_bus(cfg, url, lambda bus: snapshot(bus, cfg.run)))
    status["store_now"] = store_now(cfg.store)
    if args.json:
        print(json.dumps(status, indent=2, default=str))
    else:
        print(format_status(status, purge=purge_command(args)))
    return 0 if status["declared"] else 1


async def _with_bus(cfg: RunConfig, url: str | None, work) -> Any:
    from specbus.bus.connection import connect

    bus = await connect(cfg.bus, url, name="specbus-cli")
    try:
        return await work(bus)
    finally:
        await bus.close()


def format_status(
    s: dict[str, Any], purge: str = "specbus purge --yes", now: float | None = None
) -> str:
    """`run_status`'s dict (plus the trainers' last log row, `progress`, and the store read
    now, `store_now`) as the lines `specbus status` prints: what is read now is headed "now",
    the trainers' row "last known, as of" its time (ops/runview.py)."""
    from specbus.ops.runview import clock, leftover, row_label, world_lines

    now = time.time() if now is None else now
    done = (s.get("kv") or {}).get("train_complete")
    lines = [f"run {s['run']} @ {s['url']}  (now {time.strftime('%H:%M:%S', time.localtime(now))})"]
    if not s["declared"]:
        lines.append(
            "  not declared on this broker (run `specbus up`, or start a feeder/producer/trainer)"
        )
    lines.append("streams (now)")
    for name, st in s["streams"].items():
        if st is None:
            lines.append(f"  {name:<34} missing")
        else:
            lines.append(
                f"  {name:<34} {st['messages']:>8} msgs {size(st['bytes']):>10}  seq {st['first_seq']}..{st['last_seq']}"
            )
            lines.append(f"  {'':<34} {retention(st)}")
    lines.append("consumers (now)")
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
        if done is not None and c["ack_pending"] and not c["waiting"]:
            lines.append(f"  {'':<10} (in flight: leases of processes of a complete run; they "
                         f"come back as pending after ack_wait {c['ack_wait_s']:g}s)")  # fmt: skip
    lines.append("lag (now)")
    for group, lag in s["lag"].items():
        if lag is None:
            continue
        of_tensors = (
            ""
            if lag["bytes_method"] == "empty"
            else f", {size(lag['bytes'])} of tensors ({lag['bytes_method']})"
        )
        lines.append(
            f"  {group:<10} {lag['messages']} messages ({lag['pending']} pending + {lag['ack_pending']} in flight){of_tensors}"
        )
    kv = s["kv"]
    if kv is not None:
        lines.append("markers (now)")
        lines.append(
            f"  manifest        {'missing' if kv['manifest'] is None else ', '.join(kv['manifest'])}"
        )
        lines.append(
            f"  feed complete   {'no' if kv['feed_complete'] is None else str(kv['feed_complete']) + ' tasks'}"
        )
        if done is None:
            lines.append("  train complete  no")
        else:
            at = f" at {clock(done['time'])}" if "time" in done else ""
            shown = json.dumps({k: v for k, v in done.items() if k != "time"})
            lines.append(f"  train complete  {shown}{at}")
        lines.append(
            f"  checkpoint      {'none' if kv['checkpoint'] is None else json.dumps(kv['checkpoint'])}"
        )
        if reach := replay_reach(s, kv["checkpoint"]):
            lines.append(f"  {'':<15} {reach}")
    if s["dead_letters"] is not None:
        lines.append(
            f"dead letters     {s['dead_letters']}"
            + (" (specbus dead)" if s["dead_letters"] else "")
        )
    p = s.get("progress")
    if p is not None:
        lines.append(f"trainers ({row_label(s, now)})")
        row = f"  step {int(p.get('step', 0))}"
        if "loss" in p:
            row += f"  loss {p['loss']:.3f}"
        if "samples_per_s" in p:
            row += f"  {p['samples_per_s']:.1f} samples/s"
        if "store_bytes" in p:
            row += f"  store {size(p['store_bytes'])} resident then (peak {size(p.get('store_peak_bytes'))})"
        lines.append(row)
    lines += ["  " + line for line in world_lines(s.get("world"))]
    store = s.get("store_now")
    if store is not None:
        lines.append(
            f"store (now)      {store['uri']}: {size(store['bytes'])} resident, {store['samples']} sample(s)"
        )
    if hint := leftover(s, store, purge):
        lines.append(f"left over        {hint}")
    audit = s.get("audit")
    if audit and audit["audited"]:  # the capture audit (core/audit.py)
        lines.append(
            f"capture audit    {audit['audited']} recomputed, {audit['mismatches']} mismatched"
            + (" (dead-lettered capture_mismatch: specbus dead)" if audit["mismatches"] else "")
        )
    return "\n".join(lines)


def retention(st: dict[str, Any]) -> str:
    """A stream's retention as `specbus status` prints it: its limits (past either the oldest
    messages go) and what replay can still reach."""
    age = st.get("max_age_s") or 0
    limits = [f"age {age / 86400:g} d" if age >= 86400 else f"age {age:g} s"] if age else []
    if (st.get("max_bytes") or -1) > 0:
        limits.append(f"bytes {size(st['max_bytes'])}")
    if (st.get("max_msgs") or -1) > 0:
        limits.append(f"messages {st['max_msgs']}")
    kept = "kept until " + " or ".join(limits) if limits else "kept (no limit)"
    reach = f"replay reaches seq {st['first_seq']}..{st['last_seq']}" if st["messages"] else ""
    return f"retention: {kept}" + (f"; {reach}" if reach else "")


def replay_reach(s: dict[str, Any], pointer: dict[str, Any] | None) -> str:
    """Whether a resume from the latest checkpoint can replay what it needs: from the
    checkpoint's floor + 1 on the trainers' stream (SAMPLES; TASKS when nothing was captured
    into SAMPLES: colocated)."""
    if not pointer or "floor" not in pointer:
        return ""
    tasks, samples, _ = s["streams"].values()
    st = samples if samples and samples["last_seq"] else tasks
    if not st:
        return ""
    start = int(pointer["floor"]) + 1
    if start >= st["first_seq"]:
        return f"a resume replays from seq {start}: within the stream"
    return (f"a resume replays from seq {start}, but the stream starts at {st['first_seq']}: "
            f"{st['first_seq'] - start} messages above the checkpoint are gone (retention), "
            "a resume cannot train them")  # fmt: skip


# ---------------------------------------------------------------- specbus top
def cmd_top(args: argparse.Namespace) -> int:
    """`specbus top`: a live view of the run (ops/top.py); Ctrl-C ends it."""
    from specbus.ops.runview import purge_command
    from specbus.ops.served import discover
    from specbus.ops.top import watch

    cfg = config_of(args)
    servers = tuple(args.serve or discover(cfg))
    work = lambda bus: watch(bus, cfg.run, interval_s=args.interval, once=args.once,  # noqa: E731
                             store=cfg.store, purge=purge_command(args), servers=servers)  # fmt: skip
    try:
        return asyncio.run(_with_bus(cfg, resolve_url(args, cfg), work))
    except KeyboardInterrupt:
        return 0


# ---------------------------------------------------------------- specbus dead
def cmd_dead(args: argparse.Namespace) -> int:
    """`specbus dead`: the run's dead letters with their reasons (and payloads, `--payload`)."""
    from specbus.bus.dead import list_dead

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
    """Register `up`, `store`, `status`, `top` and `dead`."""
    p = sub.add_parser(
        "up",
        help="run the embedded nats-server in the foreground (loopback, store under the run dir)",
    )
    add_common(p)
    p.add_argument("--host", default="127.0.0.1", help="listen address (default loopback only)")
    p.add_argument(
        "--port",
        type=int,
        default=None,
        help="port (default: bus.url's, else the one this store dir used last, else 4222 or a "
        "free one when taken; 0: a new free port)",
    )
    p.add_argument("--store-dir", default=None, help="JetStream store (default <run_dir>/nats)")
    p.add_argument(
        "--store",
        choices=["shm", "mooncake"],
        default="shm",
        help="mooncake: also run `specbus store` (mooncake_master + a store node on loopback), "
        "which outlives the broker (shm needs no server)",
    )
    p.add_argument(
        "--sync",
        default="default",
        metavar="default|always|INTERVAL",
        help="JetStream sync_interval: default (fsync every 2 min), always (fsync each write: "
        "survives power loss, slower; see docs/bus.md), or e.g. 10s",
    )
    p.add_argument(
        "--no-restart",
        action="store_true",
        help="exit when nats-server dies instead of restarting it on the same port",
    )
    p.add_argument(
        "--no-declare", action="store_true", help="do not declare the run's streams/consumers/KV"
    )
    p.add_argument(
        "--cluster",
        type=int,
        default=1,
        metavar="N",
        help="N nats-servers in one JetStream cluster (3: R3 streams survive a node loss)",
    )
    p.add_argument(
        "--auth", default=None, metavar="DIR", help="role users of `specbus auth --out DIR`"
    )
    p.add_argument(
        "--tls", default=None, metavar="DIR", help="serve TLS (DIR/ca.pem, server.pem, server.key)"
    )
    p.add_argument("--mtls", action="store_true", help="with --tls: require client certificates")  # fmt: skip
    p.set_defaults(func=cmd_up)

    p = sub.add_parser(
        "store",
        help="run the Mooncake store (mooncake_master + a store node, loopback) in the foreground",
    )
    add_common(p)
    p.add_argument("--stop", action="store_true", help="stop the store running for the run dir")
    p.set_defaults(func=cmd_store)

    p = sub.add_parser("status", help="streams, consumers, lag and markers of a run")
    add_common(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser(
        "top", help="live view of a run: lag per group, in-flight leases, steps/s, store, dead"
    )
    add_common(p)
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one refresh and exit")
    p.add_argument("--serve", action="append", metavar="URL",
                   help="a serving server whose served acceptance to show (repeatable; "
                   "default: those `specbus serve` announced in the run dir)")  # fmt: skip
    p.set_defaults(func=cmd_top)

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
def version() -> str:
    """The installed distribution's version, and where this code runs from."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        number = dist_version("specbus")
    except PackageNotFoundError:
        number = "(not installed)"
    return f"{number} ({Path(__file__).resolve().parent.parent})"


def build_parser() -> argparse.ArgumentParser:
    """The `specbus` parser with every registrar's subcommands (`REGISTRARS`)."""
    parser = argparse.ArgumentParser(
        prog="specbus", description="online speculative-decoding draft training on NATS JetStream"
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING...")
    parser.add_argument("--version", action="version", version=f"specbus {version()}")
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


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`parser.parse_args`, with dotted overrides allowed after an option too (`train --config C
    run=a --from-recording R k=v`, as the README writes it): argparse takes one run of
    positionals, so later key=value words come back unknown and are added here."""
    args, extra = parser.parse_known_args(argv)
    late = [w for w in extra if "=" in w and not w.startswith("-")]
    if len(late) != len(extra) or (late and not hasattr(args, "overrides")):
        parser.parse_args(argv)  # the usual error for what is really unknown
    if late:
        args.overrides = [*args.overrides, *late]
    return args


def main(argv: list[str] | None = None) -> int:
    """Run one `specbus` command; its exit code (2 for a `SpecbusError`, printed on one line)."""
    args = parse(build_parser(), argv)
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
