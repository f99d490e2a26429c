"""Soak: a live run for an hour, sampled every minute; each series' slope against a bound.

The processes of a live run on the CPU, as users start them (`specbus intake`, `specbus
serve` on the tiny chat target, one `specbus train` rank, `specbus traffic` looping over short
chats at `--qps`, an embedded nats-server), each its own process (disaggregated), for
`--minutes`. Every `--sample-s` seconds: each process's RSS, open file descriptors and
threads, the store's bytes (the `shm://` directory), the streams' bytes and the trainers' lag
(refs, bytes). SAMPLES is capped by `bus.samples_max_bytes` (`--samples-cap`), as a run of
weeks would be (docs/bus.md, "Retention").

At the end every series gets a least-squares line over the samples after the first
`--warmup` fraction of the run (start-up: imports, allocator arenas, the first checkpoint),
and its slope per hour is held against its bound (`BOUNDS`): a series fails the run (exit 1)
when its slope is over the bound by more than two standard errors *and* the fitted line
grows by more than the series' floor over the fitted window (a short run's last warm-up
allocations are not a leak; a leak at the bound outgrows the floor within the hour). The
bounds are what a run of weeks can afford:

| series | bound per hour | floor | why |
| --- | --- | --- | --- |
| RSS of a process | 16 MiB | 8 MiB | 2.7 GiB a week: a leak of ~2 KiB a request at 2 req/s shows |
| open fds | 4 | 3 | a socket or file leaked every 15 minutes shows within the hour |
| threads | 2 | 2 | |
| store bytes | 8 MiB | 8 MiB | residency is bounded by the budget; a key leaked per request shows |
| stream bytes | 8 MiB | 8 MiB | SAMPLES capped; TASKS empty in a live run; DEAD only dead letters |
| lag refs | 120 | 64 | the trainers keep up (the intake sheds past `live.max_lag_refs`) |

    python -m specbus.ops.bench.soak --minutes 60 --out runs/bench/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import uuid
from pathlib import Path

from specbus.ops.bench.sampling import Fit, fit, human, slope_line, tree_bytes, tree_stats

MIB = 1 << 20
# series kind -> (bound on the slope per hour, floor on the fitted growth, unit)
BOUNDS: dict[str, tuple[float, float, str]] = {
    "rss_bytes": (16 * MIB, 8 * MIB, "B"),
    "fds": (4.0, 3.0, ""),
    "threads": (2.0, 2.0, ""),
    "store_bytes": (8 * MIB, 8 * MIB, "B"),
    "stream_bytes": (8 * MIB, 8 * MIB, "B"),
    "lag_refs": (120.0, 64.0, "refs"),
}


def soak_config(run: str, work: Path, target: Path, chats: Path, args) -> object:
    """The live run's config (see the module doc)."""
    from specbus.core.config import build_config

    return build_config({
        "run": run,
        "run_dir": str(work / run),
        "bus": {"ack_wait_s": 30.0, "heartbeat_s": 5.0, "fetch_timeout_s": 0.5,
                "samples_max_bytes": args.samples_cap},
        "store": {"uri": f"shm://{work / 'shm'}", "budget_bytes": 64 << 20, "pool_bytes": 0},
        "target": {"model": str(target)},
        "strategy": {"ttt_length": 2, "draft": {"draft_vocab_size": 64}},
        "data": {"source": str(chats), "max_length": 128, "holdout": 0},
        "training": {"micro_batch": 2, "accumulation": 1, "lr": 1e-3, "checkpoint_every": 25,
                     "log_every": 10, "total_steps": 1_000_000,
                     "max_minutes": args.minutes + 30},  # stopped by this bench, not by time
        "deployment": {"mode": "live"},
        "live": {"port": 0, "serve_port": 0, "max_new_tokens": args.max_tokens},
        "telemetry": {"tensorboard": False},
    })  # fmt: skip


async def _bus_sample(cfg, url: str) -> dict[str, float]:
    from specbus.bus.connection import connect
    from specbus.bus.outage import ride
    from specbus.bus.run import open_run
    from specbus.bus.subjects import TRAINERS
    from specbus.core.errors import BusNotFound

    bus = await connect(cfg.bus, url, name="soak-bench")
    out: dict[str, float] = {}
    try:
        run = await open_run(bus, cfg.run)
        if run is None:  # not declared yet
            return out
        for key, name in (("samples", run.names.samples_stream),
                          ("tasks", run.names.tasks_stream), ("dead", run.names.dead_stream)):  # fmt: skip
            try:
                info = await ride(bus, "stream", lambda name=name: bus.js.stream_info(name))
                out[f"stream_bytes.{key}"] = float(info.state.bytes)
            except BusNotFound:
                out[f"stream_bytes.{key}"] = 0.0
        try:
            lag = await run.lag(TRAINERS)
            out["lag_refs"], out["lag_bytes"] = float(lag.messages), float(lag.bytes)
            out["trained"] = float(await run.ack_floor(TRAINERS))
        except BusNotFound:
            pass
    finally:
        await bus.close()
    return out


