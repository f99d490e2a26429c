"""`specbus demo --live`: live mode on one machine, as a deployment would run it.

Starts the embedded broker, the intake (`specbus intake`: it writes the live manifest, the
vocab prior from GSM8K), two trainer ranks (`specbus train`, `deployment.mode=live`), the
capture-enabled server (`specbus serve --speculative` on the embedded SmolLM2-135M-Instruct:
it decodes with the draft being trained, reloaded at every checkpoint) and, in this process,
the traffic driver (the `openai` client replaying GSM8K questions at a Poisson rate, minus the
held-back ones). While the trainers run, the served acceptance is printed from the server's
own `/metrics` (the untrained draft's, then each reloaded one's: `ops/served.py`). Training
ends at `--minutes` (the trainers' time budget: a live run has no end of data); then traffic
stops, a few greedy probes are answered by the server with the last draft and checked
against the target's own greedy output, the server and the intake stop, and, as in `specbus
demo`, the acceptance length of the untrained and the trained draft is measured on held-back
prompts, the trained draft is exported for SGLang, and it ends with the same summary block
(ops/demo.py `summary`: what ran, the traffic, throughput, acceptance, where things are, what
to try next). Logs in `<run_dir>/logs/`.

Ctrl-C / SIGTERM stops every child by PID (the children also die with the demo, even on
kill -9: parent-death signal).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import threading
import time

import torch
from specbus.core.config import RunConfig, build_config, dump_config
from specbus.ops.demo import (
    STOP_TIMEOUT_S,
    _remove_abandoned_shm,
    demo_config,
    eval_threads,
    prepare_target,
    summary,
)
from specbus.ops.launch import QUIET_THREADS, Launcher
from specbus.ops.served import AcceptanceLog, lossless_check, probe
from specbus.ops.services.common import exit_code_interruptible, free_port, shielded
from specbus.ops.services.nats import NatsServer

PROBES = 4  # greedy requests checked against the target's own greedy output at the end


def live_demo_config(args: argparse.Namespace) -> RunConfig:
    """`specbus demo`'s defaults, in live mode: one sample per micro-batch (traffic is
    slower than a feeder) and a shorter schedule; overrides still win."""
    cfg = demo_config(args)
    tree = cfg.model_dump(mode="json")
    tree["deployment"]["mode"] = "live"
    tree["training"]["micro_batch"] = 1
    if tree["training"]["total_steps"] == 400:  # the driven demo's schedule: traffic is slower
        tree["training"]["total_steps"] = 100
    tree["live"]["max_new_tokens"] = args.max_tokens
    return build_config(tree, list(args.overrides))


def _wait_http(url: str, proc, log, timeout_s: float, handshake: bool = False) -> None:
    """Wait for `url`'s /healthz to say ok (and, with `handshake`, that the server has the
    intake's handshake); raises `RuntimeError` when `proc` exits first or at the deadline."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}; see {log}")
        try:
            state = httpx.get(url + "/healthz", timeout=1.0).json()
            if state.get("ok") and (not handshake or state.get("handshake")):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"not ready after {timeout_s:.0f}s; see {log}")


