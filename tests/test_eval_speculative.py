"""Draft-and-verify decoding on a tiny random target: lossless, and acceptance counted right.

Stub drafts with hand-set logits pin the accept/reject logic: an oracle that always proposes
the target's greedy token must have every draft accepted; an oracle that lies at known
positions must be rejected exactly there; a random real draft must still be lossless.
"""

import pytest
import torch
from specbus.core.config import DraftConfig, StrategyConfig
from specbus.core.eval.speculative import (
    LosslessError,
    greedy_generate,
    measure_acceptance,
    speculative_generate,
)
from specbus.core.models.target import TargetInfo
from specbus.core.strategies import build_strategy
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

V = 48


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.3,
    )  # the default 0.02 gives a target that repeats one token
    model = LlamaForCausalLM(cfg).double().eval()
    assert len(set(greedy_generate(model, torch.tensor([3, 17, 5, 9]), 40))) > 10
    return model


class OracleDraft(nn.Module):
    """Proposes the target's greedy next token, except at absolute positions in `lie_at`.

    It reads the tokens it is fed (draft position j embeds token j+1) and asks the target.
    """

    def __init__(self, target, first_token: int, lie_at=()):
        super().__init__()
        self.target, self.first, self.lie_at = target, first_token, set(lie_at)
        self.fc = nn.Linear(1, 1).double()
        self.register_buffer("d2t", torch.zeros(V, dtype=torch.long))
        self.known: dict[int, int] = {}
        self.proposals = 0

    def embed(self, ids):
        return ids[..., None].double()

    def project(self, aux):
        return aux[..., :1] * 0

    def backbone(self, emb, hidden, positions, cache):
        for pos, token in zip(positions[0].tolist(), emb[0, :, 0].long().tolist(), strict=True):
            self.known[pos + 1] = token
        return positions[..., None].double()

    def compute_logits(self, hidden):
        pos = int(hidden[0, -1, 0])  # the output at position p proposes token p + 2
        seq = [self.first] + [self.known[i] for i in range(1, pos + 2)]
        with torch.no_grad():
            token = int(self.target(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
        if pos + 2 in self.lie_at:
            token = (token + 1) % V
        self.proposals += 1
        return nn.functional.one_hot(torch.tensor([[token]]), V).double()


def test_an_oracle_draft_has_every_draft_accepted(target):
    prompt = torch.tensor([3, 17, 5, 9])
    spec = speculative_generate(
        target,
        OracleDraft(target, 3),
        prompt,
        aux_layers=[1, 2, 2],
        num_draft_tokens=3,
        max_new_tokens=40,
    )
    assert spec.tokens == greedy_generate(target, prompt, 40)
    assert spec.accepted[:-1] == [3] * (len(spec.accepted) - 1)
    assert len(spec.accepted) == 10  # 1 prefill token + 3 + 1 per round: 40 tokens in 10 rounds


def test_a_lying_draft_is_rejected_exactly_where_it_lies(target):
    prompt = torch.tensor([3, 17, 5, 9])
    n = len(prompt)
    # Token n is the prefill's; round 1 drafts n+1..n+3. Lying at n+2 accepts 1 (n+1), the
    # target supplies n+2 itself; round 2 then drafts n+3..n+5, all accepted.
    spec = speculative_generate(
        target,
        OracleDraft(target, 3, lie_at=[n + 2]),
        prompt,
        aux_layers=[1, 2, 2],
        num_draft_tokens=3,
        max_new_tokens=12,
    )
    assert spec.tokens == greedy_generate(target, prompt, 12)
    assert spec.accepted[:2] == [1, 3]


def test_real_draft_decoding_is_lossless_with_eos_and_length_limits(target):
    info = TargetInfo.from_hf_config(target.config, name="tiny", path=".")
    strategy = build_strategy(StrategyConfig(draft=DraftConfig(draft_vocab_size=V)), info)
    draft = strategy.build_model().double().eval()
    prompts = [torch.randint(0, V, (n,)) for n in (1, 6, 11)]
    eos = (int(greedy_generate(target, prompts[1], 10)[4]),)  # a token this target does emit
    report = measure_acceptance(
        target,
        draft,
        prompts,
        aux_layers=strategy.aux_layers,
        num_draft_tokens=3,
        max_new_tokens=25,
        eos_ids=eos,
    )
    assert report.lossless and report.prompts == 3 and report.tokens <= 75
    assert report.accept_length == pytest.approx(1 + report.mean_accepted)
    stopped = speculative_generate(
        target, draft, prompts[1], aux_layers=strategy.aux_layers, max_new_tokens=25, eos_ids=eos
    )
    assert stopped.tokens[-1] == eos[0] and len(stopped.tokens) == 5


def test_a_broken_verifier_is_caught_by_the_lossless_check(target, monkeypatch):
    import specbus.core.eval.speculative as spec_mod

    info = TargetInfo.from_hf_config(target.config, name="tiny", path=".")
    strategy = build_strategy(StrategyConfig(draft=DraftConfig(draft_vocab_size=V)), info)
    draft = strategy.build_model().double().eval()
    monkeypatch.setattr(
        spec_mod, "_crop", lambda cache, keep: None
    )  # forget to roll back the KV cache
    with pytest.raises(LosslessError, match="differs from greedy"):
        measure_acceptance(
            target,
            draft,
            [torch.tensor([1, 2, 3])],
            aux_layers=strategy.aux_layers,
            max_new_tokens=20,
        )


def test_batched_generation_equals_batch1_greedy_and_keeps_the_eos(target):
    from specbus.ops.bench.regenerate import generate_batched, token_records

    prompts = [
        torch.tensor([3, 17, 5, 9]),
        torch.tensor([1, 2]),
        torch.tensor([7, 7, 30, 4, 11, 2]),
    ]
    eos = (5,)
    outs = generate_batched(target, prompts, max_new_tokens=24, eos_ids=eos, pad_id=0, batch_size=2)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out == greedy_generate(target, prompt, 24, eos)
    sampled = generate_batched(target, prompts, max_new_tokens=8, pad_id=0, temperature=1.0, seed=3)
    assert sampled == generate_batched(
        target, prompts, max_new_tokens=8, pad_id=0, temperature=1.0, seed=3
    )
    records = token_records(prompts, outs)
    for record, prompt, out in zip(records, prompts, outs, strict=True):
        assert record["input_ids"] == prompt.tolist() + out
        assert record["loss_mask"] == [0] * len(prompt) + [1] * len(out)


def test_a_wrong_memoised_reference_is_decoded_again_and_mismatches_can_be_counted(
    target, monkeypatch
):
    import specbus.core.eval.speculative as spec_mod

    info = TargetInfo.from_hf_config(target.config, name="tiny", path=".")
    strategy = build_strategy(StrategyConfig(draft=DraftConfig(draft_vocab_size=V)), info)
    draft = strategy.build_model().double().eval()
    prompt = torch.tensor([1, 2, 3])
    kwargs = dict(aux_layers=strategy.aux_layers, max_new_tokens=20)
    wrong = {tuple(prompt.tolist()): [0] * 20}  # a faster decode that went elsewhere
    report = measure_acceptance(target, draft, [prompt], references=wrong, **kwargs)
    assert report.lossless and report.mismatches == 0
    assert wrong[tuple(prompt.tolist())] == greedy_generate(target, prompt, 20)
    monkeypatch.setattr(spec_mod, "_crop", lambda cache, keep: None)  # a broken verifier
    report = measure_acceptance(target, draft, [prompt, prompt], strict=False, **kwargs)
    assert report.mismatches == 2 and not report.lossless
