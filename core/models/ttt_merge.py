"""The TTT attention's merge of the diagonal keys (`ttt_flash.merge_steps` and its backward)
as two Triton kernels: one pass over each row, on CUDA.

Shape legend (ttt_flash.py's): B batch, N query heads, G key/value heads (N = G * R), L
sequence, D head dim, S diagonal keys (earlier TTT steps).

Why hand-written: the merge is a row-wise computation with small inner reductions (a D-dot
product per key, a sum over S keys, and in the backward a sum over the R query heads of a
kv head), bound by memory at ~1-2 GB per step at 32k tokens (~0.3 ms on an H200). Inductor's
kernels for the same arithmetic (`torch.compile` of the broadcast [S, B, G, R, L, D] form)
took 2.3-3.2 ms a call, split into several kernels with the sum over R strided (H200, 32k
tokens: ~75 ms a sample over the 7 steps, forward and backward).

A program takes `BLOCK_L` positions of one (batch, kv head): its rows are the R query heads
x BLOCK_L positions (row i: head g * R + i // BLOCK_L, position l0 + i % BLOCK_L), so each
diagonal key and value is read once for the R heads that share it, and the backward's sum
over R is a reshape of the tile. The keys are merged online (flash attention's running max
and sum), in fp32, over a runtime number of steps (one compiled kernel for every S).
"""

from __future__ import annotations

import os

import torch

# [enabled]: `SPECBUS_TRITON_MERGE=0` runs the compiled merges instead; False after a kernel
# failed (ttt_flash._merge)
ENABLED = [os.environ.get("SPECBUS_TRITON_MERGE", "1") != "0"]

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install: the compiled / eager merges run instead
    triton = None


def usable(q_BNLD: torch.Tensor, k_SBGLD: torch.Tensor) -> bool:
    """Whether these kernels take the inputs: CUDA, half precision, the head dim and the
    query heads per kv head powers of two (a tile's dims), offsets within int32 (the kernels'
    index arithmetic: ~500k tokens of 32 heads of 128), Triton installed."""
    if triton is None or not q_BNLD.is_cuda or q_BNLD.dtype not in (torch.bfloat16, torch.float16):
        return False
    d, r = q_BNLD.shape[-1], q_BNLD.shape[1] // k_SBGLD.shape[2]
    small = max(q_BNLD.numel(), k_SBGLD.numel()) < 2**31
    return (
        small
        and d >= 16
        and d & (d - 1) == 0
        and r & (r - 1) == 0
        and k_SBGLD.dtype == q_BNLD.dtype
    )


