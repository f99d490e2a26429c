"""The pipeline subcommands: `feed`, `produce`, `train`, `capture`, `export`, `demo`.

Each takes the run config (`--config run.yaml` plus dotted `key=value` overrides) and the
broker URL (`--url`, else `bus.url`). `train` reads the torchrun environment (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK), so `torchrun --nproc-per-node 2 -m
specbus.ops.cli train ...` and plain `specbus train` are the same code.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from functools import partial

from specbus.core.errors import SpecbusError
from specbus.ops.args import add_common, config_of, resolve_url
from specbus.ops.elastic import add_elastic_arguments, serve_rendezvous
from specbus.ops.observe import METRICS_FILE, MetricsFile, samples_rate

log = logging.getLogger("specbus")


def format_row(row: dict[str, float], total: int | None = None) -> str:
    """One trainer log row as the console line rank 0 prints."""
    step = int(row["step"])
    parts = [f"step {step}" + (f"/{total}" if total else "")]
    for key, fmt in (("loss", "loss {:.3f}"), ("acc_0", "acc0 {:.3f}"), ("sim_accept_len", "tau {:.2f}"),
                     ("samples_per_s", None), ("tokens_per_s", "{:.0f} tok/s"),
                     ("data_wait_frac", "wait {:.1%}"), ("bus_s_per_step", "bus {:.1e}s/step")):  # fmt: skip
        if key in row:
            parts.append(fmt.format(row[key]) if fmt else samples_rate(row))
    for key in ("dead_letters", "recaptures"):
        if row.get(key):
            parts.append(f"{key.replace('_', ' ')} {int(row[key])}")
    if "store_bytes" in row:
        parts.append(
            f"store {row['store_bytes'] / 2**20:.1f}MiB (peak {row['store_peak_bytes'] / 2**20:.1f})"
        )
    return " | ".join(parts)


def cmd_feed(args: argparse.Namespace) -> int:
    """`specbus feed`: publish the run's tasks (ops/produce.py)."""
    cfg = config_of(args)
    url = resolve_url(args, cfg)  # before the heavy imports: no broker is said at once
    from specbus.ops.produce import run_feeder

    ahead = 4 * cfg.bus.max_ack_pending
    shown = {"published": -1}

    # Who captures the tasks: producers, or (colocated) the trainer ranks themselves.
    start = ("`specbus train` captures them" if cfg.deployment.mode == "colocated"
             else "Start `specbus produce` to go on")  # fmt: skip

    def on_progress(published: int, planned: int, waiting: int | None) -> None:
        if waiting is not None:
            print(f"run {cfg.run}: published {published} of {planned} tasks; waiting for "
                  f"producers: {waiting} tasks not yet captured (the feeder stays at most "
                  f"{ahead} tasks ahead, 4 x bus.max_ack_pending). {start}; Ctrl-C is safe "
                  "(`specbus feed` again resumes)", flush=True)  # fmt: skip
        elif published == planned or published - shown["published"] >= 1024:
            print(f"run {cfg.run}: published {published} of {planned} tasks", flush=True)
            shown["published"] = published

    print(f"run {cfg.run}: feeding {what_is_fed(cfg.data)} to {url}", flush=True)
    count = asyncio.run(run_feeder(cfg, bus_url=url, on_progress=on_progress))
    print(f"run {cfg.run}: {count} tasks fed (feed complete)")
    return 0


def what_is_fed(data) -> str:
    """The feed line's account of `data.limit` and `data.holdout` (core/data/datasets.py
    `split_holdout`): the hold-out is the dataset's last records, taken before the limit
    applies, so it never counts against the limit nor overlaps what is trained."""
    what = f"the first {data.limit} records of {data.source}" if data.limit else data.source
    if data.holdout:
        what += (f" (data.holdout: the dataset's last {data.holdout} records are held back for "
                 "evaluation, apart from data.limit)")  # fmt: skip
    if data.epochs > 1:
        what += f", {data.epochs} epochs"
    return what


