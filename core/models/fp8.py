"""FP8 linear layers for the frozen target's prefill (`target.quantize: fp8`).

The target never trains, so its decoder's matrix products can run the way FP8 serving runs
them (vLLM / SGLang `fp8` with dynamic per-token scales): the weight is e4m3 with one scale
per output channel, fixed at load; each activation row (token) is scaled by its own absolute
maximum into e4m3 when the layer runs; `torch._scaled_mm` multiplies in FP8 and returns the
activation's dtype. On an H200 FP8 tensor cores do twice the bf16 rate, and the weights take
half the memory (8 GB instead of 16 for an 8B target).

What it changes: the captured features are those of the FP8 target, not the bf16 one. That
is the right target when the deployment serves the FP8 checkpoint; against a bf16 deployment
the relative error per layer (`python -m specbus.ops.bench.capture --arms eager,fp8`, and
tests/test_fp8_target.py on SmolLM2-135M) is what the draft learns on top of. Default off.

Only `nn.Linear` layers inside the decoder layers are replaced (the embeddings, the final
norm and the lm_head stay as they are), and only those whose widths are multiples of 16
(what the FP8 kernels take); the others stay in their dtype.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("specbus.capture")

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
_TINY = 1e-12  # an all-zero row scales by this, not by 0


def quantize_rows(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 `[M, K]`, fp32 scale `[M, 1]`) with `x ≈ q * scale` row by row: each row's
    absolute maximum maps to the largest e4m3 value."""
    amax_M1 = x_MK.abs().amax(dim=-1, keepdim=True).float().clamp(min=_TINY)
    scale_M1 = amax_M1 / E4M3_MAX
    q_MK = (x_MK.float() / scale_M1).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q_MK, scale_M1


class Fp8Linear(nn.Module):
    """`y = x W^T + b` with W in e4m3 (one scale per output row) and x quantised per row
    when called. Holds no high-precision copy of W. Takes `[..., K]`, returns `[..., N]` in
    x's dtype (the product is taken in bf16 output, what the row-wise FP8 kernels give)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight_NK, scale_N1 = quantize_rows(linear.weight.detach())
        self.register_buffer("weight_fp8", weight_NK)
        self.register_buffer("weight_scale", scale_N1.reshape(1, -1).contiguous())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_MK = x.reshape(-1, self.in_features)
        q_MK, scale_M1 = quantize_rows(x_MK)
        # mat2 column-major: the transposed view of the row-major [N, K] weight
        y_MN = torch._scaled_mm(q_MK, self.weight_fp8.t(), scale_a=scale_M1,
                                scale_b=self.weight_scale, out_dtype=torch.bfloat16,
                                use_fast_accum=True)  # fmt: skip
        y_MN = y_MN.to(x.dtype)
        if self.bias is not None:
            y_MN = y_MN + self.bias
        return y_MN.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3"


def quantize_linears_fp8(layers: nn.Module) -> int:
    """Replace every `nn.Linear` under `layers` whose widths are multiples of 16 by an
    `Fp8Linear` (in place; the bf16 weights are dropped); returns how many were replaced
    (0 when already done)."""
    swapped = skipped = 0
    for parent in list(layers.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            if child.in_features % 16 or child.out_features % 16:
                skipped += 1
                continue
            setattr(parent, name, Fp8Linear(child))
            swapped += 1
    if skipped:
        log.warning("target.quantize fp8: %d linear layer(s) keep their dtype (widths not "
                    "multiples of 16)", skipped)  # fmt: skip
    return swapped
