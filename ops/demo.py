"""`specbus demo`: the whole pipeline on one machine, as a user would run it.

Starts the embedded broker (unless `bus.url` is set), prepares the target (the embedded
SmolLM2-135M-Instruct by default, converted once and cached), then runs the feeder, the
producers and the trainer ranks as separate processes (the trainers under the torchrun
environment contract, gloo on CPU), shows rank 0's progress, and at the end measures the
acceptance length of the untrained and the trained draft with real speculative decoding
(k = 3 draft tokens, greedy, checked lossless) on held-back prompts, and exports the trained
draft for SGLang. Logs of every process go to `<run_dir>/logs/`.

Interrupting it (Ctrl-C, SIGTERM) stops every child by PID (trainers and producers first,
then the broker), removes the run's shared-memory store and exits with 128 + the signal. The
children also get SIGTERM from the kernel if the demo itself is killed (even by kill -9), and
run in their own sessions: a terminal's Ctrl-C reaches only the demo, which stops them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from specbus.core.config import RunConfig, build_config, dump_config, read_config_tree
from specbus.core.errors import ConfigError
from specbus.ops.launch import QUIET_THREADS, Launcher
from specbus.ops.observe import tensorboard_hint
from specbus.ops.progress import phase
from specbus.ops.services.common import exit_code_interruptible, shielded
from specbus.ops.services.nats import NatsServer

STOP_TIMEOUT_S = 30.0  # a trainer stopping on SIGTERM saves a checkpoint first


def demo_config(args: argparse.Namespace) -> RunConfig:
    """Demo defaults < the config file < command-line overrides. `ConfigError` for a missing
    or malformed file, a bad key or value."""
    tree = read_config_tree(args.config)
    if getattr(args, "strategy", None):
        tree.setdefault("strategy", {})["name"] = args.strategy
    user = build_config(tree, list(args.overrides))
    run = user.run if user.run != "default" else f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    # Sized for a 2-core CPU (see docs/benchmarks.md, Demo): short samples, three TTT positions
    # (the k=3 drafting the evaluation measures), a high learning rate (3e-3: 1.261 measured
    # after 45 steps vs 1.190 after 48 at 1e-3, one run each).
    defaults = {
        "run": run,
        "data.source": args.data or "gsm8k",
        "data.max_length": 256,
        "data.over_length": "truncate",  # GSM8K's longer chats cut to 256 tokens (SpecForge's way)
        "data.holdout": 50,
        "store.uri": f"shm://{run}",
        "store.budget_bytes": 1 << 30,
        "target.capture_batch": 2,
        "strategy.ttt_length": 3,
        "training.lr": 3e-3,
        "training.warmup_ratio": 0.02,
        "training.log_every": 5,
        "training.checkpoint_every": 50,
        "training.total_steps": 400,
        "training.max_minutes": args.minutes,
    }
    if getattr(args, "url", None):
        defaults["bus.url"] = args.url
    if user.strategy.name in ("eagle3", "peagle"):  # a reduced draft vocabulary
        defaults["strategy.draft.draft_vocab_size"] = 8192
        if user.strategy.name == "peagle":  # peagle has no TTT unroll
            del defaults["strategy.ttt_length"]
    else:  # DFlash family on a CPU: smaller blocks and fewer anchors per sample
        defaults["strategy.block_size"] = 8
        defaults["strategy.num_anchors"] = 64
    if args.target:
        defaults["target.model"] = args.target
    for dotted, value in defaults.items():
        node = tree
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node.setdefault(leaf, value)
    return build_config(tree, list(args.overrides))


def check_inputs(args: argparse.Namespace, cfg: RunConfig) -> None:
    """What would make a child fail later, checked before any process starts: the process
    counts, the data source (readable, enough records for the holdout). `ConfigError`."""
    if args.trainers < 1 or args.producers < 1:
        raise ConfigError(
            f"--trainers {args.trainers} --producers {args.producers}: the demo needs at least "
            "one of each"
        )
    from specbus.core.data.datasets import load_source, split_holdout

    try:
        records = load_source(cfg.data.source)
    except ConfigError:
        raise
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.source {cfg.data.source!r} cannot be read: {e}") from e
    train, held = split_holdout(records, cfg.data.holdout, cfg.data.limit)
    if not train:
        raise ConfigError(f"data.source {cfg.data.source!r} has no training records")
    if not held:
        raise ConfigError(
            f"data.holdout={cfg.data.holdout}: the demo measures the drafts on held-back "
            "records; hold some back"
        )


def run_demo(args: argparse.Namespace) -> int:
    """`specbus demo` (see the module doc); its exit code (128 + the signal when interrupted)."""
    return exit_code_interruptible("specbus demo", lambda: _run_demo(args))


def _remove_abandoned_shm(cfg: RunConfig) -> None:
    """The run's shm:// store once every process using it is gone (a killed child cannot
    remove it on close): the store's own sweep, which spares stores any live process holds."""
    if cfg.store.uri.startswith("shm://"):
        from specbus.core.store.shm import sweep_abandoned

        sweep_abandoned()


