"""How long one SDPA call of the serving decode takes on the host, per backend order, as the
cache grows (a new key length each call, as in `specbus serve`'s decode). On an H200 with
torch 2.11 the default order picks cuDNN for a masked attention and builds its plan on the
host for every new shape (~42 ms a call); the efficient kernel takes ~0.05 ms
(docs/benchmarks.md, "The closed loop on one H200"). Needs a CUDA device.

    python ops/bench/sdpa_decode.py
"""

import contextlib
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

dev = "cuda"
torch.manual_seed(0)
names = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


def run(label, backends, gqa, q_len=4, B=64, S0=300):
    q = torch.randn(B, 9, q_len, 64, device=dev, dtype=torch.bfloat16)
    times = []
    choice = None
    ctx = sdpa_kernel(backends) if backends else contextlib.nullcontext()
    with ctx, torch.no_grad():
        for i in range(40):
            S = S0 + 4 * i
            kh = 3 if gqa else 9
            k = torch.randn(B, kh, S, 64, device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            m = torch.ones(q_len, S, dtype=torch.bool, device=dev).tril(S - q_len)[None, None] & (
                torch.rand(B, 1, 1, S, device=dev) > 0.05
            )
            torch.cuda.synchronize()
            t = time.perf_counter()
            F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=gqa)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            if i >= 5:
                times.append((t1 - t, t2 - t))
            if choice is None:
                try:
                    choice = names.get(
                        int(torch._fused_sdp_choice(q, k, v, m, 0.0, False, enable_gqa=gqa))
                    )
                except Exception as e:
                    choice = f"? {e}"[:60]
    host = sorted(a for a, _ in times)[len(times) // 2] * 1e3
    full = sorted(b for _, b in times)[len(times) // 2] * 1e3
    print(
        f"{label:32s} gqa={gqa!s:5} choice={choice!s:10} host {host:8.3f} ms  with sync {full:8.3f} ms"
    )


def main() -> None:
    print(torch.__version__, torch.backends.cudnn.version(), torch.cuda.get_device_name())
    for gqa in (True, False):
        run("default", None, gqa)
        run(
            "no cudnn",
            [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
            gqa,
        )
        run("efficient only", [SDPBackend.EFFICIENT_ATTENTION], gqa) if not gqa else None
        run("math only", [SDPBackend.MATH], gqa)
        try:
            run("cudnn only", [SDPBackend.CUDNN_ATTENTION], gqa)
        except Exception as e:
            print("cudnn only failed:", str(e)[:200])


if __name__ == "__main__":
    main()
