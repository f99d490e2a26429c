"""Scale: many refs through feeder -> producers -> trainers, and what grows with them.

The real processes of a disaggregated run (`specbus feed`, `specbus produce`, `specbus train`,
an embedded nats-server) on this machine, with everything that is not the control plane made
tiny: a 4-layer, hidden-32 Llama target (vocab 256, no tokenizer: pre-tokenised records of
`--seq` tokens), an EAGLE3 draft of one TTT step (what is left of the step is close to a
no-op), a `shm://` store (the cross-process store; `mem://` is one process's) holding a few
KiB per sample, micro-batches of `--micro-batch`. Every `--sample-s` seconds it samples each
process's RSS, file descriptors and threads (the feeder while it runs), the refs fed /
captured / trained (TASKS and SAMPLES last sequences, the trainers' ack floor), stream and
store bytes. The trainer's log rows carry each checkpoint's size, write time and the lineage
file's length.

Then it fits lines against samples trained (after `--warmup` of them): the refs/s of each
tenth of the run (flat per-ref cost: the last tenths as fast as the first), each process's
RSS (bytes per sample), the checkpoint's size and write time, and extrapolates each to
`--extrapolate` (10 M) samples. `--minutes` bounds the run: on a shared machine the slopes
of a shorter run are the figure (what was measured is reported, and the extrapolation says
from how many).

`--mode colocated` runs the same feed into one `specbus train` rank that captures its own
tasks into `mem://` (no producer process, no SAMPLES stream: the rank acks TASKS): the
control plane's per-ref cost without the `shm://` store's files (a put and a release are a
dozen file-system calls a sample, most of the disaggregated run's CPU here).

    python -m specbus.ops.bench.scale --refs 1000000 --minutes 90 --out runs/bench/scale.json
    python -m specbus.ops.bench.scale --mode colocated --refs 1000000 --out runs/bench/scale-col.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import tempfile
import time
import uuid
from pathlib import Path

from specbus.core.config import build_config, dump_config
from specbus.ops.bench.sampling import fit, human, proc_stats, slope_line, tree_bytes
from specbus.ops.launch import Launcher
from specbus.ops.services.nats import NatsServer

VOCAB = 256


def build_target(path: Path) -> Path:
    """The tiny Llama target (random, seed 0)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=False)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def write_data(path: Path, n: int, seq: int) -> Path:
    """`n` pre-tokenised records of `seq` tokens (the last half supervised)."""
    rng = random.Random(1)
    mask = json.dumps([0] * (seq // 2) + [1] * (seq - seq // 2))
    with open(path, "w") as f:
        for _ in range(n):
            ids = [rng.randrange(3, VOCAB) for _ in range(seq)]
            f.write(f'{{"input_ids": {json.dumps(ids)}, "loss_mask": {mask}}}\n')
    return path


def config_for(run: str, work: Path, target: Path, data: Path, args) -> object:
    """The run's config (see the module doc)."""
    return build_config({
        "run": run,
        "run_dir": str(work / run),
        "bus": {"ack_wait_s": 60.0, "heartbeat_s": 10.0, "fetch_timeout_s": 0.2,
                "max_ack_pending": 1024},
        "store": {"uri": "mem://" if args.mode == "colocated" else f"shm://{work / 'shm'}",
                  "budget_bytes": 256 << 20, "pool_bytes": 0, "recycle_bytes": args.recycle_bytes},
        "target": {"model": str(target), "capture_batch": args.micro_batch, "dtype": "float32"},
        "strategy": {"ttt_length": 1, "draft": {"draft_vocab_size": 64}},
        "data": {"source": str(data), "max_length": args.seq, "holdout": 0},
        "training": {"micro_batch": args.micro_batch, "log_every": args.log_every,
                     "checkpoint_every": args.checkpoint_every, "prefetch": 2, "lr": 1e-4,
                     "keep_checkpoints": 2},
        "deployment": {"mode": args.mode},
    })  # fmt: skip


class Sampler:
    """The series of one run: one row per sample (see the module doc)."""

    def __init__(self, server: NatsServer, procs: Launcher, cfg, store_dir: Path):
        self.server, self.procs, self.cfg, self.store_dir = server, procs, cfg, store_dir
        self.colocated = cfg.deployment.mode == "colocated"  # mem:// in the trainer: no store dir
        self.rows: list[dict] = []
        self.t0 = time.monotonic()

    async def broker(self) -> dict[str, float]:
        from specbus.bus.connection import connect
        from specbus.bus.outage import ride
        from specbus.bus.subjects import PRODUCERS, TRAINERS, Names
        from specbus.core.errors import BusNotFound

        names = Names(self.cfg.run)
        bus = await connect(self.cfg.bus, self.server.url, name="scale-bench")
        out = dict.fromkeys(("fed", "captured", "trained", "tasks_bytes", "samples_bytes"), 0)
        try:  # nothing is declared before the first process connects
            tasks = await ride(bus, "stream", lambda: bus.js.stream_info(names.tasks_stream))
            samples = await ride(bus, "stream", lambda: bus.js.stream_info(names.samples_stream))
            out.update(fed=tasks.state.last_seq, captured=samples.state.last_seq,
                       tasks_bytes=tasks.state.bytes, samples_bytes=samples.state.bytes)  # fmt: skip
            # colocated: no SAMPLES, the trainer ranks ack their tasks (the producers' group)
            stream, group = (
                (names.tasks_stream, PRODUCERS)
                if self.colocated
                else (names.samples_stream, TRAINERS)
            )
            trainers = await ride(bus, "consumer", lambda: bus.js.consumer_info(stream, group))
            out["trained"] = trainers.ack_floor.stream_seq if trainers.ack_floor else 0
            if self.colocated:
                out["captured"] = out["trained"]
        except BusNotFound:
            pass
        finally:
            await bus.close()
        return out

    def sample(self) -> dict:
        row: dict = {"t": time.monotonic() - self.t0}
        row.update(asyncio.run(self.broker()))
        row["store_bytes"] = tree_bytes(self.store_dir)
        pids = {name: p.pid for name, p in self.procs.procs.items() if p.poll() is None}
        pids["nats-server"] = self.server.pid
        for name, pid in pids.items():
            stats = proc_stats(pid) if pid else None
            if stats is not None:
                row.update({f"{name}.{k}": v for k, v in stats.items()})
        self.rows.append(row)
        return row


def tenths(rows: list[dict], warmup: int) -> list[float]:
    """Refs/s trained in each tenth of the samples after `warmup` (by the sampled rows)."""
    rows = [r for r in rows if r["trained"] >= warmup]
    if len(rows) < 3:
        return []
    lo, hi = rows[0]["trained"], rows[-1]["trained"]
    out = []
    for k in range(10):
        a, b = lo + (hi - lo) * k / 10, lo + (hi - lo) * (k + 1) / 10
        seg = [r for r in rows if a <= r["trained"] <= b]
        if len(seg) >= 2 and seg[-1]["t"] > seg[0]["t"]:
            out.append((seg[-1]["trained"] - seg[0]["trained"]) / (seg[-1]["t"] - seg[0]["t"]))
    return out


def analyse(rows: list[dict], history: list[dict], warmup: int, target: int) -> dict:
    """The slopes against samples trained (over the run after `warmup`, and over its second
    half alone: a series that fills up and stops, the ledger's recent ids or the allocator's
    arenas, has its steady slope there, which is what `target` extrapolates) and the values
    at `target` samples."""
    after = [r for r in rows if r["trained"] >= warmup]
    out: dict = {
        "trained": rows[-1]["trained"] if rows else 0,
        "seconds": rows[-1]["t"] if rows else 0,
    }
    series: dict[str, tuple[list[tuple[float, float]], str]] = {}
    names = sorted({k.rsplit(".", 1)[0] for r in after for k in r if k.endswith(".rss_bytes")})
    for name in names:
        series[f"rss {name}"] = ([(float(r["trained"]), r[f"{name}.rss_bytes"]) for r in after
                                  if f"{name}.rss_bytes" in r], "B")  # fmt: skip
    for key in ("samples_bytes", "tasks_bytes", "store_bytes"):
        series[key.replace("_", " ")] = ([(float(r["trained"]), float(r[key])) for r in after], "B")
    saves = {row["checkpoint_step"]: row for row in history if "checkpoint_step" in row}
    per_step = out["trained"] / max(1.0, history[-1]["step"]) if history else 0.0
    for name, key, unit in (("checkpoint size", "checkpoint_bytes", "B"),
                            ("checkpoint write", "checkpoint_seconds", "s"),
                            ("lineage file", "checkpoint_lineage_bytes", "B")):  # fmt: skip
        series[name] = ([(r["checkpoint_step"] * per_step, float(r[key]))
                         for _, r in sorted(saves.items())], unit)  # fmt: skip
    fits, lines = {}, []
    for name, (pts, unit) in series.items():
        if len(pts) < 3:
            continue
        whole = fit([x for x, _ in pts], [y for _, y in pts])
        mid = (pts[0][0] + pts[-1][0]) / 2
        tail = [(x, y) for x, y in pts if x >= mid]
        late = fit([x for x, _ in tail], [y for _, y in tail]) if len(tail) >= 3 else whole
        fits[name] = {"slope_per_sample": whole.slope, "slope_se": whole.slope_se,
                      "late_slope_per_sample": late.slope, "late_slope_se": late.slope_se,
                      "points": whole.n, "last": pts[-1][1], "at_target": late.at(target),
                      "unit": unit}  # fmt: skip
        lines.append(slope_line(name, whole, unit, "sample") + f"; second half "
                     f"{human(late.slope, unit)}/sample (+- {human(late.slope_se, unit)}) -> "
                     f"{human(late.at(target), unit)} at {target:,}")  # fmt: skip
    rates = tenths(rows, warmup)
    out["refs_per_s_tenths"] = [round(r, 1) for r in rates]
    if rates and min(rates) > 0:
        out["refs_per_s"] = sum(rates) / len(rates)
        out["last_over_first"] = (sum(rates[-3:]) / len(rates[-3:])) / (
            sum(rates[:3]) / len(rates[:3])
        )
        out["hours_at_target"] = target / out["refs_per_s"] / 3600
    out["fits"], out["lines"] = fits, lines
    return out


def prepare_only(args) -> dict:
    """`--prepare-only`: the feeder's `prepare()` of `--refs` records in this process, under
    tracemalloc (the Python heap: records, packed samples, vocab counts), and its time."""
    import tracemalloc

    from specbus.producers.feeder import prepare

    work = Path(args.work or tempfile.mkdtemp(prefix="specbus-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    target = build_target(work / "target")
    data = write_data(work / "data.jsonl", args.refs, args.seq)
    cfg = config_for("prepare", work, target, data, args)
    tracemalloc.start()
    t0 = time.perf_counter()
    prepared = prepare(cfg)
    seconds = time.perf_counter() - t0
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"records": args.refs, "samples": len(prepared.samples), "seconds": seconds,
            "heap_peak_bytes": peak, "heap_after_bytes": held, "args": vars(args)}  # fmt: skip


def run(args) -> dict:
    work = Path(args.work or tempfile.mkdtemp(prefix="specbus-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    target = build_target(work / "target")
    data = write_data(work / "data.jsonl", args.refs, args.seq)
    cfg = config_for(f"scale-{uuid.uuid4().hex[:6]}", work, target, data, args)
    config = work / "run.yaml"
    config.write_text(dump_config(cfg))
    server = NatsServer(work / "nats").start()
    procs = Launcher(work / "logs", env={"OMP_NUM_THREADS": "1", "SPECBUS_THREADS": "1"})
    common = ["--log-level", "WARNING"]
    cli = ["--config", str(config), "--url", server.url]
    sampler = Sampler(server, procs, cfg, work / "shm")
    deadline = time.monotonic() + args.minutes * 60
    state = None
    try:
        procs.start("feeder", [*common, "feed", *cli])
        for i in range(args.producers if args.mode == "disaggregated" else 0):
            procs.start(f"producer-{i}", [*common, "produce", *cli, "--id", f"p{i}"])
        procs.ranks(args.trainers, [*common, "train", *cli], name="trainer-{rank}")
        while True:
            row = sampler.sample()
            print(f"[{row['t']:7.0f}s] fed {row['fed']:>9,} captured {row['captured']:>9,} "
                  f"trained {row['trained']:>9,}  trainer rss "
                  f"{human(row.get('trainer-0.rss_bytes', 0), 'B')}", flush=True)  # fmt: skip
            if (bad := procs.failed()) is not None:
                raise RuntimeError(f"{bad[0]} exited {bad[1]}: {procs.log(bad[0])[-3000:]}")
            if procs.procs["trainer-0"].poll() is not None or time.monotonic() >= deadline:
                break
            time.sleep(args.sample_s)
    finally:
        procs.stop(timeout_s=120)  # a trainer saves its last step on SIGTERM
        with contextlib.suppress(Exception):  # the final counts (the broker may have failed)
            sampler.sample()
        server.stop()
    from specbus.consumers.lineage import load_state

    ckpt = Path(cfg.training.checkpoint_dir or cfg.resolved_run_dir / "checkpoints")
    latest = (ckpt / "latest").read_text().strip()
    state = load_state(ckpt / latest)
    assert len(state["lineage"]) == len(set(state["lineage"])), "a sample was trained twice"
    out = analyse(sampler.rows, state["history"], args.warmup, args.extrapolate)
    out.update({"refs_planned": args.refs, "lineage": len(state["lineage"]),
                "ledger": {k: state[k] for k in ("cursor",)} | {"tasks_ranges": len(state["ledger"]["tasks"])},
                "args": vars(args), "rows": sampler.rows})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--refs", type=int, default=1_000_000)
    ap.add_argument("--minutes", type=float, default=90.0, help="stop the run after this long")
    ap.add_argument("--producers", type=int, default=1)
    ap.add_argument(
        "--mode",
        choices=("disaggregated", "colocated"),
        default="disaggregated",
        help="colocated: the trainer captures its own tasks into mem:// (no SAMPLES)",
    )
    ap.add_argument("--trainers", type=int, default=1)
    ap.add_argument("--seq", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--recycle-bytes", type=int, default=0, help="store.recycle_bytes")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--checkpoint-every", type=int, default=500, help="steps")
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--warmup", type=int, default=5000, help="samples before the fits start")
    ap.add_argument("--extrapolate", type=int, default=10_000_000)
    ap.add_argument("--work", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--prepare-only", action="store_true",
                    help="only the feeder's prepare() of --refs records, in-process: its "
                         "Python heap peak (tracemalloc) and time")  # fmt: skip
    args = ap.parse_args(argv)
    if args.prepare_only:
        out = prepare_only(args)
        print(f"prepare() of {out['records']:,} records: {out['samples']:,} samples in "
              f"{out['seconds']:.1f} s, Python heap peak {human(out['heap_peak_bytes'], 'B')}, "
              f"held after {human(out['heap_after_bytes'], 'B')}")  # fmt: skip
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(out, indent=1))
        return 0
    out = run(args)
    print(f"trained {out['trained']:,} of {args.refs:,} refs in {out['seconds']:.0f} s; "
          f"lineage {out['lineage']:,} ids, each once")  # fmt: skip
    if "refs_per_s" in out:
        print(f"refs/s {out['refs_per_s']:.1f} (tenths: {out['refs_per_s_tenths']}); last 3 tenths "
              f"/ first 3: {out['last_over_first']:.2f}; {args.extrapolate:,} refs would take "
              f"{out['hours_at_target']:.1f} h here")  # fmt: skip
    for line in out["lines"]:
        print(line)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
