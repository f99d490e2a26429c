"""EAGLE3's TTT attention as one causal flash attention plus the diagonal keys, merged exactly.

Shape legend (eagle3_attention.py's): B batch, N query heads, G key/value heads (N = G * R),
L sequence, D head dim, S earlier TTT steps (the step computed is S; its keys are K0..KS).

At TTT step S every query i attends to the step-0 keys K0[:i+1] (causal) and to one key per
later step, Ks[i] (s = 1..S). A softmax over the union of two key sets is the two partial
softmaxes merged by their log-sum-exps, so the step is:

    out0, lse0 = causal flash attention (q, K0, V0)            # one fused kernel, O(L) memory
    s_s        = q . Ks[i] * scale                              # S dot products per row
    lse        = logsumexp(lse0, s_1, ..., s_S)
    out        = exp(lse0 - lse) * out0 + sum_s exp(s_s - lse) * Vs[i]

The backward needs no second merge: with P = exp(scores - lse) over all keys and
Delta = rowsum(dO * out) of the *merged* output, every key's gradient is P (dP - Delta), so
flash attention's own backward, given the merged `out` and `lse`, returns the causal part's
exact dq, dK0, dV0 (the identity ring attention relies on), and the diagonal keys' terms are
the same formula on S columns (`merge_step_grads`).

Against the flex path (a block mask over [K0|K1|...|KS], whose diagonal tiles are partial and
pay the mask for one useful key in 128) this runs the causal part in the dense flash kernel,
and never concatenates the steps' keys. Padding: the batch is right-padded (`collate`), so a
real query's causal keys are all real; rows past a sample's length attend to padding keys
here and not in the reference, and neither reaches a real row (a row attends only to its own
and earlier positions) nor the loss (masked): real rows and every gradient are the same
function. On CUDA the causal part is torch's flash kernel (bf16/fp16), or cuDNN's at long
lengths (`kernels.causal_kernel`), which reads the G key/value heads as they are (GQA) where
flash's takes them repeated; on the CPU it is the same arithmetic written out (the tests'
reference, O(L^2) memory).
"""

from __future__ import annotations

import logging
import math

import torch
from specbus.core.models import ttt_merge
from specbus.core.models.kernels import causal_kernel, compiled, upcast

log = logging.getLogger("specbus.ttt_flash")


def supported(q_BNLD: torch.Tensor) -> bool:
    """Whether the flash kernel takes `q` (CUDA, half precision, head dim a multiple of 8 up
    to 256); the CPU always runs the written-out arithmetic."""
    if not q_BNLD.is_cuda:
        return True
    d = q_BNLD.shape[-1]
    return (
        q_BNLD.dtype in (torch.bfloat16, torch.float16)
        and d % 8 == 0
        and d <= 256
        and torch.backends.cuda.flash_sdp_enabled()
    )


def _causal_scores(q_BNLD, k_BNLD, scale):
    seq = q_BNLD.shape[2]
    s = torch.matmul(upcast(q_BNLD), upcast(k_BNLD).transpose(-1, -2)) * scale
    future = torch.ones(seq, seq, dtype=torch.bool, device=q_BNLD.device).triu(1)
    return s.masked_fill(future, float("-inf"))


def _repeated(x_BGLD: torch.Tensor, r: int) -> torch.Tensor:
    return x_BGLD if r == 1 else x_BGLD.repeat_interleave(r, 1)


def _group_sum(x_BNLD: torch.Tensor, g: int) -> torch.Tensor:
    return x_BNLD if x_BNLD.shape[1] == g else _grouped(x_BNLD, g).sum(2)


# cuDNN's kernel reads the G key/value heads as they are (GQA: no repeated copies, the keys'
# gradients come back per kv head); False after a build refused it (then repeated, as flash)
_CUDNN_GQA = [True]


def _cudnn_forward(q_BNLD, k_BGLD, v_BGLD, scale):
    """(cuDNN's outputs, whether the keys went in repeated)."""
    r = q_BNLD.shape[1] // k_BGLD.shape[1]

    def attend(k, v):
        return torch.ops.aten._scaled_dot_product_cudnn_attention(
            q_BNLD, k, v, None, True, 0.0, True, False, scale=scale
        )

    if _CUDNN_GQA[0] or r == 1:
        try:
            return attend(k_BGLD, v_BGLD), False
        except RuntimeError as e:  # an older build: the heads repeated from now on
            _CUDNN_GQA[0] = False
            log.warning("cuDNN attention refused %d kv heads for %d query heads, repeating "
                        "them: %s", k_BGLD.shape[1], q_BNLD.shape[1], str(e)[:200])  # fmt: skip
    return attend(_repeated(k_BGLD, r), _repeated(v_BGLD, r)), True


