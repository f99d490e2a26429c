"""Records -> token ids + assistant-span loss mask.

Accepted record shapes (one JSON object each):
- `{"messages": [{"role": ..., "content": ...}, ...]}` (OpenAI style), or
- `{"conversations": [{"from": "human"|"gpt"|..., "value": ...}, ...]}` (ShareGPT),
- `{"text": "<already rendered conversation>"}` (preformatted),
- `{"input_ids": [...], "loss_mask": [...]}` (pre-tokenised; a missing mask means all ones).

Semantics (SpecForge 0.2.0 `GeneralParser`): roles are normalised (human->user,
gpt->assistant); a leading system message is kept, else the template's default system prompt
(if any) is prepended; leading non-user turns are dropped; the conversation is cut at the
first turn out of order. The rendered text is tokenised without special tokens, truncated to
`max_length` (None: not truncated; with `tokenize_records(..., max_tokens=)`, the feeder's
call, a record over the run's maximum is skipped, truncated or refused: `data.over_length`). Every assistant span — text after the assistant header up to and including the
end-of-turn marker (or the end of text) — is located by regex and mapped to token indices by
tokenising the text prefix before/after it; `last_turn_only` keeps only the last span.

Raises `ConfigError` for a record of none of these shapes or a pre-tokenised record whose
mask length differs from its ids.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from specbus.core.config import DataConfig
from specbus.core.data.templates import ChatTemplate
from specbus.core.errors import ConfigError

log = logging.getLogger(__name__)

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


@dataclass(frozen=True)
class TokenizedSample:
    """`input_ids [L]` int64 and `loss_mask [L]` int64 (1 = supervised)."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor

    def __len__(self) -> int:
        return int(self.input_ids.numel())


def normalize_messages(turns: list[dict[str, Any]], template: ChatTemplate) -> list[dict[str, str]]:
    """Normalise roles/keys and enforce turn order (see module docstring)."""
    turns = [
        {
            "role": _ROLES.get(t.get("role", t.get("from", "")), t.get("role", t.get("from", ""))),
            "content": t.get("content") or t.get("value") or "",
        }
        for t in turns
    ]
    messages: list[dict[str, str]] = []
    if turns and turns[0]["role"] == "system":
        messages.append(turns[0])
        turns = turns[1:]
    elif template.system_prompt:
        messages.append({"role": "system", "content": template.system_prompt})
    while turns and turns[0]["role"] != "user":
        turns = turns[1:]
    for i, turn in enumerate(turns):
        if i > 0:
            prev = turns[i - 1]["role"]
            if turn["role"] == "assistant" and prev not in ("user", "tool"):
                break
            if turn["role"] == "tool" and prev not in ("assistant", "tool"):
                break
        messages.append(turn)
    return messages


def render(
    messages: list[dict[str, str]], tokenizer, *, add_generation_prompt: bool = False
) -> str:
    """The conversation rendered by the tokenizer's own chat template (text, not tokens)."""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def _assistant_pattern(template: ChatTemplate) -> re.Pattern[str]:
    return re.compile(
        re.escape(template.assistant_header)
        + r"([\s\S]*?(?:"
        + re.escape(template.end_of_turn)
        + "|$))",
        re.DOTALL,
    )


def tokenize_text(
    text: str,
    tokenizer,
    template: ChatTemplate,
    *,
    max_length: int | None,
    last_turn_only: bool = False,
) -> TokenizedSample:
    """Tokenise a rendered conversation and mask its assistant spans (cut to `max_length`
    tokens unless None)."""
    input_ids = tokenizer(
        text, max_length=max_length, truncation=max_length is not None, add_special_tokens=False
    )["input_ids"]
    input_ids = torch.tensor(input_ids, dtype=torch.long)
    loss_mask = torch.zeros(len(input_ids), dtype=torch.long)
    matches = list(_assistant_pattern(template).finditer(text))
    if last_turn_only and matches:
        matches = matches[-1:]
    for match in matches:
        start = len(_encode(tokenizer, text[: match.start(1)], max_length))
        end = len(_encode(tokenizer, text[: match.end(1)], max_length))
        start, end = min(start, len(input_ids)), min(end, len(input_ids))
        if start < end:
            loss_mask[start:end] = 1
    return TokenizedSample(input_ids, loss_mask)


def _encode(tokenizer, text: str, max_length: int | None) -> list[int]:
    return tokenizer.encode(
        text, add_special_tokens=False, truncation=max_length is not None, max_length=max_length
    )


