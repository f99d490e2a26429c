"""GPU pipeline throughput: a Qwen3-8B-shaped random target, an EAGLE3 draft, colocated vs
disaggregated on one GPU, per sequence length.

- colocated: one trainer rank process capturing its own tasks (`deployment.mode: colocated`);
- disaggregated: one producer process and one trainer process sharing the GPU, tensors through
  the shm store, metadata through the embedded broker;
- either with `+compile` (`--modes colocated+compile`): the same with `target.compile` on
  (the capture's decoder layers `torch.compile`d; producers/engines/hf.py).

The target is Qwen3-8B's architecture with random weights (nothing is downloaded): the target
directory holds its `config.json` and a safetensors file with only `embed_tokens` and `lm_head`
(what a trainer reads), plus a fingerprint marker (ops/bench/random_target.py: its worker
processes run `specbus train/produce` unchanged with the `hf` engine swapped for the random
model). Same compute and feature sizes as the real model; 16 GB are never written to disk.

Figures are the trainer's steady state: log intervals after `--warmup` optimizer steps
(start-up, flex-attention compilation and the first captures are excluded). Capture fraction
(colocated) is the rank's capture seconds over the steady wall time. Each worker process
writes its peak allocated/reserved CUDA memory at exit. `--profile-step N` profiles the
trainer's optimizer step N of every run (`training.profile_step`): the row gets the step's
GPU `timeline` (busy and overlapped ms per stream: how much of the colocated capture the step
hides; consumers/profiling.py) and the Chrome trace is kept beside `--out`. `--profile` adds an in-process
breakdown per sequence length (prefill, host copies, the draft's forward / backward /
clip+optimizer; no bus) and a torch.profiler table of one draft train step.

Every row carries its MFU (`mfu`: the sample's model FLOPs, the capture's prefill plus one
train step, x samples/s over the GPU's peak dense bf16 rate; ops/bench/flops.py); the FLOPs
per sample are written once per length under `flops.per_sample`, with the peak and its source.

    python -m specbus.ops.bench.gpu_pipeline --seqs 2048,4096 --out $OUT/gpu_pipeline.json --profile
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch
from specbus.core.config import build_config, dump_config
from specbus.ops.bench.flops import describe, flops_section, fmt_mfu, mfu, sample_flops
from specbus.ops.bench.random_target import (  # noqa: F401  (gpu_dflash, gpu_multi use them)
    QWEN3_8B,
    TINY,
    build_random_target,
    random_engine,
    shm_uri,
    target_variants,
    write_data,
    write_target,
)
from specbus.ops.launch import Launcher
from specbus.ops.services.nats import NatsServer

# `--modes colocated+compile+flash+graphs`: target.compile on; EAGLE3's flash TTT attention;
# target.cuda_graphs on (the prefill replayed as CUDA graphs); `+sync` / `+overlap`:
# training.overlap_steps off (the trainer waits for each step's figures before queuing the next:
# the GPU drains) / on (the default on CUDA; `+overlap` forces it on the CPU); `+fp8`:
# target.quantize fp8 (the target's decoder linears in FP8, core/models/fp8.py)
MODE_VARIANTS = ("compile", "flash", "graphs", "sync", "overlap", "fp8")


def sample_bytes(seq: int) -> int:
    """One sample's features at `seq` tokens: 3 aux layers and the final state, bf16."""
    return seq * QWEN3_8B["hidden_size"] * 4 * 2


def store_budget(seq: int) -> int:
    """The store's byte budget at `seq` tokens: 12 samples' features, at least 2 GiB."""
    return max(2 << 30, 12 * sample_bytes(seq))


def tasks_to_feed(seq: int, trained: int) -> int:
    """Tasks fed for a run that trains `trained` samples: enough that the disaggregated
    producer still captures through the trainer's last step. With only `trained`, it captured
    up to a full store (~30 samples at 2048 tokens) during the trainer's warm-up, and the
    steady window then timed the trainer alone on a GPU the producer had left (10.8
    samples/s at 2048 where the two processes' kernels add up to ~122 ms a sample)."""
    return trained + store_budget(seq) // sample_bytes(seq) + 8


