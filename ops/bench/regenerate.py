"""Prompt-only data: let the target write the assistant turns (self-distillation records).

A dataset of questions alone (e.g. source `gsm8k-prompts`) has no assistant span, hence an
all-zero loss mask. `complete_with_target` appends the target's own greedy answer to each
record, so the draft trains on exactly the contexts it will see when drafting for this
target. Greedy, batch 1, `max_new_tokens` per record; generation stops at an end-of-sequence
token. Costly on CPU (one target forward per generated token): meant for small prompt sets or
a GPU. `generate_batched` decodes many prompts at once (left-padded batches, greedy or
sampled) and `token_records` keeps the target's own token ids as pre-tokenised records.
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


def generate_batched(
    target: nn.Module,
    prompts: list,
    *,
    max_new_tokens: int = 256,
    eos_ids: tuple[int, ...] = (),
    pad_id: int = 0,
    batch_size: int = 256,
    temperature: float = 0.0,
    seed: int = 0,
    progress=None,
) -> list[list[int]]:
    """The target's continuations of many prompts (1-D id tensors), `batch_size` at a time.

    Left-padded batches of prompts of similar length (sorted), a KV cache, greedy
    (`temperature` 0) or sampled from the plain softmax at `temperature` (no top-k/top-p),
    seeded. Each continuation stops after its first end-of-sequence token (kept) or at
    `max_new_tokens`. Rounding differs from batch-1 decoding (padding, batch shapes), so a
    greedy continuation can leave `greedy_generate`'s at a near-tie: fine for training data,
    not a reference for lossless checks. Returned in the order of `prompts`.
    """
    import inspect

    import torch
    from specbus.core.eval.speculative import _new_cache

    cache_arg = (
        "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    )

    device = next(target.parameters()).device
    eos = torch.tensor(sorted(set(eos_ids)) or [-1], device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        attn = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            n = len(prompts[i])
            ids[row, width - n :] = torch.as_tensor(prompts[i])
            attn[row, width - n :] = 1
        ids, attn = ids.to(device), attn.to(device)
        done = torch.zeros(len(idx), dtype=torch.bool, device=device)
        tokens = []
        cache = _new_cache()
        step_ids = ids
        with torch.no_grad():
            for _ in range(max_new_tokens):
                positions = (attn.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
                logits = target(
                    input_ids=step_ids, attention_mask=attn, position_ids=positions,
                    use_cache=True, logits_to_keep=1, **{cache_arg: cache},
                ).logits[:, -1].float()  # fmt: skip
                if temperature > 0:
                    probs = torch.softmax(logits / temperature, dim=-1)
                    nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
                else:
                    nxt = logits.argmax(-1)
                nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
                tokens.append(nxt)
                done = done | torch.isin(nxt, eos)
                if bool(done.all()):
                    break
                step_ids = nxt[:, None]
                attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
        block = torch.stack(tokens, dim=1).tolist()
        for row, i in enumerate(idx):
            seq = block[row]
            for j, t in enumerate(seq):
                if t in eos_ids:
                    seq = seq[: j + 1]
                    break
            out[i] = seq
        if progress is not None:
            progress(min(start + batch_size, len(order)), len(order))
    return out


def token_records(prompts: list, completions: list[list[int]]) -> list[Record]:
    """Pre-tokenised training records: prompt ids (unsupervised) + the target's own tokens
    (supervised, its end-of-sequence token included), exactly the ids decoding will see: no
    detokenise/re-tokenise round trip. Empty completions are dropped."""
    records = []
    for prompt, completion in zip(prompts, completions, strict=True):
        if len(completion) < 2:
            continue
        ids = [int(t) for t in prompt] + [int(t) for t in completion]
        records.append({"input_ids": ids, "loss_mask": [0] * len(prompt) + [1] * len(completion)})
    return records
