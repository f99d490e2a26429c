"""A tiny chat target for CPU runs of live mode: the tests' and the soak benchmark's.

A random 4-layer Llama (vocab 128, context 512) with a real tokenizer: a character-level
WordLevel tokenizer with ChatML special tokens and a ChatML chat template, so the real
`openai` client, the serve's chat template and the intake's vocab prior (a JSONL of chats
tokenised by it) all run their production paths in seconds; and short chats to feed it.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch

SPECIALS = ["<pad>", "<unk>", "<|im_end|>", "<|im_start|>"]  # ids 0..3; eos = <|im_end|> (2)
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_chat_target(path: Path, seed: int = 0) -> Path:
    """A random 4-layer Llama (vocab 128, context 512) with a char-level ChatML tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    assert len(vocab) <= 128
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="<|im_end|>",
        bos_token="<|im_start|>", additional_special_tokens=["<|im_start|>"],
    )  # fmt: skip
    tok.chat_template = CHATML
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=3, eos_token_id=2,
    )  # fmt: skip
    LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def write_chats(path: Path, n: int = 40, seed: int = 0) -> Path:
    """`n` short user/assistant chats (the intake's vocab prior in tests)."""
    import random

    rng = random.Random(seed)
    words = ["apple", "seven", "add", "the", "sum", "of", "is", "12", "and", "30", "clips"]
    with open(path, "w") as f:
        for _ in range(n):
            q = " ".join(rng.choice(words) for _ in range(rng.randint(3, 8)))
            a = " ".join(rng.choice(words) for _ in range(rng.randint(3, 8)))
            f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": a}]}) + "\n")  # fmt: skip
    return path