def cmd_produce(args: argparse.Namespace) -> int:
    """`specbus produce`: one capture worker until the run is trained."""
    cfg = config_of(args)
    url = resolve_url(args, cfg)  # before the heavy imports: no broker is said at once
    from specbus.ops.produce import run_producer

    stats = asyncio.run(
        run_producer(
            cfg,
            bus_url=url,
            producer_id=args.id,
            exit_when_idle=args.exit_when_idle,
        )
    )
    print(f"producer done: {stats.summary()}", flush=True)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """`specbus train`: one trainer rank (ops/train.py), progress on rank 0; `--elastic
    MIN:MAX`: this host's torchrun agent of the elastic trainers (ops/elastic.py); under an
    elastic agent, a rank that resumes and tells its agent when its world must re-form."""
    from specbus.consumers.recording import is_run_name
    from specbus.ops.elastic import Member, launch, main_of_member

    cfg = config_of(args)
    if args.elastic:  # the agent needs no broker: a named one is passed on as is (its ranks wait)
        if args.from_recording:
            raise SpecbusError("--elastic trains from the broker, not --from-recording")
        return launch(args, cfg.run, args.url or cfg.bus.url or resolve_url(args, cfg))
    # A recording's directory needs no broker (nor looks for one); a recording run's name does.
    needs_broker = not args.from_recording or is_run_name(args.from_recording)
    url = resolve_url(args, cfg) if needs_broker else None
    member = Member.from_env()
    from specbus.ops.train import run_trainer

    if args.from_recording:  # W1: epochs over a recording (ops/offline.py)
        from specbus.ops.offline import run_recording_trainer

        run_trainer = partial(run_recording_trainer, recording=args.from_recording)
    metrics = MetricsFile(cfg.resolved_run_dir / "logs" / METRICS_FILE)
    total = cfg.training.max_steps

    def on_log(row: dict[str, float]) -> None:
        print(format_row(row, total), flush=True)
        metrics.write(row)

    if int(os.environ.get("RANK", 0)) == 0:
        print(f"run {cfg.run}: {training_source(cfg, args.from_recording, url)}", flush=True)
    if member is not None:  # an elastic rank: always resumes, says when its world must re-form
        return main_of_member(
            lambda: report(run_trainer(cfg, bus_url=url, resume=True, on_log=on_log), metrics),
            member,
        )
    report(run_trainer(cfg, bus_url=url, resume=args.resume, on_log=on_log), metrics)
    return 0


def report(result, metrics: MetricsFile):
    """Rank 0's last line and final metrics row of `specbus train`; returns `result`."""
    if result is not None and int(os.environ.get("RANK", 0)) == 0:
        what = "training stopped" if result.stopped else "training done"
        if result.stopped:
            dead = "dead letters not counted on a stop (`specbus status`)"
        elif result.recording:
            dead = "no dead letters to count (a recording: its capture run has them)"
        else:
            dead = dead_summary(result.dead_letters)
        print(f"{what}: {result.steps} steps, {result.samples} samples, {dead}, "
              f"checkpoint {result.checkpoint}")  # fmt: skip
        metrics.write({"final": 1, "steps": result.steps, "samples": result.samples,
                       "stopped": int(bool(result.stopped)), "dead_letters": result.dead_letters,
                       "checkpoint": str(result.checkpoint)})  # fmt: skip
    return result


def training_source(cfg, recording: str | None, url: str | None) -> str:
    """What a trainer rank trains from and waits for, for the line rank 0 starts with."""
    if recording and url is None:
        return (f"training {cfg.data.epochs} epoch(s) from the recording {recording} "
                "(a directory: no broker needed)")  # fmt: skip
    if recording:
        return (
            f"training from the recording run {recording!r} on {url} ({cfg.data.epochs} epoch(s))"
        )
    mode = cfg.deployment.mode
    if mode == "live":
        what = ("captured traffic: records the intake publishes (`specbus intake`, and "
                "`specbus serve` or your own server capturing through it)")  # fmt: skip
    elif mode == "colocated":
        what = "the run's tasks (from `specbus feed`; each rank captures its own)"
    elif cfg.target.engine == "sglang_server":
        what = ("the run's samples (tasks from `specbus feed`, captured by your SGLang server "
                "through `specbus intake`)")  # fmt: skip
    else:
        what = "the run's samples (from `specbus produce`, tasks from `specbus feed`)"
    return f"training on {url}; waiting for {what}"


def dead_summary(counts: dict | None) -> str:
    """`N dead letters (tasks: ..., samples: ...)` from `bus.dead.count_dead`'s counts."""
    if counts is None:
        return "dead letters unknown"
    total = sum(n for kinds in counts.values() for n in kinds.values())
    parts = [f"{kind}: " + ", ".join(f"{n} {how.replace('_', ' ')}" for how, n in kinds.items() if n)
             for kind, kinds in counts.items() if any(kinds.values())]  # fmt: skip
    return f"{total} dead letters" + (f" ({'; '.join(parts)}; `specbus dead`)" if parts else "")


