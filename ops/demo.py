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
import yaml
from specbus.core.config import RunConfig, build_config, dump_config
from specbus.ops.launch import QUIET_THREADS, Launcher
from specbus.ops.observe import tensorboard_hint
from specbus.ops.services.common import Interrupted, interruptible, shielded
from specbus.ops.services.nats import NatsServer

STOP_TIMEOUT_S = 30.0  # a trainer stopping on SIGTERM saves a checkpoint first


def demo_config(args: argparse.Namespace) -> RunConfig:
    """Demo defaults < the config file < command-line overrides."""
    tree = yaml.safe_load(Path(args.config).read_text()) if args.config else {}
    tree = tree or {}
    if getattr(args, "strategy", None):
        tree.setdefault("strategy", {})["name"] = args.strategy
    user = build_config(tree, list(args.overrides))
    run = user.run if user.run != "default" else f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    defaults = {
        "run": run,
        "data.source": args.data or "gsm8k",
        "data.max_length": 384,
        "data.holdout": 50,
        "store.uri": f"shm://{run}",
        "store.budget_bytes": 1 << 30,
        "target.capture_batch": 2,
        "training.lr": 5e-4,
        "training.warmup_ratio": 0.02,
        "training.log_every": 5,
        "training.checkpoint_every": 50,
        "training.total_steps": 400,
        "training.max_minutes": args.minutes,
    }
    if user.strategy.name == "eagle3":
        defaults["strategy.draft.draft_vocab_size"] = 8192
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


def run_demo(args: argparse.Namespace) -> int:
    """`specbus demo` (see the module doc); its exit code (128 + the signal when interrupted)."""
    with interruptible():
        try:
            return _run_demo(args)
        except Interrupted as e:
            print(f"specbus demo: stopped by signal {e.signum}", file=sys.stderr, flush=True)
            return 128 + e.signum


def _remove_abandoned_shm(cfg: RunConfig) -> None:
    """The run's shm:// store once every process using it is gone (a killed child cannot
    remove it on close): the store's own sweep, which spares stores any live process holds."""
    if cfg.store.uri.startswith("shm://"):
        from specbus.core.store.shm import sweep_abandoned

        sweep_abandoned()


def _run_demo(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    cfg = demo_config(args)
    run_dir = cfg.resolved_run_dir
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"specbus demo: run {cfg.run} in {run_dir} (logs in {logs})", flush=True)

    from specbus.core.models.target import resolve_target_dir

    t0 = time.time()
    target_dir = resolve_target_dir(cfg.target.model)  # converts the embedded GGUF once
    print(f"target {cfg.target.model} ready in {time.time() - t0:.1f}s ({target_dir})", flush=True)

    server = None
    url = cfg.bus.url
    procs = Launcher(logs, env=QUIET_THREADS, session=True)
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
        procs.ranks(args.trainers, ["train", *common], show_rank0=True)
        pids = ", ".join(f"{name} {p.pid}" for name, p in procs.procs.items())
        print(f"started {pids}", flush=True)
        if hint := tensorboard_hint(cfg):
            print(hint, flush=True)
        trainers = [procs.procs[f"trainer-{r}"] for r in range(args.trainers)]
        while any(p.poll() is None for p in trainers):
            bad = procs.failed()
            if bad:
                print(
                    f"{bad[0]} exited with {bad[1]}; see {logs / (bad[0] + '.log')}",
                    file=sys.stderr,
                )
                return 1
            time.sleep(0.5)
        bad = procs.failed()
        if bad:
            print(f"{bad[0]} exited with {bad[1]}; see {logs / (bad[0] + '.log')}", file=sys.stderr)
            return 1
        print(f"training finished in {time.time() - t0:.0f}s", flush=True)
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

    torch.set_num_threads(
        max(1, min(4, os.cpu_count() or 1))
    )  # the trainers are gone: use the cores
    report = compare_drafts(
        cfg,
        num_prompts=args.eval_prompts or 20,
        max_new_tokens=args.eval_tokens or 64,
        progress=lambda message: print(message, flush=True),
    )
    print(report.table(), flush=True)
    out = export_checkpoint(cfg, "latest", run_dir / "export")
    print(f"exported the trained draft for SGLang: {out}", flush=True)
    return 0
