"""The `hf` engine's capture, eager against `target.compile` and `target.cuda_graphs` (and
both), and `target.quantize: fp8`, in one process on the same weights.

The prefill is the larger half of a colocated sample at 2048 tokens on an H200 (67 of ~150 ms,
docs/benchmarks.md "The profile stage on one H200") and HF's eager decoder layers run their
norms, rotary embedding and activations as separate kernels between the matrix products.
`target.compile` runs each layer `torch.compile`d during capture (producers/engines/hf.py,
`CompiledLayers`); `target.cuda_graphs` replays the prefill as one CUDA graph per length bucket
(producers/engines/prefill_graphs.py). This bench measures what they buy, on the
Qwen3-8B-shaped random target (`--tiny`: a 4-layer one, a CPU check of the code path), every
arm (`--arms`: eager, compiled, graphs, compiled+graphs) over the same weights:

- per fixed length (`--seqs`): the median capture ms of `--reps` after `--warmup` (the compiled
  arm's warm-up time is reported apart: its compile), the median host ms (the capturing
  thread's CPU time in the call: what a colocated capture thread takes from the GIL and the
  CPU beside the training step; graphs should shrink it most), tokens/s, the prefill's MFU
  (ops/bench/flops.py), the graphs Dynamo compiled in it, and each arm over eager;
- `--new N`: N lengths uniform in [`--lo`, `--hi`] never seen before, each captured once by
  each arm (new shapes: the compiled arm's dynamic graph against eager), mean ms;
- per length, the largest difference of each arm's features from the eager ones, relative
  to the eager feature's largest magnitude (bf16 rounds to 2^-8 = 3.9e-3 relative: a fused
  kernel lands a few of those away).

    python -m specbus.ops.bench.capture --seqs 2048,4096 --out $OUT/capture.json
    python -m specbus.ops.bench.capture --arms eager,compiled+graphs --new 0
    python -m specbus.ops.bench.capture --tiny           # CPU check
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from specbus.ops.bench.flops import flops_section, mfu, prefill_flops
from specbus.ops.bench.mixed_lengths import Lengths
from specbus.ops.bench.random_target import TINY, random_engine, write_target


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# arm -> what it sets in target (over the eager config)
ARMS = {"eager": {}, "compiled": {"compile": True}, "graphs": {"cuda_graphs": True},
        "compiled+graphs": {"compile": True, "cuda_graphs": True},
        "fp8": {"quantize": "fp8"}, "compiled+fp8": {"compile": True, "quantize": "fp8"}}  # fmt: skip


def timed_capture(engine, ids: torch.Tensor, contract, device: torch.device):
    """(seconds, host seconds, features) of one synchronised capture of `ids`, features left
    on `device`; host seconds: the calling thread's CPU time in the capture call (on a GPU:
    the launching and Python work a colocated capture thread contends with the step for)."""
    _sync(device)
    t0, c0 = time.perf_counter(), time.thread_time()
    features = engine.capture([ids], None, contract, device=device)[0]
    host = time.thread_time() - c0
    _sync(device)
    return time.perf_counter() - t0, host, features


def largest_difference(got: dict, want: dict) -> float:
    """max over features of max|got - want| / max|want|."""
    worst = 0.0
    for name, w in want.items():
        if not torch.is_floating_point(w):
            continue
        scale = float(w.abs().max()) or 1.0
        worst = max(worst, float((got[name].float() - w.float()).abs().max()) / scale)
    return worst


def relative_error(got: dict, want: dict) -> float:
    """max over features of ||got - want|| / ||want|| (the capture audit's measure)."""
    worst = 0.0
    for name, w in want.items():
        if torch.is_floating_point(w):
            w = w.float()
            worst = max(worst, float((got[name].float() - w).norm() / w.norm().clamp(min=1e-30)))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seqs", default="2048,4096")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--new", type=int, default=8, help="lengths never seen, each once per arm")
    ap.add_argument("--lo", type=int, default=512)
    ap.add_argument("--hi", type=int, default=4096)
    ap.add_argument("--tiny", action="store_true", help="a 4-layer, 2k-vocab target (CPU check)")
    ap.add_argument("--arms", default="eager,compiled,graphs,compiled+graphs",
                    help="comma-separated, eager first: eager | compiled | graphs | "
                    "compiled+graphs | fp8 | compiled+fp8 (graphs: target.cuda_graphs; off "
                    "CUDA the bucketed prefill without graphs; fp8: target.quantize fp8)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from specbus.core.config import StrategyConfig, TargetConfig
    from specbus.core.strategies.base import build_strategy
    from specbus.producers.engines.hf import HFEngine
    from torch._dynamo.utils import counters

    if args.tiny:
        args.seqs = ",".join(str(max(16, int(s) // 32)) for s in args.seqs.split(","))
        args.lo, args.hi = max(16, args.lo // 32), max(32, args.hi // 32)
    seqs = [int(s) for s in args.seqs.split(",")]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="specbus-capture-"))
    target = write_target(work / "target", TINY if args.tiny else None, device=str(device))
    context = max(seqs + [args.hi])
    cfg = TargetConfig(model=str(target), device=str(device), capture_batch=1,
                       context_length=context)  # fmt: skip
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or arms[0] != "eager" or not set(arms) <= set(ARMS):
        ap.error(f"--arms: eager first, then any of {list(ARMS)} (got {args.arms!r})")
    eager = random_engine(cfg)
    # the fp8 arms share one copy of the same weights, quantised (HFEngine does it in place)
    fp8 = [arm for arm in arms if "fp8" in arm]
    fp8_model = random_engine(cfg.model_copy(update=ARMS[fp8[0]])).model if fp8 else None
    engines = {"eager": eager, **{
        arm: HFEngine(cfg.model_copy(update=ARMS[arm]),
                      model=fp8_model if arm in fp8 else eager.model) for arm in arms[1:]}}  # fmt: skip
    contract = build_strategy(StrategyConfig(), eager.info).feature_contract()
    target_config = json.loads((target / "config.json").read_text())
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    report: dict = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "device": device_name,
        "torch": torch.__version__,
        "flops": flops_section(device_name),
        "arms": arms,
        "fixed": {},
    }
    peak = report["flops"]["peak_flops"]
    g = torch.Generator().manual_seed(0)
    vocab = eager.info.vocab_size

    def save() -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1, default=str))

    for seq in seqs:
        ids = torch.randint(3, vocab, (seq,), generator=g)
        flops = prefill_flops(target_config, seq)
        row: dict = {"prefill_flops": flops}
        for arm, engine in engines.items():
            graphs = counters["stats"]["unique_graphs"]
            t0 = time.perf_counter()
            for _ in range(args.warmup):
                _, _, features = timed_capture(engine, ids, contract, device)
            row[f"{arm}_warmup_s"] = time.perf_counter() - t0
            # (seconds, host seconds) per rep; each rep's features dropped at once
            times, host = zip(*(timed_capture(engine, ids, contract, device)[:2]
                                for _ in range(args.reps)), strict=True)  # fmt: skip
            ms = 1000 * statistics.median(times)
            row[f"{arm}_ms"] = ms
            row[f"{arm}_host_ms"] = 1000 * statistics.median(host)
            row[f"{arm}_tokens_per_s"] = seq / ms * 1000
            row[f"{arm}_mfu"] = mfu(flops, 1000 / ms, peak)
            row[f"{arm}_features"] = features
            row[f"{arm}_graphs"] = counters["stats"]["unique_graphs"] - graphs  # Dynamo's
        want = row.pop("eager_features")
        said = [f"eager {row['eager_ms']:.1f} ms, host {row['eager_host_ms']:.1f}"]
        for arm in arms[1:]:
            row[f"{arm}_over_eager"] = row["eager_ms"] / row[f"{arm}_ms"]
            got = row.pop(f"{arm}_features")
            row[f"{arm}_max_rel_diff"] = largest_difference(got, want)
            row[f"{arm}_rel_err"] = relative_error(got, want)
            said.append(f"{arm} {row[f'{arm}_ms']:.1f} ms, host {row[f'{arm}_host_ms']:.1f} "
                        f"({row[f'{arm}_over_eager']:.3f}x; "
                        f"warm-up {row[f'{arm}_warmup_s']:.1f} s, largest difference "
                        f"{row[f'{arm}_max_rel_diff']:.2e}, relative error "
                        f"{row[f'{arm}_rel_err']:.2e})")  # fmt: skip
        if "compiled" in engines:  # the name earlier records used
            row["max_rel_diff"] = row["compiled_max_rel_diff"]
        report["fixed"][str(seq)] = row
        print(f"{seq:>6} tokens: " + "; ".join(said), flush=True)
        save()
    if args.new:
        unseen = Lengths(args.lo, args.hi)
        unseen.used.update(seqs)  # new to both arms: not a fixed length either
        lengths = unseen.new(args.new)
        new: dict = {"lengths": lengths}
        for arm, engine in engines.items():
            graphs = counters["stats"]["unique_graphs"]
            batches = [torch.randint(3, vocab, (n,), generator=g) for n in lengths]
            times = [timed_capture(engine, ids, contract, device)[0] for ids in batches]
            new[f"{arm}_ms_mean"] = 1000 * statistics.mean(times)
            new[f"{arm}_graphs"] = counters["stats"]["unique_graphs"] - graphs
            new[f"{arm}_ms_per_1k_tokens"] = 1000 * sum(times) / sum(lengths) * 1000
        for arm in arms[1:]:
            new[f"{arm}_over_eager"] = new["eager_ms_mean"] / new[f"{arm}_ms_mean"]
        report["new"] = new
        print(f"{args.new} new lengths in [{args.lo}, {args.hi}], mean ms a capture: " + ", ".join(
            f"{arm} {new[f'{arm}_ms_mean']:.1f}" for arm in arms), flush=True)  # fmt: skip
    if cuda:
        report["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / 2**30
    save()


if __name__ == "__main__":
    main()
