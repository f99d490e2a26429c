"""Loss masks on the SmolLM2 chat template (the embedded default target's real tokenizer)."""

from functools import lru_cache

import pytest
import torch
from specbus.core.data.templates import TEMPLATES, detect_template
from specbus.core.data.tokenize import prompt_ids, tokenize_record
from specbus.core.errors import ConfigError
from specbus.core.models.target import load_tokenizer, resolve_target_dir

TWO_TURNS = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello there"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]
SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@lru_cache(maxsize=1)
def tokenizer():
    return load_tokenizer(resolve_target_dir("smollm2-135m-instruct"))


def spans(sample):
    """Decoded text of each contiguous run of supervised tokens."""
    out, run = [], []
    for token, m in zip(sample.input_ids.tolist(), sample.loss_mask.tolist(), strict=True):
        if m:
            run.append(token)
        elif run:
            out.append(tokenizer().decode(run))
            run = []
    if run:
        out.append(tokenizer().decode(run))
    return out


def tok(record, **kw):
    return tokenize_record(
        record,
        tokenizer(),
        detect_template(tokenizer()),
        max_length=kw.pop("max_length", 512),
        **kw,
    )


def test_multi_turn_golden_mask():
    sample = tok({"messages": TWO_TURNS})
    # Golden: the template's default system turn (19+2 tokens), then the turns; supervised are
    # exactly the assistant contents with their end-of-turn marker and newline.
    assert sample.loss_mask.nonzero().flatten().tolist() == [31, 32, 33, 34, 48, 49, 50]
    assert len(sample) == 51
    assert spans(sample) == ["Hello there<|im_end|>\n", "4<|im_end|>\n"]
    assert tokenizer().decode(sample.input_ids[:21]) == SMOL_SYSTEM
    assert tokenizer().decode(sample.input_ids[27:31]) == "<|im_start|>assistant\n"


def test_explicit_system_prompt_replaces_the_default_and_is_not_supervised():
    sample = tok({"messages": [{"role": "system", "content": "Be terse."}, *TWO_TURNS]})
    text = tokenizer().decode(sample.input_ids)
    assert text.startswith("<|im_start|>system\nBe terse.<|im_end|>\n") and "SmolLM" not in text
    assert spans(sample) == ["Hello there<|im_end|>\n", "4<|im_end|>\n"]


def test_last_turn_only():
    sample = tok({"messages": TWO_TURNS}, last_turn_only=True)
    assert spans(sample) == ["4<|im_end|>\n"]
    assert sample.input_ids.tolist() == tok({"messages": TWO_TURNS}).input_ids.tolist()


def test_truncation_cuts_ids_and_mask_together():
    full = tok({"messages": TWO_TURNS})
    cut = tok({"messages": TWO_TURNS}, max_length=33)
    assert len(cut) == 33 and cut.input_ids.tolist() == full.input_ids[:33].tolist()
    assert cut.loss_mask.tolist() == full.loss_mask[:33].tolist()
    assert spans(cut) == ["Hello there"]
    assert tok({"messages": TWO_TURNS}, max_length=20).loss_mask.sum() == 0


def test_sharegpt_preformatted_and_pretokenised_inputs_agree():
    messages = tok({"messages": TWO_TURNS})
    sharegpt = tok(
        {
            "conversations": [
                {"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]}
                for m in TWO_TURNS
            ]
        }
    )
    text = tokenizer().apply_chat_template(TWO_TURNS, tokenize=False)
    pre = tok({"text": text})
    ids = tok({"input_ids": messages.input_ids.tolist(), "loss_mask": messages.loss_mask.tolist()})
    for other in (sharegpt, pre, ids):
        assert other.input_ids.tolist() == messages.input_ids.tolist()
        assert other.loss_mask.tolist() == messages.loss_mask.tolist()
    assert tok({"input_ids": [5, 6, 7]}).loss_mask.tolist() == [
        1,
        1,
        1,
    ]  # live traffic: all supervised
    with pytest.raises(ConfigError, match="differ in length"):
        tok({"input_ids": [5, 6, 7], "loss_mask": [1, 0]})
    with pytest.raises(ConfigError, match="none of"):
        tok({"prompt": "hi"})


def test_turns_out_of_order_are_cut_and_leading_assistant_dropped():
    sample = tok(
        {
            "messages": [
                {"role": "assistant", "content": "ignored"},
                TWO_TURNS[0],
                TWO_TURNS[1],
                {"role": "assistant", "content": "twice"},
                *TWO_TURNS[2:],
            ]
        }
    )
    text = tokenizer().decode(sample.input_ids)
    assert "ignored" not in text and "twice" not in text and "2+2?" not in text
    assert spans(sample) == ["Hello there<|im_end|>\n"]


def test_prompt_ids_end_with_the_generation_prompt():
    ids = prompt_ids({"messages": TWO_TURNS[:3] + [TWO_TURNS[3]]}, tokenizer(), TEMPLATES["chatml"])
    text = tokenizer().decode(ids)
    assert (
        text.endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
        and "\n4<|im_end|>" not in text
    )
    assert ids.dtype == torch.long


def test_detect_template_refuses_an_unknown_family():
    class NoTemplate:
        chat_template = "{{ messages }}"

    with pytest.raises(ConfigError, match="chat template"):
        detect_template(NoTemplate())
