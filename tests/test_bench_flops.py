"""The benches' FLOP counts (ops/bench/flops.py) against hand-computed numbers for a tiny
config, the Qwen3-8B-shaped target's prefill against its parameter count, the peak table and
MFU."""

from __future__ import annotations

import pytest
from specbus.core.config import build_config
from specbus.ops.bench import flops
from specbus.ops.bench.random_target import QWEN3_8B

# hidden 8, MLP 16, 2 layers, 2 query heads and 1 key/value head of 4, vocabulary 32
TINY = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 32}  # fmt: skip


def strategy(**tree):
    return build_config({"strategy": tree}).strategy


def test_prefill_of_the_tiny_target_by_hand():
    seq = 4
    per_layer = (
        2 * seq * 8 * 8  # q: 8 -> 2 heads x 4
        + 2 * (2 * seq * 8 * 4)  # k, v: 8 -> 1 head x 4
        + 2 * seq * 8 * 8  # o
        + 3 * (2 * seq * 8 * 16)  # gate, up, down
        + 4 * seq * seq * 2 * 4  # scores and values over all 4 x 4 pairs, 2 heads of 4
    )
    assert per_layer == 5120
    assert flops.prefill_flops(TINY, seq) == 2 * 5120
    assert flops.prefill_flops(TINY, seq, lm_head=True) == 2 * 5120 + 2 * seq * 8 * 32


def test_qwen3_8b_prefill_is_two_flops_per_weight_per_token_plus_attention():
    weights = 36 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288)
    assert weights == 6_945_767_424  # the 6.95 B layer weights of docs/benchmarks.md
    attention = 36 * 4 * 2048 * 2048 * 32 * 128  # not halved for the causal mask
    assert flops.prefill_flops(QWEN3_8B, 2048) == 2 * 2048 * weights + attention


def test_eagle3_step_of_the_tiny_target_by_hand():
    seq = 4
    s = strategy(ttt_length=2, draft={"draft_vocab_size": 16})
    teacher = 2 * seq * 8 * 32  # target lm_head, forward only
    fc = 2 * seq * 24 * 8  # 3 aux layers -> 8: forward + the weight's gradient

    def ttt(k):  # q/k/v read the 16-wide [embedding; hidden]
        return (2 * seq * 16 * 8 + 2 * (2 * seq * 16 * 4) + 2 * seq * 8 * 8
                + 3 * (2 * seq * 8 * 16) + 2 * seq * 8 * 16 + 4 * seq * (seq + k) * 2 * 4)  # fmt: skip

    assert (ttt(0), ttt(1)) == (7168, 7296)
    got = flops.eagle3_step_flops(s, TINY, seq)
    assert got.forward == teacher + fc + ttt(0) + ttt(1)
    assert got.backward == fc + 2 * (ttt(0) + ttt(1))
    assert got.total == 48512
    assert flops.train_step_flops(s, TINY, seq) == got


def test_dflash_and_dspark_steps_of_the_tiny_target_by_hand():
    seq, q = 8, 2 * 4  # 6 supervised positions: 5 anchor positions, 2 anchors kept, blocks of 4
    base = dict(block_size=4, num_anchors=2, mask_token_id=1)
    dflash = strategy(name="dflash", **base)
    assert flops.dflash_blocks(dflash, seq, seq - seq // 4) == 2
    fc = 2 * seq * 8 * 8  # one aux layer -> 8: forward + weight gradient
    context_kv = 2 * (2 * seq * 8 * 4)
    layer = (2 * q * 8 * 8 + 2 * (2 * q * 8 * 4) + 2 * q * 8 * 8 + 3 * (2 * q * 8 * 16)
             + 4 * q * (seq + 4) * 2 * 4)  # fmt: skip
    head = 2 * q * 8 * 32  # frozen target lm_head: forward + the input's gradient
    got = flops.dflash_step_flops(dflash, TINY, seq)
    assert got.forward == fc + context_kv + layer + head == 18432
    assert got.backward == fc + 2 * context_kv + 2 * layer + head == 31744

    dspark = strategy(name="dspark", **base, dspark={"markov_rank": 2})
    markov = 2 * q * 2 * 32  # [V, rank] over the block rows, trained with its embedding
    confidence = 2 * q * 8 * 1
    teacher = 2 * min(seq, q) * 8 * 32  # target lm_head per covered position, forward only
    got = flops.train_step_flops(dspark, TINY, seq)
    assert got.forward == 18432 + markov + confidence + teacher
    assert got.backward == 31744 + 2 * markov + 2 * confidence


def test_a_short_sample_has_fewer_blocks_and_the_mean_is_over_every_length():
    s = strategy(name="dflash", block_size=4, num_anchors=512, mask_token_id=1)
    assert flops.dflash_blocks(s, 8, 6) == 5  # anchor positions: 6 supervised - 1
    assert flops.dflash_blocks(s, 8, 0) == 1  # sample_anchors keeps one (empty) block
    mean = flops.mean_sample_flops(s, TINY, 8, 9)
    for key in ("prefill", "train_step", "total"):
        pair = [flops.sample_flops(s, TINY, n)[key] for n in (8, 9)]
        assert mean[key] == sum(pair) / 2


def test_domino_and_mixtures_of_experts_have_no_flop_model():
    with pytest.raises(ValueError, match="domino"):
        flops.train_step_flops(strategy(name="domino", mask_token_id=1), TINY, 8)
    with pytest.raises(ValueError, match="num_experts"):
        flops.prefill_flops({**TINY, "num_experts": 8}, 8)
    no_head_dim = {k: v for k, v in TINY.items() if k != "head_dim"}
    assert flops.target_shape(no_head_dim).head_dim == 4  # hidden / heads


def test_peaks_by_device_name_the_override_and_mfu(monkeypatch):
    monkeypatch.delenv(flops.PEAK_ENV, raising=False)
    assert flops.peak_flops("NVIDIA H200")[0] == 989.5e12
    assert flops.peak_flops("NVIDIA H100 80GB HBM3")[0] == 989.5e12
    assert flops.peak_flops("NVIDIA H100 PCIe")[0] == 756.5e12
    assert flops.peak_flops("cpu") is None
    assert flops.flops_section("cpu")["peak_flops"] is None
    assert flops.mfu(2e12, 3.0, None) is None
    assert flops.mfu(2e12, 3.0, 10e12) == pytest.approx(0.6)
    monkeypatch.setenv(flops.PEAK_ENV, "500")
    assert flops.peak_flops("cpu") == (500e12, f"${flops.PEAK_ENV}")


def test_flop_counts_print_with_their_prefix():
    assert flops.fmt_flops(30.92e12) == "30.92 TFLOP"
    assert flops.fmt_flops(539_475_968) == "539.5 MFLOP"
    assert flops.describe({"prefill": 1e12, "train_step": 2e12, "total": 3e12}) == (
        "prefill 1 TFLOP, train step 2 TFLOP, total 3 TFLOP"
    )
