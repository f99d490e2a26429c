"""Small pure functions of the drafts' steps, compiled on CUDA.

Each is the eager function itself on the CPU (the reference arithmetic every CPU test and
parity check runs), and on CUDA the same function under `torch.compile(dynamic=True)`: one or
two fused kernels instead of the 6-20 elementwise launches (casts, reductions, rotations)
eager PyTorch issues for it, which made the TTT step host-bound. Lengths vary by batch, so
shapes are dynamic from the first call (one compile per function and dtype). Any failure to
compile or run compiled falls back to the eager function for good, with one warning.
`SPECBUS_COMPILE=0` (or `kernels.ENABLED = False`) turns compilation off.

"Dynamic" still recompiles now and then: a function called with another rank, dtype or
requires_grad is another graph, and Inductor's kernels carry range guards on the sizes their
heuristics read (on an H200, `rms_norm` recompiled for `1280 <= L <= 8191`, then for
`L >= 8192`, then for a stride; 8 graphs in the first ~20 DSpark steps of uniform 512-4096
lengths, each 1-3 s). Dynamo's default limit of 8 graphs per function would then run it
eagerly for the rest of the process, so the limit is raised to `RECOMPILE_LIMIT`: the
recompiles are a one-off cost per size range, an eager fallback a cost on every step.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger("specbus.kernels")

ENABLED = os.environ.get("SPECBUS_COMPILE", "1") != "0"
RECOMPILE_LIMIT = 64
# From this many query positions a causal attention on CUDA runs cuDNN's kernel, below it
# flash's (`causal_kernel`). `SPECBUS_CUDNN_ATTENTION_TOKENS` overrides it (0: always cuDNN).
CUDNN_ATTENTION_TOKENS = int(os.environ.get("SPECBUS_CUDNN_ATTENTION_TOKENS", "16384"))


def upcast(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (the reference's `.float()`; fp64 stays fp64 for exact tests)."""
    return x if x.dtype == torch.float64 else x.float()


def causal_kernel(device: torch.device, seq_len: int) -> str:
    """The kernel of a causal attention over `seq_len` positions: "cudnn" on CUDA from
    `CUDNN_ATTENTION_TOKENS` (on an H200 at 32k tokens, 32/8 heads of 128: forward 580 TFLOP/s
    against flash's 342, forward + backward 545 against 323; `ops/bench/attention_kernels.py`),
    "flash" on CUDA below it (cuDNN builds a plan on the host for every new length, which a
    short attention does not repay), "math" off CUDA (the written-out reference)."""
    if torch.device(device).type != "cuda":
        return "math"
    if seq_len >= CUDNN_ATTENTION_TOKENS and torch.backends.cuda.cudnn_sdp_enabled():
        return "cudnn"
    return "flash"


def raise_recompile_limit() -> None:
    """Dynamo's per-function graph limit to at least `RECOMPILE_LIMIT` (module docstring)."""
    import torch._dynamo.config as dynamo

    for name in ("recompile_limit", "cache_size_limit"):  # the name before torch 2.6
        if hasattr(dynamo, name):
            setattr(dynamo, name, max(getattr(dynamo, name), RECOMPILE_LIMIT))
            return


class _Compiled:
    def __init__(self, fn):
        self.fn = fn
        self.compiled = None
        self.failed = False
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any) -> Any:
        first = args[0]
        if not (ENABLED and not self.failed and isinstance(first, torch.Tensor) and first.is_cuda):
            return self.fn(*args)
        if self.compiled is None:
            import torch._inductor.config as inductor

            # round where the eager code rounds (x.to(bf16) then back up), as the reference
            if hasattr(inductor, "emulate_precision_casts"):
                inductor.emulate_precision_casts = True
            raise_recompile_limit()
            self.compiled = torch.compile(self.fn, dynamic=True)
        try:
            return self.compiled(*args)
        except Exception as e:  # a compiler gap must not stop training: eager from now on
            self.failed = True
            log.warning("torch.compile of %s failed, running it eagerly: %r", self.fn.__name__, e)
            return self.fn(*args)


def compiled(fn):
    """`fn` compiled on CUDA (see the module docstring)."""
    return _Compiled(fn)


@compiled
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 (fp64 kept, for exact tests), scaled by `weight`; the result
    is `weight * x.to(x.dtype)` as the reference writes it (fp32 for fp32 weights)."""
    dtype = x.dtype
    h = x if dtype == torch.float64 else x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


@compiled
def rms_norm_to(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype):
    """`rms_norm(x, weight, eps).to(out_dtype)` in one kernel: the norm of an input that only
    matmuls read, under autocast, handed over already in autocast's dtype (the cast autocast
    would make before each matmul, made once; the same values)."""
    return rms_norm.fn(x, weight, eps).to(out_dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@compiled
def rope(
    q_BNLD: torch.Tensor,
    k_BNLD: torch.Tensor,
    inv_freq: torch.Tensor,
    position_ids_BL: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q and k at `position_ids` (frequencies in fp32, tables cast to q's
    dtype, as the reference)."""
    freqs_BLD2 = position_ids_BL.to(torch.float32)[..., None] * inv_freq.to(
        position_ids_BL.device, torch.float32
    )
    emb_BLD = torch.cat((freqs_BLD2, freqs_BLD2), dim=-1)
    cos = emb_BLD.cos().to(q_BNLD.dtype)[:, None]
    sin = emb_BLD.sin().to(q_BNLD.dtype)[:, None]
    return q_BNLD * cos + _rotate_half(q_BNLD) * sin, k_BNLD * cos + _rotate_half(k_BNLD) * sin


@compiled
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (compiled on CUDA)."""
    return F.silu(gate) * up
