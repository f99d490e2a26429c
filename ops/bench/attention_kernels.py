"""Attention kernels at long length on one GPU: which of torch's causal attention kernels the
long prefill and the draft's TTT should run (docs/benchmarks.md, "Long context").

Causal self-attention, batch 1, the Qwen3-8B shape (32 query heads, 8 key/value heads, head
dim 128, bf16), per length of `--seqs`:

- forward: flash with `enable_gqa` (what transformers' sdpa path runs), flash / cuDNN /
  memory-efficient on the key/value heads repeated, cuDNN with `enable_gqa` (refused by some
  torch builds: the row says so);
- forward + backward: flash and cuDNN (repeated heads, the ops the TTT attention calls), and
  compiled flex attention with a causal block mask and `enable_gqa` (the draft's flex path);
- cuDNN's plan per new length: the first forward at a length not seen before against the
  same call again (wall clock, host included);
- EAGLE3's TTT attention, 7 steps forward and backward as a draft step runs them: flex (the
  block mask over every step's keys), and `ttt_flash` (a causal kernel plus the diagonal
  keys, merged) with its causal part in flash's kernel and in cuDNN's;
- a matrix product [L, 4096] x [4096, 12288] (an MLP projection of the same tokens) as the
  yardstick: attention at the matrix units' rate would match its TFLOP/s.

Each row: median milliseconds over `--reps` after warm-up (CUDA events), TFLOP/s counting
the causal half (forward 4 N L^2 D / 2, backward 2.5x the forward), and the largest relative
difference of the output from flash's.

    python -m specbus.ops.bench.attention_kernels --seqs 4096,32768 --out $OUT/attention.json
    python -m specbus.ops.bench.attention_kernels --seqs 256 --reps 2   # CPU: the math kernel only
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def _timed(fn, reps: int) -> float:
    """Median milliseconds of `fn()` (one warm-up call first)."""
    fn()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _backend(name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, name))


def _row(fn, reps: int, flop: float, ref: torch.Tensor | None) -> dict:
    try:
        out = fn()
        ms = _timed(fn, reps)
    except RuntimeError as err:  # a kernel that refuses the shape: say so, keep going
        return {"error": str(err).splitlines()[0][:200]}
    row = {"ms": round(ms, 3), "tflops": round(flop / ms / 1e9, 1)}
    if ref is not None and isinstance(out, torch.Tensor):
        row["max_rel_diff"] = float(
            (out.float() - ref.float()).abs().max() / ref.float().abs().max()
        )
    return row


def measure(seq: int, reps: int) -> dict:
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    g = torch.Generator(device=device).manual_seed(seq)
    q = torch.randn(1, HEADS, seq, HEAD_DIM, device=device, dtype=dtype, generator=g)
    k = torch.randn(1, KV_HEADS, seq, HEAD_DIM, device=device, dtype=dtype, generator=g)
    v = torch.randn(1, KV_HEADS, seq, HEAD_DIM, device=device, dtype=dtype, generator=g)
    rep = HEADS // KV_HEADS
    kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    fwd = 4 * HEADS * seq * seq * HEAD_DIM / 2
    rows: dict[str, dict] = {"seq": seq}

    def sdpa(backend, key, value, gqa):
        def run():
            with _backend(backend):
                return F.scaled_dot_product_attention(q, key, value, is_causal=True, enable_gqa=gqa)

        return run

    backends = ["FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"] if cuda else ["MATH"]
    ref = sdpa(backends[0], k, v, True)()
    rows["fwd flash gqa" if cuda else "fwd math gqa"] = _row(
        sdpa(backends[0], k, v, True), reps, fwd, ref
    )
    for name in backends:
        short = name.split("_")[0].lower()
        rows[f"fwd {short} repeated"] = _row(sdpa(name, kr, vr, False), reps, fwd, ref)
    if cuda:
        rows["fwd cudnn gqa"] = _row(sdpa("CUDNN_ATTENTION", k, v, True), reps, fwd, ref)

    qg, krg, vrg = (t.detach().clone().requires_grad_() for t in (q, kr, vr))
    grad = torch.randn_like(q)

    def fwd_bwd(backend):
        def run():
            with _backend(backend):
                out = F.scaled_dot_product_attention(qg, krg, vrg, is_causal=True)
            out.backward(grad)
            return out.detach()

        return run

    for name in backends[:2]:
        short = name.split("_")[0].lower()
        rows[f"fwd+bwd {short} repeated"] = _row(fwd_bwd(name), reps, 3.5 * fwd, None)
    if cuda:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        block = create_block_mask(lambda b, h, i, j: i >= j, None, None, seq, seq, device=device)
        flex = torch.compile(flex_attention, dynamic=False)
        kg, vg = (t.detach().clone().requires_grad_() for t in (k, v))

        def flex_run():
            out = flex(qg, kg, vg, block_mask=block, enable_gqa=True)
            out.backward(grad)
            return out.detach()

        rows["fwd+bwd flex gqa"] = _row(flex_run, reps, 3.5 * fwd, None)
        rows["cudnn plan, new length"] = plan_cost(q, k, v, seq)
        rows.update(ttt_rows(seq, reps, fwd))
    x = torch.randn(seq, 4096, device=device, dtype=dtype, generator=g)
    w = torch.randn(4096, 12288, device=device, dtype=dtype, generator=g)
    rows["matmul L x 4096 x 12288"] = _row(lambda: x @ w, reps, 2 * seq * 4096 * 12288, None)
    return rows


def plan_cost(q, k, v, seq: int) -> dict:
    """Milliseconds of cuDNN's first forward at a length not seen before (seq - 8) and of the
    same call again: the difference is its plan, paid once per new shape."""
    short = seq - 8
    qs, ks, vs = q[:, :, :short], k[:, :, :short], v[:, :, :short]

    def call():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with _backend("CUDNN_ATTENTION"):
            F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    try:
        first, again = call(), call()
    except RuntimeError as err:
        return {"error": str(err).splitlines()[0][:200]}
    return {"first_ms": round(first, 2), "again_ms": round(again, 2)}


def ttt_rows(seq: int, reps: int, fwd: float, steps: int = 7) -> dict:
    """The TTT attention of `steps` steps, forward then backward (module docstring)."""
    from specbus.core.models import kernels
    from specbus.core.models.eagle3_attention import TTTCache, _ttt_flex
    from specbus.core.models.ttt_flash import ttt_flash

    g = torch.Generator(device="cuda").manual_seed(seq + 1)

    def make(*shape):
        t = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) * 0.5
        return t.requires_grad_()

    qs = [make(1, HEADS, seq, HEAD_DIM) for _ in range(steps)]
    keys = [make(1, KV_HEADS, seq, HEAD_DIM) for _ in range(steps)]
    values = [make(1, KV_HEADS, seq, HEAD_DIM) for _ in range(steps)]
    pad = torch.ones(1, seq, dtype=torch.long, device="cuda")

    def run(attend):
        def once():
            cache = TTTCache(pad, "flex")
            total = 0.0
            for s in range(steps):
                cache.keys.append(keys[s])
                cache.values.append(values[s])
                total = total + attend(qs[s], cache).float().square().mean()
            total.backward()
            return None

        return once

    def flash_with(threshold):
        def attend(q, cache):
            saved, kernels.CUDNN_ATTENTION_TOKENS = kernels.CUDNN_ATTENTION_TOKENS, threshold
            try:
                return ttt_flash(q, cache.keys, cache.values)
            finally:
                kernels.CUDNN_ATTENTION_TOKENS = saved

        return attend

    # the causal part's FLOPs (the diagonal keys' are O(L)), forward + backward, every step
    flop = steps * 3.5 * fwd
    return {
        "ttt fwd+bwd flex": _row(run(_ttt_flex), reps, flop, None),
        "ttt fwd+bwd flash": _row(run(flash_with(1 << 40)), reps, flop, None),
        "ttt fwd+bwd cudnn": _row(run(flash_with(0)), reps, flop, None),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="4096,32768")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1 if not torch.cuda.is_available() else torch.get_num_threads())
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "cudnn": torch.backends.cudnn.version(), "rows": []}  # fmt: skip
    for seq in (int(s) for s in args.seqs.split(",")):
        rows = measure(seq, args.reps)
        report["rows"].append(rows)
        for name, row in rows.items():
            if name != "seq":
                print(f"{seq:>7} {name:<26} {json.dumps(row)}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