def prepare_target(model: str, cache_dir: str | Path | None, log: Path, *, stream=None,
                   every_s: float = 15.0) -> Path:  # fmt: skip
    """The target's directory (the embedded GGUF converted once and cached), with a progress
    bar and ETA over the conversion's steps (core/models/gguf_convert.py); what the conversion
    prints (warnings, any third-party output) goes to `log`, never between our lines."""
    from contextlib import redirect_stderr

    from specbus.core.models.target import resolve_target_dir

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:  # the conversion's own bars would interleave with ours
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass
    with phase(f"preparing target {model}", 100, "%", stream=stream, every_s=every_s) as p:

        def progress(done: float, total: float, what: str) -> None:
            p.update(100 * done / total, info=what)

        with open(log, "a") as out, redirect_stderr(out):
            target_dir = resolve_target_dir(model, cache_dir, progress)
        p.info = str(target_dir)  # shown when the phase ends
    return target_dir


def budget_progress(elapsed: float, budget_s: float | None, info: str) -> tuple[float, str]:
    """The training bar's position and info at `elapsed` seconds of a `budget_s` time budget.
    The budget runs from the trainers' first fetch, so past it the last step and its
    checkpoint are still to come: the bar says so at 100% (no ETA) rather than sitting at
    "99%, ETA 0:01" (measured: 15 s there)."""
    if budget_s and elapsed >= budget_s:
        return budget_s, f"time budget used: finishing the last step and its checkpoint | {info}"
    return elapsed, info


def _train(procs: Launcher, cfg: RunConfig, trainers: list, logs: Path) -> int:
    """Wait for the trainer ranks with a progress bar over the time budget; 0, or 1 when a
    child failed (named, with its log)."""
    from specbus.ops.observe import METRICS_FILE, read_metrics

    budget_s = (cfg.training.max_minutes or 0) * 60 or None
    metrics = logs / METRICS_FILE
    started = time.monotonic()
    with phase("training", budget_s, "s") as p:
        while any(t.poll() is None for t in trainers):
            bad = procs.failed()
            if bad:
                break
            rows = [r for r in read_metrics(metrics) if "final" not in r]
            info = "waiting for the first samples (target capture)"
            if rows:
                r = rows[-1]
                info = (f"step {int(r['step'])} | loss {r.get('loss', float('nan')):.2f} | "
                        f"tau {r.get('sim_accept_len', float('nan')):.2f} | "
                        f"{r.get('samples_per_s', 0) * len(trainers):.1f} samples/s | "
                        f"wait {r.get('data_wait_frac', 0):.0%}")  # fmt: skip
            done, info = budget_progress(time.monotonic() - started, budget_s, info)
            p.update(done, info=info)
            time.sleep(0.5)
    bad = procs.failed()
    if bad:
        print(f"{bad[0]} exited with {bad[1]}; see {logs / (bad[0] + '.log')}", file=sys.stderr)
        return 1
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    started = time.monotonic()
    cfg = demo_config(args)
    check_inputs(args, cfg)
    run_dir = cfg.resolved_run_dir
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"specbus demo: run {cfg.run} in {run_dir} (logs in {logs})", flush=True)
    times: dict[str, float] = {}

    t0 = time.monotonic()
    prepare_target(cfg.target.model, cfg.target.cache_dir, logs / "target.log")
    times["target"] = time.monotonic() - t0

    server = None
    url = cfg.bus.url
    procs = Launcher(logs, env={**QUIET_THREADS, "HF_HUB_DISABLE_PROGRESS_BARS": "1"},
                     session=True)  # fmt: skip
    t0 = time.monotonic()
    try:
        if url is None:
            server = NatsServer(run_dir / "nats").start()
            url = server.url
            print(f"embedded nats-server on {url} (pid {server.pid})", flush=True)
        config_path = run_dir / "config.yaml"
        config_path.write_text(dump_config(cfg))
        common = ["--config", str(config_path), "--url", url]
        procs.start("feeder", ["feed", *common])
        for i in range(args.producers):
            procs.start(f"producer-{i}", ["produce", *common, "--id", f"producer-{i}"])
        procs.ranks(args.trainers, ["train", *common])
        pids = ", ".join(f"{name} {p.pid}" for name, p in procs.procs.items())
        print(f"started {pids}", flush=True)
        if hint := tensorboard_hint(cfg):
            print(hint, flush=True)
        trainers = [procs.procs[f"trainer-{r}"] for r in range(args.trainers)]
        if _train(procs, cfg, trainers, logs):
            return 1
        times["training"] = time.monotonic() - t0
        if not any((run_dir / "checkpoints").glob("step-*")):
            print(f"no training step was taken; see {logs}", file=sys.stderr)
            return 1
    finally:
        with shielded():  # a second Ctrl-C must not leave children behind
            procs.stop(STOP_TIMEOUT_S)
            if server is not None:
                server.stop()
            _remove_abandoned_shm(cfg)

    from specbus.ops.evaluate import compare_drafts
    from specbus.ops.export import export_checkpoint

    torch.set_num_threads(eval_threads())  # the trainers are gone
    t0 = time.monotonic()
    report = compare_drafts(
        cfg,
        num_prompts=args.eval_prompts or 20,
        max_new_tokens=args.eval_tokens or 64,
        live_check=args.eval_live,
        phase=phase,
    )
    times["evaluation"] = time.monotonic() - t0
    print(report.table(), flush=True)
    out = export_checkpoint(cfg, "latest", run_dir / "export")
    times["total"] = time.monotonic() - started
    print(summary(cfg, args, report, out, times, url_was_embedded=server is not None), flush=True)
    return 0