def strategy_tree(args) -> dict:
    """The EAGLE3 strategy section every run of this bench uses."""
    return {"ttt_length": args.ttt, "draft": {"draft_vocab_size": args.draft_vocab}}


def config_for(
    run: str,
    work: Path,
    target: Path,
    data: Path,
    seq: int,
    mode: str,
    args,
    strategy: dict | None = None,
):
    """A run of `mode` (`colocated` | `disaggregated`, then `+compile` for `target.compile`,
    `+flash` for `strategy.attention: flash`, `+graphs` for `target.cuda_graphs`, `+fp8` for
    `target.quantize: fp8`, `+sync` /
    `+overlap` for `training.overlap_steps` false / true) at
    `seq` tokens; `strategy` (a strategy section) defaults to `strategy_tree(args)`."""
    mode, *variants = mode.split("+")
    for variant in variants:
        if variant not in MODE_VARIANTS:
            raise ValueError(f"unknown mode variant +{variant} (known: {MODE_VARIANTS})")
    strategy = strategy if strategy is not None else strategy_tree(args)
    if "flash" in variants:
        strategy = strategy | {"attention": "flash"}
    budget = store_budget(seq)
    tree = {
        "run": run,
        "run_dir": str(work / run),
        "bus": {"ack_wait_s": 120.0, "heartbeat_s": 5.0, "fetch_timeout_s": 0.1},
        "store": {
            "uri": shm_uri(run, work, budget) if mode == "disaggregated" else "mem://",
            "budget_bytes": budget,
        },
        "target": {"model": str(target), "capture_batch": args.micro_batch,
                   "context_length": max(seq, 4096), **target_variants(variants)},
        "strategy": strategy,
        "data": {"source": str(data), "max_length": seq, "holdout": 0},
        "training": {"micro_batch": args.micro_batch, "log_every": args.log_every,
                     "checkpoint_every": 100_000, "prefetch": args.prefetch, "lr": 1e-4,
                     "max_steps": args.steps, "total_steps": args.steps,
                     "profile_step": getattr(args, "profile_step", None),
                     "overlap_steps": {"sync": False, "overlap": True}.get(
                         next((v for v in variants if v in ("sync", "overlap")), ""))},
        "deployment": {"mode": mode} | (
            {"colocated_prefetch": args.colocated_prefetch} if mode == "colocated" else {}
        ),
    }  # fmt: skip
    return build_config(tree)


# ---------------------------------------------------------------------------------------------
# One mode, through real processes


def run_mode(cfg, work: Path, warmup: int, timeout_s: float) -> dict:
    """Run `cfg` in its `deployment.mode` through real processes; its steady-state figures
    (`summarize`), and the profiled step's `timeline` and trace path when
    `training.profile_step` is set."""
    from specbus.ops.produce import run_feeder

    mode = cfg.deployment.mode
    server = NatsServer(work / f"nats-{cfg.run}").start()
    config_path = work / f"{cfg.run}.yaml"
    config_path.write_text(dump_config(cfg))
    # Threads: 4 per process (the GPU does the work), not the launcher's default of 1.
    procs = Launcher(work / f"{cfg.run}-logs", module="specbus.ops.bench.random_target",
                     env={"OMP_NUM_THREADS": "4", "TOKENIZERS_PARALLELISM": "false"})  # fmt: skip
    procs.env.pop("SPECBUS_THREADS", None)
    try:
        asyncio.run(run_feeder(cfg, bus_url=server.url))
        common = ["--config", str(config_path), "--url", server.url]
        roles = (["produce"] if mode == "disaggregated" else []) + ["train"]
        for role in roles:
            procs.start(role, ["--stats", str(work / f"{cfg.run}-{role}.mem.json"),
                               "--log-level", "WARNING", role, *common])  # fmt: skip
        code = procs.wait("train", timeout=timeout_s)["train"]
        if code != 0:
            tails = {r: procs.log(r)[-3000:] for r in roles}
            raise RuntimeError(f"{mode} trainer exited {code}:\n" + json.dumps(tails, indent=1))
        t_end = time.perf_counter()
        if "produce" in procs.procs:  # released by the train-complete marker
            procs.wait("produce", timeout=60)
        print(
            f"{mode}: producer exited {time.perf_counter() - t_end:.1f}s after the trainer",
            flush=True,
        )
        # what a row cannot show, e.g. a prefill graph whose capture failed (kept in the row)
        warned = {r: [line for line in procs.log(r).splitlines() if "WARNING" in line][:8]
                  for r in roles}  # fmt: skip
    finally:
        procs.stop()
        server.stop()
    for role, lines in warned.items():
        for line in lines:
            print(f"{mode} {role}: {line[:400]}", flush=True)
    ckpt = cfg.resolved_run_dir / "checkpoints"
    state = torch.load(
        ckpt / (ckpt / "latest").read_text().strip() / "state.pt", weights_only=False
    )
    row = summarize(cfg, state["history"], mode, warmup, work)
    row["warnings"] = {role: lines for role, lines in warned.items() if lines}
    step = cfg.training.profile_step
    report = cfg.resolved_run_dir / "profile" / f"step{step}-rank0.json"
    if step is not None and report.is_file():
        row["timeline"] = json.loads(report.read_text()).get("timeline")
        row["profile_trace"] = str(report.with_suffix(".trace.json.gz"))
    return row


