"""P-EAGLE: COD sampling, collate (shift + packing), the objective, config refusals, parallel
draft-and-verify decoding (lossless; the decoded rows equal the training rows) and the speculators
export vLLM serves. Parity with speculators 0.9.0 itself (loss, gradients, three AdamW steps,
the export loaded by speculators) is `ops/bench/peagle_parity.py` (docs/peagle.md)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from specbus.core.config import build_config
from specbus.core.errors import ConfigError, ExportError
from specbus.core.eval.peagle import draft_parallel, peagle_generate
from specbus.core.eval.speculative import measure_acceptance
from specbus.core.export.peagle import load_peagle_export
from specbus.core.models.peagle import peagle_allow
from specbus.core.models.target import AuxCapture, load_target_heads, load_target_info
from specbus.core.strategies.base import StepContext, build_strategy
from specbus.core.strategies.peagle import sample_cod

AUX = [2, 0, 1]  # distinct and not ascending: the export reorders them for vLLM


def strategy_of(target_dir, **peagle):
    tree = {"strategy": {"name": "peagle", "draft": {"draft_vocab_size": 96},
                         "peagle": {"num_depths": 4, "max_anchors": 16, **peagle}}}  # fmt: skip
    return build_strategy(build_config(tree).strategy, load_target_info(target_dir),
                          heads=load_target_heads(target_dir), aux_layers=AUX)  # fmt: skip


def vocab(n=128, kept=96):
    from specbus.core.data.vocab import VocabMapping

    ids = torch.randperm(n, generator=torch.Generator().manual_seed(4))[:kept].sort().values
    t2d = torch.zeros(n, dtype=torch.bool)
    t2d[ids] = True
    return VocabMapping(d2t=ids - torch.arange(kept), t2d=t2d)


def samples_for(s, lengths=(20, 13, 1), seed=0):
    g = torch.Generator().manual_seed(seed)
    h = s.target.hidden_size
    return [{"input_ids": torch.randint(3, 128, (n,), generator=g),
             "loss_mask": torch.tensor([0] * min(4, n) + [1] * max(0, n - 4)),
             "hidden_states": torch.randn(n, 3 * h, generator=g),
             "target": torch.randn(n, h, generator=g)} for n in lengths]  # fmt: skip


def test_cod_rows_form_chains_over_supervised_positions():
    mask = (torch.rand(60, generator=torch.Generator().manual_seed(0)) < 0.7).long()
    mask[0] = 0  # a supervised first row would anchor a chain at -1 (the reference does too)
    g = torch.Generator().manual_seed(1)
    anchor, depth = sample_cod(mask, num_depths=5, ratio=0.7, ratio_min=0.2, generator=g)
    assert torch.equal(anchor[depth == 0], torch.arange(60))  # depth 0: every row
    rows = set(zip(anchor.tolist(), depth.tolist(), strict=True))
    seeds = int(mask.sum())
    for d in range(1, 5):
        at = [(a, dd) for a, dd in rows if dd == d]
        assert len(at) <= int((seeds - d) * max(0.7**d, 0.2))
        for a, _ in at:  # its chain exists below it, and its position is supervised
            assert (a, d - 1) in rows and mask[a + d] == 1
    again = sample_cod(mask, 5, 0.7, 0.2, generator=torch.Generator().manual_seed(1))
    assert torch.equal(again[0], anchor) and torch.equal(again[1], depth)
    few = sample_cod(mask, 5, 0.7, 0.2, max_anchors=8, generator=torch.Generator().manual_seed(1))
    assert (few[1] == 1).sum() <= int(7 * 0.7)


def test_the_mask_sees_earlier_context_and_its_own_chain_within_a_sample():
    anchor, depth = torch.tensor([0, 1, 2, 3, 1, 1]), torch.tensor([0, 0, 0, 0, 1, 2])
    doc = torch.tensor([0, 0, 0, 1])
    allow = peagle_allow(anchor, depth, doc)
    assert allow[5].tolist() == [True, True, False, False, True, True]  # depth 2 of chain 1
    assert allow[3].tolist() == [False, False, False, True, False, False]  # another sample
    assert peagle_allow(anchor, depth, doc, sliding_window=2)[5].tolist()[:2] == [False, True]


def test_collate_shifts_each_sample_and_packs_them(tiny_target):
    s = strategy_of(tiny_target)
    raw = samples_for(s)
    batch = s.collate(raw, max_length=16)
    t = batch.tensors
    assert t["input_ids"].shape == (1, 15 + 12)  # 16 -> 15 rows, 13 -> 12, 1 -> none
    assert torch.equal(t["input_ids"][0, :15], raw[0]["input_ids"][1:16])
    assert torch.equal(t["hidden_states"][0, 15:], raw[1]["hidden_states"][:12])
    assert torch.equal(t["target"][0, :15], raw[0]["target"][1:16])
    assert torch.equal(t["loss_mask"][0, :15], raw[0]["loss_mask"][1:16])
    assert t["document_ids"][0].tolist() == [0] * 15 + [1] * 12
    assert batch.num_samples == 3 and batch.num_tokens == 16 + 13 + 1


def test_the_loss_is_the_masked_kl_to_the_teacher_over_every_row(tiny_target):
    s = strategy_of(tiny_target)
    torch.manual_seed(0)
    draft = s.build_model(vocab=vocab())
    batch = s.collate(samples_for(s))
    t = batch.tensors
    anchor, depth = sample_cod(t["loss_mask"][0], 4, 0.7, 0.2, 16, torch.Generator().manual_seed(2))
    t["cod_anchor"], t["cod_depth"] = anchor, depth
    loss, m = s.forward_loss(draft, batch)
    pos = anchor + depth
    ids = torch.where(depth > 0, torch.full_like(pos, s.mask_token_id), t["input_ids"][0, pos])
    allow = peagle_allow(anchor, depth, t["document_ids"][0])
    logits = draft(ids[None], t["hidden_states"][:, pos], depth > 0, pos[None], allow)[0].detach()
    teacher = t["target"][0, pos] @ s.heads.lm_head[draft.t2d].T
    kl = (F.softmax(teacher, -1) * (F.log_softmax(teacher, -1) - F.log_softmax(logits, -1))).sum(-1)
    w = t["loss_mask"][0, pos].float()
    assert float(loss) == pytest.approx(float((kl * w).sum() / (w.sum() + 1e-5)), rel=1e-5)
    assert float(m["denom_0"]) == float(t["loss_mask"].sum()) and float(m["denom_3"]) > 0
    loss.backward()
    assert draft.lm_head.weight.grad is None  # frozen: the target's rows
    assert draft.mask_hidden.grad.abs().sum() > 0 and draft.embed_tokens.weight.grad is not None


def test_rows_are_drawn_per_step_and_micro_batch(tiny_target):
    s = strategy_of(tiny_target)
    draft = s.build_model(vocab=vocab())
    batch = s.collate(samples_for(s))
    a = s.forward_loss(draft, batch, StepContext(0, 10))[0]
    b = s.forward_loss(draft, batch, StepContext(0, 10))[0]  # the step's second micro-batch
    c = strategy_of(tiny_target).forward_loss(draft, batch, StepContext(0, 10))[0]
    assert float(a) != float(b) and float(a) == float(c)


def test_config_refuses_what_peagle_does_not_use(tiny_target):
    info, heads = load_target_info(tiny_target), load_target_heads(tiny_target)

    def build(tree):
        return build_strategy(build_config({"strategy": tree}).strategy, info, heads=heads,
                              aux_layers=AUX)  # fmt: skip

    with pytest.raises(ConfigError, match="strategy.ttt_length"):
        build({"name": "peagle", "ttt_length": 3})
    with pytest.raises(ConfigError, match="strategy.block_size"):
        build({"name": "peagle", "block_size": 8})
    with pytest.raises(ConfigError, match="a vocab mapping is required"):
        build({"name": "peagle", "draft": {"draft_vocab_size": 64}}).build_model()
    with pytest.raises(ConfigError, match="strategy.peagle"):
        build({"name": "dflash", "peagle": {"num_depths": 3}})


@pytest.fixture(scope="module")
def target_lm(tiny_target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target).eval()


@pytest.mark.parametrize("layer_type", ["qwen3", "llama"])
def test_decoded_drafts_are_the_training_rows_argmax(tiny_target, target_lm, layer_type):
    """Parallel drafting after a context in two pieces (cached) gives the argmax of the training
    forward's rows of the chain anchored at the last context row."""
    s = strategy_of(tiny_target, layer_type=layer_type, sliding_window=5)
    torch.manual_seed(3)
    draft = s.build_model(vocab=vocab()).eval()
    ids = torch.randint(3, 128, (1, 12))
    with AuxCapture(target_lm, AUX) as aux, torch.no_grad():
        target_lm(input_ids=ids)
        feats = aux.concat()
    n, k = 11, 4  # rows 0..10 (token j+1, aux j); the chain at anchor 10 drafts 4 tokens
    caches = [[None, None] for _ in draft.layers]
    draft_parallel(draft, caches, feats[:, :6], ids[0, 1:7], 0, k)  # a first round
    drafts = draft_parallel(draft, caches, feats[:, 6:n], ids[0, 7 : n + 1], 6, k)
    anchor = torch.cat([torch.arange(n), torch.full((k - 1,), n - 1)])
    depth = torch.cat([torch.zeros(n, dtype=torch.long), torch.arange(1, k)])
    pos = anchor + depth
    row_ids = torch.where(
        depth > 0, torch.full_like(pos, s.mask_token_id), ids[0, 1:][pos.clamp(max=n - 1)]
    )
    with torch.no_grad():
        allow = peagle_allow(anchor, depth, torch.zeros(n, dtype=torch.long), 5)
        logits = draft(row_ids[None], feats[:, pos.clamp(max=n - 1)], depth > 0, pos[None], allow)
        picked = logits[0, n - 1 :].argmax(-1)
    assert drafts == (picked + draft.d2t[picked]).tolist()