def eval_threads() -> int:
    """Threads for the target's forwards in the evaluation: the cores (up to 4), or one when
    the machine is busier than its cores (oversubscribed threads spin: 6x slower measured)."""
    cores = os.cpu_count() or 1
    return 1 if os.getloadavg()[0] >= cores else max(1, min(4, cores))


def summary(cfg: RunConfig, args: argparse.Namespace, report, export_dir: Path,
            times: dict[str, float], *, url_was_embedded: bool, traffic=None) -> str:  # fmt: skip
    """The lines the demo ends with: what ran, throughput, acceptance, where things are, what
    to try next. A live run (`deployment.mode: live`, `specbus demo --live`) says it trained
    from served traffic, with `traffic`'s first line (an `ops.traffic.TrafficReport`)."""
    from specbus.ops.observe import METRICS_FILE, read_metrics

    run_dir = cfg.resolved_run_dir
    logs = run_dir / "logs"
    rows = read_metrics(logs / METRICS_FILE)
    final = next((r for r in reversed(rows) if "final" in r), {})
    steps = [r for r in rows if "final" not in r]
    rate = sum(r.get("samples_per_s", 0) for r in steps) / max(len(steps), 1)
    wait = sum(r.get("data_wait_frac", 0) for r in steps) / max(len(steps), 1)
    split = ", ".join(f"{k} {v:.0f}s" for k, v in times.items() if k != "total")
    live = cfg.deployment.mode == "live"
    if live:
        ran = (f"{cfg.strategy.name} draft for {cfg.target.model} from served traffic "
               f"(`specbus serve` capturing, the intake, {args.trainers} trainer rank(s)): ")  # fmt: skip
    else:
        ran = (f"{cfg.strategy.name} draft for {cfg.target.model} on {cfg.data.source}: "
               f"{args.producers} producer(s), {args.trainers} trainer rank(s), ")  # fmt: skip
    lines = [
        "",
        f"== specbus demo{' --live' if live else ''}: done in "
        f"{times.get('total', 0) / 60:.1f} min ({split})",
        f"ran       {ran}{final.get('steps', '?')} steps, {final.get('samples', '?')} samples",
        # each rank logs its own rate; in lockstep every rank trains the same share
        f"training  {rate * args.trainers:.2f} samples/s over {args.trainers} rank(s) "
        f"({rate:.2f} per rank), data wait {wait:.0%} of step time (mean over "
        f"{len(steps)} log intervals)",
        f"accept    untrained {report.untrained.accept_length:.3f} -> trained "
        f"{report.trained.accept_length:.3f} tokens/verify (k={report.num_draft_tokens}, "
        f"{report.trained.prompts} held-back prompts)",
        f"export    {export_dir} (SGLang draft)",
        f"ckpts     {cfg.training.checkpoint_dir or run_dir / 'checkpoints'}",
        f"logs      {logs} (metrics: {logs / METRICS_FILE})",
    ]
    if traffic is not None:
        lines.insert(4, "users     " + traffic.summary().splitlines()[0].removeprefix("traffic: "))
    tb = Path(cfg.resolved_tensorboard_dir)
    if tb.is_dir():  # written by rank 0 (ops/observe.py) when tensorboard is installed
        lines.append(f"board     tensorboard --logdir {tb}")
    config = run_dir / "config.yaml"
    if live:
        lines += [
            "next      specbus demo --live --minutes 10             # a longer run, a better draft",
            f"          specbus export --config {config} --checkpoint best --out DIR",
            "          your own server or SGLang: docs/live.md ('Your own server'), docs/sglang.md",
        ]
    else:
        lines += [
            "next      specbus demo --minutes 10                    # a longer run, a better draft",
            f"          specbus export --config {config} --checkpoint best --out DIR",
            "          the pieces by hand: README.md, 'The pieces by hand' (examples/short-run.yaml)",
        ]
    if url_was_embedded:
        lines.append(f"          specbus up --config {config} & specbus status --config {config}")
    return "\n".join(lines)
