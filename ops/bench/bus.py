"""Bus throughput: SampleRefs end to end through the specbus bus layer vs raw nats-py.

    python -m specbus.ops.bench.bus [--refs 20000] [--repeat 1]

Starts its own embedded nats-server (file storage, loopback). For each mode, one publishing
process and one consuming process (fetch + ack), started and connected before the clock
starts; the clock runs from "go" until the consumer acked the last ref (and flushed).

- raw: nats-py doing the same job as a careful hand-written client: the publisher encodes
  each SampleRef (`to_bytes`) and sends it with `js.publish_async`, a `Nats-Msg-Id` and a
  window of outstanding PubAcks; the consumer `pull_subscribe_bind(...).fetch(256)`s,
  decodes each ref (`SampleRef.from_bytes`) and `msg.ack()`s it.
- raw-bytes: the same without encoding/decoding (pre-encoded payloads, never parsed): the
  transport's ceiling, shown so the cost of validating records stays visible.
- bus: `bus.publisher.Publisher.publish_many` (encodes each SampleRef, dedup id, trace
  headers, awaits PubAcks) and `bus.lease.Leases.fetch(256)` (parses and validates each
  SampleRef, dead-letters bad ones, tracks credit) + `Lease.ack()`.
- bus-confirmed: as bus, but acking windows of 32 with `Leases.ack_all(confirm=True)`
  (every ack confirmed by the server: the optimizer-boundary path).

Each mode runs against one server per `--sync` setting (JetStream `sync_interval`; default:
`default` = nats-server's asynchronous flush, fsync every 2 min, and `always` = fsync every
write), interleaved within each repeat.

`--cluster 3` compares brokers instead: the single node against a 3-node JetStream cluster
with R3 streams (`ops/services/cluster.py`; the clients get every node's URL), interleaved
within each repeat, bus modes only; each also measures the publish latency (one awaited
publish at a time, `--latency` of them: p50/p99).

Prints refs/s per mode and sync (and CPU per ref of each process), the ratios bus / raw and
bus / raw-bytes (default sync), and per mode the ratio of each sync setting to the first.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

WINDOW = 1024
FETCH = 256
CONFIRM_WINDOW = 32


def sample_refs(n: int, run: str):
    """n distinct SampleRefs of a realistic size (~1 KB: EAGLE3-style features)."""
    from specbus.core.contracts import FeatureSpec, Provenance, SampleRef

    feats = {
        name: FeatureSpec(
            name=name, key=f"{run}/s0/{name}", shape=shape, dtype=dtype, nbytes=nbytes
        )
        for name, shape, dtype, nbytes in [
            ("aux_hidden_states", (1, 512, 2304), "bfloat16", 2 * 512 * 2304),
            ("hidden_states", (1, 512, 768), "bfloat16", 2 * 512 * 768),
            ("input_ids", (1, 512), "int64", 8 * 512),
            ("loss_mask", (1, 512), "uint8", 512),
        ]
    }
    template = SampleRef(
        sample_id="s0",
        run_id=run,
        task_id="t0",
        task_seq=0,
        store_uri=f"shm:///dev/shm/specbus/{run}",
        features=feats,
        nbytes=sum(f.nbytes for f in feats.values()),
        num_tokens=512,
        strategy="eagle3",
        target_fingerprint="f" * 16,
        tokenizer_fingerprint="e" * 16,
        provenance=Provenance(producer_id="bench-producer-0", engine="hf"),
    )
    return [
        template.model_copy(
            update={"sample_id": f"s{i:08d}", "task_id": f"t{i:08d}", "task_seq": i}
        )
        for i in range(n)
    ]


def _fetch_batch() -> int:
    return int(os.environ.get("SPECBUS_BENCH_FETCH", FETCH))


# ---------------------------------------------------------------- raw nats-py (bus/raw_nats.py)
class _Clock:
    """Set `ready`, wait for `go`, then start the wall and CPU clocks (the `started` hook)."""

    def __init__(self, ready, go):
        self.ready, self.go = ready, go
        self.t0 = self.cpu0 = 0.0

    async def __call__(self) -> None:
        self.ready.set()
        await asyncio.get_running_loop().run_in_executor(None, self.go.wait)
        self.t0, self.cpu0 = time.perf_counter(), time.process_time()

    def stop(self, fetches: int = 0) -> tuple[float, float, int]:
        return time.perf_counter() - self.t0, time.process_time() - self.cpu0, fetches


async def raw_publisher(
    url: str, run: str, n: int, ready, go, records: bool
) -> tuple[float, float, int]:
    """`records`: encode each SampleRef in the loop (`to_bytes`), else publish pre-encoded bytes."""
    from specbus.bus.raw_nats import raw_publish

    refs = sample_refs(n, run)
    items = refs if records else [r.to_bytes() for r in refs]
    encode = (lambda r: r.to_bytes()) if records else (lambda b: b)
    clock = _Clock(ready, go)
    ids = [f"{run}:s{i}" for i in range(n)]
    await raw_publish(url, f"rawbench.{run}", items, ids, encode, window=WINDOW, started=clock)
    return clock.stop()


async def raw_consumer(
    url: str, run: str, n: int, ready, go, records: bool
) -> tuple[float, float, int]:
    """`records`: decode each payload (`SampleRef.from_bytes`) before acking it."""
    from specbus.bus.raw_nats import raw_consume
    from specbus.core.contracts import SampleRef

    clock = _Clock(ready, go)
    decode = SampleRef.from_bytes if records else None
    fetches = await raw_consume(
        url, f"RAWBENCH_{run}", "c", n, decode, batch=_fetch_batch(), started=clock
    )
    return clock.stop(fetches)


async def raw_setup(url: str, run: str) -> None:
    from specbus.bus.raw_nats import raw_declare

    await raw_declare(url, f"RAWBENCH_{run}", f"rawbench.{run}", "c", max_ack_pending=1024)


# ---------------------------------------------------------------- specbus bus layer
def _bus_cfg():
    from specbus.core.config import BusConfig

    return BusConfig(ack_wait_s=60, max_ack_pending=1024, publish_window=WINDOW)


async def bus_publisher(url: str, run: str, n: int, ready, go) -> tuple[float, float, int]:
    from specbus.bus.connection import connect
    from specbus.bus.publisher import Publisher
    from specbus.bus.subjects import Names

    refs = sample_refs(n, run)
    bus = await connect(_bus_cfg(), url, name="bench-publisher")
    pub = Publisher(bus)
    await pub.publish(Names(run).samples, refs[0])  # warm the inbox subscription
    clock = _Clock(ready, go)
    await clock()
    acks = await pub.publish_many(Names(run).samples, refs)
    timing = clock.stop()
    assert sum(a.duplicate for a in acks) == 1, "only the warm-up ref is a duplicate"
    await bus.close()
    return timing


async def bus_consumer(
    url: str, run: str, n: int, ready, go, confirm: bool
) -> tuple[float, float, int]:
    from specbus.bus.connection import connect
    from specbus.bus.lease import Leases

    bus = await connect(_bus_cfg(), url, name="bench-consumer")
    group = await Leases.join(bus, run, "trainers")
    clock = _Clock(ready, go)
    await clock()
    got = fetches = 0
    while got < n:
        fetches += 1
        leases = await group.fetch(CONFIRM_WINDOW if confirm else _fetch_batch(), 1.0)
        if confirm:
            await group.ack_all(leases, confirm=True)
        else:
            for lease in leases:
                await lease.ack()
        got += len(leases)
    await bus.flush()
    timing = clock.stop(fetches)
    await bus.close()
    return timing


async def bus_setup(url: str, run: str, replicas: int = 1) -> None:
    from specbus.bus.connection import connect
    from specbus.bus.run import declare

    cfg = _bus_cfg().model_copy(update={"replicas": replicas})
    bus = await connect(cfg, url)
    await declare(bus, cfg, run)
    await bus.close()


async def publish_latency(url: str, run: str, n: int, replicas: int) -> dict[str, float]:
    """p50/p99 (ms) of `n` publishes, one at a time, each awaited until its PubAck."""
    from specbus.bus.connection import connect
    from specbus.bus.publisher import Publisher
    from specbus.bus.subjects import Names

    await bus_setup(url, run, replicas)
    refs = sample_refs(n + 20, run)
    bus = await connect(_bus_cfg(), url, name="bench-latency")
    pub = Publisher(bus)
    for ref in refs[:20]:  # warm up
        await pub.publish(Names(run).samples, ref)
    times = []
    for ref in refs[20:]:
        t0 = time.perf_counter()
        await pub.publish(Names(run).samples, ref)
        times.append(time.perf_counter() - t0)
    await bus.close()
    q = statistics.quantiles(times, n=100)
    return {"p50_ms": 1e3 * statistics.median(times), "p99_ms": 1e3 * q[98]}


# ---------------------------------------------------------------- acks lost to a kill -9
KILL_DELAYS_S = (0.0, 0.05, 0.1, 0.2, 0.5)


async def _ack_floor_after_kill(server, run: str, delay_s: float, n: int = 40, acked: int = 24):
    """Publish `n` refs, lease them all, ack the first `acked` with confirmation (the server
    applied them), wait `delay_s`, kill -9 the server and restart it on the same store dir:
    the trainers' (ack floor, delivered) it comes back with. Before: (acked, n)."""
    from specbus.bus.connection import connect
    from specbus.bus.lease import Leases
    from specbus.bus.publisher import Publisher
    from specbus.bus.run import declare
    from specbus.bus.subjects import Names

    cfg = _bus_cfg().model_copy(update={"connect_timeout_s": 5.0})
    bus = await connect(cfg, server.url, name="bench-kill")
    await declare(bus, cfg, run)
    await Publisher(bus).publish_many(Names(run).samples, sample_refs(n, run))
    group = await Leases.join(bus, run, "trainers")
    leases = await group.fetch(n, 5.0)
    assert len(leases) == n, f"fetched {len(leases)} of {n}"
    await group.ack_all(leases[:acked], confirm=True)
    await asyncio.sleep(delay_s)
    server.kill()
    await bus.close()
    server.start()
    bus = await connect(cfg, server.url, name="bench-kill")
    info = await bus.js.consumer_info(Names(run).samples_stream, "trainers")
    await bus.close()
    return info.ack_floor.stream_seq, info.delivered.stream_seq