def causal_attention(q_BNLD, k_BGLD, v_BGLD, scale: float):
    """(out [B, N, L, D] in q's dtype, lse [B, N, L] fp32, the kernel's state for its
    backward): causal attention with its log-sum-exp over G key/value heads (N = G * R), in
    the kernel `kernels.causal_kernel` picks by the length (cuDNN's at long lengths, reading
    the kv heads as they are; flash's below, on the heads repeated; the arithmetic on the
    CPU)."""
    kernel = causal_kernel(q_BNLD.device, q_BNLD.shape[2])
    r = q_BNLD.shape[1] // k_BGLD.shape[1]
    if kernel == "cudnn":
        res, repeated = _cudnn_forward(q_BNLD, k_BGLD, v_BGLD, scale)
        # cuDNN's lse may carry a trailing unit dim: [B, N, L] here, its own shape back in the backward
        lse = res[1]
        return res[0], lse.reshape(q_BNLD.shape[:3]), (
            "cudnn", repeated, tuple(lse.shape), *res[2:8]
        )  # fmt: skip
    k_BNLD, v_BNLD = _repeated(k_BGLD, r), _repeated(v_BGLD, r)
    if kernel == "flash":
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            q_BNLD, k_BNLD, v_BNLD, 0.0, True, False, scale=scale
        )
        return res[0], res[1], ("flash", *res[2:8])
    s = _causal_scores(q_BNLD, k_BNLD, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse[..., None]), upcast(v_BNLD)).to(q_BNLD.dtype)
    return out, lse, ("math",)


def causal_attention_backward(grad_BNLD, q_BNLD, k_BGLD, v_BGLD, out_BNLD, lse_BNL, scale, state):
    """(dq, dk [B, G, L, D], dv) of the causal part, with P = exp(scores - lse) and
    Delta = rowsum(dO * out) read from the *merged* `out` and `lse` (module docstring);
    `state` from `causal_attention`."""
    kernel, *rest = state
    g = k_BGLD.shape[1]
    r = q_BNLD.shape[1] // g
    if kernel == "cudnn":  # dO in O's layout (cuDNN reads both with one stride set)
        repeated, lse_shape, cum_q, cum_k, max_q, max_k, seed, offset = rest
        k, v = (_repeated(k_BGLD, r), _repeated(v_BGLD, r)) if repeated else (k_BGLD, v_BGLD)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_BNLD.contiguous(), q_BNLD, k, v, out_BNLD.contiguous(),
            lse_BNL.reshape(lse_shape).contiguous(), seed, offset, None, cum_q, cum_k, max_q,
            max_k, 0.0, True, scale=scale,
        )  # fmt: skip
        return dq, _group_sum(dk, g), _group_sum(dv, g)
    k_BNLD, v_BNLD = _repeated(k_BGLD, r), _repeated(v_BGLD, r)
    if kernel == "flash":
        cum_q, cum_k, max_q, max_k, seed, offset = rest
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_BNLD, q_BNLD, k_BNLD, v_BNLD, out_BNLD, lse_BNL, cum_q, cum_k, max_q, max_k,
            0.0, True, seed, offset, scale=scale,
        )  # fmt: skip
        return dq, _group_sum(dk, g), _group_sum(dv, g)
    gr, q, k, v = upcast(grad_BNLD), upcast(q_BNLD), upcast(k_BNLD), upcast(v_BNLD)
    p = torch.exp(_causal_scores(q_BNLD, k_BNLD, scale) - lse_BNL[..., None])
    delta = (gr * upcast(out_BNLD)).sum(-1, keepdim=True)
    ds = p * (torch.matmul(gr, v.transpose(-1, -2)) - delta)
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    dv = torch.matmul(p.transpose(-1, -2), gr)
    return (
        dq.to(q_BNLD.dtype),
        _group_sum(dk, g).to(k_BGLD.dtype),
        _group_sum(dv, g).to(v_BGLD.dtype),
    )


