"""Multi-GPU runs on one host: data parallel (ddp, fsdp), target-TP islands, disaggregated
capture -> trainer GPUs, checkpoint/resume and elastic trainer replicas, with lineage checks.

Same Qwen3-8B-shaped random target, EAGLE3 draft and data as `gpu_pipeline.py` (whose worker
entry point runs `specbus train/produce` unchanged with the random-target engine). Every
scenario is real processes on real GPUs: an embedded broker, the feeder, producer and trainer
ranks (torchrun-style RANK/WORLD_SIZE/LOCAL_RANK, NCCL for gradients, gloo for the control
plane), each process pinned to its GPU(s) with CUDA_VISIBLE_DEVICES.

Scenarios (`--scenarios`, default all that fit `--gpus`):
- coloc1       colocated, 1 rank on GPU 0: the per-GPU baseline;
- coloc1p      as coloc1 with `deployment.colocated_prefetch=1` (capture overlaps the step);
- ddpp         as ddp with `deployment.colocated_prefetch=1`;
- ddp          colocated, one rank per GPU, replicated draft (one all-reduce per step);
- fsdp         colocated, one rank per GPU, FSDP draft; run in two phases: the first stops
               at half the steps, the second resumes from its checkpoint (same world size);
- tp           colocated, target TP over all GPUs (islands of `--tp`), disjoint slices;
- disagg       1 producer GPU (GPU 0) -> the other GPUs as trainer ranks, shm store;
- elastic      1 producer GPU -> 1 trainer rank for half the steps, then the run resumes
               with one more trainer rank (the new replica joins the "trainers" group; with 2
               GPUs it shares GPU 0 with the producer).
Each optimizer step accumulates `--accumulation` micro-batches; step `--profile-step` of every
rank is profiled (collective counts per rank: the one-gradient-collective-per-step check).

Per scenario: samples/s per GPU over the steady log rows (after `--warmup` steps), data-wait,
scaling vs coloc1, the lineage check (every trained sample id unique, from the fed set, and as
many as the steps imply), the profiled collectives.

    python -m specbus.ops.bench.gpu_multi --gpus 2 --out $OUT/gpu_multi.json
    python -m specbus.ops.bench.gpu_multi --gpus 2 --tiny --steps 8 --seq 256   # quick path check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
from specbus.consumers.lineage import load_state
from specbus.core.config import build_config, dump_config
from specbus.ops.bench.random_target import QWEN3_8B, TINY, shm_uri, write_data, write_target
from specbus.ops.launch import Launcher
from specbus.ops.services.nats import NatsServer


@dataclass
class Proc:
    role: str  # "produce" or "train"
    gpus: str  # CUDA_VISIBLE_DEVICES
    extra: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


class Run:
    """One run (one broker, one run name) and the processes of its phases."""

    def __init__(self, name: str, work: Path, cfg_tree: dict, hidden: int):
        self.work = work
        self.cfg = build_config(cfg_tree)
        self.hidden = hidden
        self.server = NatsServer(work / f"nats-{self.cfg.run}").start()
        self.config_path = work / f"{self.cfg.run}.yaml"
        self.config_path.write_text(dump_config(self.cfg))
        self.name = name

    def feed(self) -> None:
        from specbus.ops.produce import run_feeder

        asyncio.run(run_feeder(self.cfg, bus_url=self.server.url))

    def phase(self, tag: str, procs: list[Proc], timeout_s: float) -> float:
        """Start `procs`, wait for every trainer rank, then the producers. Returns wall s."""
        env0 = {"OMP_NUM_THREADS": "4", "TOKENIZERS_PARALLELISM": "false", "NCCL_NVLS_ENABLE": "0"}
        launcher = Launcher(self.work / f"{self.cfg.run}-logs", env=env0,
                            module="specbus.ops.bench.random_target")  # fmt: skip
        launcher.env.pop("SPECBUS_THREADS", None)
        trainers = [p for p in procs if p.role == "train"]
        producers = [p for p in procs if p.role != "train"]

        def argv(key: str, p: Proc) -> list[str]:
            return ["--stats", str(self.work / f"{self.cfg.run}-{key}.mem.json"),
                    "--log-level", "WARNING", p.role, "--config", str(self.config_path),
                    "--url", self.server.url, *p.extra]  # fmt: skip

        t0 = time.perf_counter()
        try:
            # Trainers first (one visible GPU each: LOCAL_RANK 0); producers once a resuming
            # trainer has cleared the run's train-complete marker (a producer that sees it
            # leaves at once).
            launcher.ranks(
                len(trainers), lambda r: argv(f"{tag}-train{r}", trainers[r]),
                name=f"{tag}-train{{rank}}",
                env=lambda r: {"CUDA_VISIBLE_DEVICES": trainers[r].gpus, **trainers[r].env},
                local_rank=lambda r: 0,
            )  # fmt: skip
            if producers and any("--resume" in p.extra for p in trainers):
                self.wait_marker_cleared(deadline_s=timeout_s)
            for i, p in enumerate(producers, start=len(trainers)):
                launcher.start(f"{tag}-produce{i}", argv(f"{tag}-produce{i}", p),
                               env={"CUDA_VISIBLE_DEVICES": p.gpus, **p.env})  # fmt: skip
            names = [f"{tag}-train{r}" for r in range(len(trainers))]
            for key, code in launcher.wait(*names, timeout=timeout_s).items():
                if code != 0:
                    tails = {k: launcher.log(k)[-2500:] for k in launcher.procs}
                    raise RuntimeError(f"{self.name}/{tag}: {key} exited {code}\n"
                                       + json.dumps(tails, indent=1))  # fmt: skip
            wall = time.perf_counter() - t0
            producer_names = [k for k in launcher.procs if "produce" in k]
            if producer_names:  # producers leave on the train-complete marker
                launcher.wait(*producer_names, timeout=60)
            return wall
        finally:
            launcher.stop()

    def wait_marker_cleared(self, deadline_s: float) -> None:
        from specbus.bus.connection import connect
        from specbus.bus.topology import open_kv

        async def go():
            async with await connect(self.cfg.bus, self.server.url) as bus:
                kv = await open_kv(bus, self.cfg.run)
                end = time.monotonic() + deadline_s
                while await kv.train_complete() is not None and time.monotonic() < end:
                    await asyncio.sleep(0.2)

        asyncio.run(go())

    def checkpoint(self) -> dict:
        ckpt = self.cfg.resolved_run_dir / "checkpoints"
        name = (ckpt / "latest").read_text().strip()
        return load_state(ckpt / name)  # the lineage read from the lineage file

    def profiles(self, step: int) -> dict[str, dict]:
        out = {}
        for path in sorted((self.cfg.resolved_run_dir / "profile").glob(f"step{step}-rank*.json")):
            out[path.stem] = json.loads(path.read_text())["collectives"]
        return out

    def close(self) -> None:
        self.server.stop()


def config_tree(run: str, work: Path, target: Path, data: Path, args, *, mode: str,
                tp: int = 1, wrap: str = "ddp") -> dict:  # fmt: skip
    sample_bytes = args.seq * args.hidden * 4 * 2
    budget = max(2 << 30, 16 * sample_bytes)
    return {
        "run": run,
        "run_dir": str(work / run),
        "bus": {"ack_wait_s": 120.0, "heartbeat_s": 5.0, "fetch_timeout_s": 0.1},
        "store": {"uri": shm_uri(run, work, budget) if mode == "disaggregated" else "mem://",
                  "budget_bytes": budget},
        # Colocated: one forward per window (an island's window: tp x per rank).
        "target": {"model": str(target), "tp_size": tp,
                   "capture_batch": args.micro_batch * args.accumulation * tp,
                   "context_length": max(args.seq, 4096)},
        "strategy": {"ttt_length": args.ttt, "draft": {"draft_vocab_size": args.draft_vocab}},
        "data": {"source": str(data), "max_length": args.seq, "holdout": 0},
        "training": {"micro_batch": args.micro_batch, "accumulation": args.accumulation,
                     "log_every": args.log_every, "checkpoint_every": 100_000,
                     "prefetch": args.prefetch, "lr": 1e-4, "wrap": wrap,
                     "max_steps": args.steps, "total_steps": args.steps,
                     "profile_step": args.profile_step},
        "deployment": {"mode": mode},
    }  # fmt: skip


def steady(rows: list[dict], warmup: int, per_rank_step: int) -> dict:
    """Per-rank steady figures from one rank's log rows after `warmup` steps."""
    rows = [r for r in rows if "samples_per_s" in r]
    base = [r for r in rows if r["step"] <= warmup]
    tail = [r for r in rows if r["step"] > warmup] or rows[-1:]
    prev = base[-1]["step"] if base else 0.0
    spans, samples, waits = [], 0.0, 0.0
    for r in tail:
        n = (r["step"] - prev) * per_rank_step
        spans.append(n / r["samples_per_s"])
        samples += n
        waits += spans[-1] * r["data_wait_frac"]
        prev = r["step"]
    wall = sum(spans)
    return {"rank_samples_per_s": samples / wall, "data_wait_frac": waits / wall,
            "steady_steps": int(tail[-1]["step"] - (base[-1]["step"] if base else 0)),
            "loss_last": tail[-1].get("loss")}  # fmt: skip


