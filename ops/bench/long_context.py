"""Long-context benchmark: EAGLE3 (or DFlash, `--strategy dflash`) on the Qwen3-8B-shaped random
target, one GPU, lengths up to the first that fails (docs/benchmarks.md, "Long context").

Stages (`--stages`, in this order):
- `pipeline`: runs through real processes at `--pipeline-seqs`, in each of `--modes`
  (`colocated`, `disaggregated`: a producer and a trainer process on the GPU, the features
  through the shm store; `gpu_pipeline.run_mode`: `specbus feed` + `specbus train` with the hf
  engine swapped for the random target): the trainer's steady samples/s and tokens/s, its peak
  allocated/reserved CUDA memory;
- `sweep`: one process, the target built once; first (`--check L`) the long-context paths
  against the plain one on one batch of L tokens (relative differences of the loss, metrics
  and gradients: rounding only); then every length of `--seqs` ascending until one fails
  (out of memory): per sample, capture (hf engine, features left on the GPU, as
  colocated) -> collate -> one optimizer step (bf16 autocast, fp32 master weights, the run's
  default strategy settings: the long-context paths above `strategy.chunk_tokens`, TTT
  steps checkpointed from `strategy.checkpoint_tokens`); samples/s, tokens/s, capture and
  step seconds, peak allocated/reserved memory (of the whole loop and of the capture alone),
  and the slope of the peak per 1k tokens between consecutive lengths; with
  `--capture-orders` (e.g. `flash,efficient,cudnn,math` or `default`, torch's own order) the
  same sample's capture timed again under each SDPA backend order (`capture_s_by_order`;
  the engine's own order is cuDNN first from `kernels.CUDNN_ATTENTION_TOKENS`, flash first
  below: `hf.sdpa_order`); with `--profile L1,L2` one more sample at each of those lengths
  under torch.profiler (`profile`: per phase, capture and step, its wall time, its kernels'
  device time by family and its top kernels);
- `floor`: the bare floor probe (`--floor FILE`, a copy of the steering folder's floor.py,
  lengths from `$FLOOR_SEQS`) in a process of its own, as the baseline.

Every sweep and pipeline row carries its MFU (`mfu`; the sweep's `capture_mfu` and `step_mfu`
too): the sample's model FLOPs (ops/bench/flops.py: the prefill and one EAGLE3 train step,
recomputation by the checkpointed steps not counted; written once per length under
`flops.per_sample`) x samples/s over the GPU's peak dense bf16 rate.

    python -m specbus.ops.bench.long_context --out $OUT/long_context.json --floor .gpu/floor.py
    python -m specbus.ops.bench.long_context --tiny --seqs 256,512,1024 --pipeline-seqs 512  # CPU
    python -m specbus.ops.bench.long_context --strategy dflash --modes colocated,disaggregated \
        --capture-orders default --out $OUT/long_dflash.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
from specbus.consumers.profiling import union_ms
from specbus.ops.bench.flops import describe, flops_section, fmt_mfu, mfu, sample_flops
from specbus.ops.bench.gpu_pipeline import config_for, run_mode, strategy_tree, tasks_to_feed
from specbus.ops.bench.random_target import QWEN3_8B, TINY, random_engine, write_data, write_target
from specbus.producers.engines.hf import SDPA_ENV

SEQS = "2048,4096,8192,16384,32768,65536,131072"


def long_strategy_tree(args, vocab: int) -> dict:
    """The strategy section of every run: EAGLE3 as the GPU pipeline bench has it (with the
    long-context thresholds given), or DFlash as the DFlash bench has it (1 layer, 512
    anchors x 16, the mask token an embedding row past the tokenizer's)."""
    if args.strategy == "dflash":
        return {"name": "dflash", "mask_token_id": vocab - 1, "block_size": 16,
                "num_anchors": 512, "draft": {"num_layers": 1}}  # fmt: skip
    tree = strategy_tree(args)
    for key in ("chunk_tokens", "checkpoint_tokens", "attention"):
        if getattr(args, key):
            tree[key] = getattr(args, key)
    return tree


def steps_for(seq: int) -> tuple[int, int]:
    """(optimizer steps, warm-up steps) of a pipeline run: ~40 s of steady steps at most."""
    if seq <= 4096:
        return 24, 8
    if seq <= 16384:
        return 12, 4
    return (6, 2) if seq <= 32768 else (4, 1)


def reps_for(seq: int) -> int:
    """Timed samples per length in the sweep (after one warm-up sample)."""
    return 4 if seq <= 16384 else 2 if seq <= 65536 else 1


# ---------------------------------------------------------------------------------------------
# sweep: one process, every length


def sweep(target: Path, seqs: list[int], args, vocab_size: int) -> dict:
    from specbus.core.config import TargetConfig, TrainingConfig, build_config
    from specbus.core.data.vocab import build_vocab_mapping, count_tokens
    from specbus.core.models.target import load_target_heads
    from specbus.core.strategies.base import StepContext, build_strategy
    from specbus.core.training import build_optimizer, train_step

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    engine = random_engine(TargetConfig(model=str(target), device=device.type, capture_batch=1,
                                        context_length=max(seqs)))  # fmt: skip
    heads = load_target_heads(target)
    strategy_cfg = build_config({"strategy": long_strategy_tree(args, vocab_size)}).strategy
    eagle3 = strategy_cfg.name == "eagle3"
    strategy = build_strategy(strategy_cfg, engine.info, heads=heads)
    contract = strategy.feature_contract(engine.info)
    g = torch.Generator().manual_seed(2)
    vocab_ids = torch.randint(3, engine.info.vocab_size, (65536,), generator=g)
    vocab = build_vocab_mapping(count_tokens([(vocab_ids, torch.ones_like(vocab_ids))]),
                                args.draft_vocab, engine.info.vocab_size)  # fmt: skip
    draft = strategy.build_model(engine.info, heads, vocab).to(device)
    optimizer = build_optimizer(draft, TrainingConfig())

    def sync():
        if cuda:
            torch.cuda.synchronize()

    rows: dict[str, dict] = {}
    if args.check and eagle3:  # the chunked / checkpointed paths are EAGLE3's
        rows["check"] = check(engine, strategy, draft, contract, args.check)
        print("check", json.dumps(rows["check"]), flush=True)
    for seq in seqs:
        ids = torch.randint(3, engine.info.vocab_size, (seq,), generator=g)
        mask = torch.cat([torch.zeros(seq // 4), torch.ones(seq - seq // 4)]).long()
        row: dict = {"checkpointed": eagle3 and strategy_cfg.checkpoint_tokens is not None
                     and seq >= strategy_cfg.checkpoint_tokens,
                     "chunked": eagle3 and strategy_cfg.chunk_tokens is not None
                     and seq > strategy_cfg.chunk_tokens}  # fmt: skip
        try:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if cuda else 0
            times = {"capture": [], "step": []}
            for i in range(1 + reps_for(seq)):
                sync()
                t0 = time.perf_counter()
                features = engine.capture([ids], [mask], contract, device=device)
                sync()
                t1 = time.perf_counter()
                if i == 0 and cuda:
                    row["capture_peak_alloc_gib"] = (
                        torch.cuda.max_memory_allocated() - base
                    ) / 2**30
                batch = strategy.collate(features, seq).to(device)
                train_step(strategy, draft, [batch], optimizer, None, grad_clip=0.5,
                           step=StepContext(i, 100), autocast_dtype=torch.bfloat16 if cuda else None)  # fmt: skip
                sync()
                t2 = time.perf_counter()
                del features, batch
                if i:  # the first sample compiles the kernels of this length
                    times["capture"].append(t1 - t0)
                    times["step"].append(t2 - t1)
            if seq in args.profile_seqs:
                row["profile"] = profile_sample(
                    lambda ids=ids, mask=mask: engine.capture([ids], [mask], contract, device=device),
                    lambda features, seq=seq: train_step(
                        strategy, draft, [strategy.collate(features, seq).to(device)], optimizer,
                        None, grad_clip=0.5, step=StepContext(99, 100),
                        autocast_dtype=torch.bfloat16 if cuda else None),
                    sync)  # fmt: skip
            capture_s, step_s = (
                statistics.median(times["capture"]),
                statistics.median(times["step"]),
            )
            row.update(capture_s=capture_s, step_s=step_s, samples_per_s=1 / (capture_s + step_s),
                       tokens_per_s=seq / (capture_s + step_s))  # fmt: skip
            if args.capture_orders:
                row["capture_s_by_order"] = capture_by_order(
                    engine, ids, mask, contract, args.capture_orders.split(";"), reps_for(seq),
                    sync)  # fmt: skip
            if cuda:
                row["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / 2**30
                row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        except torch.OutOfMemoryError as e:
            row["error"] = f"out of memory: {str(e)[:300]}"
        except RuntimeError as e:  # a CUDA failure other than the allocator's
            row["error"] = repr(e)[:600]
        rows[str(seq)] = row
        print("sweep", seq, json.dumps(row), flush=True)
        if "error" in row:
            break
    add_slopes(rows)
    engine.close()
    return rows


# kernel families of a profile: the first whose key is in a kernel's name (lower case)
FAMILIES = (("attention", ("fmha", "flash", "cudnn", "sdpa", "attn", "attention")),
            ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "matmul")),
            ("compiled", ("triton",)), ("other", ("",)))  # fmt: skip


def family(kernel: str) -> str:
    """The `FAMILIES` entry a kernel's name falls in."""
    name = kernel.lower()
    return next(f for f, keys in FAMILIES if any(k in name for k in keys))


# kineto's activity types of work on the device (kernels, copies, fills)
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def _device_work(event, ranges: set[str]) -> bool:
    """Whether a kineto event is work on the device, not a range's mirror on its timeline (a
    record_function's: the phases, the optimizer's `Optimizer.step#AdamW.step`, whose names
    are in `ranges`, the host's event names); torch builds before 2.13 have no
    `activity_type` on the event. (Not a test for "#" in the name: eager kernels' names
    carry their lambdas', `{lambda()#3}`.)"""
    from torch.autograd import DeviceType

    if hasattr(event, "activity_type"):
        return event.activity_type() in DEVICE_WORK
    return event.device_type() == DeviceType.CUDA and event.name() not in ranges


def busy_ms(spans: list[tuple[int, int]]) -> float:
    """Milliseconds covered by the union of `(start_ns, end_ns)` spans (kernels of several
    streams overlap: their sum is not the time the device was busy): `union_ms` of the spans
    in microseconds, kineto's raw records being in nanoseconds."""
    return union_ms([(start / 1e3, end / 1e3) for start, end in spans])


def distinct(work: list[tuple[str, int, int]], within_ns: int = 1500) -> list:
    """`(name, start_ns, end_ns)` records less the copies of one kernel launch (the same name
    starting within `within_ns`: two lists' records of it, their clocks rounded apart)."""
    kept: list[tuple[str, int, int]] = []
    last: dict[str, int] = {}
    for name, start, end in sorted(work, key=lambda w: (w[0], w[1])):
        if name in last and start - last[name] < within_ns:
            continue
        last[name] = start
        kept.append((name, start, end))
    return kept


def profile_sample(capture, step, sync, top: int = 40) -> dict:
    """One sample (capture, then the step on its features) under torch.profiler: per phase its
    wall milliseconds, its kernels' device milliseconds by family (`FAMILIES`), the device's
    busy and idle milliseconds (`busy_ms`: the wall time no kernel ran is host-bound time)
    and its `top` kernels by device time (name, calls, ms), to show where a length's time
    goes. Kernels are kineto's raw device records and the operators' kernels, each launch
    once (`distinct`)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    )
    with profile(activities=activities) as prof:
        with record_function("phase:capture"):
            features = capture()
            sync()
        with record_function("phase:step"):
            step(features)
            sync()
    results = prof.profiler.kineto_results
    events = results.events()
    phases = {e.name()[6:]: (e.start_ns(), e.end_ns()) for e in events
              if e.device_type() == DeviceType.CPU and e.name().startswith("phase:")}  # fmt: skip
    ranges = {e.name() for e in events if e.device_type() == DeviceType.CPU}
    work = [(e.name(), e.start_ns(), e.end_ns()) for e in events if _device_work(e, ranges)]
    # the operators' kernels too (times in us from the trace's start): one H200 profile's
    # operator list (torch 2.11) had none of Inductor's kernels; each launch counts once
    base = results.trace_start_ns()
    work += [(e.name, base + round(e.time_range.start * 1e3), base + round(e.time_range.end * 1e3))
             for e in prof.events() if e.device_type == DeviceType.CUDA
             and e.name not in ranges]  # fmt: skip
    work = distinct(work)
    out: dict = {"wall_ms": {k: round((b - a) / 1e6, 1) for k, (a, b) in phases.items()}}
    for phase, (a, b) in phases.items():
        kernels: dict[str, list[float]] = {}
        families = dict.fromkeys((f for f, _ in FAMILIES), 0.0)
        spans = []
        for name, start, end in work:
            if not a <= start <= b:
                continue
            ms = (end - start) / 1e6
            entry = kernels.setdefault(name, [0, 0.0])
            entry[0] += 1
            entry[1] += ms
            families[family(name)] += ms
            spans.append((start, min(end, b)))
        ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
        busy = busy_ms(spans)
        out[phase] = {
            "device_ms": {f: round(v, 1) for f, v in families.items()},
            "busy_ms": round(busy, 1),
            "idle_ms": round((b - a) / 1e6 - busy, 1),
            "top": [[name[:160], calls, round(ms, 2)] for name, (calls, ms) in ranked],
        }
    return out


def capture_by_order(engine, ids, mask, contract, orders: list[str], reps: int, sync) -> dict:
    """The median capture time (s) of one sample under each SDPA backend order (`default`:
    torch's own; else names as `$SPECBUS_SDPA_BACKENDS` takes them), after one untimed capture
    per order (a new order's first call builds its plans); an order that runs out of memory
    is reported as such (the length's own row stands); the environment is restored."""
    saved, out = os.environ.get(SDPA_ENV), {}
    try:
        for order in orders:
            os.environ[SDPA_ENV] = order
            times = []
            try:
                for i in range(1 + reps):
                    sync()
                    t0 = time.perf_counter()
                    features = engine.capture([ids], [mask], contract, device=engine.device)
                    sync()
                    if i:
                        times.append(time.perf_counter() - t0)
                    del features
                out[order] = statistics.median(times)
            except torch.OutOfMemoryError as e:
                out[order] = f"out of memory: {str(e)[:200]}"
    finally:
        if saved is None:
            os.environ.pop(SDPA_ENV, None)
        else:
            os.environ[SDPA_ENV] = saved
    return out


def check(engine, strategy, draft, contract, seq: int) -> dict:
    """The long-context paths against the plain one on this device, at `seq` tokens (chunks
    of seq/4, every TTT step checkpointed): relative differences of the loss, the metrics and
    each parameter's gradient (bf16 autocast, fused loss on CUDA: rounding only)."""
    import copy

    from specbus.core.strategies.base import StepContext

    cuda = engine.device.type == "cuda"
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, engine.info.vocab_size, (seq,), generator=g)
    mask = (torch.rand(seq, generator=g) > 0.2).long()
    features = engine.capture([ids], [mask], contract, device=engine.device)
    batch = strategy.collate(features, seq).to(engine.device)
    out, original = {}, strategy.cfg
    for name, chunk, ckpt in (("plain", None, None), ("long", seq // 4, 1)):
        model = copy.deepcopy(draft)
        strategy.cfg = strategy.cfg.model_copy(update={"chunk_tokens": chunk,
                                                       "checkpoint_tokens": ckpt})  # fmt: skip
        with torch.autocast(engine.device.type, dtype=torch.bfloat16, enabled=cuda):
            loss, metrics = strategy.forward_loss(model, batch, StepContext(0, 100))
        loss.backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        out[name] = (
            loss.detach().float(),
            {k: torch.as_tensor(v).double() for k, v in metrics.items()},
            grads,
        )
    strategy.cfg = original
    (lp, mp, gp), (ll, ml, gl) = out["plain"], out["long"]
    rel = lambda a, b: float((a - b).norm() / b.norm().clamp_min(1e-30))  # noqa: E731
    report = {"seq": seq, "loss_rel": rel(ll, lp), "grad_rel_max": max(rel(gl[n], gp[n]) for n in gp),
              "metric_abs_max": max(float((ml[k] - mp[k]).abs()) for k in mp if "correct" not in k)}  # fmt: skip
    report["grad_rel"] = {n: round(rel(gl[n], gp[n]), 6) for n in gp}
    return report


def add_slopes(rows: dict[str, dict]) -> None:
    """`slope_gib_per_1k`: the peak's growth per 1k tokens since the previous length."""
    prev = None
    for seq, row in rows.items():
        if seq == "check" or "peak_alloc_gib" not in row:
            continue
        if prev is not None:
            row["slope_gib_per_1k"] = (row["peak_alloc_gib"] - prev[1]) / (
                (int(seq) - prev[0]) / 1024
            )
        prev = (int(seq), row["peak_alloc_gib"])


# ---------------------------------------------------------------------------------------------
# pipeline: real processes


def pipeline(target: Path, seqs: list[int], modes: list[str], args, work: Path, vocab: int) -> dict:
    """`{mode: {seq: row}}`: each length through real processes in each mode; a failed run
    keeps the other runs' figures."""
    rows: dict[str, dict] = {mode: {} for mode in modes}
    strategy = long_strategy_tree(args, vocab)
    for seq in seqs:
        steps, warmup = steps_for(seq)
        args.steps, args.warmup = (3, 1) if args.tiny else (steps, warmup)
        args.log_every = 1 if seq > 16384 or args.tiny else 2
        fed = tasks_to_feed(seq, args.steps * args.micro_batch)  # the producer busy to the end
        data = write_data(work / f"data-{seq}.jsonl", fed, seq, vocab)
        for mode in modes:
            run = f"long-{seq}-{mode[:5]}-{uuid.uuid4().hex[:6]}"
            cfg = config_for(run, work, target, data, seq, mode, args, strategy=strategy)
            t0 = time.perf_counter()
            try:
                row = run_mode(cfg, work, args.warmup, args.timeout)
            except Exception as e:  # keep the other runs' figures
                row = {"error": str(e)[-3000:]}
            row["wall_s"] = time.perf_counter() - t0
            rows[mode][str(seq)] = row
            print("pipeline", mode, seq, json.dumps(row, default=str), flush=True)
    return rows


def floor(path: Path, seqs: list[int], timeout_s: float) -> dict:
    """The floor probe at `seqs` (`$FLOOR_SEQS`), its output lines."""
    env = {**os.environ, "FLOOR_SEQS": ",".join(str(s) for s in seqs)}
    try:
        out = subprocess.run([sys.executable, str(path)], env=env, capture_output=True,
                             text=True, timeout=timeout_s)  # fmt: skip
        text, code = out.stdout + out.stderr[-2000:], out.returncode
    except subprocess.TimeoutExpired as e:
        text, code = (
            (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""),
            "timeout",
        )
    print(text, flush=True)
    return {
        "exit": code,
        "lines": [ln for ln in text.splitlines() if ln.startswith(("L=", "target"))],
    }


# ---------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--stages", default="pipeline,sweep,floor")
    ap.add_argument("--seqs", default=SEQS, help="the sweep's lengths, ascending")
    ap.add_argument("--pipeline-seqs", default="4096,32768,65536")
    ap.add_argument(
        "--modes",
        default="colocated",
        help="the pipeline's modes: colocated, disaggregated (comma-separated)",
    )
    ap.add_argument("--strategy", choices=("eagle3", "dflash"), default="eagle3")
    ap.add_argument("--capture-orders", default="",
                    help="the sweep also times each capture under these SDPA orders, ';'-separated "
                         "(`default` = torch's; e.g. 'default;cudnn,flash,math')")  # fmt: skip
    ap.add_argument("--profile", default="",
                    help="the sweep also profiles one sample at these lengths (kernels by device time)")  # fmt: skip
    ap.add_argument("--floor", type=Path, default=None, help="the floor probe script")
    ap.add_argument("--floor-seqs", default="2048,4096,8192,16384,32768,65536")
    ap.add_argument("--floor-timeout", type=float, default=150.0)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--chunk-tokens", type=int, default=None, help="strategy.chunk_tokens")
    ap.add_argument("--checkpoint-tokens", type=int, default=None)
    ap.add_argument("--attention", default=None, help="EAGLE3's strategy.attention (default auto)")
    ap.add_argument("--check", type=int, default=4096,
                    help="compare the long-context paths with the plain one at this length first (0: no)")  # fmt: skip
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--colocated-prefetch", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per pipeline run")
    ap.add_argument("--tiny", action="store_true", help="a 4-layer, 2k-vocab target (CPU check)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    args.profile_seqs = {int(s) for s in args.profile.split(",") if s}
    stages = args.stages.split(",")
    work = Path(tempfile.mkdtemp(prefix="specbus-long-"))
    overrides = {**TINY, "max_position_embeddings": 131072} if args.tiny else {
        "max_position_embeddings": 131072}  # fmt: skip
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = write_target(work / "target", overrides, device=device)
    vocab = (TINY if args.tiny else QWEN3_8B)["vocab_size"]
    args.draft_vocab = min(args.draft_vocab, vocab)
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()},
                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                    "torch": torch.__version__}  # fmt: skip
    report["flops"] = flops_section(report["device"])

    def save():
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1, default=str))

    target_config = json.loads((target / "config.json").read_text())
    for stage in stages:
        t0 = time.perf_counter()
        if stage == "pipeline":
            seqs = [int(s) for s in args.pipeline_seqs.split(",") if s]
            modes = [m for m in args.modes.split(",") if m]
            report["pipeline"] = pipeline(target, seqs, modes, args, work, vocab)
        elif stage == "sweep":
            report["sweep"] = sweep(target, [int(s) for s in args.seqs.split(",")], args, vocab)
        elif stage == "floor" and args.floor is not None:
            seqs = [int(s) for s in args.floor_seqs.split(",")]
            report["floor"] = floor(args.floor, seqs, args.floor_timeout)
        print(f"stage {stage} done in {time.perf_counter() - t0:.0f}s", flush=True)
        add_mfu(report, target_config, args)
        save()
    print_table(report)


def add_mfu(report: dict, target_config: dict, args) -> None:
    """The FLOPs per sample of every length in the report (once, under `flops.per_sample`)
    and each row's MFU: the pipeline's over samples/s, the sweep's also per phase."""
    from specbus.core.config import build_config

    vocab = target_config["vocab_size"]
    strategy = build_config({"strategy": long_strategy_tree(args, vocab)}).strategy
    flops, peak = report["flops"], report["flops"]["peak_flops"]
    tables = [("sweep", report.get("sweep") or {})]
    tables += [("pipeline", rows) for rows in (report.get("pipeline") or {}).values()]
    for stage, table in tables:
        for seq, row in table.items():
            if seq == "check" or "samples_per_s" not in row:
                continue
            per = flops["per_sample"].setdefault(
                seq, sample_flops(strategy, target_config, int(seq))
            )
            row["mfu"] = mfu(per["total"], row["samples_per_s"], peak)
            if stage == "sweep":
                row["capture_mfu"] = mfu(per["prefill"], 1 / row["capture_s"], peak)
                row["step_mfu"] = mfu(per["train_step"], 1 / row["step_s"], peak)


def print_table(report: dict) -> None:
    print(f"\n=== {report['device']} (torch {report['torch']}), {report['args']['strategy']}")
    print(f"{'seq':>7} {'samples/s':>9} {'MFU':>5} {'tokens/s':>9} {'capture s':>9} {'step s':>7} "
          f"{'alloc GiB':>9} {'resv GiB':>8} {'capture GiB':>11} {'GiB/1k':>7} ckpt")  # fmt: skip
    for seq, r in (report.get("sweep") or {}).items():
        if seq == "check":
            print(f"check at {r['seq']}: loss rel {r['loss_rel']:.2e}, grad rel max "
                  f"{r['grad_rel_max']:.2e}, metrics abs max {r['metric_abs_max']:.2e}")  # fmt: skip
            continue
        if "error" in r:
            print(f"{seq:>7} FAILED {r['error'][:200]}")
            continue
        print(f"{seq:>7} {r['samples_per_s']:>9.3f} {fmt_mfu(r.get('mfu')):>5} "
              f"{r['tokens_per_s']:>9.0f} {r['capture_s']:>9.2f} "
              f"{r['step_s']:>7.2f} {r.get('peak_alloc_gib', float('nan')):>9.1f} "
              f"{r.get('peak_reserved_gib', float('nan')):>8.1f} "
              f"{r.get('capture_peak_alloc_gib', float('nan')):>11.1f} "
              f"{r.get('slope_gib_per_1k', float('nan')):>7.2f} {r['checkpointed']}")  # fmt: skip
        profiled = r.get("profile") or {}
        for phase, wall in profiled.get("wall_ms", {}).items():
            print(f"{seq:>7} profile {phase}: wall {wall} ms, busy {profiled[phase]['busy_ms']}"
                  f" ms, device ms {profiled[phase]['device_ms']}")  # fmt: skip
            for name, calls, ms in profiled[phase]["top"][:15]:
                print(f"{seq:>7}   {ms:>9.1f} ms {calls:>5}x {name[:110]}")
        for order, s in (r.get("capture_s_by_order") or {}).items():
            took = f"{s:.3f} s ({r['capture_s'] / s:.2f}x the engine's order)" if isinstance(
                s, float) else s  # fmt: skip
            print(f"{seq:>7} capture under SDPA order {order!r}: {took}")
    rows = [(mode, seq, r) for mode, by_seq in (report.get("pipeline") or {}).items()
            for seq, r in by_seq.items()]  # fmt: skip
    for mode, seq, r in rows:
        if "error" in r:
            print(f"pipeline {seq:>7} {mode} FAILED {r['error'][-300:]}")
            continue
        mem = r.get("train_mem", {})
        print(f"pipeline {seq:>7} {mode} {r['samples_per_s']:.3f} samples/s "
              f"MFU {fmt_mfu(r.get('mfu'))} "
              f"{r['tokens_per_s']:.0f} tokens/s, step {r['step_ms']:.0f} ms, capture "
              f"{r.get('capture_frac', float('nan')):.2f}, peak "
              f"{mem.get('peak_allocated_gib', float('nan')):.1f} / "
              f"{mem.get('peak_reserved_gib', float('nan')):.1f} GiB")  # fmt: skip
    for line in (report.get("floor") or {}).get("lines", []):
        print("floor", line)
    flops = report.get("flops") or {}
    for seq, f in sorted((flops.get("per_sample") or {}).items(), key=lambda kv: int(kv[0])):
        print(f"FLOPs per sample at {seq}: {describe(f)}")
    if flops:
        print(f"MFU against {flops['peak_source']}; {flops['convention']}")


if __name__ == "__main__":
    main()
