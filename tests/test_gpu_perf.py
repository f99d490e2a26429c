"""The fast paths of the draft steps on CUDA against the reference paths, on the same inputs.

- DFlash family: flex attention (the compiled kernel, tile-level BlockMask) against the dense
  SDPA mask, at two context lengths (the second one recompiles with dynamic shapes);
- DFlash / DSpark: the fused vocabulary head against the checkpointed chunks;
- EAGLE3: the fused step loss and the per-forward TTT masks against the eager reference, at a
  length that is not a whole number of tiles, with padding;
- the compiled pointwise kernels (`core/models/kernels.py`) against eager.

`pytest -m gpu tests/test_gpu_perf.py` on the H200 (ops/bench/gpu.sh). On a CPU,
`SPECBUS_GPU_TEST_DEVICE=cpu` runs the same comparisons through the CPU stand-ins (a check of
the test itself: flex is the dense emulation there and nothing is compiled)."""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from specbus.core.models import kernels
from specbus.core.models.dflash import DFlashConfig, DFlashDraft
from specbus.core.strategies import eagle3, eagle3_fused
from specbus.core.strategies.dflash import dflash_loss, dspark_loss, sample_anchors

DEVICE = os.environ.get("SPECBUS_GPU_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs CUDA"),
]
warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def _dflash_case(projector, seq, attention, fused, autocast, seed=0):
    torch.manual_seed(seed)
    cfg = DFlashConfig(
        hidden_size=256, intermediate_size=512, num_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=4096, target_layer_ids=[1],
        num_target_layers=4, block_size=16, mask_token_id=1, projector=projector,
        markov_rank=32 if projector == "dspark" else 0, confidence_head=projector == "dspark",
    )  # fmt: skip
    model = DFlashDraft(cfg).to(DEVICE)
    g = torch.Generator().manual_seed(seed + 1)
    dtype = torch.bfloat16 if autocast else torch.float32
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[:, : seq // 4] = 0
    mask[1, seq * 3 // 4 :] = 0  # a shorter sample: fewer anchors
    anchors = tuple(t.to(DEVICE) for t in sample_anchors(mask, 48, g))
    kwargs = dict(
        input_ids_BL=torch.randint(2, 4096, (2, seq), generator=g).to(DEVICE),
        loss_mask_BL=mask.to(DEVICE),
        hidden_states_BLA=torch.randn(2, seq, 256, generator=g).to(DEVICE, dtype),
        embed_VH=(torch.randn(4096, 256, generator=g) * 0.05).to(DEVICE, dtype),
        lm_head_VH=(torch.randn(4096, 256, generator=g) * 0.05).to(DEVICE, dtype),
        mask_token_id=1, block_size=16, num_anchors=48, gamma=7.0, anchors=anchors,
        chunk_blocks=16, attention=attention, fused=fused,
    )  # fmt: skip
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        if projector == "dflash":
            loss, metrics = dflash_loss(model, **kwargs)
        else:
            final = torch.randn(2, seq, 256, generator=g).to(DEVICE, dtype)
            loss, metrics = dspark_loss(model, **kwargs, target_BLH=final)
    loss.backward()
    grads = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
    return loss.detach().float(), metrics, grads


@pytest.mark.parametrize("projector", ["dflash", "dspark"])
@pytest.mark.parametrize("seq", [700, 333])  # the second length runs the dynamic recompile
def test_dflash_flex_kernel_matches_the_dense_mask(projector, seq):
    ref = _dflash_case(projector, seq, "sdpa", fused=False, autocast=False)
    got = _dflash_case(projector, seq, "flex", fused=False, autocast=False)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[2], ref[2], rtol=1e-3, atol=1e-5)
    for key in ("accuracy", "accept_len", "acc_0", "acc_5"):
        torch.testing.assert_close(got[1][key].float(), ref[1][key].float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("projector", ["dflash", "dspark"])
def test_fused_vocabulary_head_matches_the_checkpointed_chunks(projector):
    ref = _dflash_case(projector, 700, "flex", fused=False, autocast=False)
    got = _dflash_case(projector, 700, "flex", fused=True, autocast=False)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[2], ref[2], rtol=1e-3, atol=1e-5)
    # bf16 autocast (the training setting): within bf16 rounding of the reference
    ref = _dflash_case(projector, 700, "sdpa", fused=False, autocast=True)
    got = _dflash_case(projector, 700, "flex", fused=True, autocast=True)
    torch.testing.assert_close(got[0], ref[0], rtol=2e-2, atol=2e-2)
    assert cosine(got[2], ref[2]) > 0.99


def _eagle3_target():
    """A small Llama-shaped target (vocab 4096, hidden 256) and its random heads, seed 0."""
    from specbus.core.models.target import TargetHeads, TargetInfo

    torch.manual_seed(0)
    vocab, hidden = 4096, 256
    target = TargetInfo(
        name="t", path=".", model_type="llama", num_layers=30, hidden_size=hidden,
        vocab_size=vocab, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, rms_norm_eps=1e-5, hidden_act="silu", max_position_embeddings=8192,
        rope_theta=1e5,
    )  # fmt: skip
    heads = TargetHeads(torch.randn(vocab, hidden) * 0.05, torch.randn(vocab, hidden) * 0.05)
    return vocab, hidden, target, heads


def _eagle3_case(seq, attention, fused, compile_kernels, autocast):
    from specbus.core.config import DraftConfig, StrategyConfig
    from specbus.core.strategies import StepContext, build_strategy

    vocab, hidden, target, heads = _eagle3_target()
    strategy = build_strategy(
        StrategyConfig(attention=attention, draft=DraftConfig(draft_vocab_size=vocab)),
        target,
        heads=heads,
    )
    strategy.fused = lambda batch: fused
    dtype = torch.bfloat16 if autocast else torch.float32
    samples = [
        {
            "input_ids": torch.randint(0, vocab, (n,)),
            "loss_mask": torch.ones(n, dtype=torch.long),
            "hidden_states": torch.randn(n, 3 * hidden).to(dtype),
            "target": torch.randn(n, hidden).to(dtype),
        }
        for n in (seq, seq * 3 // 4)
    ]
    draft = strategy.build_model().to(DEVICE)
    batch = strategy.collate(samples).to(DEVICE)
    was, kernels.ENABLED = kernels.ENABLED, compile_kernels
    try:
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            loss, metrics = strategy.forward_loss(draft, batch, StepContext())
        loss.backward()
    finally:
        kernels.ENABLED = was
    grads = torch.cat([p.grad.flatten().float() for p in draft.parameters() if p.requires_grad])
    return loss.detach().float(), metrics, grads


def test_an_eagle3_step_is_queued_without_waiting_for_the_gpu():
    """`training.overlap_steps` gains only if queuing a step never waits for the device: no
    `.item()`, no blocking copy, no stream sync in staging a host batch (pinned) and in
    `launch_step` (forward, backward, clip, AdamW, the metrics' copy), flash attention and
    the fused loss as on the H200; the figures then come from `result()`."""
    from specbus.core.config import TrainingConfig
    from specbus.core.strategies import StepContext
    from specbus.core.training import build_optimizer, launch_step

    if DEVICE != "cuda":
        pytest.skip("a sync is a CUDA notion (torch.cuda.set_sync_debug_mode)")
    case = _eagle3_step_case(1000)
    strategy, draft, batch = case
    optimizer = build_optimizer(draft, TrainingConfig())

    def launch(step):
        return launch_step(strategy, draft, [batch.to(DEVICE, non_blocking=True)], optimizer,
                           None, grad_clip=1.0, step=StepContext(step, 100),
                           autocast_dtype=torch.bfloat16)  # fmt: skip

    for step in range(3):  # compiles, caches the draft vocabulary's ids
        launch(step).result()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = [launch(3), launch(4)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    results = [p.result() for p in pending]
    assert all(math.isfinite(r.loss) and r.grad_norm > 0 for r in results)
    assert "acc_0" in results[-1].metrics


def _eagle3_step_case(seq):
    """An EAGLE3 strategy with flash TTT attention, its draft on CUDA and a host batch."""
    from specbus.core.config import DraftConfig, StrategyConfig
    from specbus.core.data.vocab import build_vocab_mapping, count_tokens
    from specbus.core.strategies import build_strategy

    vocab, hidden, target, heads = _eagle3_target()
    strategy = build_strategy(
        StrategyConfig(attention="flash", draft=DraftConfig(draft_vocab_size=vocab // 2)),
        target, heads=heads,
    )  # fmt: skip
    samples = [
        {
            "input_ids": torch.randint(0, vocab, (seq,)),
            "loss_mask": torch.ones(seq, dtype=torch.long),
            "hidden_states": torch.randn(seq, 3 * hidden).to(torch.bfloat16),
            "target": torch.randn(seq, hidden).to(torch.bfloat16),
        }
    ]
    pairs = [(s["input_ids"], s["loss_mask"]) for s in samples]
    mapping = build_vocab_mapping(count_tokens(pairs), vocab // 2, vocab)
    draft = strategy.build_model(vocab=mapping).to(DEVICE)
    return strategy, draft, strategy.collate(samples)


def test_eagle3_fused_loss_and_step_masks_match_the_eager_reference():
    flex = "flex" if DEVICE == "cuda" else "sdpa"  # the CPU has no flex backward
    ref = _eagle3_case(1000, "sdpa", fused=False, compile_kernels=False, autocast=False)
    got = _eagle3_case(1000, flex, fused=True, compile_kernels=False, autocast=False)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-5)
    for k in range(7):
        torch.testing.assert_close(
            got[1][f"acceptance_rate_{k}"].float(), ref[1][f"acceptance_rate_{k}"].float(),
            rtol=1e-4, atol=1e-5,
        )  # fmt: skip
        assert abs(float(got[1][f"acc_{k}"]) - float(ref[1][f"acc_{k}"])) < 1e-3
    torch.testing.assert_close(got[2], ref[2], rtol=1e-3, atol=1e-5)


def test_compiled_kernels_match_eager():
    eager = _eagle3_case(1000, "sdpa", fused=True, compile_kernels=False, autocast=False)
    comp = _eagle3_case(1000, "sdpa", fused=True, compile_kernels=True, autocast=False)
    torch.testing.assert_close(comp[0], eager[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comp[2], eager[2], rtol=1e-3, atol=1e-6)
    eager = _eagle3_case(1000, "sdpa", fused=True, compile_kernels=False, autocast=True)
    comp = _eagle3_case(1000, "sdpa", fused=True, compile_kernels=True, autocast=True)
    torch.testing.assert_close(comp[0], eager[0], rtol=1e-2, atol=1e-2)
    assert cosine(comp[2], eager[2]) > 0.999
    if DEVICE == "cuda":
        fns = (
            kernels.rms_norm, kernels.rms_norm_to, kernels.rope, kernels.swiglu,
            eagle3.step_accuracy, eagle3_fused.ttt_step_terms,
            eagle3_fused.logit_teacher_tensors, eagle3_fused.scaled_to,
        )  # fmt: skip
        failed = [f.__name__ for f in fns if f.failed]
        assert not failed, f"compile fell back to eager: {failed}"