def kill_probe(syncs: list[str], trials: int, tmp: Path) -> dict[str, dict[float, int]]:
    """For each sync setting and delay between confirmed acks and a kill -9 of the server,
    how many of `trials` restarts kept the ack floor."""
    import logging

    from specbus.ops.services.nats import NatsServerConfig

    logging.getLogger("specbus.bus").setLevel(logging.ERROR)  # the kills' reconnect noise
    kept: dict[str, dict[float, int]] = {}
    for sync in syncs:
        server = NatsServerConfig(store_dir=tmp / f"kill-{sync}", sync=sync).build().start()
        try:
            for delay in KILL_DELAYS_S:
                floors = [
                    asyncio.run(
                        _ack_floor_after_kill(server, f"kill{i}d{int(delay * 1000)}", delay)
                    )
                    for i in range(trials)
                ]
                kept.setdefault(sync, {})[delay] = sum(f == 24 for f, _ in floors)
                print(
                    f"kill -9 {delay * 1000:4.0f} ms after 24 confirmed acks, sync {sync:<8}: "
                    f"ack floor kept {kept[sync][delay]}/{trials} "
                    f"(ack floor, delivered after restart: {floors}; before: (24, 40))",
                    flush=True,
                )
        finally:
            server.stop()
    return kept


# ---------------------------------------------------------------- driver
def _child(role: str, result, fn, *args) -> None:
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    result.put((role, *asyncio.run(fn(*args))))


