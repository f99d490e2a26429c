"""Where a mixed-length colocated step goes: the target's prefill and the draft's train step,
each synchronised and timed per sample, on lengths never seen before vs lengths seen before.

At a fixed length the DSpark pipeline step is the in-process step + the prefill; on the seed's
uniform 512-4096 lengths it was ~300 ms slower than that (docs/benchmarks.md). This probe runs
the real `hf` engine over the Qwen3-8B-shaped random target and the real strategy's train step
(as the colocated trainer does, minus the bus) through phases of `--n` samples each:

- `new`: distinct lengths uniform in [lo, hi], none seen before by this process;
- `seen`: the same lengths again (every per-shape cache warm: cuDNN plans, cuBLAS heuristics,
  compiled graphs, allocator blocks);
- `fixed`: one length (the mean) `--n` times;
- `new@torchsdpa`: new lengths, the prefill's SDPA in torch's own order (cuDNN first on sm90;
  the `hf` engine's default is flash first);
- `new@bucket`: new lengths, each right-extended to a multiple of `--bucket` (causal: the
  real rows are unchanged) with the extension's loss mask 0, as a bucketed batch's padding;
- `new@expandable`: new lengths with the allocator's expandable segments on (set last: it
  applies to segments mapped from then on).

Each phase reports the median and mean prefill / step milliseconds, the compiled graphs
and recompiles Dynamo counted in it, and the allocator's device mallocs / frees / retries.

    python -m specbus.ops.bench.mixed_lengths --strategies dspark,eagle3 --out $OUT/mixed.json
    python -m specbus.ops.bench.mixed_lengths --tiny      # CPU check of the code path
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from specbus.ops.bench.random_target import TINY, random_engine, write_target
from specbus.ops.bench.step_profile import build

PHASES = ("new", "seen", "fixed", "new@torchsdpa", "new@bucket", "new@expandable")


def _counters() -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        from torch._dynamo.utils import counters

        out["graphs"] = float(counters["stats"].get("unique_graphs", 0))
        out["recompiles"] = float(sum(counters["recompiles"].values()))
    except Exception:  # a private API: the timing is the figure, these are hints
        pass
    if torch.cuda.is_available():
        stats = torch.cuda.memory_stats()
        for key in ("num_device_alloc", "num_device_free", "num_alloc_retries"):
            out[key] = float(stats.get(key, 0))
        out["segments"] = float(stats.get("segment.all.allocated", 0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--strategies", default="dspark", help="comma-separated, run in turn")
    ap.add_argument("--lo", type=int, default=512)
    ap.add_argument("--hi", type=int, default=4096)
    ap.add_argument("--n", type=int, default=12, help="samples per phase")
    ap.add_argument("--bucket", type=int, default=256)
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-anchors", type=int, default=512)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--markov-rank", type=int, default=128)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--tiny", action="store_true", help="a 4-layer, 2k-vocab target (CPU check)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    args.attention, args.fused = None, "auto"  # step_profile.build's knobs: the defaults
    from specbus.core.config import TargetConfig

    phases = args.phases.split(",")
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        ap.error(f"unknown phase(s) {unknown}; known: {PHASES}")
    if args.tiny:
        args.lo, args.hi, args.bucket = max(32, args.lo // 16), max(64, args.hi // 16), 32
        args.num_anchors = min(args.num_anchors, 16)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    work = Path(tempfile.mkdtemp(prefix="specbus-mixed-"))
    t0 = time.perf_counter()
    target = write_target(work / "target", TINY if args.tiny else None, device=str(device))
    print(f"target written in {time.perf_counter() - t0:.1f}s", flush=True)
    engine = random_engine(TargetConfig(model=str(target), device=str(device), capture_batch=1,
                                        context_length=args.hi + args.bucket))  # fmt: skip
    report: dict = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "results": {},
    }
    lengths = Lengths(args.lo, args.hi)  # shared: a length is new once per process
    names = args.strategies.split(",")
    for i, name in enumerate(names):
        # the allocator setting holds from then on: only the last strategy's last phase has it
        todo = [p for p in phases if p != "new@expandable" or i == len(names) - 1]
        probe(name, engine, target, todo, lengths, args, report)
        if cuda:  # the last strategy's draft and optimizer are garbage now
            torch.cuda.empty_cache()
    for name, rows in report["results"].items():
        print(f"\n{name:<16} {'prefill ms':>10} {'step ms':>8} {'samples/s':>9} {'graphs':>6} "
              f"{'mallocs':>7}")  # fmt: skip
        for phase, r in rows.items():
            print(f"{phase:<16} {r['prefill_ms_mean']:>10.1f} {r['step_ms_mean']:>8.1f} "
                  f"{r['samples_per_s']:>9.2f} {r.get('d_graphs', 0):>6.0f} "
                  f"{r.get('d_num_device_alloc', 0):>7.0f}")  # fmt: skip


class Lengths:
    """Lengths uniform in [lo, hi], each handed out once (`new`)."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi, self.used, self.rng = lo, hi, set(), random.Random(3)

    def new(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            seq = self.rng.randint(self.lo, self.hi)
            if seq not in self.used:
                self.used.add(seq)
                out.append(seq)
        return out


def probe(name: str, engine, target: Path, phases: list[str], lengths: Lengths, args, report):
    """The phases for one strategy (a fresh draft and optimizer), rows by phase."""
    from specbus.core.config import TrainingConfig
    from specbus.core.data.vocab import build_vocab_mapping, count_tokens
    from specbus.core.strategies.base import StepContext
    from specbus.core.training import build_optimizer, train_step
    from specbus.producers.engines.hf import SDPA_ENV

    device = engine.device
    cuda = device.type == "cuda"
    strategy, info, heads = build(name, target, args)
    contract = strategy.feature_contract(info)
    vocab = None
    if name == "eagle3":
        ids = torch.randint(3, info.vocab_size - 1, (4096,))
        vocab = build_vocab_mapping(
            count_tokens([(ids, torch.ones_like(ids))]), strategy.draft_vocab_size, info.vocab_size
        )
    draft = strategy.build_model(info, heads, vocab).to(device)
    optimizer = build_optimizer(draft, TrainingConfig())
    step_no = [0]

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def one(seq: int, bucket: int | None) -> tuple[float, float]:
        padded = -(-seq // bucket) * bucket if bucket else seq
        ids = torch.randint(3, info.vocab_size - 1, (padded,))
        mask = torch.tensor([0] * (padded // 4) + [1] * (padded - padded // 4))
        sync()
        t0 = time.perf_counter()
        (captured,) = engine.capture([ids], [mask], contract, device=device)
        sync()
        t1 = time.perf_counter()
        if bucket:  # the rows past `seq` stand for the batch's padding: never supervised
            captured["loss_mask"][seq:] = 0
        batch = strategy.collate([captured]).to(device)
        step_no[0] += 1
        train_step(strategy, draft, [batch], optimizer, None, grad_clip=1.0,
                   step=StepContext(step_no[0], 10_000),
                   autocast_dtype=torch.bfloat16 if cuda else None)  # fmt: skip
        sync()
        t2 = time.perf_counter()
        return 1000 * (t1 - t0), 1000 * (t2 - t1)

    def phase(phase_name: str, seqs: list[int], bucket: int | None = None) -> dict:
        before = _counters()
        prefill, step = [], []
        for seq in seqs:
            p, s = one(seq, bucket)
            prefill.append(p)
            step.append(s)
        after = _counters()
        row = {
            "n": len(seqs),
            "mean_len": statistics.mean(seqs),
            "prefill_ms_median": statistics.median(prefill),
            "prefill_ms_mean": statistics.mean(prefill),
            "step_ms_median": statistics.median(step),
            "step_ms_mean": statistics.mean(step),
            "samples_per_s": 1000 * len(seqs) / (sum(prefill) + sum(step)),
            "prefill_ms": [round(x, 1) for x in prefill],
            "step_ms": [round(x, 1) for x in step],
            **{f"d_{k}": after[k] - before.get(k, 0.0) for k in after},
        }
        print(name, phase_name, json.dumps({k: (round(v, 2) if isinstance(v, float) else v)
                                            for k, v in row.items()}), flush=True)  # fmt: skip
        return row

    rows: dict[str, dict] = {}
    report["results"][name] = rows
    t0 = time.perf_counter()
    for seq in lengths.new(3):  # warm-up: every kernel compiled once, dynamic shapes included
        one(seq, None)
    print(f"{name}: warm-up {time.perf_counter() - t0:.1f}s", flush=True)
    mean = (args.lo + args.hi) // 2
    seen: list[int] = []
    for phase_name in phases:
        if phase_name == "new":
            seen = lengths.new(args.n)
            rows[phase_name] = phase(phase_name, seen)
        elif phase_name == "seen":
            rows[phase_name] = phase(phase_name, seen or lengths.new(args.n))
        elif phase_name == "fixed":
            one(mean, None)
            rows[phase_name] = phase(phase_name, [mean] * args.n)
        elif phase_name == "new@torchsdpa":
            os.environ[SDPA_ENV] = "default"
            try:
                rows[phase_name] = phase(phase_name, lengths.new(args.n))
            finally:
                os.environ.pop(SDPA_ENV, None)
        elif phase_name == "new@bucket":
            rows[phase_name] = phase(phase_name, lengths.new(args.n), bucket=args.bucket)
        elif phase_name == "new@expandable":
            if cuda:
                torch.cuda.memory._set_allocator_settings("expandable_segments:True")
            rows[phase_name] = phase(phase_name, lengths.new(args.n))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1))
    return rows


if __name__ == "__main__":
    main()
