"""The served-output check of `specbus demo --live` and the closed-loop bench
(`ops.served.lossless_check`): an answer equal to the target's greedy output passes, and one
that departs is reported where it departs, with the target's top-2 logit margin there (a
near-tie in bf16 or a bug)."""

from __future__ import annotations

import pytest
import torch
from specbus.core.config import build_config
from specbus.core.data.templates import detect_template
from specbus.core.data.tokenize import prompt_ids
from specbus.core.eval.speculative import greedy_generate
from specbus.ops.served import Divergence, first_divergence, lossless_check
from specbus.producers.engines.registry import build_engine

MAX_TOKENS = 12


def test_first_divergence_is_the_first_token_whose_prefix_leaves_the_text():
    decode = lambda ids: "".join(chr(97 + i) for i in ids)  # noqa: E731 - one char a token
    assert first_divergence(decode, [0, 1, 2, 3], "abxd") == 2
    assert first_divergence(decode, [0, 1, 2], "abc and more") == 3  # only longer
    assert first_divergence(decode, [0, 1, 2], "") == 0


def test_a_departing_answer_is_reported_at_its_token_with_the_targets_margin(chat_target, tmp_path):
    cfg = build_config({"run": "lossless", "run_dir": str(tmp_path),
                        "target": {"model": str(chat_target), "dtype": "float32"}})  # fmt: skip
    messages = [{"role": "user", "content": "what is 2+3?"}]
    engine = build_engine(cfg.target)
    try:
        tok, eos = engine.tokenizer, tuple(engine.info.eos_token_ids)
        ids = prompt_ids({"messages": messages}, tok, detect_template(tok))
        with torch.no_grad():
            tokens = greedy_generate(engine.model, ids, MAX_TOKENS, eos)
            body = [t for t in tokens if t not in eos]
            assert len(body) > 4, "the tiny target answered too little to alter"
            # the expected margin at token 3, computed here from one forward over the prefix
            logits = engine.model(torch.cat([ids, torch.tensor(tokens[:3])])[None]).logits
            top = logits[0, -1].float().topk(2).values
        want = tok.decode(body, skip_special_tokens=True)
    finally:
        engine.close()
    # the chat target's tokenizer is one character a token: change the 4th character
    wrong = want[:3] + ("#" if want[3] != "#" else "%") + want[4:]
    differ, dtype = lossless_check(cfg, [(messages, want, None), (messages, wrong, None)],
                                   MAX_TOKENS)  # fmt: skip
    assert dtype == "float32"
    assert [(d.probe, d.token) for d in differ] == [(1, 3)]
    assert differ[0].margin == pytest.approx(float(top[0] - top[1]), abs=1e-4)
    assert differ[0].margin >= 0 and isinstance(differ[0], Divergence)
