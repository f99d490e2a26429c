"""Live mode: what capture costs users, and what the intake sustains and sheds. One run.

Part 1, latency (same server, same traffic): one `specbus serve` process on the embedded
SmolLM2-135M-Instruct (or `--target DIR`) capturing into a real intake and shm store, a drain
standing in for the trainers (it acks and releases every ref at once, so nothing sheds and
the store stays small). The traffic driver (`ops/traffic.py`, the `openai` client, Poisson
arrivals of GSM8K questions, streaming) sends the same requests in rounds that alternate
capture on and off on the same server (`POST /v1/spec-capture/sink`), so both arms see the
same load from the rest of the machine (short rounds, ABBA order). Reported per arm: TTFT
and total latency p50/p99 over every round and their ratios on/off (goals: p50 <= 1.05,
p99 <= 1.15), and the paired estimate: the median over rounds of p50(on) / p50(off) within
the round (robust to a machine whose load drifts between rounds).

Part 2, intake throughput and shedding (same intake process): records of one real capture
shape (SmolLM2's EAGLE3 features, `--rows` rows) are put into the store and POSTed as a sink
does (`--clients` concurrent clients). (a) as fast as they go with a drain that keeps up:
records/s the intake accepts; (b) against a drain consuming `--capacity` refs/s (the trainers'
capacity), Poisson arrivals at 1x and 5x that rate for `--seconds` each, the intake's lag
watermark at `--max-lag` refs: the shed fraction (429s over records), and that every shed
capture's keys were removed (store residency = the bytes of the refs not yet drained).

Part 3, the closed loop (`--loop`, `ops/bench/live_loop.py`): a live run trains from the
traffic of a `specbus serve --speculative` server that decodes with the draft being trained;
the served acceptance over time, served tokens/s with the final draft vs without on the same
server, user errors, and greedy probes checked against the target's own output.

    python -m specbus.ops.bench.live --rounds 12 --requests 6 --out runs/bench/live.json
    python -m specbus.ops.bench.live --skip-latency --skip-intake --loop --device cuda \
        --loop-minutes 10 --out runs/bench/live-loop.json       # the closed loop alone
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from specbus.core.config import build_config, dump_config
from specbus.ops.bench.live_loop import add_loop_args, loop_part, print_loop
from specbus.ops.launch import QUIET_THREADS, Launcher
from specbus.ops.services.common import free_port, stop_pid
from specbus.ops.services.nats import NatsServer
from specbus.ops.traffic import load_prompts, percentile, run_traffic


def wait_http(url: str, proc, log: Path, key: str = "ok") -> None:
    """Wait for `url`'s /healthz to report `key` (readiness, polled); raises `RuntimeError`
    with the log's tail when `proc` exits first."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/healthz", timeout=1).json().get(key):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready")


class Drain:
    """Stands in for the trainers: leases refs from the "trainers" group, acks and releases
    them, at most `rate` refs/s (None: as fast as they come)."""

    def __init__(self, cfg, url: str, rate: float | None = None):
        self.cfg, self.url, self.rate = cfg, url, rate
        self.done = 0
        self._stop = asyncio.Event()

    async def run(self) -> None:
        from specbus.bus.connection import connect
        from specbus.bus.run import open_run
        from specbus.bus.subjects import TRAINERS

        store = self.cfg.store.build()
        try:
            async with await connect(self.cfg.bus, self.url, name="bench-drain") as bus:
                group = await (await open_run(bus, self.cfg.run)).join(TRAINERS)
                started = time.monotonic()
                while not self._stop.is_set():
                    want = 64
                    if self.rate is not None:  # a token bucket: rate refs/s on average
                        want = int(self.rate * (time.monotonic() - started)) - self.done
                        if want <= 0:
                            await asyncio.sleep(0.01)
                            continue
                    leases = await group.fetch(min(want, 64), 0.1)
                    if leases:
                        await group.ack_all(leases)
                        for lease in leases:
                            store.release(lease.record)
                        self.done += len(leases)
                await group.close(nak_held=True)
        finally:
            store.close(timeout_s=0)

    def stop(self) -> None:
        self._stop.set()


async def set_capture(serve_url: str, enabled: bool) -> None:
    """Turn the server's capture on or off (its operator switch)."""
    async with httpx.AsyncClient() as c:
        r = await c.post(serve_url + "/v1/spec-capture/sink", json={"enabled": enabled})
        r.raise_for_status()