def run_mode(url: str, server_pid: int | list[int], mode: str, n: int, tag: str,
             replicas: int = 1) -> dict:  # fmt: skip
    ctx = mp.get_context("spawn")
    run = f"bench{tag}{mode.replace('-', '')}"
    pids = server_pid if isinstance(server_pid, list) else [server_pid]
    if mode.startswith("raw"):
        asyncio.run(raw_setup(url, run))
        records = mode == "raw"
        roles = [("publish", raw_publisher, (records,)), ("consume", raw_consumer, (records,))]
    else:
        asyncio.run(bus_setup(url, run, replicas))
        roles = [
            ("publish", bus_publisher, ()),
            ("consume", bus_consumer, (mode == "bus-confirmed",)),
        ]
    go, result = ctx.Event(), ctx.Queue()
    procs, readies = [], []
    for role, fn, extra in roles:
        ready = ctx.Event()
        p = ctx.Process(target=_child, args=(role, result, fn, url, run, n, ready, go, *extra))
        p.start()
        procs.append(p)
        readies.append(ready)
    for ready in readies:
        if not ready.wait(120):
            raise RuntimeError(f"{mode}: a bench process did not get ready")
    server_cpu0 = sum(_cpu_of(p) for p in pids)
    t0 = time.perf_counter()
    go.set()
    got = {role: rest for role, *rest in (result.get(timeout=600) for _ in procs)}
    wall = time.perf_counter() - t0
    server_cpu = sum(_cpu_of(p) for p in pids) - server_cpu0
    for p in procs:
        p.join(30)
    return {
        "mode": mode,
        "refs_per_s": n / got["consume"][0],
        "publish_refs_per_s": n / got["publish"][0],
        "wall_s": wall,
        "refs_per_fetch": n / max(got["consume"][2], 1),
        "cpu_us_per_ref": {
            "publisher": 1e6 * got["publish"][1] / n,
            "consumer": 1e6 * got["consume"][1] / n,
            "server": 1e6 * server_cpu / n,
        },
    }