def summarize(cfg, rows: list[dict], mode: str, warmup: int, work: Path) -> dict:
    """Steady-state figures from the trainer's log rows after `warmup` steps."""
    mb = cfg.training.micro_batch
    base = [r for r in rows if r["step"] <= warmup]
    steady = [r for r in rows if r["step"] > warmup] or rows[-1:]
    spans = []  # seconds of each steady row
    prev = base[-1]["step"] if base else 0.0
    for r in steady:
        spans.append((r["step"] - prev) * mb / r["samples_per_s"])
        prev = r["step"]
    wall = sum(spans)
    samples = sum(s * r["samples_per_s"] for s, r in zip(spans, steady, strict=True))
    tokens = sum(s * r["tokens_per_s"] for s, r in zip(spans, steady, strict=True))
    out = {
        "steady_steps": int(steady[-1]["step"] - (base[-1]["step"] if base else 0)),
        "samples_per_s": samples / wall,
        "tokens_per_s": tokens / wall,
        "step_ms": 1000 * wall / max(1, samples / mb),
        "data_wait_frac": sum(s * r["data_wait_frac"] for s, r in zip(spans, steady, strict=True))
        / wall,
        "bus_ms_per_step": 1000 * statistics.mean(r["bus_s_per_step"] for r in steady),
        "trainer_peak_alloc_gib_history": max(r.get("gpu_peak_gib", 0.0) for r in rows),
        "loss_last": steady[-1].get("loss"),
    }
    if "lag_refs" in steady[-1]:
        # refs captured before the window and trained in it (the window's start lag less its
        # end lag): near 0 when the producer kept pace inside the window; a large figure means
        # the rate is partly the trainer alone on a backlog
        start = (base[-1] if base else steady[0])["lag_refs"]
        out["backlog_trained"] = start - steady[-1]["lag_refs"]
        # the rate of the samples captured inside the window (a lower bound on what the two
        # processes sustain: the trainer that drains a backlog leaves the producer less GPU)
        trained = samples
        out["captured_per_s"] = max(0.0, trained - max(0.0, out["backlog_trained"])) / wall
    if mode == "colocated" and "capture_s" in steady[-1]:
        before = base[-1].get("capture_s", 0.0) if base else 0.0
        out["capture_frac"] = (steady[-1]["capture_s"] - before) / wall
    for role in ("train", "produce"):
        mem = work / f"{cfg.run}-{role}.mem.json"
        if mem.is_file():
            out[f"{role}_mem"] = json.loads(mem.read_text())
    return out


# ---------------------------------------------------------------------------------------------
# In-process breakdown of one step (no bus, no store)


