"""Live mode, part 3 of `ops/bench/live.py`: the closed loop. One run.

A live run trains from the traffic of a `specbus serve --speculative` server that decodes with
the draft being trained (reloaded at every checkpoint through the run KV): the embedded broker,
`specbus intake`, `--trainers` ranks, the server (`--servers` replicas; each verifies a wave
of up to `--serve-batch` requests in one forward a round), and users (`ops/traffic.py`, the `openai`
client, Poisson arrivals of GSM8K or ShareGPT prompts, greedy) for `--loop-minutes`.
Measured, from the server's own `/metrics` (`ops/served.py`):
- the served acceptance over time: tokens per verify of every draft version (k =
  `--draft-tokens`), the time the serving draft first reached `--goal` (2.0 by default);
- user-visible errors (none expected);
- after the trainers stop, served tokens/s with the final draft vs without a draft on the same
  server (`POST /v1/spec-decode`, ABBA rounds of `--ab-requests` back-to-back requests at
  `--ab-concurrency`), and the tokens per verify during those rounds;
- lossless: `--probes` greedy answers with the final draft against the target's own greedy
  output, decoded token by token (fp32: equal; bf16 can round a near-tie apart).

On CUDA the server and the trainers share the GPU (`--device cuda`; SmolLM2-135M-Instruct, k
= 3: the issue's goal is 1.0 -> >= 2.0 within 10 minutes). On a CPU the figures are ratios
of a short run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from pathlib import Path

import httpx
from specbus.core.config import build_config, dump_config
from specbus.ops.launch import Launcher
from specbus.ops.served import AcceptanceLog, lossless_check, probe, scrape
from specbus.ops.services.common import free_port, stop_pid
from specbus.ops.traffic import load_prompts, percentile, run_traffic


def loop_config(args, work: Path, run: str):
    """The loop's run: live, EAGLE3 (or `--strategy`), checkpoints every `--checkpoint-every`."""
    tree = {
        "run": run, "run_dir": str(work / "loop"),
        "target": {"model": args.target, "device": args.device, "dtype": args.dtype},
        "store": {"uri": f"shm://{run}", "budget_bytes": 2 << 30},
        "data": {"source": args.data, "holdout": 50, "max_length": 512},
        "strategy": {"name": args.strategy},
        "deployment": {"mode": "live"},
        "training": {"total_steps": args.total_steps, "checkpoint_every": args.checkpoint_every,
                     "log_every": 5, "micro_batch": args.micro_batch, "lr": args.lr},
        "live": {"max_new_tokens": args.loop_max_tokens, "serve_batch": args.serve_batch},
    }  # fmt: skip
    if args.strategy == "eagle3":
        tree["strategy"]["draft"] = {"draft_vocab_size": args.draft_vocab}
    return build_config(tree)


