"""The DFlash-family flex-attention path (the CUDA default): its tile-level block mask covers
exactly the dense block mask, and the losses, metrics and gradients equal the dense paths.

On the CPU the flex path runs the same tiles and mask_mod as a dense SDPA (the flex kernel has
no CPU backward); `tests/test_dflash_gpu.py` compares the compiled kernel on CUDA."""

from __future__ import annotations

import warnings

import pytest
import torch
from specbus.core.models.dflash import DFlashConfig, DFlashDraft, _flex_dense, flex_blocks
from specbus.core.strategies.dflash import (
    block_mask,
    dflash_loss,
    domino_loss,
    dspark_loss,
    sample_anchors,
)

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


def _anchors(b, seq, n, seed=1, drop_last_half=True):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, seq, generator=g) < 0.9).long()
    mask[:, : seq // 4] = 0
    if b > 1 and drop_last_half:
        mask[-1, seq // 2 :] = 0  # a shorter sample: fewer anchors, padding blocks
    return mask, sample_anchors(mask, n, g)


@pytest.mark.parametrize(
    "b,seq,n,k", [(2, 700, 40, 16), (1, 130, 9, 16), (3, 300, 20, 4), (1, 1000, 70, 10)]
)
def test_flex_tiles_cover_exactly_the_dense_block_mask(b, seq, n, k):
    _, (anchors, keep) = _anchors(b, seq, n)
    fb = flex_blocks(anchors, keep, seq, k)
    dense = _flex_dense(fb)[:, 0]  # what the kernel computes: [B, Qp, ctx_len + Qp]
    q = anchors.shape[1] * k
    cols = torch.cat([torch.arange(seq), fb.ctx_len + torch.arange(q)])
    assert torch.equal(dense[:, :q][:, :, cols], block_mask(anchors, keep, seq, k))
    outside = dense.clone()
    outside[:, :q, cols] = False
    assert not outside.any()  # nothing allowed in the padding (context, queries, keys)
    assert fb.q_pad % 128 == 0 and fb.ctx_len % 128 == 0
    if seq >= 700:  # long contexts have tiles the kernel skips the mask_mod for
        assert fb.full_BQtKt.any()
    assert not (fb.full_BQtKt & fb.tiles_BQtKt).any()


@pytest.mark.parametrize("b,seq,n,k", [(2, 700, 40, 16), (3, 300, 20, 4)])
def test_flex_tiles_are_create_block_masks_tiles(b, seq, n, k):
    from torch.nn.attention.flex_attention import create_block_mask

    _, (anchors, keep) = _anchors(b, seq, n)
    fb = flex_blocks(anchors, keep, seq, k)
    ref = create_block_mask(fb.mask_mod, b, None, fb.q_pad, fb.ctx_len + fb.q_pad, "cpu")
    ours = fb.block_mask
    for a, r in (("kv_num_blocks", "kv_num_blocks"), ("full_kv_num_blocks", "full_kv_num_blocks")):
        assert torch.equal(getattr(ours, a), getattr(ref, r))
    for num, idx in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        cnt = getattr(ref, num)
        for pos in range(int(cnt.max())):
            sel = cnt > pos
            assert torch.equal(getattr(ours, idx)[..., pos][sel], getattr(ref, idx)[..., pos][sel])


def test_flex_tiles_with_unsorted_fixed_anchors_and_dropped_blocks():
    anchors = torch.tensor([[300, 5, 170, 0, 260, 40, 129, 128, 2, 9]])
    keep = torch.tensor([[True, True, True, False, True, True, True, True, False, True]])
    fb = flex_blocks(anchors, keep, 400, 16)
    dense = _flex_dense(fb)[:, 0]
    cols = torch.cat([torch.arange(400), fb.ctx_len + torch.arange(160)])
    assert torch.equal(dense[:, :160][:, :, cols], block_mask(anchors, keep, 400, 16))


def _draft(projector: str, dtype: torch.dtype) -> DFlashDraft:
    torch.manual_seed(0)
    cfg = DFlashConfig(
        hidden_size=32, intermediate_size=48, num_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=64, target_layer_ids=[1, 2],
        num_target_layers=4, block_size=16, mask_token_id=1, projector=projector,
        emb_dim=16, gru_hidden_dim=8, markov_rank=4 if projector == "dspark" else 0,
        confidence_head=projector == "dspark",
    )  # fmt: skip
    return DFlashDraft(cfg).to(dtype)


def _loss(projector, model, attention, dtype, seq=300, n=20):
    mask, anchors = _anchors(2, seq, n, seed=3)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(2, 64, (2, seq), generator=g)
    aux = torch.randn(2, seq, 64, generator=g, dtype=dtype)
    final = torch.randn(2, seq, 32, generator=g, dtype=dtype)
    embed = torch.randn(64, 32, generator=g, dtype=dtype)
    head = torch.randn(64, 32, generator=g, dtype=dtype) * 0.3
    kwargs = dict(
        input_ids_BL=ids, loss_mask_BL=mask, hidden_states_BLA=aux, embed_VH=embed,
        lm_head_VH=head, mask_token_id=1, block_size=16, num_anchors=n, gamma=7.0,
        anchors=anchors, chunk_blocks=8, attention=attention,
    )  # fmt: skip
    if projector == "dflash":
        return dflash_loss(model, **kwargs)
    if projector == "domino":
        return domino_loss(model, **kwargs, lambda_base=0.3)
    return dspark_loss(model, **kwargs, target_BLH=final)


def _run(projector, attention, dtype):
    model = _draft(projector, dtype)
    loss, metrics = _loss(projector, model, attention, dtype)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), metrics, grads


@pytest.mark.parametrize("projector", ["dflash", "domino", "dspark"])
def test_flex_losses_metrics_and_gradients_equal_the_dense_paths(projector):
    # fp64: flex against the dense SDPA of the same function, to rounding
    loss_f, m_f, g_f = _run(projector, "flex", torch.float64)
    loss_s, m_s, g_s = _run(projector, "sdpa", torch.float64)
    torch.testing.assert_close(loss_f, loss_s, rtol=1e-10, atol=1e-12)
    for key in m_s:
        torch.testing.assert_close(
            torch.as_tensor(m_f[key]).double(), torch.as_tensor(m_s[key]).double(),
            rtol=1e-10, atol=1e-12, msg=key,
        )  # fmt: skip
    assert g_f.keys() == g_s.keys()
    for key in g_s:
        torch.testing.assert_close(g_f[key], g_s[key], rtol=1e-8, atol=1e-11, msg=key)
    # fp32: flex against the reference's eager arithmetic
    loss_f, _, g_f = _run(projector, "flex", torch.float32)
    loss_e, _, g_e = _run(projector, "eager", torch.float32)
    torch.testing.assert_close(loss_f, loss_e, rtol=1e-5, atol=1e-6)
    for key in g_e:
        torch.testing.assert_close(g_f[key], g_e[key], rtol=1e-3, atol=1e-5, msg=key)


def _run_fused(projector, fused, dtype, seq=200, n=20, **loss_keys):
    model = _draft(projector, dtype)
    mask, anchors = _anchors(2, seq, n, seed=5)
    g = torch.Generator().manual_seed(6)
    kwargs = dict(
        input_ids_BL=torch.randint(2, 64, (2, seq), generator=g), loss_mask_BL=mask,
        hidden_states_BLA=torch.randn(2, seq, 64, generator=g, dtype=dtype),
        embed_VH=torch.randn(64, 32, generator=g, dtype=dtype),
        lm_head_VH=torch.randn(64, 32, generator=g, dtype=dtype) * 0.3, mask_token_id=1,
        block_size=16, num_anchors=n, gamma=7.0, anchors=anchors, chunk_blocks=3,
        attention="sdpa" if dtype == torch.float64 else "eager", fused=fused,
    )  # fmt: skip
    if projector == "dflash":
        loss, metrics = dflash_loss(model, **kwargs)
    else:
        final = torch.randn(2, seq, 32, generator=g, dtype=dtype)
        loss, metrics = dspark_loss(model, **kwargs, target_BLH=final, **loss_keys)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), metrics, grads