def run_live_demo(args: argparse.Namespace) -> int:
    """`specbus demo --live` (module doc); its exit code (128 + the signal when interrupted)."""
    return exit_code_interruptible("specbus demo", lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    from specbus.ops.traffic import load_prompts, run_traffic

    torch.set_num_threads(1)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per readiness probe
    started = time.time()
    t_started = time.monotonic()
    times: dict[str, float] = {}
    cfg = live_demo_config(args)
    run_dir = cfg.resolved_run_dir
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"specbus demo --live: run {cfg.run} in {run_dir} (logs in {logs})", flush=True)
    target_dir = prepare_target(cfg.target.model, None, logs / "target.log")
    times["target"] = time.monotonic() - t_started
    print(
        f"target {cfg.target.model} ready in {time.time() - started:.1f}s ({target_dir})",
        flush=True,
    )
    prompts = load_prompts(args.data or "gsm8k", holdout=cfg.data.holdout)

    server = None
    url = cfg.bus.url
    procs = Launcher(logs, env=QUIET_THREADS, session=True)
    traffic_stop = threading.Event()
    traffic_box: dict = {}
    try:
        if url is None:
            server = NatsServer(run_dir / "nats").start()
            url = server.url
            print(f"embedded nats-server on {url} (pid {server.pid})", flush=True)
        config_path = run_dir / "config.yaml"
        config_path.write_text(dump_config(cfg))
        common = ["--config", str(config_path), "--url", url]
        intake_port, serve_port = free_port(), free_port()
        procs.start("intake", ["intake", *common, "--port", str(intake_port)])
        procs.start("serve", ["serve", *common, "--port", str(serve_port), "--speculative"])
        procs.ranks(args.trainers, ["train", *common], show_rank0=True)
        print("started " + ", ".join(f"{n} {p.pid}" for n, p in procs.procs.items()), flush=True)
        _wait_http(
            f"http://127.0.0.1:{intake_port}", procs.procs["intake"], logs / "intake.log", 300
        )
        serve_url = f"http://127.0.0.1:{serve_port}"
        _wait_http(serve_url, procs.procs["serve"], logs / "serve.log", 300, handshake=True)
        print(f"intake on 127.0.0.1:{intake_port}, server on {serve_url}/v1: traffic at "
              f"{args.qps:g} req/s (Poisson, {args.concurrency} in flight at most, "
              f"{args.max_tokens} tokens each)", flush=True)  # fmt: skip

        def traffic() -> None:
            async def go():
                stop = asyncio.Event()
                loop = asyncio.get_running_loop()
                threading.Thread(target=lambda: (traffic_stop.wait(), loop.call_soon_threadsafe(stop.set)),
                                 daemon=True).start()  # fmt: skip
                return await run_traffic(
                    serve_url + "/v1", prompts, qps=args.qps, concurrency=args.concurrency,
                    loop=True, max_tokens=args.max_tokens, temperature=0.0, stop=stop,
                    seed=cfg.data.seed,
                )  # fmt: skip

            try:
                traffic_box["report"] = asyncio.run(go())
            except Exception as e:  # noqa: BLE001 - reported below
                traffic_box["error"] = e

        driver = threading.Thread(target=traffic, name="traffic", daemon=True)
        driver.start()
        trainers = [procs.procs[f"trainer-{r}"] for r in range(args.trainers)]
        print("served acceptance (the server's own /metrics; the draft reloads at every "
              "checkpoint):", flush=True)  # fmt: skip
        served_log, polled = AcceptanceLog(serve_url), 0.0
        while any(p.poll() is None for p in trainers):
            if time.monotonic() - polled >= 15:
                polled = time.monotonic()
                for line in served_log.poll():
                    print(line, flush=True)
            bad = procs.failed()
            if bad:
                print(
                    f"{bad[0]} exited with {bad[1]}; see {logs / (bad[0] + '.log')}",
                    file=sys.stderr,
                )
                return 1
            time.sleep(0.5)
        traffic_stop.set()
        driver.join(300)
        for line in served_log.poll():
            print(line, flush=True)
        probes = probe(serve_url, prompts[:PROBES], args.max_tokens)  # the last draft serving
        bad = procs.failed()
        if bad:
            print(f"{bad[0]} exited with {bad[1]}; see {logs / (bad[0] + '.log')}", file=sys.stderr)
            return 1
        if "report" in traffic_box:
            print(traffic_box["report"].summary(), flush=True)
        else:
            print(f"traffic failed: {traffic_box.get('error')}", file=sys.stderr, flush=True)
        times["training"] = time.monotonic() - t_started - times["target"]
        print(f"training finished in {time.time() - started:.0f}s", flush=True)
        if not any((run_dir / "checkpoints").glob("step-*")):
            print(f"no training step was taken; see {logs}", file=sys.stderr)
            return 1
    finally:
        with shielded():
            traffic_stop.set()
            procs.stop(
                STOP_TIMEOUT_S
            )  # serve prints its capture counts, intake its record counts on SIGTERM
            if server is not None:
                server.stop()
            _remove_abandoned_shm(cfg)
    for name in ("serve", "intake"):
        tail = [ln for ln in (logs / f"{name}.log").read_text(errors="replace").splitlines()
                if ln.startswith(("capture:", "specbus intake stopped"))]  # fmt: skip
        if tail:
            print(f"{name}: {tail[-1]}", flush=True)
    differ, dtype = lossless_check(cfg, probes, args.max_tokens)
    versions = sorted({v for _, _, s in probes if s for v in s["draft_versions"]})
    print(f"served outputs equal the target's greedy output: {len(probes) - len(differ)} of "
          f"{len(probes)} probes (draft versions {versions}, {dtype})", flush=True)  # fmt: skip
    for d in differ:
        print(f"  probe {d.probe} departs at token {d.token}, where the target's top-2 logit "
              f"margin is {d.margin:.4f}", flush=True)  # fmt: skip
    if differ and dtype == "float32":
        print(f"probes {[d.probe for d in differ]} differ from the target's greedy output",
              file=sys.stderr)  # fmt: skip
        return 1

    from specbus.ops.evaluate import compare_drafts
    from specbus.ops.export import export_checkpoint
    from specbus.ops.progress import phase

    torch.set_num_threads(eval_threads())  # the trainers and the server are gone
    # the same replayed measurement as `specbus demo` (ops/evaluate.py); fewer, shorter
    # held-back prompts by default, since a live run trains fewer steps
    t0 = time.monotonic()
    report = compare_drafts(cfg, num_prompts=args.eval_prompts or 6,
                            max_new_tokens=args.eval_tokens or 40,
                            live_check=args.eval_live, phase=phase)  # fmt: skip
    times["evaluation"] = time.monotonic() - t0
    print(report.table(), flush=True)
    out = export_checkpoint(cfg, "latest", run_dir / "export")
    times["total"] = time.monotonic() - t_started
    # the same closing block as `specbus demo`: what ran, throughput, acceptance, where things are
    print(summary(cfg, args, report, out, times, url_was_embedded=server is not None,
                  traffic=traffic_box.get("report")), flush=True)  # fmt: skip
    return 0
