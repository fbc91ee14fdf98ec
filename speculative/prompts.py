"""Turning text into the token ids the runtime decodes, and knowing where to stop."""

from __future__ import annotations

from draftsmith.speculative.errors import InvalidInputError


def encode_prompt(tokenizer, text: str | list[dict], *, chat: bool) -> list[int]:
    """Token ids of a prompt: raw text, or (chat=True) a user message / message list rendered with the
    tokenizer's chat template and the assistant turn opened."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidInputError("--chat needs a tokenizer with a chat template; this one has none")
        messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(text)["input_ids"]
    if not ids:
        raise InvalidInputError("the prompt is empty after tokenization")
    return list(ids)


def stop_token_ids(model, tokenizer) -> list[int]:
    """EOS ids from the tokenizer and the model's generation config (which may list several)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None) if config is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(t) for t in eos)
    return sorted(ids)
