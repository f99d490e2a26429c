"""Chat-template facts used to find assistant spans in rendered conversations.

Rendering itself is the tokenizer's own chat template (`apply_chat_template`); this module
only knows, per template family, the assistant header and the end-of-turn marker that delimit
an assistant span (the loss mask covers the text after the header up to and including the
end-of-turn marker), and an optional default system prompt inserted when a conversation has
none (None: leave it to the tokenizer's template, which for SmolLM2 inserts its own).
"""

from __future__ import annotations

from dataclasses import dataclass

from specbus.core.errors import ConfigError


@dataclass(frozen=True)
class ChatTemplate:
    """Where assistant spans start and end in a rendered conversation (the loss mask's markers), and
    the default system prompt."""

    assistant_header: str
    user_header: str
    end_of_turn: str
    system_prompt: str | None = None


TEMPLATES: dict[str, ChatTemplate] = {
    # ChatML: SmolLM2, Qwen2/2.5. The tokenizer template supplies the default system prompt.
    "chatml": ChatTemplate(
        assistant_header="<|im_start|>assistant\n",
        user_header="<|im_start|>user\n",
        end_of_turn="<|im_end|>\n",
    ),
    "llama3": ChatTemplate(
        assistant_header="<|start_header_id|>assistant<|end_header_id|>\n\n",
        user_header="<|start_header_id|>user<|end_header_id|>",
        end_of_turn="<|eot_id|>",
    ),
}


def register_template(name: str, template: ChatTemplate) -> None:
    """Register a chat template under `name`; `ConfigError` for a taken name."""
    if name in TEMPLATES:
        raise ConfigError(f"chat template {name!r} is already registered")
    TEMPLATES[name] = template


def get_template(name: str) -> ChatTemplate:
    """The template `name`; `ConfigError` naming the known ones otherwise."""
    try:
        return TEMPLATES[name]
    except KeyError as e:
        raise ConfigError(f"unknown chat template {name!r}; known: {sorted(TEMPLATES)}") from e


def detect_template(tokenizer) -> ChatTemplate:
    """Pick the template family from the tokenizer's chat template text.

    Raises `ConfigError` when the tokenizer has no chat template or an unknown one.
    """
    text = getattr(tokenizer, "chat_template", None) or ""
    if "<|im_start|>" in text:
        return TEMPLATES["chatml"]
    if "<|start_header_id|>" in text:
        return TEMPLATES["llama3"]
    raise ConfigError(
        "cannot tell the tokenizer's chat template family (no ChatML or Llama-3 markers); "
        "pass a template explicitly (data.chat_template)"
    )