async def latency_part(args, cfg, bus_url: str, serve_url: str) -> dict:
    """Part 1 (module doc): TTFT and latency per arm, ratios, and the paired per-round p50
    ratios of ABBA-ordered rounds."""
    prompts = load_prompts("gsm8k", holdout=50, limit=args.rounds * args.requests)
    drain = Drain(cfg, bus_url)
    drain_task = asyncio.create_task(drain.run())
    arms = {arm: {"ttft": [], "latency": [], "errors": 0} for arm in ("on", "off")}
    paired = {"ttft": [], "latency": []}  # per round: p50 on / p50 off (the same minute's load)
    # warm-up (first requests pay for lazy initialisation), not counted
    await run_traffic(serve_url + "/v1", prompts[:2], qps=100, concurrency=1, requests=2,
                      max_tokens=args.max_tokens)  # fmt: skip
    for r in range(args.rounds):
        batch = prompts[r * args.requests : (r + 1) * args.requests]
        got = {}
        for arm in ("on", "off") if r % 4 in (0, 3) else ("off", "on"):  # ABBA order
            await set_capture(serve_url, arm == "on")
            got[arm] = rep = await run_traffic(
                serve_url + "/v1", batch, qps=args.qps, concurrency=args.concurrency,
                requests=len(batch), max_tokens=args.max_tokens, seed=r,
            )  # fmt: skip
            arms[arm]["ttft"] += rep.ttft_s
            arms[arm]["latency"] += rep.latency_s
            arms[arm]["errors"] += sum(rep.errors.values())
        for name, attr in (("ttft", "ttft_s"), ("latency", "latency_s")):
            ratio = percentile(getattr(got["on"], attr), 50) / percentile(
                getattr(got["off"], attr), 50
            )
            paired[name].append(ratio)
        print(f"  round {r}: TTFT p50 on {percentile(got['on'].ttft_s, 50) * 1e3:.0f} / off "
              f"{percentile(got['off'].ttft_s, 50) * 1e3:.0f} ms, latency p50 on "
              f"{percentile(got['on'].latency_s, 50) * 1e3:.0f} / off "
              f"{percentile(got['off'].latency_s, 50) * 1e3:.0f} ms", flush=True)  # fmt: skip
    await set_capture(serve_url, True)
    drain.stop()
    await drain_task
    out = {}
    for arm, d in arms.items():
        for name in ("ttft", "latency"):
            for q in (50, 99):
                out[f"{arm}_{name}_p{q}_s"] = percentile(d[name], q)
        out[f"{arm}_requests"] = len(d["latency"])
        out[f"{arm}_errors"] = d["errors"]
    for name in ("ttft", "latency"):
        for q in (50, 99):
            out[f"ratio_{name}_p{q}"] = out[f"on_{name}_p{q}_s"] / out[f"off_{name}_p{q}_s"]
        out[f"paired_{name}_p50_ratios"] = paired[name]
        out[f"paired_{name}_p50_median"] = percentile(paired[name], 50)
    out["drained_refs"] = drain.done
    return out


