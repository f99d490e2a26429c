"""One draft train step in-process (no bus, no store, no target forward): wall time, device
time, launches and the host work torch.profiler sees, for any strategy.

The features are random tensors of the captured shapes (the target's frozen embedding and
lm_head are the random ones `gpu_pipeline.write_target` writes), so the step is exactly what
the trainer runs (`core.training.train_step`: bf16 autocast on CUDA, clip, fused AdamW).
Reported per configuration:
- `step_ms`: median wall time of `--reps` synchronised steps after `--warmup` (no profiler);
  `overlapped_step_ms`: the mean of `--reps` steps run as the trainer runs them
  (`training.overlap_steps`: each queued before the last one's figures are read);
- `launches`: kernel launches of one profiled step (CUDA runtime launch calls); on the CPU
  `compute_ops` stands in for them: leaf aten ops that are not views, allocations or
  metadata (each launches about one kernel on a GPU); `ops` counts every aten op;
- `kernel_ms` / `busy_frac`: the union of the step's kernel intervals, and that over
  `step_ms` (how much of the step the GPU is busy);
- `syncs`: host-device synchronisations (stream / device / event synchronise and blocking
  copies on a GPU; `.item()`s on the CPU); `async_copies`; `casts` (`aten::to` / `_to_copy`), `nonzero`,
  `argsort` / `sort`, `index_put_`, `copy_`; `peak_alloc_gib` (CUDA);
- `mfu`: the step's model FLOPs (ops/bench/flops.py; written once per configuration under
  `flops.per_sample`) over `step_ms`, against the GPU's peak dense bf16 rate (None without
  one: the CPU).

    python -m specbus.ops.bench.step_profile --strategy dspark --seqs 512,2048,4096 --out X.json
    python -m specbus.ops.bench.step_profile --strategy eagle3 --seqs 2048,4096
    python -m specbus.ops.bench.step_profile --tiny ...   # a small target (CPU counts)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from specbus.consumers.profiling import union_ms
from specbus.ops.bench.flops import flops_section, mfu

# host-device synchronisations: the runtime calls on a GPU; `.item()` on the CPU
GPU_SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                "cudaMemcpy")  # fmt: skip
CPU_SYNC_OPS = ("aten::_local_scalar_dense",)
LAUNCH_PREFIXES = ("cudaLaunch", "cuLaunch", "cudaGraphLaunch")  # kernel launches
COPY_OPS = ("cudaMemcpyAsync", "cudaMemsetAsync")
# ops that launch no kernel (views, allocation, metadata): left out of `compute_ops`
NO_KERNEL = {
    "aten::as_strided", "aten::view", "aten::_reshape_alias", "aten::reshape", "aten::transpose",
    "aten::t", "aten::permute", "aten::expand", "aten::slice", "aten::select", "aten::unsqueeze",
    "aten::squeeze", "aten::detach", "aten::alias", "aten::resolve_conj", "aten::resolve_neg",
    "aten::narrow", "aten::_unsafe_view", "aten::empty", "aten::empty_strided", "aten::resize_",
    "aten::split", "aten::chunk", "aten::unbind", "aten::split_with_sizes", "aten::lift_fresh",
    "aten::empty_like", "aten::result_type", "aten::is_nonzero", "aten::set_",
    "aten::_has_compatible_shallow_copy_type", "aten::unflatten", "aten::flatten",
    "aten::contiguous", "aten::numpy_T", "aten::values", "aten::indices",
}  # fmt: skip
WATCH = {
    "casts": ("aten::to", "aten::_to_copy"),
    "nonzero": ("aten::nonzero",),
    "argsort": ("aten::argsort", "aten::sort"),
    "index_put_": ("aten::index_put_", "aten::_index_put_impl_"),
    "copy_": ("aten::copy_",),
}


def profile_once(fn, cuda: bool) -> dict:
    """Counts of one call of `fn` under torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    names = Counter(e.name for e in events if e.device_type == DeviceType.CPU)
    kernels = [
        (e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA
    ]
    leaves = Counter(
        e.name
        for e in events
        if e.device_type == DeviceType.CPU
        and e.name.startswith("aten::")
        and not e.cpu_children
        and e.name not in NO_KERNEL
    )
    out = {
        "ops": sum(n for k, n in names.items() if k.startswith("aten::")),
        "compute_ops": sum(leaves.values()),
        "launches": sum(n for k, n in names.items() if k.startswith(LAUNCH_PREFIXES)),
        "async_copies": sum(names[k] for k in COPY_OPS),
        "syncs": sum(names[k] for k in (GPU_SYNC_OPS if cuda else CPU_SYNC_OPS)),
        **{key: sum(names[k] for k in ops) for key, ops in WATCH.items()},
        "kernels": len(kernels),
        "kernel_ms": union_ms(kernels),
    }
    out["top_ops"] = dict(leaves.most_common(25))
    out["table"] = prof.key_averages().table(
        sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=40,
        max_name_column_width=60,
    )  # fmt: skip
    return out


def build(strategy_name: str, target: Path, args):
    from specbus.core.config import build_config
    from specbus.core.models.target import load_target_heads, load_target_info
    from specbus.core.strategies.base import build_strategy

    info = load_target_info(target)
    heads = load_target_heads(target)
    tree: dict = {"name": strategy_name}
    if strategy_name == "eagle3":
        tree |= {
            "ttt_length": args.ttt,
            "draft": {"draft_vocab_size": min(args.draft_vocab, info.vocab_size)},
        }
    else:
        tree |= {"block_size": args.block_size, "num_anchors": args.num_anchors,
                 "mask_token_id": info.vocab_size - 1, "draft": {"num_layers": args.draft_layers}}  # fmt: skip
        if strategy_name == "dspark":
            tree["dspark"] = {"markov_rank": args.markov_rank}
    if args.attention:
        tree["attention"] = args.attention
    cfg = build_config({"strategy": tree})
    strategy = build_strategy(cfg.strategy, info, heads=heads)
    if args.fused != "auto" and hasattr(strategy, "fused"):
        strategy.fused = lambda batch: args.fused == "on"
    return strategy, info, heads


def step_flops(strategy, target: Path, seqs: list[int]) -> dict[int, float | None]:
    """The model FLOPs of one train step per length (`sample` supervises the last three
    quarters, `flops.train_step_flops`'s default); None for a strategy without a FLOP model."""
    from specbus.ops.bench.flops import train_step_flops

    config = json.loads((target / "config.json").read_text())
    try:
        return {seq: train_step_flops(strategy.cfg, config, seq).total for seq in seqs}
    except ValueError:  # domino, peagle: timed and counted all the same
        return dict.fromkeys(seqs)


def sample(strategy, info, seq: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """A random captured sample of `seq` tokens, the last three quarters supervised."""
    contract = strategy.feature_contract(info)
    out = {
        "input_ids": torch.randint(3, info.vocab_size - 1, (seq,), generator=g),
        "loss_mask": torch.tensor([0] * (seq // 4) + [1] * (seq - seq // 4)),
    }
    for f in contract.fields:
        if f.dtype == "float":
            out[f.name] = torch.randn(*f.resolve(seq), generator=g)
    return out


def run(strategy_name: str, target: Path, seqs: list[int], args, flops: dict) -> dict:
    """Each length's row (the module docstring); `flops` (the report's `flops` section) gets
    this strategy's FLOPs per step under `per_sample`."""
    from specbus.core.config import TrainingConfig
    from specbus.core.data.vocab import build_vocab_mapping, count_tokens
    from specbus.core.strategies.base import StepContext
    from specbus.core.training import build_optimizer, launch_step

    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if cuda else "cpu")
    low = cuda or args.autocast
    dtype = torch.bfloat16 if low else torch.float32
    strategy, info, heads = build(strategy_name, target, args)
    per_step = step_flops(strategy, target, seqs)
    for seq, value in per_step.items():
        flops["per_sample"][f"{strategy_name}/{seq}"] = {"train_step": value}
    g = torch.Generator().manual_seed(2)
    samples = {seq: [sample(strategy, info, seq, g) for _ in range(2)] for seq in seqs}
    vocab = None
    if strategy_name == "eagle3":
        pairs = [(s["input_ids"], s["loss_mask"]) for ss in samples.values() for s in ss]
        vocab = build_vocab_mapping(count_tokens(pairs), strategy.draft_vocab_size, info.vocab_size)
    draft = strategy.build_model(info, heads, vocab).to(device)
    optimizer = build_optimizer(draft, TrainingConfig())
    results = {}
    counter = [0]

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for seq in seqs:
        batches = []
        for s in samples[seq]:
            s = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in s.items()}
            batches.append(strategy.collate([s], seq).to(device))

        def launch(batches=batches):
            counter[0] += 1
            batch = batches[counter[0] % len(batches)]
            return launch_step(strategy, draft, [batch], optimizer, None, grad_clip=1.0,
                               step=StepContext(counter[0], 1000),
                               autocast_dtype=torch.bfloat16 if low else None)  # fmt: skip

        def step():
            launch().result()

        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for _ in range(args.warmup):
            step()
        sync()
        times = []
        for _ in range(args.reps):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t0)
        row = {"step_ms": 1000 * statistics.median(times),
               "step_ms_all": [round(1000 * t, 2) for t in times]}  # fmt: skip
        # as the trainer runs them (`training.overlap_steps`): each step queued before the
        # last one's figures are read, so the GPU does not drain between steps
        sync()
        t0, pending = time.perf_counter(), None
        for _ in range(args.reps):
            queued = launch()
            if pending is not None:
                pending.result()
            pending = queued
        pending.result()
        sync()
        row["overlapped_step_ms"] = 1000 * (time.perf_counter() - t0) / args.reps
        row.update(profile_once(step, cuda))
        row["mfu"] = mfu(per_step[seq], 1000 / row["step_ms"], flops["peak_flops"])
        if cuda:
            row["busy_frac"] = row["kernel_ms"] / row["step_ms"]
            row["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / 2**30
            row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        if args.out_dir is not None:
            args.out_dir.mkdir(parents=True, exist_ok=True)
            (args.out_dir / f"step_{strategy_name}_{seq}.txt").write_text(row["table"])
        row.pop("table")
        results[seq] = row
        brief = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                 if k not in ("top_ops", "step_ms_all")}  # fmt: skip
        print(f"step {strategy_name} {seq}: {json.dumps(brief)}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--strategies", default="eagle3,dspark")
    ap.add_argument("--seqs", default="2048")
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-anchors", type=int, default=512)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--markov-rank", type=int, default=128)
    ap.add_argument("--attention", default=None, help="strategy.attention (default: auto)")
    ap.add_argument("--fused", choices=("auto", "on", "off"), default="auto",
                    help="the fused loss / vocabulary head (auto: on CUDA)")  # fmt: skip
    ap.add_argument("--autocast", action="store_true",
                    help="CPU: bf16 features and autocast, as on a GPU (counts of casts)")  # fmt: skip
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="a small target (CPU counts)")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even with a GPU")
    ap.add_argument("--out", type=Path, default=None, help="JSON report")
    ap.add_argument("--out-dir", type=Path, default=None, help="profiler tables here")
    args = ap.parse_args(argv)
    from specbus.ops.bench.random_target import QWEN3_8B, write_target

    # --tiny: the Qwen3-8B layout scaled down (counts of ops do not depend on the widths)
    tiny = {"vocab_size": 8192, "hidden_size": 256, "intermediate_size": 512,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 64}  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="specbus-stepprof-"))
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    target = write_target(work / "target", tiny if args.tiny else None, device=device)
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    report = {
        "device": device_name,
        "torch": torch.__version__,
        "target": "tiny" if args.tiny else "qwen3-8b",
        "vocab": (tiny if args.tiny else QWEN3_8B)["vocab_size"],
        "args": {k: str(v) for k, v in vars(args).items()},
        "results": {},
        "flops": flops_section(device_name),
    }
    seqs = [int(s) for s in args.seqs.split(",")]
    for name in args.strategies.split(","):
        try:
            report["results"][name] = run(name, target, seqs, args, report["flops"])
        except Exception as e:  # keep the other strategies' figures
            import traceback

            traceback.print_exc()
            report["results"][name] = {"error": repr(e)[-2000:]}
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
