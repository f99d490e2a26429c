"""EAGLE3's flash TTT attention (core/models/ttt_flash.py) computes the eager path's function.

On the CPU the causal part is written out (the flash kernel is CUDA's), so in float64 these
check the merge by log-sum-exp and the hand-written backward exactly: the attention's output
at every real row and the gradients w.r.t. q and every step's keys and values, then the whole
TTT loss (values, metrics, gradients) with padding, checkpointing and the long-context path.
"""

import pytest
import torch
from specbus.core.config import StrategyConfig
from specbus.core.errors import ConfigError
from specbus.core.models.ttt_flash import ttt_flash
from specbus.core.strategies import build_strategy

from tests.test_eagle3_long import padded, run, single


def leaves(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64).requires_grad_(True) for s in shapes]


def reference(q_BNLD, keys, values, pad_BL):
    """The TTT attention written densely in float64 (the eager path's function; its softmax
    runs in fp32, this one does not): causal + key padding over K0, one key per later step."""
    rep = q_BNLD.shape[1] // keys[0].shape[1]
    keys = [k.repeat_interleave(rep, dim=1) for k in keys]
    values = [v.repeat_interleave(rep, dim=1) for v in values]
    seq, scale = q_BNLD.shape[2], q_BNLD.shape[-1] ** -0.5
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril() & pad_BL.bool()[:, None, None, :]
    scores = (q_BNLD @ keys[0].transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    diag = [(q_BNLD * k).sum(-1, keepdim=True) * scale for k in keys[1:]]
    probs = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1)
    out = probs[..., :seq] @ values[0]
    for s, v in enumerate(values[1:]):
        out = out + probs[..., seq + s, None] * v
    return out


@pytest.mark.parametrize("steps", [1, 2, 4])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (3, 3)], ids=["gqa", "mha"])
def test_flash_ttt_attention_equals_the_eager_attention(steps, heads, kv_heads):
    b, seq, d = 2, 9, 8
    lengths = torch.tensor([9, 6])
    pad_BL = (torch.arange(seq)[None] < lengths[:, None]).long()  # right padding (collate's)
    q, *kv = leaves((b, heads, seq, d), *[(b, kv_heads, seq, d)] * (2 * steps))
    keys, values = kv[:steps], kv[steps:]
    weight = torch.randn(b, heads, seq, d, dtype=torch.float64) * pad_BL[:, None, :, None]

    want = reference(q, keys, values, pad_BL)
    want_grads = torch.autograd.grad((want * weight).sum(), [q, *kv])
    got = ttt_flash(q, keys, values)
    got_grads = torch.autograd.grad((got * weight).sum(), [q, *kv])

    real = pad_BL.bool()[:, None, :, None].expand_as(got)
    torch.testing.assert_close(got[real], want[real], rtol=1e-12, atol=1e-12)
    for name, g, w in zip(
        ["q"] + [f"kv{i}" for i in range(2 * steps)], got_grads, want_grads, strict=True
    ):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("batch_of", [padded, single], ids=["padded", "single"])
@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
@pytest.mark.parametrize(
    "chunk, checkpoint", [(None, False), (None, True), (4, False)],
    ids=["plain", "checkpointed", "chunk4"],
)  # fmt: skip
def test_the_ttt_loss_through_flash_equals_the_eager_loss(batch_of, fused, chunk, checkpoint):
    want_loss, want_m, want_g = run(batch_of, fused=fused, chunk=None, checkpoint=False)
    loss, metrics, grads = run(
        batch_of, fused=fused, chunk=chunk, checkpoint=checkpoint, attention="flash"
    )
    # the eager path's softmax runs in fp32 even on float64 inputs: its rounding, no more
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-9)
    assert metrics.keys() == want_m.keys()
    for key, want in want_m.items():
        torch.testing.assert_close(metrics[key], want, rtol=1e-6, atol=1e-9, msg=key)
    for name, want in want_g.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-7, msg=name)


