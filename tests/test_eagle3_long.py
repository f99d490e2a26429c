"""EAGLE3's long-context paths compute the plain path's function (values and gradients).

The chunked teacher and loss (`core/strategies/eagle3_long.py`), the blocked eager attention
and the checkpointed TTT steps (`core/models/`) only reorder sums, so on a tiny model in
float64 every loss, metric and gradient equals the plain path's to rounding; and they never
form an `L x L` (or `L x Vd` per step) tensor.
"""

import pytest
import torch
from specbus.core.config import DraftConfig, StrategyConfig
from specbus.core.strategies import build_strategy
from specbus.core.strategies.eagle3 import eagle3_ttt_loss
from torch.utils._python_dispatch import TorchDispatchMode

from tests.test_eagle3_loss import setup


def run(
    batch_of,
    *,
    fused: bool,
    chunk: int | None,
    checkpoint: bool,
    ttt: int = 3,
    attention: str = "eager",
):
    strategy, draft, batch = batch_of(ttt)
    t = batch.tensors
    loss, metrics = eagle3_ttt_loss(
        draft, input_ids_BL=t["input_ids"], attention_mask_BL=t["attention_mask"],
        loss_mask_BL=t["loss_mask"], hidden_states_BL3H=t["hidden_states"],
        target_BLH=t["target"], lm_head_VH=strategy.heads.lm_head, ttt_length=ttt,
        fused=fused, chunk=chunk, checkpoint=checkpoint, attention=attention,
    )  # fmt: skip
    (loss * 0.7).backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}
    return loss.detach(), metrics, grads


def padded(ttt):  # two samples of 9 and 6 tokens: key padding, the blocked attention
    return setup(ttt_length=ttt)


def single(ttt):  # one sample, no padding: step 0 through SDPA's causal kernel
    strategy, draft, batch = setup(ttt_length=ttt)
    batch.tensors = {k: v[:1] for k, v in batch.tensors.items()}
    return strategy, draft, batch


@pytest.mark.parametrize("batch_of", [padded, single], ids=["padded", "single"])
@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
@pytest.mark.parametrize(
    "chunk, checkpoint",
    [(None, True), (3, False), (3, True), (4, False), (8, True)],
    ids=["checkpointed", "chunk3", "chunk3-checkpointed", "chunk4", "chunk8-checkpointed"],
)
def test_long_paths_equal_the_plain_path(batch_of, fused, chunk, checkpoint):
    plain_loss, plain_m, plain_g = run(batch_of, fused=fused, chunk=None, checkpoint=False)
    loss, metrics, grads = run(batch_of, fused=fused, chunk=chunk, checkpoint=checkpoint)
    # float64: anything but a reordered sum (SDPA's online softmax, chunked sums) is far off
    torch.testing.assert_close(loss, plain_loss, rtol=1e-9, atol=1e-12)
    assert metrics.keys() == plain_m.keys()
    for key, want in plain_m.items():
        assert metrics[key].dtype == want.dtype, key
        torch.testing.assert_close(metrics[key], want, rtol=1e-9, atol=1e-12, msg=key)
    assert grads.keys() == plain_g.keys()
    for name, want in plain_g.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-7, atol=1e-9, msg=name)


def test_the_strategy_takes_the_long_paths_by_length_and_keeps_the_loss():
    """`strategy.chunk_tokens` / `checkpoint_tokens` pick the paths; a batch at or under
    the chunk takes the plain path untouched."""
    results = {}
    for chunk, ckpt in ((None, None), (4, 8), (64, None)):
        strategy, draft, batch = setup(ttt_length=2)
        strategy.cfg = strategy.cfg.model_copy(
            update={"chunk_tokens": chunk, "checkpoint_tokens": ckpt}
        )
        assert strategy.checkpoint(batch) is (ckpt is not None)  # 2 x 9 tokens >= 8
        loss, _ = strategy.forward_loss(draft, batch)
        loss.backward()
        results[chunk] = (loss.detach(), draft.lm_head.weight.grad.clone())
    torch.testing.assert_close(results[4][0], results[None][0], rtol=1e-12, atol=0)
    torch.testing.assert_close(results[4][1], results[None][1], rtol=1e-10, atol=1e-13)
    assert torch.equal(results[64][0], results[None][0])  # 9 <= 64: the plain path
    assert torch.equal(results[64][1], results[None][1])


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_the_long_path_forms_no_l_by_l_tensor():
    """At 512 positions with chunks of 32 the largest tensor of the forward and the backward is
    one block of scores (B x N x 32 x (L + K - 1)); the plain path forms B x N x L x L."""
    from specbus.core.data.vocab import VocabMapping
    from specbus.core.models.target import TargetHeads

    from tests.test_eagle3_loss import tiny_target

    seq, vocab, draft_vocab, batch_size = 512, 40, 24, 2
    torch.manual_seed(0)
    target = tiny_target()
    heads = TargetHeads(embed_tokens=torch.randn(vocab, 16), lm_head=torch.randn(vocab, 16))
    sample = {
        "input_ids": torch.randint(0, vocab, (seq,)),
        "loss_mask": torch.ones(seq, dtype=torch.long),
        "hidden_states": torch.randn(seq, 48),
        "target": torch.randn(seq, 16),
    }

    def largest(chunk):
        cfg = StrategyConfig(
            ttt_length=3, chunk_tokens=chunk, checkpoint_tokens=None,
            draft=DraftConfig(draft_vocab_size=draft_vocab),
        )  # fmt: skip
        strategy = build_strategy(cfg, target, heads=heads)
        draft = strategy.build_model(vocab=VocabMapping.from_d2t([0] * draft_vocab, vocab))
        batch = strategy.collate([sample, {k: v[:-7] for k, v in sample.items()}])
        with LargestTensor() as probe:
            loss, _ = strategy.forward_loss(draft, batch)
            loss.backward()
        return probe.numel

    n = target.num_attention_heads
    assert largest(None) >= batch_size * n * seq * seq
    assert largest(32) <= batch_size * n * 32 * (seq + 2)


@pytest.mark.parametrize("operands", [torch.float64, torch.bfloat16])
def test_add_product_accumulates_in_the_accumulators_dtype(operands):
    """acc += a @ b in place, in acc's dtype, whatever the operands' (the CPU's branches;
    CUDA's out_dtype product: tests/test_eagle3_gpu.py)."""
    from specbus.core.strategies.eagle3_long import add_product

    g = torch.Generator().manual_seed(0)
    acc = torch.randn(6, 5, dtype=torch.float64 if operands == torch.float64 else torch.float32)
    a, b = torch.randn(7, 6, generator=g).to(operands), torch.randn(7, 5, generator=g).to(operands)
    want = acc.double() + a.double().T @ b.double()
    before, dtype = acc.data_ptr(), acc.dtype
    add_product(acc, a.T, b)
    assert acc.data_ptr() == before and acc.dtype == dtype
    tol = 1e-12 if operands == torch.float64 else 2e-2  # the CPU rounds a bf16 product
    torch.testing.assert_close(acc.double(), want, rtol=tol, atol=tol)