def lineage_check(state: dict, fed: int, expected: int | None) -> dict:
    lineage = state["lineage"]
    fed_ids = {f"t{i}-e0" for i in range(fed)}
    ok = len(lineage) == len(set(lineage)) and set(lineage) <= fed_ids
    if expected is not None:
        ok = ok and len(lineage) == expected
    return {"trained": len(lineage), "unique": len(set(lineage)), "expected": expected,
            "step": state["step"], "exactly_once": ok}  # fmt: skip


def scenario(name: str, gpus: int, args, work: Path, target: Path, data: Path, fed: int) -> dict:
    per_rank = args.micro_batch * args.accumulation
    run_name = f"m-{name}-{uuid.uuid4().hex[:6]}"
    half = max(args.warmup + 2, args.steps // 2)
    others = ",".join(str(g) for g in range(1, gpus))
    coloc = {"mode": "colocated"}
    if name in ("coloc1", "coloc1p"):
        tree, world, used = config_tree(run_name, work, target, data, args, **coloc), 1, 1
        phases = [[Proc("train", "0")]]
    elif name == "ddpp":
        tree = config_tree(run_name, work, target, data, args, **coloc)
        world = used = gpus
        phases = [[Proc("train", str(g)) for g in range(gpus)]]
    elif name in ("ddp", "fsdp"):
        tree = config_tree(run_name, work, target, data, args, wrap=name, **coloc)
        world = used = gpus
        ranks = [Proc("train", str(g)) for g in range(gpus)]
        if name == "fsdp":  # checkpoint at `half`, then resume with the same world size
            phases = [[Proc("train", str(g), [f"training.max_steps={half}"]) for g in range(gpus)],
                      [Proc("train", str(g), ["--resume"]) for g in range(gpus)]]  # fmt: skip
        else:
            phases = [ranks]
    elif name == "tp":
        tree = config_tree(run_name, work, target, data, args, tp=args.tp, **coloc)
        world = used = gpus
        phases = [[Proc("train", str(g)) for g in range(gpus)]]
    elif name == "disagg":
        tree = config_tree(run_name, work, target, data, args, mode="disaggregated")
        world, used = gpus - 1, gpus
        phases = [[Proc("produce", "0")] + [Proc("train", str(g)) for g in range(1, gpus)]]
    elif name == "elastic":
        tree = config_tree(run_name, work, target, data, args, mode="disaggregated")
        world, used = gpus, gpus  # the final phase
        grown = [Proc("train", g, ["--resume"]) for g in [*others.split(","), "0"]]
        phases = [[Proc("produce", "0"), Proc("train", others.split(",")[0],
                                              [f"training.max_steps={half}"])],
                  [Proc("produce", "0")] + grown]  # fmt: skip
    else:
        raise SystemExit(f"unknown scenario {name!r}")
    if name in ("coloc1p", "ddpp"):  # capture of the next window overlaps the step
        tree["deployment"]["colocated_prefetch"] = 1
    hidden = args.hidden
    run = Run(name, work, tree, hidden)
    out: dict = {"gpus_used": used, "trainer_ranks": world}
    try:
        run.feed()
        walls = []
        for i, procs in enumerate(phases):
            walls.append(run.phase(f"p{i}", procs, args.timeout))
            if i == 0 and len(phases) > 1:
                first = run.checkpoint()
                out["phase0"] = lineage_check(first, fed, half * per_rank * len(
                    [p for p in procs if p.role == "train"]))  # fmt: skip
        state = run.checkpoint()
        rows = state["history"]
        if len(phases) > 1:  # figures of the last phase only, after its own warm-up
            fig = steady(rows, half + args.log_every, per_rank)
        else:
            fig = steady(rows, args.warmup, per_rank)
        # Every rank trains per_rank samples per step: global = per-rank x world.
        fig["samples_per_s"] = fig["rank_samples_per_s"] * world
        fig["samples_per_s_per_gpu"] = fig["samples_per_s"] / used
        out.update(fig)
        steps_done = state["step"]
        if len(phases) > 1:
            first_world = len([p for p in phases[0] if p.role == "train"])
            expected = half * per_rank * first_world + (steps_done - half) * per_rank * world
        else:
            expected = steps_done * per_rank * world
        out["lineage"] = lineage_check(state, fed, expected)
        out["collectives"] = run.profiles(args.profile_step)
        out["wall_s"] = walls
    finally:
        run.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count() or 2)
    ap.add_argument("--scenarios", default="coloc1,ddp,fsdp,tp,disagg,elastic")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--log-every", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument(
        "--profile-step",
        type=int,
        default=4,
        help="0-based; keep it inside the warm-up (profiling slows that step)",
    )
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per phase")
    ap.add_argument("--tiny", action="store_true", help="a 4-layer, 2k-vocab target")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.gpus < 2:
        raise SystemExit(f"--gpus {args.gpus}: these scenarios need at least 2 GPUs")
    work = Path(tempfile.mkdtemp(prefix="specbus-gpumulti-"))
    overrides = TINY if args.tiny else None
    shape = {**QWEN3_8B, **(overrides or {})}
    args.hidden = shape["hidden_size"]
    args.draft_vocab = min(args.draft_vocab, shape["vocab_size"])
    cuda = torch.cuda.is_available()  # without: a CPU/gloo check of the same paths (--tiny)
    target = write_target(work / "target", overrides, device="cuda" if cuda else "cpu")
    per_rank = args.micro_batch * args.accumulation
    fed = args.steps * per_rank * args.gpus + 8
    data = write_data(work / "data.jsonl", fed, args.seq, shape["vocab_size"])
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()},
                    "device": f"{args.gpus}x {torch.cuda.get_device_name() if cuda else 'cpu'}",
                    "torch": torch.__version__, "results": {}}  # fmt: skip
    for name in args.scenarios.split(","):
        t0 = time.perf_counter()
        try:
            report["results"][name] = scenario(name, args.gpus, args, work, target, data, fed)
        except Exception as e:  # keep the other scenarios' figures
            report["results"][name] = {"error": str(e)[-5000:]}
        report["results"][name]["scenario_s"] = time.perf_counter() - t0
        print(name, json.dumps(report["results"][name], default=str), flush=True)
        base = report["results"].get("coloc1", {}).get("samples_per_s_per_gpu")
        if base and "samples_per_s_per_gpu" in report["results"][name]:
            r = report["results"][name]
            r["per_gpu_vs_coloc1"] = r["samples_per_s_per_gpu"] / base
            r["total_vs_coloc1"] = r["samples_per_s"] / base
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1, default=str))
    print_table(report)
    shutil.rmtree(work, ignore_errors=True)


def print_table(report: dict) -> None:
    print(f"\n=== {report['device']} (torch {report['torch']})")
    print(f"{'scenario':<9} {'gpus':>4} {'ranks':>5} {'samples/s':>9} {'per GPU':>8} "
          f"{'xcoloc1':>7} {'wait':>6} {'lineage':>16}")  # fmt: skip
    for name, r in report["results"].items():
        if "error" in r:
            print(f"{name:<9} ERROR {r['error'][-400:]}")
            continue
        lin = r["lineage"]
        print(f"{name:<9} {r['gpus_used']:>4} {r['trainer_ranks']:>5} {r['samples_per_s']:>9.2f} "
              f"{r['samples_per_s_per_gpu']:>8.2f} {r.get('total_vs_coloc1', float('nan')):>7.2f} "
              f"{r['data_wait_frac']:>6.2f} "
              f"{('ok ' if lin['exactly_once'] else 'BAD ') + str(lin['trained']):>16}")  # fmt: skip
        for rank, ops in r.get("collectives", {}).items():
            print(f"    {rank}: " + ", ".join(f"{k} x{v}" for k, v in ops.items()))


if __name__ == "__main__":
    main()
