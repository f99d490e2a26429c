"""DFlash, Domino, DSpark: anchors, block mask, the pure losses, schedule, collate, config
refusals, export round trip, and block draft-and-verify decoding (lossless) on a tiny target."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from specbus.core.config import build_config
from specbus.core.errors import ConfigError, ExportError
from specbus.core.eval import block as block_eval
from specbus.core.eval.block import block_generate
from specbus.core.eval.speculative import greedy_generate, measure_acceptance
from specbus.core.export.dflash import export_dflash, load_dflash_export
from specbus.core.models.dflash import ContextCache
from specbus.core.models.target import load_target_heads, load_target_info
from specbus.core.strategies.base import StepContext, build_strategy
from specbus.core.strategies.dflash import (
    block_mask,
    dflash_loss,
    domino_lambda,
    draft_blocks,
    sample_anchors,
)
from torch import nn

STRATEGIES = ("dflash", "domino", "dspark")


def strategy_of(target_dir, name: str, **keys):
    tree = {
        "strategy": {"name": name, "block_size": 4, "num_anchors": 6, "chunk_blocks": 2, **keys}
    }
    if name == "dspark":
        tree["strategy"].setdefault("dspark", {"markov_rank": 8})
    cfg = build_config(tree)
    info = load_target_info(target_dir)
    return build_strategy(cfg.strategy, info, heads=load_target_heads(target_dir))


def samples_for(strategy, lengths=(20, 13), seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    width = len(strategy.aux_layers) * strategy.target.hidden_size
    for n in lengths:
        s = {
            "input_ids": torch.randint(3, 128, (n,), generator=g),
            "loss_mask": torch.tensor([0] * 5 + [1] * (n - 5)),
            "hidden_states": torch.randn(n, width, generator=g),
        }
        if strategy.name == "dspark":
            s["target"] = torch.randn(n, strategy.target.hidden_size, generator=g)
        out.append(s)
    return out


# -- anchors and masks -------------------------------------------------------------------------


def test_anchors_are_distinct_sorted_supervised_pairs_and_reproducible():
    mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 0, 0, 0, 0, 0, 0]])
    a, keep = sample_anchors(mask, 8, torch.Generator().manual_seed(3))
    assert a.shape == keep.shape == (2, 3)  # width = the most valid positions in a row (3)
    assert keep[0].all() and keep[1].tolist() == [True, False, False]
    assert a[0].tolist() == [1, 2, 5] and a[1, 0] == 0 and a[1, 1:].tolist() == [0, 0]
    b, _ = sample_anchors(mask, 2, torch.Generator().manual_seed(3))
    c, _ = sample_anchors(mask, 2, torch.Generator().manual_seed(3))
    assert torch.equal(b, c) and b.shape == (2, 2)
    assert all(int(t) in (1, 2, 5) for t in b[0]) and b[0, 0] < b[0, 1]
    none, keep_none = sample_anchors(torch.zeros(2, 5, dtype=torch.long), 4)
    assert none.shape == (2, 1) and not keep_none.any()


def test_block_mask_sees_context_before_its_anchor_and_its_own_block_only():
    anchors, keep = torch.tensor([[2, 4]]), torch.tensor([[True, False]])
    allow = block_mask(anchors, keep, seq_len=5, block_size=2)  # [1, 4, 5 + 4]
    first = [[True, True, False, False, False, True, True, False, False]] * 2
    assert allow[0, :2].tolist() == first
    assert not allow[0, 2:].any()  # a block that is not kept sees nothing


# -- the losses --------------------------------------------------------------------------------


class FixedHidden(nn.Module):
    """A stub draft: returns a learnable hidden per query (ignores its inputs)."""

    def __init__(self, q: int, h: int):
        super().__init__()
        self.h = nn.Parameter(torch.randn(1, q, h))

    def forward(self, noise, aux, positions, allow, attention="sdpa"):
        return self.h.expand(noise.shape[0], -1, -1)


def test_dflash_loss_is_the_decayed_weighted_cross_entropy_over_the_weight_sum():
    torch.manual_seed(0)
    seq, k, h, v, gamma = 8, 3, 4, 11, 2.0
    ids = torch.randint(0, v, (1, seq))
    mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1]])
    anchors = (torch.tensor([[1, 5]]), torch.tensor([[True, True]]))
    model, embed, head = FixedHidden(2 * k, h), torch.randn(v, h), torch.randn(v, h)
    loss, m = dflash_loss(
        model, input_ids_BL=ids, loss_mask_BL=mask, hidden_states_BLA=torch.zeros(1, seq, h),
        embed_VH=embed, lm_head_VH=head, mask_token_id=0, block_size=k, gamma=gamma,
        anchors=anchors, chunk_blocks=1,
    )  # fmt: skip
    num = den = 0.0
    logits = (model.h[0] @ head.T).detach()
    for n, a in enumerate((1, 5)):
        for j in range(1, k):
            t = a + j
            if t >= seq or not mask[0, t]:
                continue
            w = math.exp(-(j - 1) / gamma)
            num += w * float(F.cross_entropy(logits[n * k + j][None], ids[0, t][None]))
            den += w
    assert float(loss.detach()) == pytest.approx(num / den, rel=1e-6)
    assert float(m["loss_denom"]) == pytest.approx(den)
    assert set(m) >= {"acc_0", "acc_1", "correct_0", "denom_1", "ploss_0", "accept_len"}


@pytest.mark.parametrize("name", STRATEGIES)
def test_losses_are_pure_and_train_only_the_draft(tiny_target, name):
    strategy = strategy_of(tiny_target, name)
    model = strategy.build_model()
    batch = strategy.collate(samples_for(strategy))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = {k: v.clone() for k, v in batch.tensors.items()}
    step = StepContext(2, 10)
    batch.tensors["anchors"], batch.tensors["anchor_keep"] = sample_anchors(
        batch.tensors["loss_mask"], 6, torch.Generator().manual_seed(1)
    )
    a, ma = strategy.forward_loss(model, batch, step)
    b, mb = strategy.forward_loss(model, batch, step)
    assert torch.equal(a, b) and all(
        torch.equal(torch.as_tensor(ma[k]), torch.as_tensor(mb[k])) for k in ma
    )
    a.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(batch.tensors[k], v) for k, v in inputs.items())
    assert not strategy.heads.lm_head.requires_grad and strategy.heads.lm_head.grad is None


def test_anchor_generator_is_seeded_by_step_and_micro_batch(tiny_target):
    s = strategy_of(tiny_target, "dflash")
    draws = [s.generator(StepContext(step, 10)).initial_seed() for step in (0, 0, 1, 1, 0)]
    assert draws[0] != draws[1] and draws[2] != draws[3]  # two micro-batches of one step differ
    assert draws[4] == draws[0]  # a new step restarts the micro-batch count
    other = strategy_of(tiny_target, "dflash", anchor_seed=7)
    assert other.generator(StepContext(0, 10)).initial_seed() != draws[0]


def test_domino_lambda_decays_linearly_over_the_first_half_then_stays_zero():
    assert domino_lambda(StepContext(0, 100)) == 1.0
    assert domino_lambda(StepContext(25, 100)) == pytest.approx(0.5)
    assert domino_lambda(StepContext(50, 100)) == 0.0 == domino_lambda(StepContext(99, 100))
    assert domino_lambda(StepContext(0, None)) == 0.0  # no schedule: the final loss alone
    assert domino_lambda(StepContext(10, 100), start=0.5, decay_ratio=0.2) == pytest.approx(0.25)


def test_domino_loss_follows_the_step_context(tiny_target):
    s = strategy_of(tiny_target, "domino")
    model = s.build_model()
    batch = s.collate(samples_for(s))
    batch.tensors["anchors"], batch.tensors["anchor_keep"] = sample_anchors(
        batch.tensors["loss_mask"], 6, torch.Generator().manual_seed(1)
    )
    _, start = s.forward_loss(model, batch, StepContext(0, 10))
    _, late = s.forward_loss(model, batch, StepContext(9, 10))
    assert float(start["lambda_base"]) == 1.0 and float(late["lambda_base"]) == 0.0
    assert float(start["loss"]) == pytest.approx(float(start["base_loss"]), rel=1e-6)
    assert float(late["loss"]) == pytest.approx(float(late["final_loss"]), rel=1e-6)


def test_a_batch_without_supervised_pairs_trains_nothing(tiny_target):
    s = strategy_of(tiny_target, "dflash")
    model = s.build_model()
    samples = samples_for(s)
    for x in samples:
        x["loss_mask"] = torch.zeros_like(x["loss_mask"])
    loss, m = s.forward_loss(model, s.collate(samples), StepContext(0, 1))
    loss.backward()
    assert float(loss) == 0.0 and float(m["loss_denom"]) == 0.0


# -- collate and contract ----------------------------------------------------------------------


@pytest.mark.parametrize("name", STRATEGIES)
def test_collate_pads_truncates_and_keeps_the_mask(tiny_target, name):
    s = strategy_of(tiny_target, name)
    samples = samples_for(s, lengths=(20, 13))
    batch = s.collate(samples, max_length=16)
    names = {"input_ids", "loss_mask", "hidden_states"} | (
        {"target"} if name == "dspark" else set()
    )
    assert set(batch.tensors) == names and batch.tensors["input_ids"].shape == (2, 16)
    assert batch.num_tokens == 29 and batch.num_loss_tokens == 11 + 8
    assert (
        batch.tensors["loss_mask"][1, 13:].sum() == 0
        and batch.tensors["input_ids"][1, 13:].sum() == 0
    )
    contract = s.feature_contract()
    assert contract.aux_layers == (2,) and (contract.final_feature == "target") == (
        name == "dspark"
    )
    with pytest.raises(Exception, match="missing"):
        s.collate([{k: v for k, v in samples[0].items() if k != "hidden_states"}])


def test_config_refuses_what_a_strategy_cannot_use(tiny_target):
    info, heads = load_target_info(tiny_target), load_target_heads(tiny_target)

    def build(tree):
        return build_strategy(build_config({"strategy": tree}).strategy, info, heads=heads)

    with pytest.raises(ConfigError, match=r"strategy.ttt_length"):
        build({"name": "dflash", "ttt_length": 3})
    with pytest.raises(ConfigError, match=r"strategy.draft.draft_vocab_size"):
        build({"name": "dspark", "draft": {"draft_vocab_size": 64}})
    with pytest.raises(ConfigError, match=r"strategy.dspark"):
        build({"name": "domino", "dspark": {"markov_rank": 4}})
    with pytest.raises(ConfigError, match=r"strategy.draft.hidden_size"):
        build({"name": "dflash", "draft": {"hidden_size": 64}})
    with pytest.raises(ConfigError, match=r"strategy.mask_token_id"):
        build({"name": "dflash", "mask_token_id": 500})
    with pytest.raises(ConfigError, match=r"strategy.name 'nope' is not registered"):
        build({"name": "nope"})
    s = build({"name": "dflash", "block_size": 8, "loss_gamma": 3.0, "mask_token_id": 5})
    assert s.mask_token_id == 5 and s.build_model().config.block_size == 8
    assert build({"name": "dflash"}).mask_token_id == 0  # the tiny target's pad token


# -- export ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", STRATEGIES)
def test_export_round_trip_with_sglang_names(tiny_target, tmp_path, name):
    s = strategy_of(tiny_target, name)
    draft = s.build_model()
    out = s.export(draft, tmp_path / "export", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [
        "DSparkDraftModel" if name == "dspark" else "DFlashDraftModel"
    ]
    assert config["dflash_config"]["target_layer_ids"] == [2] and config["block_size"] == 4
    if name == "domino":
        assert config["dflash_config"]["projector_type"] == "domino"
    if name == "dspark":
        assert config["markov_rank"] == 8 and config["enable_confidence_head"] is True
    back = load_dflash_export(out)
    assert back.config == draft.config
    for k, v in draft.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    from safetensors.torch import load_file

    names = set(load_file(str(out / "model.safetensors")))
    assert "fc.weight" in names and "layers.0.self_attn.q_norm.weight" in names
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)


def test_export_refuses_what_sglang_cannot_load(tiny_target, tmp_path):
    s = strategy_of(tiny_target, "dspark", dspark={"markov_rank": 0})
    with pytest.raises(ExportError, match="markov_rank"):
        s.export(s.build_model(), tmp_path / "x")
    d = strategy_of(tiny_target, "dflash")
    draft = d.build_model()
    draft.register_buffer("stray", torch.zeros(1))
    with pytest.raises(ExportError, match="extra"):
        export_dflash(draft, tmp_path / "y")
    assert not (tmp_path / "y").exists()


# -- block decoding ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_lm(tiny_target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target).eval()


@pytest.mark.parametrize("name", STRATEGIES)
def test_decoding_a_block_equals_the_training_forward(tiny_target, target_lm, name):
    """The cached decode path (context K/V, then one block) gives the training pass's hidden."""
    s = strategy_of(tiny_target, name)
    torch.manual_seed(0)
    draft = s.build_model().eval()
    ids = torch.randint(3, 128, (1, 12))
    from specbus.core.models.target import AuxCapture

    with AuxCapture(target_lm, s.aux_layers) as aux, torch.no_grad():
        target_lm(input_ids=ids)
        feats = aux.concat()
    anchor = 7
    heads = s.target_heads(torch.device("cpu"), torch.float32)
    trained = draft_blocks(
        draft, input_ids_BL=ids, hidden_states_BLA=feats, anchors_BN=torch.tensor([[anchor]]),
        keep_BN=torch.tensor([[True]]), embed_VH=heads.embed_VH, mask_token_id=s.mask_token_id,
        block_size=4,
    )[0, 0]  # fmt: skip
    cache = ContextCache()
    draft.extend_context(cache, feats[:, :3], start=0)  # in two pieces, as rounds do
    draft.extend_context(cache, feats[:, 3:anchor], start=3)
    block = torch.full((1, 4), s.mask_token_id)
    block[0, 0] = ids[0, anchor]
    decoded = draft.block_hidden(cache, F.embedding(block, heads.embed_VH), anchor)[0]
    torch.testing.assert_close(decoded, trained, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", STRATEGIES)
def test_block_decoding_is_lossless(tiny_target, target_lm, name):
    s = strategy_of(tiny_target, name)
    torch.manual_seed(0)
    draft = s.build_model().eval()
    prompts = [torch.randint(3, 128, (n,)) for n in (5, 11)]
    report = measure_acceptance(
        target_lm, draft, prompts, aux_layers=s.aux_layers, max_new_tokens=24,
        eos_ids=(2,), generate=block_generate,
    )  # fmt: skip
    assert report.lossless and report.rounds > 0 and report.accept_length >= 1.0


def test_an_oracle_block_is_accepted_whole_and_a_lie_where_it_lies(
    tiny_target, target_lm, monkeypatch
):
    s = strategy_of(tiny_target, "dflash")
    draft = s.build_model().eval()
    prompt = torch.randint(3, 128, (6,))
    reference = greedy_generate(target_lm, prompt, 40)
    lie_at = {"pos": None}

    def oracle(draft, target, cache, next_tok, start):
        i = start - prompt.numel() + 1  # the reference index of the token after next_tok
        out = (reference[i : i + 3] + [0, 0, 0])[:3]
        if lie_at["pos"] is not None:
            out[lie_at["pos"]] = (out[lie_at["pos"]] + 1) % 128
        return out

    monkeypatch.setattr(block_eval, "draft_block", oracle)
    spec = block_generate(target_lm, draft, prompt, max_new_tokens=40)
    assert spec.tokens == reference and all(a == 3 for a in spec.accepted[:-1])
    lie_at["pos"] = 1
    spec = block_generate(target_lm, draft, prompt, max_new_tokens=40)
    assert spec.tokens == reference and set(spec.accepted) == {1}