class Poster:
    """A sink's write path without the server: put one capture's tensors, POST its record,
    remove the keys unless it was accepted."""

    def __init__(self, intake_url: str, token: str, rows: int):
        from specbus.producers.live.sink import CaptureSink

        self.sink = CaptureSink(intake_url, token, server_id="bench", engine="hf")
        assert self.sink.handshake(), "handshake with the intake failed"
        cap = self.sink.config
        import torch

        prompt = rows // 2
        self.capture = dict(
            prompt_ids=list(range(10, 10 + prompt)), output_ids=list(range(20, 20 + rows - prompt + 1)),
            aux=[torch.randn(rows, len(cap.aux_layers) * cap.hidden_size)],
            final=[torch.randn(rows, cap.hidden_size)],
        )  # fmt: skip
        self.counts = {"accepted": 0, "shed": 0, "other": 0}
        self.client = httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=30,
                                        limits=httpx.Limits(max_connections=64))  # fmt: skip
        self.url = intake_url

    async def one(self) -> None:
        from specbus.producers.live.sink import Capture, rows_of
        from specbus.producers.live.wire import CaptureRecord, sample_id_of

        cap, sink = self.sink.config, self.sink
        rid = uuid.uuid4().hex
        c = Capture(request_id=rid, sample_id=sample_id_of(rid), **self.capture)
        tensors = sink.tensors(c, cap)
        specs = await asyncio.to_thread(sink.store.put, c.sample_id, tensors, 0)
        record = CaptureRecord(
            run_id=cap.run_id, request_id=rid, sample_id=c.sample_id, store_uri=cap.store_uri,
            features=specs, num_tokens=rows_of(tensors, cap), num_prompt_tokens=len(c.prompt_ids),
            target_fingerprint=cap.target_fingerprint, tokenizer_fingerprint=cap.tokenizer_fingerprint,
            server_id="bench", engine="hf",
        )  # fmt: skip
        r = await self.client.post(self.url + "/v1/spec-capture/records",
                                   content=record.model_dump_json())  # fmt: skip
        if r.status_code == 200:
            self.counts["accepted"] += 1
            return
        self.counts["shed" if r.status_code == 429 else "other"] += 1
        await asyncio.to_thread(sink.store.release, specs)

    async def closed_loop(self, clients: int, seconds: float) -> float:
        """Records/s accepted with `clients` POSTing back to back."""
        stop = time.monotonic() + seconds

        async def client() -> None:
            while time.monotonic() < stop:
                await self.one()

        before = self.counts["accepted"]
        t0 = time.monotonic()
        await asyncio.gather(*(client() for _ in range(clients)))
        return (self.counts["accepted"] - before) / (time.monotonic() - t0)

    async def open_loop(self, rate: float, seconds: float, clients: int) -> dict:
        """Poisson arrivals at `rate` records/s for `seconds`: accepted, shed, other."""
        rng = random.Random(0)
        before = dict(self.counts)
        slots = asyncio.Semaphore(clients)
        tasks = []
        t0 = next_at = time.monotonic()
        while time.monotonic() - t0 < seconds:
            next_at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

            async def go() -> None:
                async with slots:
                    await self.one()

            tasks.append(asyncio.create_task(go()))
        await asyncio.gather(*tasks)
        got = {k: self.counts[k] - before[k] for k in self.counts}
        total = sum(got.values())
        return {**got, "records": total, "offered_per_s": total / seconds,
                "shed_fraction": got["shed"] / max(total, 1)}  # fmt: skip

    async def close(self) -> None:
        await self.client.aclose()
        self.sink.close(timeout_s=0)


async def undrained_bytes(cfg, bus_url: str) -> int:
    """Tensor bytes of the refs the drains left (exact: every ref of the window is read)."""
    from specbus.bus.connection import connect
    from specbus.bus.run import open_run

    async with await connect(cfg.bus, bus_url, name="bench-lag") as bus:
        return (await (await open_run(bus, cfg.run)).lag(scan=True)).bytes


async def intake_part(args, cfg, bus_url: str, intake_url: str, token: str) -> dict:
    """Part 2 (module doc): records/s accepted, shed fractions at 1x and 5x the drain's
    capacity, and the store's residency after."""
    poster = Poster(intake_url, token, args.rows)
    out: dict = {"record_bytes": None}
    try:
        drain = Drain(cfg, bus_url)
        task = asyncio.create_task(drain.run())
        out["accepted_per_s"] = await poster.closed_loop(args.clients, args.seconds)
        drain.stop()
        await task
        for mult in (1, 5):
            drain = Drain(cfg, bus_url, rate=args.capacity)
            task = asyncio.create_task(drain.run())
            res = await poster.open_loop(args.capacity * mult, args.seconds, args.clients)
            drain.stop()
            await task
            out[f"at_{mult}x"] = res
            print(f"  {mult}x capacity ({args.capacity * mult:g} records/s offered): "
                  f"{res['accepted']} accepted, {res['shed']} shed "
                  f"({res['shed_fraction']:.1%}), {res['other']} other", flush=True)  # fmt: skip
        store = cfg.store.build()
        try:
            out["store_resident_bytes_after"] = store.usage().resident_bytes
        finally:
            store.close(timeout_s=0)
        out["undrained_ref_bytes_after"] = await undrained_bytes(cfg, bus_url)
    finally:
        await poster.close()
    return out