def _grouped(x_BNL_: torch.Tensor, g: int) -> torch.Tensor:
    """[B, N, ...] -> [B, G, R, ...] (query head h = g * R + r)."""
    return x_BNL_.unflatten(1, (g, x_BNL_.shape[1] // g))


@compiled
def merge_steps(q_BNLD, out_BNLD, lse_BNL, k_SBGLD, v_SBGLD, scale: float):
    """(out in q's dtype, lse fp32) with S more keys per row, each step's key and value at the
    row's own position (`k`/`v` stacked over the steps): the causal part's softmax (`out`,
    `lse`) and the S diagonal scores merged by one log-sum-exp, in fp32 (fp64 kept). One
    pass over q and out for all S keys (compiled on CUDA, S a dynamic size: one graph for
    S = 1 and one for the rest; a key at a time read and wrote the fp32 output S times, and a
    tuple of keys was a graph per step count, each compiled cold)."""
    g = k_SBGLD.shape[2]
    q = upcast(_grouped(q_BNLD, g))  # [B, G, R, L, D]
    lse = _grouped(lse_BNL, g)  # [B, G, R, L]
    kf, vf = upcast(k_SBGLD)[:, :, :, None], upcast(v_SBGLD)[:, :, :, None]  # [S, B, G, 1, L, D]
    scores = (q * kf).sum(-1) * scale  # [S, B, G, R, L]
    merged = torch.logsumexp(torch.cat((lse[None], scores)), 0)
    out = torch.exp(lse - merged)[..., None] * upcast(_grouped(out_BNLD, g)) + (
        torch.exp(scores - merged)[..., None] * vf
    ).sum(0)
    return out.flatten(1, 2).to(q_BNLD.dtype), merged.flatten(1, 2)


@compiled
def merge_steps_grads(
    q_BNLD, grad_BNLD, out_BNLD, lse_BNL, k_SBGLD, v_SBGLD, dq_BNLD, scale: float
):
    """(dq + the S diagonal keys' terms in q's dtype, dK [S, B, G, L, D], dV): P (dP - Delta)
    on each key's column, with P = exp(score - lse) of the merged softmax and
    Delta = rowsum(dO * out) of the merged output (compiled on CUDA: one kernel reads grad,
    out, q and the causal part's dq once)."""
    g = k_SBGLD.shape[2]
    q, grad = upcast(_grouped(q_BNLD, g)), upcast(_grouped(grad_BNLD, g))
    delta = (grad * upcast(_grouped(out_BNLD, g))).sum(-1)  # [B, G, R, L]
    kf, vf = upcast(k_SBGLD)[:, :, :, None], upcast(v_SBGLD)[:, :, :, None]
    p = torch.exp((q * kf).sum(-1) * scale - _grouped(lse_BNL, g))  # [S, B, G, R, L]
    ds = p * ((grad * vf).sum(-1) - delta)
    dq = upcast(_grouped(dq_BNLD, g)) + (ds[..., None] * kf).sum(0) * scale
    dk = ((ds[..., None] * q).sum(3) * scale).to(k_SBGLD.dtype)
    dv = (p[..., None] * grad).sum(3).to(v_SBGLD.dtype)
    return dq.flatten(1, 2).to(q_BNLD.dtype), dk, dv


def _merge(kernel, fallback, *args):
    """`kernel` (ttt_merge's Triton kernel of `fallback`, None where it does not take the
    inputs) or, without it or after it failed once, `fallback` (compiled on CUDA)."""
    if kernel is not None and ttt_merge.ENABLED[0]:
        try:
            return kernel(*args)
        except Exception as e:  # a Triton gap must not stop training: compiled from now on
            ttt_merge.ENABLED[0] = False
            log.warning("the Triton merge %s failed, the compiled one from now on: %r",
                        kernel.__name__, e)  # fmt: skip
    return fallback(*args)


_SAVED = object()  # a slot of the kernel's state that went through save_for_backward


def _stride_one(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class TTTFlashAttention(torch.autograd.Function):
    """`apply(q [B, N, L, D], steps, K0..K{steps-1}, V0..V{steps-1})` -> [B, N, L, D]: the TTT
    step's attention (module docstring). Keeps q, the merged output and lse and the keys and
    values (no repeated heads, no probabilities)."""

    @staticmethod
    def forward(ctx, q_BNLD, steps: int, *keys_values):
        q_BNLD = _stride_one(q_BNLD)
        keys, values = keys_values[:steps], keys_values[steps:]
        scale = 1.0 / math.sqrt(q_BNLD.shape[-1])
        out, lse, state = causal_attention(q_BNLD, keys[0], values[0], scale)
        if steps > 1:
            k, v = torch.stack(keys[1:]), torch.stack(values[1:])
            kernel = ttt_merge.merge_steps if ttt_merge.usable(q_BNLD, k) else None
            out, lse = _merge(kernel, merge_steps, q_BNLD, out, lse, k, v, scale)
        ctx.steps, ctx.scale = steps, scale
        # the kernel's state: tensors saved as such, the rest (lengths, None) kept as is
        tensors = [t for t in state if isinstance(t, torch.Tensor)]
        ctx.state = [_SAVED if isinstance(t, torch.Tensor) else t for t in state]
        ctx.save_for_backward(q_BNLD, out, lse.contiguous(), *keys_values, *tensors)
        return out

    @staticmethod
    def backward(ctx, grad_BNLD):
        steps, scale = ctx.steps, ctx.scale
        q, out, lse, *rest = ctx.saved_tensors
        keys, values = rest[:steps], rest[steps : 2 * steps]
        saved = iter(rest[2 * steps :])
        state = [next(saved) if s is _SAVED else s for s in ctx.state]
        grad = _stride_one(grad_BNLD)
        dq, dk0, dv0 = causal_attention_backward(
            grad, q, keys[0], values[0], out, lse, scale, state
        )
        dks, dvs = [dk0], [dv0]
        if steps > 1:
            k, v = torch.stack(keys[1:]), torch.stack(values[1:])
            kernel = ttt_merge.merge_steps_grads if ttt_merge.usable(q, k) else None
            dq, dk, dv = _merge(kernel, merge_steps_grads, q, grad, out, lse, k, v, dq, scale)
            dks.extend(dk.unbind(0))
            dvs.extend(dv.unbind(0))
        return (dq, None, *dks, *dvs)


def ttt_flash(q_BNLD: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]):
    """The TTT attention of step `len(keys) - 1` over `keys`/`values` (step 0 first)."""
    return TTTFlashAttention.apply(q_BNLD, len(keys), *keys, *values)