def cmd_capture(args: argparse.Namespace) -> int:
    cfg = config_of(args)
    url = resolve_url(args, cfg)  # before the heavy imports: no broker is said at once
    from specbus.ops.capture import run_capture

    marker = run_capture(cfg, bus_url=url, feed=not args.no_feed, produce=not args.no_produce)
    print(
        f"recording {cfg.run}: {marker['samples']} samples ({marker['dead_letters']} dead "
        f"letters), {marker['bytes'] / 2**20:.1f} MiB in {marker['store_uri']}"
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """`specbus export`: a checkpoint as an SGLang (default) or speculators draft directory."""
    from specbus.ops.export import export_checkpoint

    cfg = config_of(args)
    out = export_checkpoint(cfg, args.checkpoint, args.out, args.format)
    print(f"exported {out}")
    return 0


def cmd_purge(args: argparse.Namespace) -> int:
    """`specbus purge --yes`: every object of a run's store that is gone; refuses without `--yes`."""
    from specbus.core.store import purge_store

    cfg = config_of(args)
    if not args.yes:
        print(
            f"this removes every object of {cfg.store.uri} (run {cfg.run!r}), read leases "
            "overridden: only for a run that is gone. Pass --yes to do it.",
            file=sys.stderr,
        )
        return 2
    freed = purge_store(cfg.store)
    print(f"purged {cfg.store.uri}: {freed} bytes freed")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """`specbus demo`: the whole pipeline on this machine (ops/demo.py); `--live`: trained
    from served traffic instead (ops/live_demo.py)."""
    if args.live:  # intake + capture-enabled server + traffic instead of feeder/producers
        from specbus.ops.live_demo import run_live_demo

        return run_live_demo(args)
    from specbus.ops.demo import run_demo

    return run_demo(args)


def add_pipeline_commands(sub: argparse._SubParsersAction) -> None:
    """Register `feed`, `produce`, `train`, `export`, `purge` and `demo`."""
    p = sub.add_parser("feed", help="publish the dataset's tasks to the run's TASKS stream")
    add_common(p)
    p.set_defaults(func=cmd_feed)

    p = sub.add_parser("produce", help="join the producers group: capture tasks into the store")
    add_common(p)
    p.add_argument("--id", default=None, help="producer id (default host-pid)")
    p.add_argument(
        "--exit-when-idle",
        action="store_true",
        help="exit once the feed is complete and no task is pending",
    )
    p.set_defaults(func=cmd_produce)

    p = sub.add_parser("train", help="one trainer rank (torchrun sets RANK/WORLD_SIZE)")
    add_common(p)
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint (replay from its cursor)",
    )
    p.add_argument(
        "--from-recording",
        default=None,
        metavar="REC",
        help="train data.epochs epochs over a recording: its directory, a speculators or "
        "SpecForge dump directory, or the run name of a recording on the broker (see specbus capture)",
    )
    add_elastic_arguments(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("rendezvous", help="serve the elastic trainers' c10d rendezvous")
    p.add_argument("--rdzv-endpoint", default="127.0.0.1:29400", help="HOST:PORT to serve")
    p.set_defaults(func=lambda args: serve_rendezvous(args.rdzv_endpoint))

    p = sub.add_parser(
        "capture", help="capture the dataset once into a file:// store, as a recording"
    )
    add_common(p)
    p.add_argument("--no-feed", action="store_true", help="the tasks are fed already")
    p.add_argument(
        "--no-produce", action="store_true", help="only wait for other producers, then finalize"
    )
    p.set_defaults(func=cmd_capture)

    p = sub.add_parser(
        "export", help="export a checkpoint as an SGLang draft (EAGLE3, DFLASH, DSPARK)"
    )
    add_common(p)
    p.add_argument("--checkpoint", default="latest", help="latest, best, or a checkpoint directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--format", choices=["sglang", "speculators"], default="sglang",
                   help="sglang: SGLang's draft layout; speculators: vLLM's (EAGLE3, DFlash, DSpark; docs/vllm.md)")  # fmt: skip
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("purge", help="remove every stored feature of a run that is gone")
    add_common(p)
    p.add_argument("--yes", action="store_true", help="the run is gone: remove its objects")
    p.set_defaults(func=cmd_purge)

    p = sub.add_parser("demo", help="the whole pipeline on this machine (SmolLM2-135M, GSM8K)")
    add_common(p)
    p.add_argument("--minutes", type=float, default=3.0, help="training time budget")
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--producers", type=int, default=1)
    p.add_argument(
        "--target", default=None, help="a local HF model directory (default: SmolLM2-135M-Instruct)"
    )
    p.add_argument("--data", default=None, help="gsm8k, chatterbot, or a JSONL path")
    p.add_argument(
        "--strategy",
        default=None,
        help="eagle3 (default), dflash, domino or dspark (strategy.name)",
    )
    p.add_argument("--eval-prompts", type=int, default=None,
                   help="held-back prompts measured (20; --live: 6)")  # fmt: skip
    p.add_argument("--eval-tokens", type=int, default=None,
                   help="tokens generated per prompt (64; --live: 40)")  # fmt: skip
    p.add_argument(
        "--eval-live",
        type=int,
        default=1,
        help="prompts also decoded live with the trained draft (a cross-check of the replay)",
    )
    live = p.add_argument_group("live mode (--live)")
    live.add_argument("--live", action="store_true",
                      help="train from served traffic: intake + `specbus serve` + traffic, no feeder")  # fmt: skip
    live.add_argument("--qps", type=float, default=1.0, help="traffic: Poisson arrival rate")
    live.add_argument("--concurrency", type=int, default=4, help="traffic: requests in flight")
    live.add_argument("--max-tokens", type=int, default=64, help="traffic: tokens per answer")
    p.set_defaults(func=cmd_demo)
