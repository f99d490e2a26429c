"""Sampled speculative decoding keeps the target's distribution (rejection sampling).

Statistical tests with fixed seeds (deterministic: the same draws on every run): chi-square
of the emitted tokens against the exact distribution, p-value above 1e-3. First on hand-set
distributions (`sampled_accept` alone; a verifier that accepts every draft is caught: it
emits the draft's distribution), then end to end on a tiny target (vocab 10) with a real
EAGLE3 draft (a reduced draft vocabulary) and a real DFlash block draft: every generated
token's probability integral transform under the target's exact conditional is uniform.
"""

from __future__ import annotations

import pytest
import torch
from specbus.core.eval.verify import Sampling, greedy_accept, sampled_accept, warp

V = 10


def chi_square_p(counts: torch.Tensor, expected_p: torch.Tensor, min_expected: float = 5.0):
    """Pearson's chi-square p-value of `counts` against probabilities `expected_p`; bins
    expected below `min_expected` are pooled into one (the test's approximation needs it)."""
    n = float(counts.sum())
    exp = expected_p.double() * n
    small = exp < min_expected
    obs, want = counts.double()[~small], exp[~small]
    if small.any():
        obs = torch.cat([obs, counts.double()[small].sum()[None]])
        want = torch.cat([want, exp[small].sum()[None]])
    stat = float(((obs - want) ** 2 / want).sum())
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def test_greedy_accept_takes_the_longest_agreeing_prefix_and_the_targets_next():
    logits = torch.full((4, V), -1.0)
    for i, t in enumerate([3, 5, 7, 9]):
        logits[i, t] = 1.0
    assert greedy_accept([3, 5, 7], logits) == ([3, 5, 7, 9], 3)
    assert greedy_accept([3, 6, 7], logits) == ([3, 5], 1)
    assert greedy_accept([4, 5, 7], logits) == ([3], 0)
    assert greedy_accept([], logits[:1]) == ([3], 0)


def test_warp_is_temperature_then_the_top_p_nucleus():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    torch.testing.assert_close(warp(logits, 1.0), torch.softmax(logits, -1))
    full = torch.softmax(logits / 0.5, -1)
    nucleus = warp(logits, 0.5, top_p=0.9)
    keep = full[:2] / full[:2].sum()  # 0.867 < 0.9, the second token completes the nucleus
    torch.testing.assert_close(nucleus, torch.cat([keep, torch.zeros(2)]))


def _draws(accept, p_logits, q, n_draws: int, seed: int):
    """The first emitted token of `n_draws` rounds of two drafts drawn from `q`."""
    gen = torch.Generator().manual_seed(seed)
    sampling = Sampling(temperature=1.0, generator=gen)
    counts = torch.zeros(V)
    for _ in range(n_draws):
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        emitted, _ = accept(drafts, [q[0], q[1]], p_logits, sampling)
        counts[emitted[0]] += 1
    return counts


def test_rejection_sampling_emits_the_targets_distribution_not_the_drafts():
    g = torch.Generator().manual_seed(0)
    p_logits = torch.randn(3, V, generator=g) * 1.5
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    p0 = warp(p_logits[0], 1.0)
    assert (p0 - q[0]).abs().sum() > 0.5  # the draft is far from the target
    counts = _draws(sampled_accept, p_logits, q, 6000, seed=1)
    assert chi_square_p(counts, p0) > 1e-3

    def accept_everything(drafts, q_probs, logits, sampling):  # a broken verifier
        return [*drafts, sampling.draw(sampling.target_probs(logits[len(drafts)]))], len(drafts)

    broken = _draws(accept_everything, p_logits, q, 6000, seed=1)
    assert chi_square_p(broken, p0) < 1e-6  # the test has the power to see it


def test_a_draft_equal_to_the_target_is_always_accepted():
    g = torch.Generator().manual_seed(2)
    p_logits = torch.randn(3, V, generator=g)
    sampling = Sampling(temperature=0.7, generator=torch.Generator().manual_seed(3))
    q = [sampling.target_probs(p_logits[i]) for i in range(2)]
    for _ in range(200):
        drafts = [sampling.draw(q[0]), sampling.draw(q[1])]
        emitted, a = sampled_accept(drafts, q, p_logits, sampling)
        assert a == 2 and emitted[:2] == drafts