class Soak:
    """The processes of one soak and their samples (see the module doc)."""

    def __init__(self, args, work: Path):
        from specbus.core.config import dump_config
        from specbus.ops.bench.tiny_chat import build_chat_target, write_chats
        from specbus.ops.launch import QUIET_THREADS, Launcher
        from specbus.ops.services.nats import NatsServer

        self.args, self.work = args, work
        target = build_chat_target(work / "target")
        chats = write_chats(work / "chats.jsonl", n=200)
        self.cfg = soak_config(f"soak-{uuid.uuid4().hex[:6]}", work, target, chats, args)
        self.config = work / "run.yaml"
        self.config.write_text(dump_config(self.cfg))
        self.chats = chats
        self.server = NatsServer(work / "nats").start()
        self.procs = Launcher(work / "logs", env=QUIET_THREADS, session=True)
        self.rows: list[dict] = []

    def start(self) -> None:
        from specbus.ops.live_demo import _wait_http
        from specbus.ops.services.common import free_port

        common = ["--config", str(self.config), "--url", self.server.url]
        intake, serve = free_port(), free_port()
        self.procs.start("intake", ["intake", *common, "--port", str(intake)])
        self.procs.start("serve", ["serve", "--config", str(self.config), "--port", str(serve)])
        self.procs.ranks(1, ["train", *common])
        logs = self.work / "logs"
        _wait_http(
            f"http://127.0.0.1:{intake}", self.procs.procs["intake"], logs / "intake.log", 600
        )
        self.serve_url = f"http://127.0.0.1:{serve}"
        _wait_http(
            self.serve_url, self.procs.procs["serve"], logs / "serve.log", 600, handshake=True
        )
        self.procs.start("traffic", ["traffic", "--server", self.serve_url + "/v1", "--data",
                                     str(self.chats), "--holdout", "0", "--loop", "--qps",
                                     str(self.args.qps), "--concurrency", "2", "--max-tokens",
                                     str(self.args.max_tokens), "--allow-errors"])  # fmt: skip

    def sample(self, t: float) -> dict:
        row: dict = {"t": t}
        pids = {n: p.pid for n, p in self.procs.procs.items() if p.poll() is None}
        pids["nats-server"] = self.server.pid
        for name, pid in pids.items():
            stats = tree_stats(pid) if pid else None
            for key, value in (stats or {}).items():
                row[f"{key}.{name}"] = value
        row["store_bytes"] = float(tree_bytes(self.work / "shm"))
        row.update(asyncio.run(_bus_sample(self.cfg, self.server.url)))
        self.rows.append(row)
        return row

    def stop(self) -> None:
        self.procs.stop(timeout_s=60)  # the trainer saves its last step on SIGTERM
        self.server.stop()


def analyse(rows: list[dict], warmup: float) -> dict:
    """Each series' slope per hour after the warm-up, against its bound (module doc)."""
    if len(rows) < 3:
        return {"ok": False, "why": f"{len(rows)} samples: too few for a slope", "series": {}}
    t_end = rows[-1]["t"]
    kept = [r for r in rows if r["t"] >= warmup * t_end]
    series: dict[str, dict] = {}
    lines = []
    ok = True
    keys = sorted({k for r in kept for k in r if k not in ("t", "trained", "lag_bytes")})
    for key in keys:
        kind = key.split(".", 1)[0]
        if kind not in BOUNDS:
            continue
        pts = [(r["t"] / 3600, r[key]) for r in kept if key in r]
        if len(pts) < 3:
            continue
        f: Fit = fit([p[0] for p in pts], [p[1] for p in pts])
        bound, floor, unit = BOUNDS[kind]
        growth = f.slope * (pts[-1][0] - pts[0][0])  # the fitted line's rise over the window
        passed = f.bounded(bound) or growth <= floor
        ok &= passed
        series[key] = {"slope_per_h": f.slope, "slope_se": f.slope_se, "points": f.n,
                       "bound_per_h": bound, "growth": growth, "floor": floor, "ok": passed,
                       "first": pts[0][1], "last": pts[-1][1]}  # fmt: skip
        verdict = "ok" if passed else "OVER"
        lines.append(slope_line(key, f, unit, "h") + f"  bound {human(bound, unit)}/h, growth "
                     f"{human(growth, unit)} (floor {human(floor, unit)}): {verdict}  "
                     f"({human(pts[0][1], unit)} -> {human(pts[-1][1], unit)})")  # fmt: skip
    return {"ok": ok, "series": series, "lines": lines}


def run(args) -> dict:
    """Start the live run, sample it for `args.minutes`, stop it; the analysis and the rows."""
    work = Path(args.work or tempfile.mkdtemp(prefix="specbus-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    soak = Soak(args, work)
    try:
        soak.start()
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        while True:
            row = soak.sample(time.monotonic() - t0)
            print(f"[{row['t'] / 60:5.1f} min] trained {row.get('trained', 0):>6.0f}  lag "
                  f"{row.get('lag_refs', 0):>4.0f}  trainer rss "
                  f"{human(row.get('rss_bytes.trainer-0', 0), 'B')}  store "
                  f"{human(row['store_bytes'], 'B')}", flush=True)  # fmt: skip
            if (bad := soak.procs.failed()) is not None:
                raise RuntimeError(f"{bad[0]} exited {bad[1]}: {soak.procs.log(bad[0])[-3000:]}")
            if time.monotonic() >= end:
                break
            time.sleep(max(0.0, min(args.sample_s, end - time.monotonic())))
    finally:
        soak.stop()
    out = analyse(soak.rows, args.warmup)
    out.update({"trained": soak.rows[-1].get("trained", 0), "minutes": args.minutes,
                "args": vars(args), "rows": soak.rows, "work": str(work)})  # fmt: skip
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--sample-s", type=float, default=60.0)
    ap.add_argument(
        "--warmup", type=float, default=0.25, help="fraction of the run left out of the fits"
    )
    ap.add_argument("--qps", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--samples-cap", type=int, default=2 << 20, help="bus.samples_max_bytes")
    ap.add_argument("--work", default=None)
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = run(args)
    print(f"soak of {args.minutes:g} min: {out['trained']:.0f} refs trained; slopes after the "
          f"first {args.warmup:.0%}:")  # fmt: skip
    for line in out["lines"]:
        print("  " + line)
    print("PASS" if out["ok"] else f"FAIL{': ' + out['why'] if 'why' in out else ''}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