@pytest.mark.parametrize(
    "projector,keys",
    [
        ("dflash", {}),
        ("dspark", {}),
        ("dspark", {"ce_alpha": 0.0}),
        ("dspark", {"l1_alpha": 0.0, "confidence_alpha": 0.0}),
        ("dspark", {"seq": 400, "n": 10}),  # fewer block rows than positions: no teacher table
    ],
)
def test_fused_head_equals_the_checkpointed_chunks(projector, keys):
    """`fused_head` (the CUDA default) computes the same loss, metrics and gradients as the
    reference's checkpointed chunks (fp64: to fp32 rounding, as both take the vocabulary
    softmax in fp32; fp32: within the parity tolerances)."""
    for dtype, rtol, atol in ((torch.float64, 1e-6, 1e-9), (torch.float32, 1e-4, 1e-6)):
        loss_f, m_f, g_f = _run_fused(projector, True, dtype, **keys)
        loss_r, m_r, g_r = _run_fused(projector, False, dtype, **keys)
        torch.testing.assert_close(loss_f, loss_r, rtol=rtol, atol=atol)
        assert m_f.keys() == m_r.keys()
        for key in m_r:
            torch.testing.assert_close(
                torch.as_tensor(m_f[key]).double(), torch.as_tensor(m_r[key]).double(),
                rtol=rtol, atol=atol, msg=key,
            )  # fmt: skip
        assert g_f.keys() == g_r.keys()
        for key in g_r:
            torch.testing.assert_close(g_f[key], g_r[key], rtol=rtol * 10, atol=atol, msg=key)


