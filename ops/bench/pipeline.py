"""Pipeline throughput: disaggregated vs colocated vs a single-process loop, one run, same data.

- loop: `ops.bench.local_loop.train_local` in this process: capture -> collate -> step, no bus, no
  store (the baseline);
- colocated: one trainer rank process capturing its own tasks through the broker;
- disaggregated: one producer process + one trainer process through the broker and shm.

Same random target (Llama-shaped, built from a config), same pre-tokenised samples, one torch
thread per process (the 2-core CI box: the disaggregated producer and trainer each get a
core; the loop and the colocated rank use one). Samples/s is the steady state of the trainer
(log intervals after the first); data-wait and bus time per optimizer step come from the
trainer's metrics; the capture fraction is capture seconds over training seconds.

    python -m specbus.ops.bench.pipeline --samples 96 --out runs/bench/pipeline.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch
from specbus.core.config import build_config, dump_config
from specbus.ops.launch import Launcher
from specbus.ops.services.nats import NatsServer


def build_target(path: Path, hidden: int, layers: int, vocab: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                      max_position_embeddings=4096, tie_word_embeddings=False)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def write_data(path: Path, n: int, seq: int, vocab: int) -> Path:
    g = torch.Generator().manual_seed(1)
    with open(path, "w") as f:
        for _ in range(n):
            ids = torch.randint(3, vocab, (seq,), generator=g).tolist()
            f.write(
                json.dumps(
                    {"input_ids": ids, "loss_mask": [0] * (seq // 4) + [1] * (seq - seq // 4)}
                )
                + "\n"
            )
    return path


def config_for(run: str, work: Path, target: Path, data: Path, mode: str, args) -> object:
    tree = {
        "run": run,
        "run_dir": str(work / run),
        "bus": {"ack_wait_s": 30.0, "heartbeat_s": 5.0, "fetch_timeout_s": 0.2},
        "store": {"uri": f"shm://{run}" if mode == "disaggregated" else "mem://", "budget_bytes": 2 << 30},
        "target": {"model": str(target), "capture_batch": args.micro_batch},
        "strategy": {"ttt_length": args.ttt, "draft": {"draft_vocab_size": min(args.vocab, 2048)}},
        "data": {"source": str(data), "max_length": args.seq, "holdout": 0},
        "training": {"micro_batch": args.micro_batch, "log_every": 2, "checkpoint_every": 10_000,
                     "prefetch": 2, "lr": 1e-4},
        "deployment": {"mode": "colocated" if mode == "colocated" else "disaggregated"},
    }  # fmt: skip
    return build_config(tree)


def run_loop(cfg) -> dict:
    from specbus.ops.bench.local_loop import train_local
    from specbus.producers.engines.registry import build_engine

    engine = build_engine(cfg.target)
    try:
        run = train_local(cfg, engine)
    finally:
        engine.close()
    busy = run.capture_s + run.train_s
    steady = run.history[2:] or run.history
    step_s = statistics.mean(r["capture_s"] + r["train_s"] for r in steady)
    return {
        "samples_per_s": cfg.training.micro_batch / step_s,
        "capture_frac": run.capture_s / busy,
        "data_wait_frac": 0.0,
        "bus_s_per_step": 0.0,
        "steps": run.steps,
    }


def run_pipeline(cfg, work: Path, mode: str) -> dict:
    from specbus.ops.produce import run_feeder

    server = NatsServer(work / f"nats-{mode}").start()
    config_path = work / f"{cfg.run}.yaml"
    config_path.write_text(dump_config(cfg))
    procs = Launcher(work / f"{cfg.run}-logs", env={"OMP_NUM_THREADS": "1", "SPECBUS_THREADS": "1"})
    try:
        asyncio.run(run_feeder(cfg, bus_url=server.url))
        common = ["--log-level", "WARNING"]
        args = ["--config", str(config_path), "--url", server.url]
        if mode == "disaggregated":
            procs.start("produce", [*common, "produce", *args])
        procs.start("train", [*common, "train", *args])
        code = procs.wait("train", timeout=1800)["train"]
        if code != 0:
            raise RuntimeError(f"{mode} trainer failed ({code}): {procs.log('train')[-2000:]}")
        if "produce" in procs.procs:
            procs.wait("produce", timeout=60)
    finally:
        procs.stop()
        server.stop()
    ckpt = cfg.resolved_run_dir / "checkpoints"
    state = torch.load(
        ckpt / (ckpt / "latest").read_text().strip() / "state.pt", weights_only=False
    )
    rows = state["history"]
    steady = rows[1:] or rows
    out = {
        "samples_per_s": statistics.mean(r["samples_per_s"] for r in steady),
        "data_wait_frac": statistics.mean(r["data_wait_frac"] for r in steady),
        "bus_s_per_step": statistics.mean(r["bus_s_per_step"] for r in steady),
        "steps": state["step"],
    }
    step_s = cfg.training.micro_batch / out["samples_per_s"]
    out["bus_frac_of_step"] = out["bus_s_per_step"] / step_s
    if mode == "colocated":
        elapsed = sum(
            cfg.training.log_every * cfg.training.micro_batch / r["samples_per_s"] for r in rows
        )
        out["capture_frac"] = rows[-1].get("capture_s", 0.0) / elapsed
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--modes", default="loop,colocated,disaggregated")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="specbus-bench-"))
    target = build_target(work / "target", args.hidden, args.layers, args.vocab)
    data = write_data(work / "data.jsonl", args.samples, args.seq, args.vocab)
    results = {}
    for mode in args.modes.split(","):
        cfg = config_for(f"bench-{mode}-{uuid.uuid4().hex[:6]}", work, target, data, mode, args)
        t0 = time.perf_counter()
        results[mode] = run_loop(cfg) if mode == "loop" else run_pipeline(cfg, work, mode)
        results[mode]["wall_s"] = time.perf_counter() - t0
        print(mode, json.dumps({k: round(v, 4) for k, v in results[mode].items()}), flush=True)
    if "loop" in results:
        for mode in results:
            results[mode]["ratio_vs_loop"] = (
                results[mode]["samples_per_s"] / results["loop"]["samples_per_s"]
            )
    if "colocated" in results and "disaggregated" in results:
        results["disaggregated"]["ratio_vs_colocated"] = (
            results["disaggregated"]["samples_per_s"] / results["colocated"]["samples_per_s"]
        )
    print(
        json.dumps(
            {"args": vars(args) | {"out": str(args.out)}, "results": results}, indent=1, default=str
        )
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {"args": vars(args) | {"out": str(args.out)}, "results": results}, default=str
            )
        )


if __name__ == "__main__":
    main()