def tokenize_record(
    record: dict[str, Any],
    tokenizer,
    template: ChatTemplate,
    *,
    max_length: int | None,
    last_turn_only: bool = False,
) -> TokenizedSample:
    """Turn one record of any accepted shape into a `TokenizedSample` (<= max_length tokens;
    None: the whole record)."""
    if "input_ids" in record:
        ids = torch.as_tensor(record["input_ids"], dtype=torch.long).flatten()[:max_length]
        mask = record.get("loss_mask")
        if mask is None:
            mask_t = torch.ones_like(ids)
        else:
            mask_t = torch.as_tensor(mask, dtype=torch.long).flatten()
            if mask_t.numel() != torch.as_tensor(record["input_ids"]).numel():
                raise ConfigError(
                    f"record input_ids ({torch.as_tensor(record['input_ids']).numel()}) and "
                    f"loss_mask ({mask_t.numel()}) differ in length"
                )
            mask_t = mask_t[:max_length]
        return TokenizedSample(ids, mask_t)
    if "text" in record:
        text = record["text"]
    elif "messages" in record or "conversations" in record:
        turns = record.get("messages", record.get("conversations"))
        text = render(normalize_messages(list(turns), template), tokenizer)
    else:
        raise ConfigError(
            f"record has none of messages/conversations/text/input_ids (keys: {sorted(record)})"
        )
    return tokenize_text(
        text, tokenizer, template, max_length=max_length, last_turn_only=last_turn_only
    )


def prompt_ids(record: dict[str, Any], tokenizer, template: ChatTemplate) -> torch.Tensor:
    """Token ids of a record's conversation up to its last user turn, plus the generation prompt.

    Used by evaluation: the target (and draft) then generate the assistant answer.
    """
    turns = record.get("messages", record.get("conversations"))
    if turns is None:
        raise ConfigError(
            f"a prompt record needs messages or conversations (keys: {sorted(record)})"
        )
    messages = normalize_messages(list(turns), template)
    while messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    text = render(messages, tokenizer, add_generation_prompt=True)
    return torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)


def tokenize_records(
    records: Iterable[dict[str, Any]],
    tokenizer,
    data: DataConfig,
    *,
    max_tokens: int | None = None,
    key: str = "data.max_length",
    source: str = "",
    collect: Callable[[Iterator[TokenizedSample]], Any] = list,
) -> Any:
    """Tokenise with `data.chat_template` (else the tokenizer's own, detected); drops samples
    with fewer than 2 supervised tokens (collate zeroes each sample's last loss position).
    Records are cut to `data.max_length` tokens, unless `max_tokens` is given: then they are
    tokenised whole and one longer than `max_tokens` raises `SampleTooLong` (naming the
    record, its length and `key`, the setting that bounds it). Raises `ConfigError` for a
    record of no known shape. `collect` builds the result from the kept samples as they are
    tokenised, one at a time: `list` (the default), or `core.data.packed.PackedSamples` (the
    feeder: a whole dataset without a tensor object per sample)."""
    from specbus.core.data.templates import detect_template, get_template

    if data.chat_template:
        template = get_template(data.chat_template)
    else:  # pre-tokenised records need no template (a weights-only target has no tokenizer)
        template = detect_template(tokenizer) if tokenizer is not None else None
    if max_tokens is None:
        cut = data.max_length
    else:
        cut = max_tokens if data.over_length == "truncate" else None
    over: list[tuple[int, int]] = []  # (record index, tokens) over max_tokens

    def kept() -> Iterator[TokenizedSample]:
        for i, r in enumerate(records):
            s = tokenize_record(
                r, tokenizer, template, max_length=cut, last_turn_only=data.last_turn_only
            )
            if max_tokens is not None and len(s) > max_tokens:
                over.append((i, len(s)))
            elif int(s.loss_mask.sum()) >= 2:
                yield s

    samples = collect(kept())
    if over and data.over_length == "refuse":  # every record is read first: the error lists all
        raise SampleTooLong(over, max_tokens, key, source)
    if over:  # skip: nothing is fed for them, and the feed says which
        log.warning("%s", SampleTooLong(over, max_tokens, key, source, skipped=True))
    return samples


class SampleTooLong(ConfigError):
    """Records longer than the run's maximum: `over` lists (record index, tokens); `source`
    names where the records come from."""

    def __init__(self, over: list[tuple[int, int]], max_tokens: int, key: str, source: str = "",
                 skipped: bool = False):  # fmt: skip
        index, length = over[0]
        where = f" of {source}" if source else ""
        more = f" (and {len(over) - 1} more over it)" if len(over) > 1 else ""
        what = ("skipped: not fed (data.over_length=skip; truncate cuts them, refuse fails the "
                "feed)" if skipped else "refused, nothing was fed")  # fmt: skip
        super().__init__(
            f"record {index}{where} has {length} tokens, over the run's maximum of "
            f"{max_tokens} ({key}){more}: {what}; raise {key} or shorten the record"
        )
        self.over, self.max_tokens, self.key, self.source = over, max_tokens, key, source