def _block(r: int) -> int:
    # R x BLOCK_L rows of D fp32 values per tile: 32 rows keep the backward's ~6 live tiles
    # in registers at D = 128 (4 warps forward, 8 backward)
    return max(1, 32 // r)


if triton is not None:

    @triton.jit
    def _tile(L, G, R: tl.constexpr, BLOCK_L: tl.constexpr, D: tl.constexpr):
        """(batch, query head and position of each of the tile's R * BLOCK_L rows, the head
        dim's offsets, which rows are real positions); a row's kv head is its head // R."""
        pid_l, pid_bg = tl.program_id(0), tl.program_id(1)
        i = tl.arange(0, R * BLOCK_L)
        pos = pid_l * BLOCK_L + i % BLOCK_L
        return pid_bg // G, (pid_bg % G) * R + i // BLOCK_L, pos, tl.arange(0, D), pos < L

    @triton.jit
    def _load(x, s_b, s_h, s_l, b, h, pos, d, live):
        """The rows (head h, position pos) of a [B, H, L, D] tensor in fp32 (0 past L)."""
        at = x + b * s_b + h[:, None] * s_h + pos[:, None] * s_l + d[None, :]
        return tl.load(at, live[:, None], 0.0).to(tl.float32)

    @triton.jit
    def _merge_fwd(
        q, sq_b, sq_n, sq_l, o, so_b, so_n, so_l, lse, sl_b, sl_n, sl_l,
        k, v, sk_s, sk_b, sk_g, sk_l, sv_s, sv_b, sv_g, sv_l,
        out, lse_out, S, L, G, scale,
        R: tl.constexpr, BLOCK_L: tl.constexpr, D: tl.constexpr,
    ):  # fmt: skip
        b, n, pos, d, live = _tile(L, G, R, BLOCK_L, D)
        qv = _load(q, sq_b, sq_n, sq_l, b, n, pos, d, live)
        acc = _load(o, so_b, so_n, so_l, b, n, pos, d, live)
        m = tl.load(lse + b * sl_b + n * sl_n + pos * sl_l, live, other=0.0)
        total = tl.full(m.shape, 1.0, tl.float32)  # the causal part's weight, exp(lse - m)
        for s in range(S):
            ks = _load(k + s * sk_s, sk_b, sk_g, sk_l, b, n // R, pos, d, live)
            vs = _load(v + s * sv_s, sv_b, sv_g, sv_l, b, n // R, pos, d, live)
            score = tl.sum(qv * ks, 1) * scale
            m_new = tl.maximum(m, score)
            alpha, beta = tl.exp(m - m_new), tl.exp(score - m_new)
            total = total * alpha + beta
            acc = acc * alpha[:, None] + beta[:, None] * vs
            m = m_new
        rows = (b * (G * R) + n) * L + pos
        tl.store(
            out + rows[:, None] * D + d[None, :],
            (acc / total[:, None]).to(out.dtype.element_ty),
            live[:, None],
        )
        tl.store(lse_out + rows, m + tl.log(total), live)

    @triton.jit
    def _merge_bwd(
        q, sq_b, sq_n, sq_l, dout, sd_b, sd_n, sd_l, o, so_b, so_n, so_l,
        lse, sl_b, sl_n, sl_l, dq_in, sg_b, sg_n, sg_l,
        k, v, sk_s, sk_b, sk_g, sk_l, sv_s, sv_b, sv_g, sv_l,
        dq, dk, dv, S, L, G, scale,
        R: tl.constexpr, BLOCK_L: tl.constexpr, D: tl.constexpr,
    ):  # fmt: skip
        b, n, pos, d, live = _tile(L, G, R, BLOCK_L, D)
        qv = _load(q, sq_b, sq_n, sq_l, b, n, pos, d, live)
        gr = _load(dout, sd_b, sd_n, sd_l, b, n, pos, d, live)
        # rowsum(dO * out) of the merged output
        delta = tl.sum(gr * _load(o, so_b, so_n, so_l, b, n, pos, d, live), 1)
        lv = tl.load(lse + b * sl_b + n * sl_n + pos * sl_l, live, other=float("inf"))
        acc = _load(dq_in, sg_b, sg_n, sg_l, b, n, pos, d, live)
        one = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)  # the tile's positions, once
        for s in range(S):
            ks = _load(k + s * sk_s, sk_b, sk_g, sk_l, b, n // R, pos, d, live)
            vs = _load(v + s * sv_s, sv_b, sv_g, sv_l, b, n // R, pos, d, live)
            p = tl.exp(tl.sum(qv * ks, 1) * scale - lv)  # [R * BLOCK_L]
            ds = p * (tl.sum(gr * vs, 1) - delta)
            acc += ds[:, None] * ks * scale
            dks = tl.sum(tl.reshape(ds[:, None] * qv * scale, (R, BLOCK_L, D)), 0)
            dvs = tl.sum(tl.reshape(p[:, None] * gr, (R, BLOCK_L, D)), 0)
            at = ((s * tl.num_programs(1) + tl.program_id(1)) * L + one)[:, None] * D + d[None, :]
            tl.store(dk + at, dks.to(dk.dtype.element_ty), (one < L)[:, None])
            tl.store(dv + at, dvs.to(dv.dtype.element_ty), (one < L)[:, None])
        rows = (b * (G * R) + n) * L + pos
        tl.store(dq + rows[:, None] * D + d[None, :], acc.to(dq.dtype.element_ty), live[:, None])


def _grid(q_BNLD: torch.Tensor, k_SBGLD: torch.Tensor, block: int):
    batch, _, seq, _ = q_BNLD.shape
    return (triton.cdiv(seq, block), batch * k_SBGLD.shape[2])


def merge_steps(q_BNLD, out_BNLD, lse_BNL, k_SBGLD, v_SBGLD, scale: float):
    """`ttt_flash.merge_steps` (same contract): (out [B, N, L, D] in q's dtype, lse fp32)."""
    batch, heads, seq, dim = q_BNLD.shape
    r = heads // k_SBGLD.shape[2]
    out = torch.empty((batch, heads, seq, dim), dtype=q_BNLD.dtype, device=q_BNLD.device)
    lse = torch.empty((batch, heads, seq), dtype=torch.float32, device=q_BNLD.device)
    block = _block(r)
    _merge_fwd[_grid(q_BNLD, k_SBGLD, block)](
        q_BNLD, *_s3(q_BNLD), out_BNLD, *_s3(out_BNLD), lse_BNL, *lse_BNL.stride(),
        k_SBGLD, v_SBGLD, *_s4(k_SBGLD), *_s4(v_SBGLD),
        out, lse, k_SBGLD.shape[0], seq, k_SBGLD.shape[2], scale,
        R=r, BLOCK_L=block, D=dim, num_warps=4,
    )  # fmt: skip
    return out, lse


def merge_steps_grads(q_BNLD, grad_BNLD, out_BNLD, lse_BNL, k_SBGLD, v_SBGLD, dq_BNLD, scale):
    """`ttt_flash.merge_steps_grads` (same contract): (dq in q's dtype, dK [S, B, G, L, D],
    dV)."""
    batch, heads, seq, dim = q_BNLD.shape
    r = heads // k_SBGLD.shape[2]
    dq = torch.empty((batch, heads, seq, dim), dtype=q_BNLD.dtype, device=q_BNLD.device)
    dk = torch.empty(k_SBGLD.shape, dtype=k_SBGLD.dtype, device=k_SBGLD.device)
    dv = torch.empty(v_SBGLD.shape, dtype=v_SBGLD.dtype, device=v_SBGLD.device)
    block = _block(r)
    _merge_bwd[_grid(q_BNLD, k_SBGLD, block)](
        q_BNLD, *_s3(q_BNLD), grad_BNLD, *_s3(grad_BNLD), out_BNLD, *_s3(out_BNLD),
        lse_BNL, *lse_BNL.stride(), dq_BNLD, *_s3(dq_BNLD),
        k_SBGLD, v_SBGLD, *_s4(k_SBGLD), *_s4(v_SBGLD),
        dq, dk, dv, k_SBGLD.shape[0], seq, k_SBGLD.shape[2], scale,
        R=r, BLOCK_L=block, D=dim, num_warps=8,
    )  # fmt: skip
    return dq, dk, dv


def _s3(x_BNLD: torch.Tensor) -> tuple[int, int, int]:
    """Batch, head and position strides (the head dim's is 1: `ttt_flash._stride_one`)."""
    assert x_BNLD.stride(-1) == 1
    return x_BNLD.stride(0), x_BNLD.stride(1), x_BNLD.stride(2)


def _s4(x_SBGLD: torch.Tensor) -> tuple[int, int, int, int]:
    assert x_SBGLD.stride(-1) == 1
    return x_SBGLD.stride(0), x_SBGLD.stride(1), x_SBGLD.stride(2), x_SBGLD.stride(3)