def test_parallel_decoding_is_lossless(tiny_target, target_lm):
    s = strategy_of(tiny_target)
    torch.manual_seed(0)
    draft = s.build_model(vocab=vocab()).eval()
    prompts = [torch.randint(3, 128, (n,)) for n in (5, 11)]
    report = measure_acceptance(target_lm, draft, prompts, aux_layers=AUX, num_draft_tokens=4,
                                max_new_tokens=24, eos_ids=(2,), generate=peagle_generate)  # fmt: skip
    assert report.lossless and report.rounds > 0 and report.accept_length >= 1.0


def test_export_is_the_speculators_format_vllm_reads(tiny_target, tmp_path):
    s = strategy_of(tiny_target)
    torch.manual_seed(1)
    draft = s.build_model(vocab=vocab())
    with torch.no_grad():
        draft.mask_hidden.copy_(torch.arange(96.0).view(1, 1, 96))
    out = s.export(draft, tmp_path / "export", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["mask_token_id"] == 0
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM's ids, ascending
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["sliding_window"] == 2048
    tensors = load_file(str(out / "model.safetensors"))
    assert {"mask_hidden", "embed_tokens.weight", "d2t", "t2d", "lm_head.weight"} <= set(tensors)
    h = 32  # aux blocks in ascending layer order: our [2, 0, 1] -> [0, 1, 2]
    assert tensors["mask_hidden"][0, 0, :h].tolist() == list(range(h, 2 * h))
    assert torch.equal(tensors["fc.weight"][:, 2 * h :], draft.fc.weight[:, :h].detach())
    back = load_peagle_export(out)
    assert back.config.aux_layers == [0, 1, 2] and back.config.num_depths == 4
    assert torch.equal(back.d2t, draft.d2t) and torch.equal(back.t2d, draft.t2d)
    repeated = strategy_of(tiny_target)
    repeated.aux_layers = [1, 1, 0]
    with pytest.raises(ExportError, match="repeat"):
        repeated.export(repeated.build_model(vocab=vocab()), tmp_path / "r")