def test_flex_query_side_tiles_are_from_kv_blocks_ones():
    """The backward's query-side indices (built from the tiles transposed) equal the ones
    `BlockMask.from_kv_blocks` derives."""
    from torch.nn.attention.flex_attention import BlockMask

    _, (anchors, keep) = _anchors(2, 700, 40)
    ours = flex_blocks(anchors, keep, 700, 16).block_mask
    ref = BlockMask.from_kv_blocks(
        ours.kv_num_blocks, ours.kv_indices, ours.full_kv_num_blocks, ours.full_kv_indices,
        seq_lengths=ours.seq_lengths,
    )  # fmt: skip
    for name in ("q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(ours, name), getattr(ref, name))
    for num, idx in (("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
        cnt = getattr(ref, num)
        for pos in range(int(cnt.max())):
            sel = cnt > pos
            assert torch.equal(getattr(ours, idx)[..., pos][sel], getattr(ref, idx)[..., pos][sel])


def test_fused_head_in_one_chunk_without_a_teacher():
    """One chunk (no sums added across chunks) and no teacher (terms return one zero tensor
    for several metrics): the fused head still returns distinct outputs and trains."""
    loss, metrics, grads = _run_fused_one_chunk()
    assert torch.isfinite(loss) and grads and float(metrics["l1_loss"]) == 0.0


def _run_fused_one_chunk():
    model = _draft("dspark", torch.float32)
    mask, anchors = _anchors(1, 100, 4, seed=7)
    g = torch.Generator().manual_seed(8)
    loss, metrics = dspark_loss(
        model, input_ids_BL=torch.randint(2, 64, (1, 100), generator=g), loss_mask_BL=mask,
        hidden_states_BLA=torch.randn(1, 100, 64, generator=g),
        target_BLH=torch.randn(1, 100, 32, generator=g),
        embed_VH=torch.randn(64, 32, generator=g), lm_head_VH=torch.randn(64, 32, generator=g),
        mask_token_id=1, block_size=16, num_anchors=4, anchors=anchors, chunk_blocks=128,
        attention="flex", fused=True, l1_alpha=0.0, confidence_alpha=0.0,
    )  # fmt: skip
    loss.backward()
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), metrics, grads