def test_the_compiled_merges_are_few_graphs_for_every_step_and_equal_eager():
    """What CUDA runs, compiled by Inductor on the CPU: each merge takes all of a step's
    diagonal keys at once (stacked; S a dynamic size), is one graph for one key and one for
    2-6 keys at both lengths (the form that took a graph per step count compiled for minutes
    on a fresh GPU machine), and equals its eager function."""
    from specbus.core.models import ttt_flash as tf
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    step = torch.compile(tf.merge_steps.fn, dynamic=True)
    grads = torch.compile(tf.merge_steps_grads.fn, dynamic=True)
    before = counters["stats"]["unique_graphs"]
    scale = 8**-0.5
    for seq in (12, 20):
        q, g = torch.randn(1, 4, seq, 8), torch.randn(1, 4, seq, 8)
        out, lse = torch.randn(1, 4, seq, 8), torch.randn(1, 4, seq)
        dq = torch.randn(1, 4, seq, 8)
        for s in range(1, 7):  # steps 1..6: one diagonal key more each time
            k, v = torch.randn(s, 1, 2, seq, 8), torch.randn(s, 1, 2, seq, 8)
            merged = tf.merge_steps.fn(q, out, lse, k, v, scale)
            for a, b in zip(step(q, out, lse, k, v, scale), merged, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            want = tf.merge_steps_grads.fn(q, g, merged[0], merged[1], k, v, dq, scale)
            for a, b in zip(grads(q, g, merged[0], merged[1], k, v, dq, scale), want, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] - before == 4


def test_merging_the_keys_at_once_equals_merging_them_one_at_a_time():
    """One log-sum-exp over the causal part and S diagonal scores is the chain of S pairwise
    merges (the softmax over a union of key sets), values and each key's gradient terms."""
    from specbus.core.models import ttt_flash as tf

    torch.manual_seed(0)
    scale, seq, s = 8**-0.5, 10, 4
    q, g = (
        torch.randn(2, 4, seq, 8, dtype=torch.float64),
        torch.randn(2, 4, seq, 8, dtype=torch.float64),
    )
    k, v = (
        torch.randn(s, 2, 2, seq, 8, dtype=torch.float64),
        torch.randn(s, 2, 2, seq, 8, dtype=torch.float64),
    )
    out0, lse0 = (
        torch.randn(2, 4, seq, 8, dtype=torch.float64),
        torch.randn(2, 4, seq, dtype=torch.float64),
    )
    out, lse = tf.merge_steps.fn(q, out0, lse0, k, v, scale)
    acc, chain = out0, lse0
    for i in range(s):
        acc, chain = tf.merge_steps.fn(q, acc, chain, k[i : i + 1], v[i : i + 1], scale)
    torch.testing.assert_close(out, acc)
    torch.testing.assert_close(lse, chain)
    dq0 = torch.zeros(2, 4, seq, 8, dtype=torch.float64)
    dq, dk, dv = tf.merge_steps_grads.fn(q, g, out, lse, k, v, dq0, scale)
    acc = dq0
    for i in range(s):
        acc, dki, dvi = tf.merge_steps_grads.fn(
            q, g, out, lse, k[i : i + 1], v[i : i + 1], acc, scale
        )
        torch.testing.assert_close(dk[i], dki[0])
        torch.testing.assert_close(dv[i], dvi[0])
    torch.testing.assert_close(dq, acc)


def test_auto_attention_runs_the_merged_path_where_cudnn_takes_the_causal_part(monkeypatch):
    """EAGLE3's "auto" on CUDA: eager below 2048 tokens, flex from 2048, and from
    `kernels.CUDNN_ATTENTION_TOKENS` the flash path, whose causal part is then cuDNN's kernel;
    eager on the CPU at any length."""
    from specbus.core.models import kernels

    from tests.test_eagle3_loss import tiny_target

    strategy = build_strategy(StrategyConfig(), tiny_target())
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    at = kernels.CUDNN_ATTENTION_TOKENS
    assert strategy.resolve_attention(cuda, 1024) == "eager"
    assert strategy.resolve_attention(cuda, 4096) == "flex"
    assert kernels.causal_kernel(cuda, at - 1) == "flash"
    assert strategy.resolve_attention(cuda, at) == "flash"
    assert kernels.causal_kernel(cuda, at) == "cudnn"
    assert strategy.resolve_attention(cpu, 1 << 20) == "eager"
    assert kernels.causal_kernel(cpu, 1 << 20) == "math"
    monkeypatch.setattr(kernels, "CUDNN_ATTENTION_TOKENS", 1 << 40)
    assert strategy.resolve_attention(cuda, 1 << 20) == "flex"


def test_a_failing_triton_merge_falls_back_to_the_compiled_one_for_good(monkeypatch, caplog):
    """The merges' Triton kernels are not taken off CUDA, and a kernel that raises (a Triton
    gap on some GPU) hands the call to the compiled merge, and every later one, with one
    warning: training goes on with the same values."""
    from specbus.core.models import ttt_flash as tf
    from specbus.core.models import ttt_merge

    torch.manual_seed(0)
    q, out = torch.randn(1, 4, 9, 8), torch.randn(1, 4, 9, 8)
    lse, k, v = torch.randn(1, 4, 9), torch.randn(2, 1, 2, 9, 8), torch.randn(2, 1, 2, 9, 8)
    assert not ttt_merge.usable(q.bfloat16(), k.bfloat16())  # CPU tensors
    calls = []

    def broken(*args):
        calls.append(args)
        raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(ttt_merge, "ENABLED", [True])
    want = tf.merge_steps(q, out, lse, k, v, 0.3)
    with caplog.at_level("WARNING", logger="specbus.ttt_flash"):
        for _ in range(2):
            got = tf._merge(broken, tf.merge_steps, q, out, lse, k, v, 0.3)
            torch.testing.assert_close(got, want)
    assert len(calls) == 1 and ttt_merge.ENABLED == [False]
    assert sum("Triton merge broken failed" in r.message for r in caplog.records) == 1


def test_flash_is_eagle3s_attention_only():
    from tests.test_eagle3_loss import tiny_target

    with pytest.raises(ConfigError, match="EAGLE3's"):
        build_strategy(StrategyConfig(name="dflash", attention="flash"), tiny_target())


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: torch's flash attention kernel"
)
@pytest.mark.parametrize("seq", [1000, 2048])
@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
def test_flash_matches_flex_on_cuda(seq, kernel, monkeypatch):
    """bf16, Qwen3-8B's heads (32 query, 8 kv, dim 128), right padding, 7 steps: the causal
    part in flash's kernel and in cuDNN's (forced by the threshold) against flex (values at
    real rows, gradients)."""
    from specbus.core.models import kernels
    from specbus.core.models.eagle3_attention import TTTCache, _ttt_flex

    monkeypatch.setattr(kernels, "CUDNN_ATTENTION_TOKENS", 0 if kernel == "cudnn" else 1 << 40)
    assert kernels.causal_kernel(torch.device("cuda"), seq) == kernel
    torch.manual_seed(0)
    b, heads, kv_heads, d, steps = 2, 32, 8, 128, 7
    pad_BL = (torch.arange(seq)[None] < torch.tensor([seq, seq * 3 // 4])[:, None]).long()
    pad_BL = pad_BL.cuda()

    def make(*shape):
        return (torch.randn(shape, device="cuda") * 0.5).bfloat16().requires_grad_(True)

    q = make(b, heads, seq, d)
    kv = [make(b, kv_heads, seq, d) for _ in range(2 * steps)]
    weight = torch.randn(b, heads, seq, d, device="cuda") * pad_BL[:, None, :, None]
    flex = _ttt_flex(q, TTTCache(pad_BL, "flex", keys=kv[:steps], values=kv[steps:]))
    got = ttt_flash(q, kv[:steps], kv[steps:])
    real = pad_BL.bool()[:, None, :, None].expand_as(got)
    torch.testing.assert_close(got[real].float(), flex[real].float(), rtol=2e-2, atol=2e-2)
    want_g = torch.autograd.grad((flex.float() * weight).sum(), [q, *kv])
    got_g = torch.autograd.grad((got.float() * weight).sum(), [q, *kv])
    for i, (g, w) in enumerate(zip(got_g, want_g, strict=True)):
        cos = torch.nn.functional.cosine_similarity(g.flatten().float(), w.flatten().float(), 0)
        assert cos > 0.999, (i, float(cos))
    from specbus.core.models import ttt_merge

    assert ttt_merge.ENABLED[0]  # the merges ran in the Triton kernels (no fallback)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: Triton's kernels")
@pytest.mark.parametrize(
    "heads, kv_heads, seq, steps", [(32, 8, 1000, 6), (4, 4, 77, 1), (8, 4, 300, 3)]
)
def test_the_triton_merges_equal_the_written_out_arithmetic(heads, kv_heads, seq, steps):
    """ttt_merge's kernels (bf16 in, fp32 inside) against `merge_steps` / `merge_steps_grads`
    written out in float64 on the same inputs: q and the gradient in the draft's layout
    ([B, L, N, D] transposed), two batch rows, a length that no tile divides, one and several
    diagonal keys, grouped and plain heads."""
    from specbus.core.models import ttt_merge
    from specbus.core.models.ttt_flash import merge_steps, merge_steps_grads

    g = torch.Generator(device="cuda").manual_seed(0)
    b, d = 2, 128

    def make(*shape):
        return torch.randn(shape, device="cuda", generator=g).bfloat16()

    q, grad = (make(b, seq, heads, d).transpose(1, 2) for _ in range(2))
    out0, dq0 = make(b, heads, seq, d), make(b, heads, seq, d)
    lse0 = torch.randn(b, heads, seq, device="cuda", generator=g) + 5
    k, v = make(steps, b, kv_heads, seq, d), make(steps, b, kv_heads, seq, d)
    scale = d**-0.5
    assert ttt_merge.usable(q, k)
    out, lse = ttt_merge.merge_steps(q, out0, lse0, k, v, scale)
    want_out, want_lse = merge_steps.fn(*(x.double() for x in (q, out0, lse0, k, v)), scale)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-5)
    got = ttt_merge.merge_steps_grads(q, grad, out, lse, k, v, dq0, scale)
    want = merge_steps_grads.fn(*(x.double() for x in (q, grad, out, lse, k, v, dq0)), scale)
    for name, x, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert x.dtype == torch.bfloat16 and x.shape == w.shape, name
        torch.testing.assert_close(x.double(), w, rtol=1e-2, atol=2e-2, msg=name)
