"""GPU throughput of DFlash-family training (the seed's setup): a Qwen3-8B-shaped random target,
a DSpark (or DFlash / Domino) draft, bf16, colocated, micro-batch 1, mixed sequence lengths.

Each run is `specbus train` in colocated mode as users run it (one trainer rank capturing its
own tasks; the random-target `hf` engine of `ops/bench/random_target.py`, registered in the
worker process), on pre-tokenised samples whose lengths are drawn uniformly from
[--min-len, --max-len] (the last three quarters of each supervised). Figures are the steady
state after `--warmup` optimizer steps: samples/s (per GPU), tokens/s, the capture fraction
(capture seconds over wall time), the trainer's peak CUDA memory; the seed's DSpark figure
(5.7 samples/s per H200, capture 11.2 %) and each run's goal (issue 26, `perf_summary.GOALS`:
DSpark 512-4096 >= 7.5, DFlash 2048 >= 9.0) are printed beside them.
Each run's MFU (`mfu`): its model FLOPs per sample (the prefill and one train step, averaged
over the run's lengths; ops/bench/flops.py, written once under `flops.per_sample`) x
samples/s over the GPU's peak dense bf16 rate.

    python -m specbus.ops.bench.gpu_dflash --runs dspark:512-4096 --out $OUT/gpu_dflash.json
    python -m specbus.ops.bench.gpu_dflash --runs dflash:2048-2048 --out $OUT/gpu_dflash_2048.json
    python -m specbus.ops.bench.gpu_dflash --runs dspark:512-4096,dspark:512-4096@torchsdpa,dspark:512-4096@expandable
                                                           # variants: VARIANTS below
    python -m specbus.ops.bench.gpu_dflash --tiny          # CPU check of the same code paths (minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import torch
from specbus.core.config import build_config
from specbus.ops.bench.flops import describe, flops_section, fmt_mfu, mean_sample_flops, mfu
from specbus.ops.bench.gpu_pipeline import run_mode
from specbus.ops.bench.perf_summary import row_goal
from specbus.ops.bench.random_target import QWEN3_8B, TINY, shm_uri, target_variants, write_target

SEED_SAMPLES_PER_S, SEED_CAPTURE_FRAC = 5.7, 0.112
# `--runs dspark:512-4096@torchsdpa`: the same run with its processes' environment changed
# (docs/benchmarks.md, "Mixed lengths"): the prefill's SDPA backends in torch's own order
# (cuDNN first on sm90: a plan per new length; the hf engine's default is flash first) or
# flash only, the allocator's expandable segments; or with the config changed: `@compile`,
# `target.compile` on (the capture's decoder layers torch.compile'd); `@disagg`, the
# disaggregated layout on the same GPU (a producer process and the trainer, the shm store);
# `@graphs`, `target.cuda_graphs` on (the prefill replayed as CUDA graphs per length bucket).
# `@fp8`, `target.quantize: fp8` (the target's decoder linears in FP8, core/models/fp8.py).
# Variants combine with `+`: `dflash:2048-2048@compile+disagg`.
CONFIG_VARIANTS = ("compile", "disagg", "graphs", "fp8")
STORE_BUDGET = 8 << 30
VARIANTS = {
    "torchsdpa": {"SPECBUS_SDPA_BACKENDS": "default"},
    "flash": {"SPECBUS_SDPA_BACKENDS": "flash,efficient,math"},
    "expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "both": {"SPECBUS_SDPA_BACKENDS": "flash,efficient,math",
             "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
}  # fmt: skip


def write_mixed_data(path: Path, n: int, lo: int, hi: int, vocab: int) -> Path:
    """`n` pre-tokenised samples, lengths uniform in [lo, hi], the last 3/4 supervised."""
    rng = random.Random(1)
    with open(path, "w") as f:
        for _ in range(n):
            seq = rng.randint(lo, hi)
            ids = [rng.randrange(3, vocab) for _ in range(seq)]
            mask = [0] * (seq // 4) + [1] * (seq - seq // 4)
            f.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
    return path


def config_for(run, work: Path, target: Path, data: Path, strategy: str, hi: int, args, vocab,
               variants: tuple[str, ...] = ()):  # fmt: skip
    """The run's config, with what its `CONFIG_VARIANTS` among `variants` change."""
    strat = {
        "name": strategy,
        "mask_token_id": vocab - 1,  # an embedding row past Qwen3's tokenizer (151669 < 151936)
        "block_size": args.block_size,
        "num_anchors": args.num_anchors,
        "loss_gamma": 7.0,
        "draft": {"num_layers": args.draft_layers},
    }
    if strategy == "dspark":
        strat["dspark"] = {"markov_rank": args.markov_rank}
    tree = {
        "run": run,
        "run_dir": str(work / run),
        "bus": {"ack_wait_s": 120.0, "heartbeat_s": 5.0, "fetch_timeout_s": 0.1},
        "store": {"uri": shm_uri(run, work, 8 << 30) if "disagg" in variants else "mem://",
                  "budget_bytes": STORE_BUDGET},
        "target": {"model": str(target), "capture_batch": 1, "context_length": max(hi, 4096),
                   **target_variants(variants)},
        "strategy": strat,
        "data": {"source": str(data), "max_length": hi, "holdout": 0},
        "training": {"micro_batch": 1, "log_every": args.log_every, "checkpoint_every": 100_000,
                     "lr": 6e-4, "warmup_ratio": 0.04, "grad_clip": 1.0,
                     "max_steps": args.steps, "total_steps": args.steps},
        "deployment": {"mode": "disaggregated"} if "disagg" in variants
        else {"mode": "colocated", "colocated_prefetch": args.colocated_prefetch},
    }  # fmt: skip
    return build_config(tree)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--runs", default="dspark:512-4096,dflash:2048-2048",
        help="strategy:min-max token lengths, comma-separated",
    )  # fmt: skip
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=8, help="steps excluded from the figures")
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-anchors", type=int, default=512)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--markov-rank", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds per run")
    ap.add_argument(
        "--colocated-prefetch", type=int, default=0,
        help="deployment.colocated_prefetch (1: capture the next window on its own stream "
        "while the step runs)",
    )  # fmt: skip
    ap.add_argument("--tiny", action="store_true", help="a 4-layer, 2k-vocab target (CPU check)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    runs = []
    for spec in args.runs.split(","):
        spec, _, variant = spec.partition("@")
        name, lengths = spec.split(":")
        lo, hi = (int(x) for x in lengths.split("-"))
        if args.tiny:
            lo, hi = max(32, lo // 16), max(32, hi // 16)
        variants = tuple(v for v in variant.split("+") if v)
        for v in variants:
            if v not in VARIANTS and v not in CONFIG_VARIANTS:
                ap.error(f"unknown variant @{v}; known: {sorted([*VARIANTS, *CONFIG_VARIANTS])}")
        runs.append((name, lo, hi, variants))
    if args.tiny:
        args.steps, args.warmup, args.log_every = min(args.steps, 8), min(args.warmup, 2), 2
        args.num_anchors = min(args.num_anchors, 32)
    work = Path(tempfile.mkdtemp(prefix="specbus-gpudflash-"))
    overrides = TINY if args.tiny else None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = write_target(work / "target", overrides, device=device)
    vocab = (overrides or QWEN3_8B)["vocab_size"]
    report: dict = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "seed": {"samples_per_s": SEED_SAMPLES_PER_S, "capture_frac": SEED_CAPTURE_FRAC},
        "results": {},
    }
    report["flops"] = flops_section(report["device"])
    peak = report["flops"]["peak_flops"]
    target_config = json.loads((target / "config.json").read_text())

    def save():
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1, default=str))

    for name, lo, hi, variants in runs:
        key = f"{name}:{lo}-{hi}" + (f"@{'+'.join(variants)}" if variants else "")
        fed = args.steps + 4
        if "disagg" in variants:
            # the producer must still be capturing at the trainer's last step: with only what
            # is trained it filled the store in the warm-up and the window timed the trainer
            # alone (gpu_pipeline.tasks_to_feed); a bound on what the store can hold
            fed += min(2048, STORE_BUDGET // (lo * target_config["hidden_size"] * 2))
        data = write_mixed_data(work / f"data-{name}-{lo}-{hi}.jsonl", fed, lo, hi, vocab)
        run = f"gd-{name}-{uuid.uuid4().hex[:6]}"
        cfg = config_for(run, work, target, data, name, hi, args, vocab, variants)
        flops = mean_sample_flops(cfg.strategy, target_config, lo, hi)
        report["flops"]["per_sample"][key] = flops
        t1 = time.perf_counter()
        env = {k: v for name in variants for k, v in VARIANTS.get(name, {}).items()}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the run's processes inherit it
        try:
            row = run_mode(cfg, work, args.warmup, args.timeout)
        except Exception as e:  # keep the other runs' figures
            row = {"error": str(e)[-4000:]}
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        row["wall_s"] = time.perf_counter() - t1
        row["mfu"] = mfu(flops["total"], row.get("samples_per_s"), peak)
        if "samples_per_s" in row:
            row["vs_seed"] = row["samples_per_s"] / SEED_SAMPLES_PER_S
            goal = row_goal("dflash", key)
            row["goal_samples_per_s"] = goal and goal.samples_per_s
            row["vs_goal"] = goal and row["samples_per_s"] / goal.samples_per_s
        report["results"][key] = row
        print(key, json.dumps(row, default=str), flush=True)
        save()
    print(f"\n=== {report['device']} (torch {report['torch']}); seed DSpark {SEED_SAMPLES_PER_S} "
          f"samples/s, capture {SEED_CAPTURE_FRAC:.1%}")  # fmt: skip
    print(f"{'run':<32} {'samples/s':>9} {'MFU':>5} {'tokens/s':>9} {'step ms':>8} {'capture':>8} "
          f"{'alloc GiB':>9} {'resv GiB':>8} {'vs seed':>7} {'goal':>5}")  # fmt: skip
    for key, r in report["results"].items():
        if "error" in r:
            print(f"{key:<32} ERROR {r['error'][-600:]}")
            continue
        mem = r.get("train_mem", {})
        print(f"{key:<32} {r['samples_per_s']:>9.2f} {fmt_mfu(r['mfu']):>5} "
              f"{r['tokens_per_s']:>9.0f} {r['step_ms']:>8.1f} "
              f"{r.get('capture_frac', float('nan')):>8.1%} "
              f"{mem.get('peak_allocated_gib', float('nan')):>9.1f} "
              f"{mem.get('peak_reserved_gib', float('nan')):>8.1f} {r['vs_seed']:>7.2f} "
              f"{r.get('goal_samples_per_s') or '':>5}")  # fmt: skip
    for key, f in report["flops"]["per_sample"].items():
        print(f"FLOPs per sample, {key}: {describe(f)}")
    print(f"MFU against {report['flops']['peak_source']}; {report['flops']['convention']}")
    save()
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
