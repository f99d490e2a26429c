"""EAGLE3 on CUDA: the flex-attention TTT path against the eager one (values, grads, memory)."""

import pytest
import torch
from specbus.core.config import DraftConfig, StrategyConfig
from specbus.core.models.target import TargetHeads, TargetInfo
from specbus.core.strategies import StepContext, build_strategy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def batch_and_draft(seq: int, attention: str, vocab: int = 4096, hidden: int = 576):
    torch.manual_seed(0)
    target = TargetInfo(
        name="t",
        path=".",
        model_type="llama",
        num_layers=30,
        hidden_size=hidden,
        vocab_size=vocab,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        max_position_embeddings=8192,
        rope_theta=1e5,
    )
    heads = TargetHeads(torch.randn(vocab, hidden) * 0.05, torch.randn(vocab, hidden) * 0.05)
    strategy = build_strategy(
        StrategyConfig(attention=attention, draft=DraftConfig(draft_vocab_size=vocab)),
        target,
        heads=heads,
    )
    lengths = (seq, seq * 3 // 4)
    samples = [
        {
            "input_ids": torch.randint(0, vocab, (n,)),
            "loss_mask": torch.ones(n, dtype=torch.long),
            "hidden_states": torch.randn(n, 3 * hidden, dtype=torch.bfloat16),
            "target": torch.randn(n, hidden, dtype=torch.bfloat16),
        }
        for n in lengths
    ]
    draft = strategy.build_model().cuda()
    return strategy, draft, strategy.collate(samples).to("cuda")


def run(strategy, draft, batch):
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, metrics = strategy.forward_loss(draft, batch, StepContext())
    loss.backward()
    grads = torch.cat([p.grad.flatten().float() for p in draft.parameters() if p.requires_grad])
    return loss.detach().float(), metrics, grads, torch.cuda.max_memory_allocated()


@pytest.mark.parametrize(
    "seq, attention, reference",
    [(512, "flex", "sdpa"), (1024, "flash", "flex")],
    ids=["flex-vs-sdpa", "ttt_flash-vs-flex"],  # `-k ttt_flash`: every flash test on CUDA
)
def test_an_attention_matches_its_reference_on_a_padded_batch(seq, attention, reference):
    want = run(*batch_and_draft(seq, reference))
    got = run(*batch_and_draft(seq, attention))
    torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-2)
    for k in range(7):
        assert abs(float(got[1][f"acc_{k}"]) - float(want[1][f"acc_{k}"])) < 0.02
    cos = torch.nn.functional.cosine_similarity(got[2], want[2], dim=0)
    assert cos > 0.99, float(cos)


def test_flex_uses_less_memory_at_long_sequences():
    eager = run(*batch_and_draft(4096, "sdpa"))
    flex = run(*batch_and_draft(4096, "flex"))
    print(
        f"peak bytes at L=4096, B=2, ttt=7: eager {eager[3] / 2**30:.2f} GiB, flex {flex[3] / 2**30:.2f} GiB"
    )
    assert flex[3] < eager[3]


def test_the_long_paths_lm_head_gradient_accumulates_in_fp32_from_bf16_operands():
    """`add_product` on CUDA: acc += a @ b with bf16 operands into an fp32 accumulator, in
    place (cuBLAS's out_dtype, the output aliasing the input), `a` a transposed view as the
    long path passes it; against the float64 product."""
    from specbus.core.strategies.eagle3_long import add_product

    g = torch.Generator(device="cuda").manual_seed(0)
    acc = torch.randn(384, 256, device="cuda", generator=g)
    grad = torch.randn(1000, 384, device="cuda", generator=g).bfloat16()  # [c, Vd]
    normed = torch.randn(1000, 256, device="cuda", generator=g).bfloat16()  # [c, H]
    want = acc.double() + grad.double().T @ normed.double()
    for _ in range(2):  # twice: the sum of two chunks
        add_product(acc, grad.T, normed)
    want = want + grad.double().T @ normed.double()
    assert acc.dtype == torch.float32
    assert float((acc.double() - want).norm() / want.norm()) < 1e-6


def test_the_long_teachers_compiled_rows_equal_the_eager_reduction():
    """`teacher_rows` compiled on CUDA (one read of the bf16 logits for the argmax and the
    log-sum-exp) against the eager fp32 reduction it replaced, on a chunk wider than the
    draft vocabulary and a ragged last chunk (dynamic rows)."""
    from specbus.core.strategies.eagle3_long import teacher_rows

    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.arange(0, 5000, 7, device="cuda")
    for rows in (300, 77):
        logits = (torch.randn(1, rows, 5000, device="cuda", generator=g) * 4).bfloat16()
        got_ids, got_lse, got_draft = teacher_rows(logits, ids)
        full = logits.float()
        assert torch.equal(got_ids, full.argmax(-1))
        want = torch.logsumexp(full.double(), -1, keepdim=True)
        assert got_lse.dtype == torch.float32 and got_lse.shape == (1, rows, 1)
        assert float((got_lse.double() - want).abs().max()) < 1e-5
        assert torch.equal(got_draft, logits.index_select(-1, ids))
    assert not teacher_rows.failed  # it ran compiled, not through the eager fallback
