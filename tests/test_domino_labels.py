"""Domino's label layouts (`strategy.domino.shift_label`, `pure_draft_prefix_len`): the labels and
weights of each block position, the pure-draft prefix, decoding that drafts what training
scores, and the export SGLang serves. SpecForge 0.2.0 parity of both layouts (loss, gradients,
three AdamW steps) is `ops/bench/dflash_parity.py` (docs/dflash.md)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from specbus.core.config import build_config
from specbus.core.errors import ConfigError, ExportError
from specbus.core.eval.block import draft_block
from specbus.core.models.dflash import ContextCache
from specbus.core.models.target import AuxCapture
from specbus.core.strategies.dflash import domino_loss, draft_blocks

from tests.test_dflash import strategy_of

LAYOUTS = [(True, 1), (False, 1), (False, 0), (True, 0)]  # (shift_label, pure_draft_prefix_len)


def domino(tiny_target, shift: bool, prefix: int):
    return strategy_of(
        tiny_target, "domino", domino={"shift_label": shift, "pure_draft_prefix_len": prefix}
    )


def test_the_defaults_are_the_reference_recipe_and_impossible_prefixes_are_refused(tiny_target):
    d = build_config({}).strategy.domino
    assert (d.shift_label, d.pure_draft_prefix_len) == (True, 1)
    cfg = domino(tiny_target, True, 1).build_model().config
    assert (cfg.shift_label, cfg.pure_draft_prefix_len, cfg.suffix_start) == (True, 1, 1)
    assert domino(tiny_target, False, 1).build_model().config.suffix_start == 2
    with pytest.raises(ConfigError, match="pure_draft_prefix_len=3"):
        domino(tiny_target, False, 3).build_model()  # block 4: position 4 does not exist


@pytest.mark.parametrize("shift", [True, False])
def test_labels_and_weights_of_each_block_position(tiny_target, shift):
    """With lambda 1 the loss is the base CE: shifted, position k is scored on token anchor+k+1
    with weight exp(-k/gamma); not shifted, on anchor+k for k >= 1 with exp(-(k-1)/gamma)."""
    s = domino(tiny_target, shift, 1)
    torch.manual_seed(0)
    draft = s.build_model()
    seq, k, gamma = 12, 4, 7.0
    ids = torch.randint(3, 128, (1, seq))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1]])
    feats = torch.randn(1, seq, len(s.aux_layers) * s.target.hidden_size)
    anchors = (torch.tensor([[2, 8]]), torch.tensor([[True, True]]))
    heads = s.target_heads(torch.device("cpu"), torch.float32)
    kw = dict(input_ids_BL=ids, hidden_states_BLA=feats, embed_VH=heads.embed_VH,
              mask_token_id=s.mask_token_id, block_size=k)  # fmt: skip
    loss, m = domino_loss(
        draft, **kw, loss_mask_BL=mask, lm_head_VH=heads.lm_head_VH, lambda_base=1.0,
        gamma=gamma, anchors=anchors, chunk_blocks=1,
    )  # fmt: skip
    hidden = draft_blocks(draft, **kw, anchors_BN=anchors[0], keep_BN=anchors[1]).detach()
    logits = hidden[0] @ heads.lm_head_VH.T  # [N, K, V]
    num = den = 0.0
    for n, a in enumerate((2, 8)):
        for pos in range(k):
            label = a + pos + 1 if shift else a + pos
            if (not shift and pos == 0) or label >= seq or not mask[0, label]:
                continue
            w = math.exp(-(pos if shift else pos - 1) / gamma)
            num += w * float(F.cross_entropy(logits[n, pos][None], ids[0, label][None]))
            den += w
    assert float(m["base_loss"]) == pytest.approx(num / (den + 1e-6), rel=1e-5)
    assert float(loss) == pytest.approx(num / (den + 1e-6), rel=1e-5)
    assert float(m["loss_denom"]) == pytest.approx(den, rel=1e-6)


@pytest.mark.parametrize(("shift", "prefix"), LAYOUTS)
def test_the_correction_skips_the_prefix_and_reads_only_earlier_tokens(tiny_target, shift, prefix):
    draft = domino(tiny_target, shift, prefix).build_model()
    torch.manual_seed(1)
    b, n, k, h, v = 1, 2, 4, draft.config.hidden_size, draft.config.vocab_size
    base, hidden, prev = torch.randn(b, n, k, v), torch.randn(b, n, k, h), torch.randn(b, n, k, h)
    with torch.no_grad():
        final = draft.domino_logits(base, hidden, prev)
        start = draft.config.suffix_start
        assert torch.equal(final[:, :, :start], base[:, :, :start])
        assert not torch.allclose(final[:, :, start:], base[:, :, start:])
        for pos in range(start, k):  # the GRU reads tokens 0..pos (shifted) or 0..pos-1
            last = pos if shift else pos - 1
            later = prev.clone()
            later[:, :, last + 1 :] += 1.0
            torch.testing.assert_close(draft.domino_logits(base, hidden, later)[:, :, pos],
                                       final[:, :, pos])  # fmt: skip
            earlier = prev.clone()
            earlier[:, :, last] += 1.0
            assert not torch.allclose(draft.domino_logits(base, hidden, earlier)[:, :, pos],
                                      final[:, :, pos])  # fmt: skip


@pytest.fixture(scope="module")
def target_lm(tiny_target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target).eval()


@pytest.mark.parametrize(("shift", "prefix"), LAYOUTS)
def test_decoding_drafts_the_tokens_training_scores_highest(tiny_target, target_lm, shift, prefix):
    """A decoded block, written back into the sequence as its labels, is the argmax of the
    training forward's final logits at every drafted position (the GRU reads the drafted tokens
    at decode time as it reads the true ones in training)."""
    s = domino(tiny_target, shift, prefix)
    torch.manual_seed(2)
    draft = s.build_model().eval()
    with torch.no_grad():  # a correction large enough to change argmaxes
        draft.embed_proj[2].weight.mul_(200.0)
    heads = s.target_heads(torch.device("cpu"), torch.float32)
    n_ctx = 9
    ids = torch.randint(3, 128, (1, n_ctx + 1))
    with AuxCapture(target_lm, s.aux_layers) as aux, torch.no_grad():
        target_lm(input_ids=ids)
        feats = aux.concat()
    cache = ContextCache()
    draft.extend_context(cache, feats[:, :n_ctx], start=0)
    drafts = draft_block(draft, target_lm, cache, int(ids[0, n_ctx]), n_ctx)
    assert len(drafts) == 3
    full = torch.cat([ids, torch.tensor([drafts])], dim=1)  # [ctx, next_tok, d1, d2, d3]
    aux_full = torch.cat([feats, torch.zeros(1, 3, feats.shape[-1])], dim=1)
    with torch.no_grad():
        hidden = draft_blocks(
            draft, input_ids_BL=full, hidden_states_BLA=aux_full,
            anchors_BN=torch.tensor([[n_ctx]]), keep_BN=torch.tensor([[True]]),
            embed_VH=heads.embed_VH, mask_token_id=s.mask_token_id, block_size=4,
        )  # fmt: skip
        base = hidden @ heads.lm_head_VH.T
        offsets = torch.arange(4) + (1 if shift else 0)
        labels = full[0, (n_ctx + offsets).clamp(max=full.shape[1] - 1)]
        prev = full[0, n_ctx : n_ctx + 4] if shift else labels
        final = draft.domino_logits(base, hidden, F.embedding(prev, heads.embed_VH)[None, None])
    first = 0 if shift else 1
    assert final[0, 0, first : first + 3].argmax(-1).tolist() == drafts
    corrected = [p for p in range(first, first + 3) if p >= draft.config.suffix_start]
    assert corrected and any(
        int(final[0, 0, p].argmax()) != int(base[0, 0, p].argmax()) for p in corrected
    )  # the correction decided at least one draft


def test_export_writes_the_layout_and_refuses_what_sglang_cannot_serve(tiny_target, tmp_path):
    for shift in (True, False):
        s = domino(tiny_target, shift, 1)
        out = s.export(s.build_model(), tmp_path / f"d{shift}", dtype="float32")
        dflash = json.loads((out / "config.json").read_text())["dflash_config"]
        assert (dflash["shift_label"], dflash["pure_draft_prefix_len"]) == (shift, 1)
        from specbus.core.export.dflash import load_dflash_export

        assert load_dflash_export(out).config.shift_label is shift
    s = domino(tiny_target, False, 0)
    with pytest.raises(ExportError, match="pure_draft_prefix_len"):
        s.export(s.build_model(), tmp_path / "p0")
    assert not (tmp_path / "p0").exists()