def _cpu_of(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc), 0.0 if unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _median(rows: list[dict], mode: str, sync: str) -> float:
    return statistics.median(
        r["refs_per_s"] for r in rows if r["mode"] == mode and r["sync"] == sync
    )


def _per_repeat(rows: list[dict], a: tuple[str, str], b: tuple[str, str]) -> list[float]:
    """refs/s of (mode, sync) `a` over `b`, repeat by repeat (the same repeat ran both)."""
    pick = lambda m, s: [x for x in rows if x["mode"] == m and x["sync"] == s]  # noqa: E731
    return [x["refs_per_s"] / y["refs_per_s"] for x, y in zip(pick(*a), pick(*b), strict=True)]


def main(argv: list[str] | None = None) -> dict:
    from specbus.ops.services.nats import NatsServerConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--refs", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--modes", default="raw-bytes,raw,bus,bus-confirmed")
    parser.add_argument(
        "--fetch", type=int, default=FETCH, help="fetch batch of the raw and bus consumers"
    )
    parser.add_argument(
        "--sync",
        default="default,always",
        help="JetStream sync_interval settings to compare, one server each (the first is the baseline)",
    )
    parser.add_argument(
        "--kill-probe",
        type=int,
        default=0,
        metavar="TRIALS",
        help="instead of throughput: kill -9 the server at several delays after confirmed acks, "
        "TRIALS times each, per sync setting, and count the restarts that kept the ack floor",
    )
    parser.add_argument(
        "--cluster",
        type=int,
        default=0,
        metavar="N",
        help="compare the single node with an N-node cluster (R3 streams) instead of sync settings",
    )
    parser.add_argument("--latency", type=int, default=500, help="publishes timed one by one (--cluster)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.cluster:
        return compare_cluster(args)
    if args.kill_probe:
        with tempfile.TemporaryDirectory() as tmp:
            return kill_probe(args.sync.split(","), args.kill_probe, Path(tmp))
    os.environ["SPECBUS_BENCH_FETCH"] = str(args.fetch)  # read by the (spawned) consumers
    modes = args.modes.split(",")
    syncs = args.sync.split(",")
    rows = []
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        servers = {}
        for sync in syncs:
            server = NatsServerConfig(store_dir=tmp / f"nats-{sync}", sync=sync).build().start()
            stack.callback(server.stop)
            servers[sync] = server
        for rep in range(args.repeat):
            for mode in modes:
                for sync, server in servers.items():  # interleaved: both see the same load
                    row = run_mode(server.url, server.pid, mode, args.refs, f"r{rep}")
                    row["sync"] = sync
                    rows.append(row)
                    print(
                        f"{mode:>14} sync {sync:<8}: {row['refs_per_s']:9.0f} refs/s end to end "
                        f"(publisher {row['publish_refs_per_s']:.0f} refs/s, {row['refs_per_fetch']:.0f} refs/fetch; CPU us/ref: "
                        + ", ".join(f"{k} {v:.0f}" for k, v in row["cpu_us_per_ref"].items())
                        + ")",
                        flush=True,
                    )
    # Other work shares the CPUs: modes are interleaved per repeat and summarised by the median.
    base_sync = syncs[0]
    summary = {mode: _median(rows, mode, base_sync) for mode in modes}
    for base in ("raw", "raw-bytes"):
        if base in summary and "bus" in summary:
            per_repeat = _per_repeat(rows, ("bus", base_sync), (base, base_sync))
            print(
                f"bus/{base}: {summary['bus'] / summary[base]:.2f} (medians of {args.repeat}: bus {summary['bus']:.0f}, "
                f"{base} {summary[base]:.0f} refs/s; per repeat "
                + ", ".join(f"{x:.2f}" for x in per_repeat)
                + ")"
            )
    for sync in syncs[1:]:
        for mode in modes:
            other = _median(rows, mode, sync)
            per_repeat = _per_repeat(rows, (mode, sync), (mode, base_sync))
            summary[f"{mode}@{sync}"] = other
            print(
                f"{mode} sync {sync}/{base_sync}: {other / summary[mode]:.2f} (medians of {args.repeat}: "
                f"{other:.0f} vs {summary[mode]:.0f} refs/s; per repeat "
                + ", ".join(f"{x:.2f}" for x in per_repeat)
                + ")"
            )
    return summary


def compare_cluster(args: argparse.Namespace) -> dict:
    """Single node vs an `args.cluster`-node cluster with R3 streams, interleaved per repeat."""
    from specbus.ops.services.cluster import NatsCluster
    from specbus.ops.services.nats import NatsServerConfig

    os.environ["SPECBUS_BENCH_FETCH"] = str(args.fetch)
    modes = [m for m in args.modes.split(",") if m.startswith("bus")] or ["bus"]
    replicas = min(3, args.cluster)
    rows = []
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        single = NatsServerConfig(store_dir=tmp / "single").build().start()
        stack.callback(single.stop)
        cluster = NatsCluster(tmp / "cluster", args.cluster).start()
        stack.callback(cluster.stop)
        brokers = {
            "single": (single.url, [single.pid], 1),
            f"R{replicas}": (cluster.url, [n.pid for n in cluster.nodes], replicas),
        }
        for rep in range(args.repeat):
            for mode in modes:
                for label, (url, pids, r) in brokers.items():
                    row = run_mode(url, pids, mode, args.refs, f"r{rep}{label}", replicas=r)
                    row["sync"] = label
                    rows.append(row)
                    print(f"{mode:>14} {label:<6}: {row['refs_per_s']:9.0f} refs/s end to end (publisher "
                          f"{row['publish_refs_per_s']:.0f} refs/s; server CPU us/ref {row['cpu_us_per_ref']['server']:.0f})",
                          flush=True)  # fmt: skip
            for label, (url, _, r) in brokers.items():
                lat = asyncio.run(publish_latency(url, f"lat{rep}{label}", args.latency, r))
                rows.append({"mode": "latency", "sync": label, **lat})
                print(f"{'publish latency':>14} {label:<6}: p50 {lat['p50_ms']:.2f} ms, p99 {lat['p99_ms']:.2f} ms", flush=True)  # fmt: skip
    summary = {}
    labels = list(brokers)
    for mode in modes:
        for label in labels:
            summary[f"{mode}@{label}"] = _median(rows, mode, label)
        per = _per_repeat(rows, (mode, labels[1]), (mode, labels[0]))
        ratio = summary[f"{mode}@{labels[1]}"] / summary[f"{mode}@{labels[0]}"]
        summary[f"{mode}:ratio"] = ratio
        print(f"{mode} {labels[1]}/single: {ratio:.2f} (medians of {args.repeat}: "
              f"{summary[f'{mode}@{labels[1]}']:.0f} vs {summary[f'{mode}@{labels[0]}']:.0f} refs/s; per repeat "
              + ", ".join(f"{x:.2f}" for x in per) + ")")  # fmt: skip
    for label in labels:
        lat = [r for r in rows if r["mode"] == "latency" and r["sync"] == label]
        p50 = statistics.median(r["p50_ms"] for r in lat)
        p99 = statistics.median(r["p99_ms"] for r in lat)
        summary[f"latency@{label}"] = {"p50_ms": p50, "p99_ms": p99}
        print(
            f"publish latency {label}: p50 {p50:.2f} ms, p99 {p99:.2f} ms (medians of {args.repeat})"
        )
    return summary


if __name__ == "__main__":
    main()