def main(argv=None) -> int:
    """Run the benchmark (module doc); prints the figures, `--out` writes them as JSON."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument(
        "--device", default="auto", help="target.device of the server (auto: cuda if any)"
    )
    p.add_argument(
        "--rounds", type=int, default=4, help="latency: rounds (each arm once per round)"
    )
    p.add_argument("--requests", type=int, default=12, help="latency: requests per arm per round")
    p.add_argument("--qps", type=float, default=0.5, help="latency: Poisson arrival rate")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--rows", type=int, default=128, help="intake: rows per capture record")
    p.add_argument("--clients", type=int, default=8, help="intake: concurrent POSTing clients")
    p.add_argument("--seconds", type=float, default=20.0, help="intake: seconds per measurement")
    p.add_argument("--capacity", type=float, default=20.0, help="intake: the drain's refs/s")
    p.add_argument("--max-lag", type=int, default=64, help="intake: live.max_lag_refs")
    p.add_argument("--skip-latency", action="store_true")
    p.add_argument("--skip-intake", action="store_true")
    p.add_argument("--out", default=None)
    add_loop_args(p)
    args = p.parse_args(argv)

    import logging

    logging.basicConfig(level=logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="specbus-bench-live-"))
    run = "benchlive" + uuid.uuid4().hex[:6]
    cfg = build_config({
        "run": run, "run_dir": str(work / "run"),
        "target": {"model": args.target, "device": args.device},
        "store": {"uri": f"shm://{run}", "budget_bytes": 2 << 30},
        "data": {"source": "gsm8k", "holdout": 50},
        "strategy": {"draft": {"draft_vocab_size": 8192}},
        "deployment": {"mode": "live"},
        "live": {"max_lag_refs": args.max_lag, "max_new_tokens": args.max_tokens,
                 "max_inflight": 256},
    })  # fmt: skip
    config = work / "run.yaml"
    config.write_text(dump_config(cfg))
    broker = NatsServer(work / "nats").start()
    procs = Launcher(work, env=QUIET_THREADS)  # <work>/<name>.log
    results: dict = {"args": vars(args)}
    try:
        ip, sp = free_port(), free_port()
        common = ["--config", str(config), "--url", broker.url]
        if not (args.skip_latency and args.skip_intake):
            intake = procs.start("intake", ["intake", *common, "--port", str(ip)])
            wait_http(f"http://127.0.0.1:{ip}", intake, work / "intake.log")
            token = json.loads((cfg.resolved_run_dir / "live" / "intake.json").read_text())["token"]
        if not args.skip_latency:
            serve = procs.start("serve", ["serve", *common, "--port", str(sp)])
            serve_url = f"http://127.0.0.1:{sp}"
            wait_http(serve_url, serve, work / "serve.log", key="handshake")
            print("latency, capture on vs off (same server, same traffic):", flush=True)
            results["latency"] = asyncio.run(latency_part(args, cfg, broker.url, serve_url))
            stop_pid(serve, 30)
        if not args.skip_intake:
            print("intake throughput and shedding:", flush=True)
            results["intake"] = asyncio.run(
                intake_part(args, cfg, broker.url, f"http://127.0.0.1:{ip}", token)
            )
        if args.loop:
            print("closed loop: serving with the draft being trained:", flush=True)
            results["loop"] = loop_part(args, work, broker.url, procs)
    finally:
        procs.stop(30)
        broker.stop()
    lat, itk = results.get("latency"), results.get("intake")
    if lat:
        print(f"latency ({lat['on_requests']} requests per arm, errors on/off "
              f"{lat['on_errors']}/{lat['off_errors']}):")  # fmt: skip
        for name in ("ttft", "latency"):
            for q in (50, 99):
                goal = 1.05 if q == 50 else 1.15
                print(f"  {name:<7} p{q}: on {lat[f'on_{name}_p{q}_s'] * 1e3:7.0f} ms, off "
                      f"{lat[f'off_{name}_p{q}_s'] * 1e3:7.0f} ms, ratio {lat[f'ratio_{name}_p{q}']:.3f} "
                      f"(goal <= {goal})")  # fmt: skip
            ratios = " ".join(f"{x:.2f}" for x in lat[f"paired_{name}_p50_ratios"])
            print(f"  {name:<7} p50 on/off per round (same minute): median "
                  f"{lat[f'paired_{name}_p50_median']:.3f} [{ratios}]")  # fmt: skip
    if itk:
        print(f"intake: {itk['accepted_per_s']:.0f} records/s accepted ({args.clients} clients, "
              f"{args.rows}-row captures); shed fraction at 1x capacity "
              f"{itk['at_1x']['shed_fraction']:.1%}, at 5x {itk['at_5x']['shed_fraction']:.1%}; "
              f"store after the drains stopped: {itk['store_resident_bytes_after']} bytes resident, "
              f"{itk['undrained_ref_bytes_after']} bytes named by undrained refs (equal: every "
              "shed capture's keys were removed)")  # fmt: skip
    if results.get("loop"):
        print_loop(results["loop"])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
