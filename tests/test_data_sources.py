"""Dataset sources: packaged GSM8K and chatterbot dialogues, JSONL files, the held-back split."""

import pytest
from specbus.core.data.datasets import (
    StreamedSplit,
    chatterbot_records,
    gsm8k_records,
    iter_source,
    load_jsonl,
    load_source,
    split_holdout,
)
from specbus.core.errors import ConfigError


def test_gsm8k_pairs_each_payload_question_with_its_reference_answer():
    records = gsm8k_records()
    assert len(records) == 1319
    first = records[0]["messages"]
    assert [m["role"] for m in first] == ["user", "assistant"]
    assert first[0]["content"].startswith("Question: Janet") and first[0]["content"].endswith(
        "Answer:"
    )
    assert first[1]["content"].endswith("#### 18") and "<<" not in first[1]["content"]
    prompts = load_source("gsm8k-prompts")
    assert len(prompts) == 1319 and [m["role"] for m in prompts[0]["messages"]] == ["user"]


def test_chatterbot_dialogues_alternate_user_and_assistant():
    records = chatterbot_records()
    assert len(records) > 100
    for record in records:
        roles = [m["role"] for m in record["messages"]]
        assert roles[0] == "user" and all(a != b for a, b in zip(roles, roles[1:], strict=False))
    assert chatterbot_records() == records  # deterministic order


def test_jsonl_loading_names_the_bad_line(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "a"}\n\n{"input_ids": [1, 2]}\n')
    assert load_source(str(good)) == [{"text": "a"}, {"input_ids": [1, 2]}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2"):
        load_jsonl(bad)
    with pytest.raises(ConfigError, match="nope"):
        load_source("nope")


def test_holdout_is_the_tail_and_limit_caps_the_train_part():
    records = [{"text": str(i)} for i in range(10)]
    train, held = split_holdout(records, holdout=3, limit=4)
    assert [r["text"] for r in train] == ["0", "1", "2", "3"]
    assert [r["text"] for r in held] == ["7", "8", "9"]
    assert split_holdout(records, 0) == (records, [])
    with pytest.raises(ConfigError, match="holdout"):
        split_holdout(records, 10)


@pytest.mark.parametrize("limit", [None, 0, 1, 4, 20])
@pytest.mark.parametrize("holdout", [0, 1, 3, 9, 10, 11])
def test_a_streamed_split_is_split_holdout_holding_only_the_tail(holdout, limit):
    """`StreamedSplit` (the feeder's: records streamed from the source) gives what
    `split_holdout` gives on the list, error included, and never holds more than `holdout`
    records: the train records come out before the stream has been read to its end."""
    records = [{"text": str(i)} for i in range(10)]
    read = []

    def source():
        for r in records:
            read.append(r)
            yield r

    split = StreamedSplit(source(), holdout, limit)
    try:
        want = split_holdout(records, holdout, limit)
    except ConfigError:
        with pytest.raises(ConfigError, match="holdout"):
            list(split)
        return
    train = []
    for r in split:
        assert len(read) - len(train) <= holdout + 1  # only the tail (and this one) is held
        train.append(r)
    assert (train, split.held) == want and split.given == len(want[0]) and split.count == 10


def test_a_jsonl_source_streams_its_records(tmp_path):
    path = tmp_path / "late.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n{oops\n')
    records = iter_source(str(path))
    assert next(records) == {"text": "a"} and next(records) == {"text": "b"}
    with pytest.raises(ConfigError, match=r"late.jsonl:3"):  # read only when it is reached
        next(records)


def test_prompt_only_records_get_the_targets_own_answer():
    from specbus.core.data.templates import detect_template
    from specbus.core.data.tokenize import tokenize_record
    from specbus.core.eval.speculative import greedy_generate
    from specbus.core.models.target import load_causal_lm, load_tokenizer, resolve_target_dir
    from specbus.ops.bench.regenerate import complete_with_target

    path = resolve_target_dir("smollm2-135m-instruct")
    tokenizer, model = load_tokenizer(path), load_causal_lm(path)
    template = detect_template(tokenizer)
    prompt = load_source("gsm8k-prompts")[0]
    [record] = complete_with_target(
        [prompt], model, tokenizer, template, max_new_tokens=6, eos_ids=(2,)
    )
    assert (
        record["messages"][:-1] == prompt["messages"]
        and record["messages"][-1]["role"] == "assistant"
    )
    from specbus.core.data.tokenize import prompt_ids

    generated = greedy_generate(model, prompt_ids(prompt, tokenizer, template), 6, (2,))
    expected = tokenizer.decode([t for t in generated if t != 2], skip_special_tokens=True)
    assert record["messages"][-1]["content"] == expected
    sample = tokenize_record(record, tokenizer, template, max_length=512)
    assert sample.loss_mask.sum() >= 6  # the answer (+ end of turn) is now supervised