def profile(target: Path, seqs: list[int], args, out_dir: Path | None) -> dict:
    from specbus.core.config import DraftConfig, StrategyConfig, TargetConfig
    from specbus.core.models.target import load_target_heads
    from specbus.core.strategies.base import build_strategy

    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke test of this code
    engine = random_engine(TargetConfig(model=str(target), device=device, capture_batch=1,
                                        context_length=max(seqs)))  # fmt: skip
    heads = load_target_heads(target)
    strategy = build_strategy(
        StrategyConfig(ttt_length=args.ttt, draft=DraftConfig(draft_vocab_size=args.draft_vocab)),
        engine.info,
        heads=heads,
    )
    results = {}
    for seq in seqs:
        results[seq] = profile_seq(engine, strategy, heads, seq, args, out_dir)
        print("profile", seq, json.dumps({k: round(v, 2) for k, v in results[seq].items()}))
    engine.close()
    return results


def profile_seq(engine, strategy, heads, seq: int, args, out_dir: Path | None) -> dict:
    """Medians over `args.profile_reps` after 3 warm-ups, each phase synchronised."""
    from specbus.core.config import TrainingConfig
    from specbus.core.data.vocab import build_vocab_mapping, count_tokens
    from specbus.core.strategies.base import StepContext
    from specbus.core.training import build_optimizer, train_step

    device = engine.device
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    contract = strategy.feature_contract(engine.info)
    g = torch.Generator().manual_seed(2)
    ids = [torch.randint(3, engine.info.vocab_size, (seq,), generator=g) for _ in range(4)]
    masks = [torch.ones(seq, dtype=torch.long) for _ in ids]
    vocab = build_vocab_mapping(
        count_tokens(zip(ids, masks, strict=True)), args.draft_vocab, engine.info.vocab_size
    )
    draft = strategy.build_model(engine.info, heads, vocab).to(device)
    optimizer = build_optimizer(draft, TrainingConfig())
    timings: dict[str, list[float]] = {"prefill_gpu": [], "d2h_h2d": [], "train_step": []}
    split: dict[str, list[float]] = {"forward": [], "backward": [], "clip_optimizer": []}

    def capture(i: int) -> list[dict[str, torch.Tensor]]:
        return engine.capture([ids[i % 4]], [masks[i % 4]], contract, device=device)

    def step(batch, i: int = 0) -> None:
        train_step(strategy, draft, [batch], optimizer, None, grad_clip=0.5,
                   step=StepContext(i, 100), autocast_dtype=torch.bfloat16 if cuda else None)  # fmt: skip

    def loop_step(i: int) -> None:
        """capture -> host (as through a store) -> collate -> device -> train_step."""
        sync()
        t0 = time.perf_counter()
        on_gpu = capture(i)
        sync()
        t1 = time.perf_counter()
        host = [{k: v.cpu() for k, v in s.items()} for s in on_gpu]
        batch = strategy.collate(host, seq).to(device)
        sync()
        t2 = time.perf_counter()
        step(batch, i)
        sync()
        t3 = time.perf_counter()
        for key, v in zip(timings, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            timings[key].append(v)

    def phases(batch, i: int) -> None:
        """The train step's phases, each synchronised (the same work as train_step)."""
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss, _ = strategy.forward_loss(draft, batch, StepContext(i, 100))
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_([p for p in draft.parameters() if p.requires_grad], 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        t3 = time.perf_counter()
        for key, v in zip(split, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            split[key].append(v)

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i in range(3):  # warm-up: compile, allocator, cuBLAS handles
        loop_step(i)
    for v in timings.values():
        v.clear()
    for i in range(args.profile_reps):
        loop_step(i)
    row = {f"{k}_ms": 1000 * statistics.median(v) for k, v in timings.items()}
    row["loop_samples_per_s"] = 1000 / sum(row.values())
    if cuda:
        row["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    batch = strategy.collate(capture(0), seq).to(device)
    for i in range(args.profile_reps):
        phases(batch, i)
    row.update({f"step_{k}_ms": 1000 * statistics.median(v) for k, v in split.items()})
    table = profiler_table(lambda: step(batch))
    if out_dir is not None:
        (out_dir / f"profile_{seq}.txt").write_text(table)
    lines = table.splitlines()
    print(f"--- torch.profiler, one draft train step at {seq} tokens (top ops by device time)")
    print("\n".join(lines[:28] + lines[-3:]), flush=True)
    return row


def profiler_table(step) -> str:
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    averages = prof.key_averages()
    for key in ("self_device_time_total", "self_cuda_time_total", "self_cpu_time_total"):
        try:
            return averages.table(sort_by=key, row_limit=45, max_name_column_width=60)
        except (AttributeError, KeyError, ValueError):
            continue
    return averages.table(row_limit=30)


# ---------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seqs", default="2048,4096")
    ap.add_argument(
        "--modes", default="colocated,disaggregated",
        help="comma-separated; after a mode `+compile`: target.compile on, `+flash`: "
        "strategy.attention flash (EAGLE3's TTT attention, core/models/ttt_flash.py), "
        "`+graphs`: target.cuda_graphs (producers/engines/prefill_graphs.py)",
    )  # fmt: skip
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps per mode run")
    ap.add_argument("--warmup", type=int, default=8, help="steps excluded from the figures")
    ap.add_argument("--log-every", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument(
        "--colocated-prefetch", type=int, default=0,
        help="deployment.colocated_prefetch (1: capture the next window on its own stream "
        "while the step runs)",
    )  # fmt: skip
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per mode run")
    ap.add_argument(
        "--profile-step", type=int, default=None,
        help="profile the trainer's step N of every run (its GPU timeline, a trace)",
    )  # fmt: skip
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-reps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="a 4-layer, 2k-vocab target (CPU check)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.profile_step is not None and args.profile_step >= args.warmup:
        # the profiler's start and its trace export (~1 s) would count in the figures
        ap.error(f"--profile-step {args.profile_step} lies in the measured window (the steps "
                 f"after --warmup {args.warmup}); profile a warm-up step, e.g. "
                 f"{max(0, args.warmup - 2)}")  # fmt: skip
    seqs = [int(s) for s in args.seqs.split(",")]
    work = Path(tempfile.mkdtemp(prefix="specbus-gpubench-"))
    overrides = TINY if args.tiny else None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    target = write_target(work / "target", overrides, device=device)
    vocab = (overrides or QWEN3_8B)["vocab_size"]
    args.draft_vocab = min(args.draft_vocab, vocab)
    print(f"target written in {time.perf_counter() - t0:.1f}s: {target}", flush=True)
    report: dict = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "results": {},
    }
    report["flops"] = flops_section(report["device"])
    peak = report["flops"]["peak_flops"]
    target_config = json.loads((target / "config.json").read_text())
    strategy = build_config({"strategy": strategy_tree(args)}).strategy
    per_sample = report["flops"]["per_sample"]
    for seq in seqs:
        per_sample[str(seq)] = sample_flops(strategy, target_config, seq)

    def save():
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1, default=str))

    for seq in seqs:
        fed = tasks_to_feed(seq, args.steps * args.micro_batch)
        data = write_data(work / f"data-{seq}.jsonl", fed, seq, vocab)
        row = report["results"].setdefault(str(seq), {})
        for mode in args.modes.split(","):
            run = f"gpu-{mode[:5]}-{seq}-{uuid.uuid4().hex[:6]}"
            cfg = config_for(run, work, target, data, seq, mode, args)
            t1 = time.perf_counter()
            try:
                row[mode] = run_mode(cfg, work, args.warmup, args.timeout)
            except Exception as e:  # keep the other runs' figures
                row[mode] = {"error": str(e)[-4000:]}
            row[mode]["wall_s"] = time.perf_counter() - t1
            keep_trace(row[mode], args.out, f"trace_{seq}_{mode}.json.gz")
            row[mode]["mfu"] = mfu(
                per_sample[str(seq)]["total"], row[mode].get("samples_per_s"), peak
            )
            print(seq, mode, json.dumps(row[mode], default=str), flush=True)
            save()
        if "samples_per_s" in row.get("colocated", {}) and "samples_per_s" in row.get(
            "disaggregated", {}
        ):
            row["ratio_disagg_over_coloc"] = (
                row["disaggregated"]["samples_per_s"] / row["colocated"]["samples_per_s"]
            )
        save()
    if args.profile:
        try:
            report["profile"] = profile(target, seqs, args, args.out.parent if args.out else None)
            for seq, p in report["profile"].items():  # each phase against its own FLOPs
                flops = per_sample[str(seq)]
                p["prefill_mfu"] = mfu(flops["prefill"], 1000 / p["prefill_gpu_ms"], peak)
                p["step_mfu"] = mfu(flops["train_step"], 1000 / p["train_step_ms"], peak)
                p["loop_mfu"] = mfu(flops["total"], p["loop_samples_per_s"], peak)
        except Exception as e:
            report["profile"] = {"error": repr(e)[-2000:]}
            print("profile failed:", repr(e), flush=True)
        save()
    print_table(report)
    save()
    shutil.rmtree(work, ignore_errors=True)


def keep_trace(row: dict, out: Path | None, name: str) -> None:
    """The run's profiled-step trace copied beside `out` as `name` (the run's directory is
    deleted at the end); the row then names the copy."""
    trace = Path(row.get("profile_trace") or "")
    if out is not None and trace.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(trace, out.parent / name)
        row["profile_trace"] = name


def print_table(report: dict) -> None:
    print(f"\n=== {report['device']} (torch {report['torch']})")
    print(f"{'seq':>5} {'mode':<18} {'samples/s':>9} {'MFU':>5} {'tokens/s':>9} {'step ms':>8} "
          f"{'capture':>8} {'wait':>6} {'bus ms':>7} {'alloc GiB':>9} {'resv GiB':>8}")  # fmt: skip
    for seq, row in report["results"].items():
        for mode, r in row.items():
            if not isinstance(r, dict):
                continue
            if "error" in r:
                print(f"{seq:>5} {mode:<18} ERROR {r['error'][-300:]}")
                continue
            mem = r.get("train_mem", {})
            pmem = r.get("produce_mem", {})
            alloc = mem.get("peak_allocated_gib", float("nan")) + pmem.get("peak_allocated_gib", 0)
            resv = mem.get("peak_reserved_gib", float("nan")) + pmem.get("peak_reserved_gib", 0)
            print(f"{seq:>5} {mode:<18} {r['samples_per_s']:>9.2f} {fmt_mfu(r.get('mfu')):>5} "
                  f"{r['tokens_per_s']:>9.0f} "
                  f"{r['step_ms']:>8.1f} {r.get('capture_frac', float('nan')):>8.2f} "
                  f"{r['data_wait_frac']:>6.2f} {r['bus_ms_per_step']:>7.1f} {alloc:>9.1f} "
                  f"{resv:>8.1f}")  # fmt: skip
            if r.get("timeline"):
                t = r["timeline"]
                streams = ", ".join(f"stream {k} {v:.1f}" for k, v in t["streams"].items())
                print(f"{'':>5} {'':<18} profiled step: wall {t['wall_ms']:.1f} ms, GPU busy "
                      f"{t['busy_ms']:.1f} ({t['busy_frac']:.0%}), overlapped {t['overlap_ms']:.1f}"
                      f"; {streams}")  # fmt: skip
            if r.get("backlog_trained", 0) > 0:
                print(f"{'':>5} {'':<18} {r['backlog_trained']:.0f} refs trained from a backlog "
                      f"captured before the window: captured inside it {r['captured_per_s']:.2f}"
                      "/s (what the layout sustains lies between)")  # fmt: skip
        if "ratio_disagg_over_coloc" in row:
            print(f"{seq:>5} disagg/coloc   {row['ratio_disagg_over_coloc']:.3f}")
    for seq, p in (report.get("profile") or {}).items():
        if isinstance(p, dict):
            print(f"profile {seq}: " + ", ".join(f"{k} {v:.2f}" for k, v in p.items()
                                                 if isinstance(v, float)))  # fmt: skip
    flops = report.get("flops") or {}
    for seq, f in (flops.get("per_sample") or {}).items():
        print(f"FLOPs per sample at {seq}: {describe(f)}")
    if flops:
        print(f"MFU against {flops['peak_source']}; {flops['convention']}")


if __name__ == "__main__":
    main()