def wait_ready(url: str, proc, log: Path, key: str = "ok", timeout_s: float = 900) -> None:
    """Poll `url`'s /healthz for `key`; `RuntimeError` with the log's tail if `proc` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/healthz", timeout=1).json().get(key):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f}s")


def _users(url: str, prompts, args, stop: threading.Event, box: dict) -> threading.Thread:
    async def go():
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        threading.Thread(target=lambda: (stop.wait(), loop.call_soon_threadsafe(done.set)),
                         daemon=True).start()  # fmt: skip
        return await run_traffic(url + "/v1", prompts, qps=args.loop_qps, loop=True,
                                 concurrency=args.loop_concurrency, stop=done,
                                 max_tokens=args.loop_max_tokens, temperature=0.0)  # fmt: skip

    def run() -> None:
        try:
            box["report"] = asyncio.run(go())
        except Exception as e:  # noqa: BLE001 - reported
            box["error"] = repr(e)

    thread = threading.Thread(target=run, name="users", daemon=True)
    thread.start()
    return thread


async def _switch(url: str, enabled: bool) -> None:
    async with httpx.AsyncClient() as c:
        (await c.post(url + "/v1/spec-decode", json={"enabled": enabled})).raise_for_status()


def ab_rounds(url: str, prompts, args) -> dict:
    """Served tokens/s with the draft (on) vs without (off), ABBA rounds on one server; the
    tokens per verify of the on arms (the metrics' delta)."""
    arms = {a: {"tokens": 0, "wall_s": 0.0, "latency": [], "errors": 0} for a in ("on", "off")}
    paired = []
    before = scrape(url)
    for r in range(args.ab_rounds):
        batch = [
            prompts[(r * args.ab_requests + i) % len(prompts)] for i in range(args.ab_requests)
        ]
        got = {}
        for arm in ("on", "off") if r % 4 in (0, 3) else ("off", "on"):
            asyncio.run(_switch(url, arm == "on"))
            rep = asyncio.run(run_traffic(url + "/v1", batch, qps=0, requests=len(batch),
                                          concurrency=args.ab_concurrency, stream=False,
                                          max_tokens=args.loop_max_tokens))  # fmt: skip
            got[arm] = rep.completion_tokens / max(rep.wall_s, 1e-9)
            a = arms[arm]
            a["tokens"] += rep.completion_tokens
            a["wall_s"] += rep.wall_s
            a["latency"] += rep.latency_s
            a["errors"] += sum(rep.errors.values())
        paired.append(got["on"] / max(got["off"], 1e-9))
        print(f"  round {r}: {got['on']:.1f} tok/s with the draft, {got['off']:.1f} without",
              flush=True)  # fmt: skip
    asyncio.run(_switch(url, True))
    after = scrape(url)
    v = after.version
    b = (before.versions.get(v) or {}) if before else {}
    a = after.versions.get(v) or {}
    verifies = a.get("verifies", 0) - b.get("verifies", 0)
    out = {f"{arm}_tokens_per_s": d["tokens"] / max(d["wall_s"], 1e-9) for arm, d in arms.items()}
    out.update({f"{arm}_latency_p50_s": percentile(d["latency"], 50) for arm, d in arms.items()})
    out.update({f"{arm}_errors": d["errors"] for arm, d in arms.items()})
    out["ratio_tokens_per_s"] = out["on_tokens_per_s"] / max(out["off_tokens_per_s"], 1e-9)
    out["paired_ratios"] = paired
    out["paired_ratio_median"] = percentile(paired, 50)
    out["draft_version"] = v
    out["accept_length"] = (
        (a.get("tokens", 0) - b.get("tokens", 0)) / verifies if verifies else None
    )
    return out


def _merge(reports: list) -> dict:
    """The users' reports of every server as one (counts summed, errors merged)."""
    if not reports:
        return {}
    out = reports[0].as_dict()
    for key in ("sent", "ok", "completion_tokens"):
        out[key] = sum(getattr(r, key) for r in reports)
    out["errors"] = {k: sum(r.errors.get(k, 0) for r in reports)
                     for r in reports for k in r.errors}  # fmt: skip
    out["servers"] = len(reports)
    return out


def loop_part(args, work: Path, broker_url: str, procs: Launcher) -> dict:
    """Part 3 (module doc). `--servers` replicas serve (each its own users at `--loop-qps`);
    the curve, the A/B and the probes are the first one's."""
    import uuid

    run = "benchloop" + uuid.uuid4().hex[:6]
    cfg = loop_config(args, work, run)
    config = work / "loop.yaml"
    config.write_text(dump_config(cfg))
    common = ["--config", str(config), "--url", broker_url]
    prompts = load_prompts(args.data, holdout=50)
    ip = free_port()
    intake = procs.start("loop-intake", ["intake", *common, "--port", str(ip)])
    wait_ready(f"http://127.0.0.1:{ip}", intake, work / "loop-intake.log")
    servers, urls = [], []
    for i in range(args.servers):
        port = free_port()
        servers.append(procs.start(f"loop-serve-{i}", ["serve", *common, "--port", str(port),
                                   "--speculative", "--draft-tokens", str(args.draft_tokens)]))  # fmt: skip
        urls.append(f"http://127.0.0.1:{port}")
    for i, (url, proc) in enumerate(zip(urls, servers, strict=True)):
        wait_ready(url, proc, work / f"loop-serve-{i}.log", key="handshake")
    url = urls[0]
    trainers = procs.ranks(args.trainers, ["train", *common], name="loop-trainer-{rank}")
    started = time.monotonic()
    served_log, stop = AcceptanceLog(url, started), threading.Event()
    boxes = [{} for _ in urls]
    users = [_users(u, prompts[i :: len(urls)], args, stop, boxes[i]) for i, u in enumerate(urls)]
    reached = None
    print(f"closed loop: {args.trainers} trainer(s), {len(urls)} server(s) from {url} (k="
          f"{args.draft_tokens}), {args.loop_minutes:g} min of {args.data} traffic", flush=True)  # fmt: skip

    def more() -> bool:  # the minutes, and then (bounded) until --min-reloads drafts were served
        elapsed = time.monotonic() - started
        if elapsed < args.loop_minutes * 60:
            return True
        short = served_log.reloads.get("loaded", 0) < args.min_reloads
        return short and elapsed < args.loop_minutes * 60 + 600

    while more():
        dead = [p for p in (intake, *servers, *trainers) if p.poll() is not None]
        if dead:
            raise RuntimeError(f"a loop process exited {dead[0].returncode}: see {work}/*.log")
        for line in served_log.poll():
            print(line, flush=True)
        last = served_log.curve[-1] if served_log.curve else None
        if reached is None and last and last["version"] > 0 and last["accept_length"] >= args.goal:
            reached = last["t"]
        time.sleep(args.poll_s)
    for line in served_log.poll():
        print(line, flush=True)
    stop.set()
    for thread in users:
        thread.join(600)
    for p in [*trainers, *servers[1:]]:  # the draft stops changing; the A/B has the device
        stop_pid(p, 120)
    final = scrape(url)
    ab = ab_rounds(url, prompts[-args.ab_requests * 4 :], args)
    answers = probe(url, prompts[: args.probes], args.loop_max_tokens)
    stop_pid(servers[0], 60)
    stop_pid(intake, 60)
    differ, dtype = lossless_check(cfg, answers, args.loop_max_tokens)
    reports = [b["report"] for b in boxes if "report" in b]
    errors = [b["error"] for b in boxes if "error" in b]
    return {
        "minutes": args.loop_minutes, "goal": args.goal, "reached_goal_at_s": reached,
        "curve": served_log.curve,
        "versions": {str(v): d for v, d in (final.versions.items() if final else [])},
        "reloads": final.reloads if final else None,
        "users": {**_merge(reports), **({"error": errors} if errors else {})},
        "ab": ab, "probes": len(answers), "probes_differing": [d.probe for d in differ],
        "divergences": [dataclasses.asdict(d) for d in differ], "dtype": dtype,
        "probe_versions": sorted({v for _, _, s in answers if s for v in s["draft_versions"]}),
    }  # fmt: skip


def print_loop(lp: dict) -> None:
    """The loop's summary lines."""
    curve, users, ab = lp["curve"], lp["users"], lp["ab"]
    first = next((c["accept_length"] for c in curve if c["version"] == 0), float("nan"))
    last = curve[-1] if curve else {"accept_length": float("nan"), "version": None}
    reached = lp["reached_goal_at_s"]
    when = "never" if reached is None else f"at {reached:.0f}s"
    print(f"closed loop ({lp['minutes']:g} min): served tokens/verify {first:.3f} (untrained) -> "
          f"{last['accept_length']:.3f} (draft v{last['version']}); {lp['goal']} reached {when}; "
          f"reloads {lp['reloads']}; users: {users.get('ok')} ok, errors "
          f"{users.get('errors', users.get('error'))}")  # fmt: skip
    print(f"  with the draft v{ab['draft_version']} vs without: {ab['on_tokens_per_s']:.1f} vs "
          f"{ab['off_tokens_per_s']:.1f} tok/s (ratio {ab['ratio_tokens_per_s']:.3f}, paired "
          f"median {ab['paired_ratio_median']:.3f}), tokens/verify {ab['accept_length']}, "
          f"latency p50 {ab['on_latency_p50_s']:.2f} vs {ab['off_latency_p50_s']:.2f} s")  # fmt: skip
    print(f"  lossless: {lp['probes'] - len(lp['probes_differing'])} of {lp['probes']} greedy "
          f"probes equal the target's greedy output ({lp['dtype']}, drafts "
          f"{lp['probe_versions']})")  # fmt: skip
    for d in lp.get("divergences", []):
        print(f"    probe {d['probe']} departs at token {d['token']}: the target's top-2 logit "
              f"margin there is {d['margin']:.4f}")  # fmt: skip
    points = [(c["t"], c["version"], round(c["accept_length"], 3)) for c in curve]
    print("  curve (s, version, tokens/verify): " + json.dumps(points))


def add_loop_args(p) -> None:
    """The loop's options (`ops/bench/live.py --loop`)."""
    g = p.add_argument_group("closed loop (--loop)")
    g.add_argument("--loop", action="store_true", help="run part 3, the closed loop")
    g.add_argument("--loop-minutes", type=float, default=10.0)
    g.add_argument("--strategy", default="eagle3")
    g.add_argument("--data", default="gsm8k", help="gsm8k, sharegpt, or a JSONL path")
    g.add_argument("--trainers", type=int, default=1)
    g.add_argument("--servers", type=int, default=1,
                   help="speculative server replicas (more data per minute for the trainers "
                   "on a CPU; on one GPU the processes time-share it: prefer one replica "
                   "with a larger --serve-batch)")  # fmt: skip
    g.add_argument("--draft-tokens", type=int, default=3, help="k, the EAGLE3 chain")
    g.add_argument("--draft-vocab", type=int, default=8192, help="EAGLE3's draft vocabulary")
    g.add_argument("--goal", type=float, default=2.0, help="tokens per verify to reach")
    g.add_argument("--loop-qps", type=float, default=4.0, help="per server")
    g.add_argument("--loop-concurrency", type=int, default=8, help="per server")
    g.add_argument("--loop-max-tokens", type=int, default=128)
    g.add_argument("--serve-batch", type=int, default=8)
    g.add_argument("--checkpoint-every", type=int, default=25)
    g.add_argument("--total-steps", type=int, default=4000)
    g.add_argument("--micro-batch", type=int, default=4)
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--poll-s", type=float, default=15.0, help="seconds between metric reads")
    g.add_argument("--min-reloads", type=int, default=0,
                   help="go on after --loop-minutes until the server loaded this many drafts "
                   "(at most 10 more minutes)")  # fmt: skip
    g.add_argument("--ab-rounds", type=int, default=4)
    g.add_argument("--ab-requests", type=int, default=8)
    g.add_argument("--ab-concurrency", type=int, default=1)
    g.add_argument("--probes", type=int, default=6)
    g.add_argument("--dtype", default="auto",
                   help="target.dtype of the servers and trainers (auto: bf16 on a GPU); "
                        "float32 makes the lossless probes exact on a GPU too")  # fmt: skip