# ---------------------------------------------------------------- end to end, a tiny target
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 4-layer Llama with a vocab of 10 (peaked enough that drafts are often accepted)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)  # fmt: skip
    path = tmp_path_factory.mktemp("tiny-v10")
    LlamaForCausalLM(cfg).eval().save_pretrained(path, safe_serialization=True)
    return path


def _draft_of(tiny, name: str):
    from specbus.core.config import build_config
    from specbus.core.data.vocab import VocabMapping
    from specbus.core.models.target import load_target_heads, load_target_info
    from specbus.core.strategies.base import build_strategy

    if name == "eagle3":
        tree = {"strategy": {"draft": {"draft_vocab_size": 8}}}
    else:
        tree = {"strategy": {"name": name, "block_size": 3, "num_anchors": 4, "chunk_blocks": 2}}
    cfg = build_config(tree)
    info, heads = load_target_info(tiny), load_target_heads(tiny)
    strategy = build_strategy(cfg.strategy, info, heads=heads)
    # the draft can propose 8 of the 10 tokens: ids 0 and 4 (t2d False) have q = 0
    vocab = VocabMapping.from_d2t([0] * 4 + [1] * 4, V) if name == "eagle3" else None
    torch.manual_seed(5)
    return strategy, strategy.build_model(info, heads, vocab).eval()


def pit_values(target, prompt: list[int], tokens: list[int], temperature: float, gen):
    """Randomised probability integral transforms of `tokens` under the target's sampling
    distribution given everything before each: `F(x - 1) + v * p(x)`, v ~ U(0, 1). Tokens drawn
    from the target's conditionals give i.i.d. U(0, 1) values (sequential PIT)."""
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([prompt + tokens])).logits[0]
    out = []
    for i, x in enumerate(tokens):
        p = warp(logits[len(prompt) - 1 + i], temperature).double()
        below = float(p[:x].sum())
        out.append(below + float(torch.rand(1, generator=gen, dtype=torch.float64)) * float(p[x]))
    return out


@pytest.mark.parametrize("name", ["eagle3", "dflash"])
def test_sampled_speculative_decoding_keeps_the_targets_distribution(tiny, name):
    """Sampled decodes (k = 3 drafts a round; DFlash: blocks of 2) of 8 prompts x 150 tokens:
    the PIT of every generated token under the target's exact conditional is uniform
    (chi-square over 10 bins), and drafts were both accepted and rejected (the rejection
    path ran, the accepted ones count)."""
    from specbus.core.eval.block import block_generate
    from specbus.core.eval.speculative import speculative_generate
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    target = AutoModelForCausalLM.from_pretrained(tiny).eval()
    strategy, draft = _draft_of(tiny, name)
    generate = speculative_generate if name == "eagle3" else block_generate
    temperature, gen = 0.8, torch.Generator().manual_seed(11)
    sampling = Sampling(temperature=temperature, generator=gen)
    u, accepted, drafted = [], 0, 0
    with torch.no_grad():
        for i in range(8):
            prompt = [1, 3 + i % 7, 5 + i % 3]
            out = generate(target, draft, torch.tensor(prompt), aux_layers=strategy.aux_layers,
                           num_draft_tokens=3, max_new_tokens=150, sampling=sampling)  # fmt: skip
            assert len(out.tokens) == 150
            u += pit_values(target, prompt, out.tokens, temperature, gen)
            accepted += sum(out.accepted)
            drafted += len(out.accepted) * (3 if name == "eagle3" else 2)
    assert 0.1 < accepted / drafted < 0.9, (accepted, drafted)
    counts = torch.histc(torch.tensor(u), bins=10, min=0.0, max=1.0)
    assert chi_square_p(counts, torch.full((10,), 0.1)) > 1e-3, counts.tolist()
