"""Prompt-only data: let the target write the assistant turns (self-distillation records).

A dataset of questions alone (e.g. source `gsm8k-prompts`) has no assistant span, hence an
all-zero loss mask. `complete_with_target` appends the target's own greedy answer to each
record, so the draft trains on exactly the contexts it will see when drafting for this
target. Greedy, batch 1, `max_new_tokens` per record; generation stops at an end-of-sequence
token. Costly on CPU (one target forward per generated token): meant for small prompt sets or
a GPU.
"""

from __future__ import annotations

from specbus.core.data.datasets import Record
from specbus.core.data.templates import ChatTemplate
from specbus.core.data.tokenize import prompt_ids
from torch import nn


def complete_with_target(
    records: list[Record],
    target: nn.Module,
    tokenizer,
    template: ChatTemplate,
    *,
    max_new_tokens: int = 256,
    eos_ids: tuple[int, ...] = (),
) -> list[Record]:
    """Each record's conversation (up to its last user turn) + the target's greedy answer."""
    from specbus.core.eval.speculative import greedy_generate

    out = []
    for record in records:
        turns = list(record.get("messages", record.get("conversations", [])))
        while turns and turns[-1].get("role", turns[-1].get("from")) in ("assistant", "gpt"):
            turns = turns[:-1]
        tokens = greedy_generate(
            target, prompt_ids({"messages": turns}, tokenizer, template), max_new_tokens, eos_ids
        )
        if tokens and tokens[-1] in eos_ids:
            tokens = tokens[:-1]  # the template adds its own end-of-turn marker
        answer = tokenizer.decode(tokens, skip_special_tokens=True)
        out.append({"messages": [*turns, {"role": "assistant", "content": answer}]})
    return out
