"""Conversations as token ids and a loss mask, rendered with the tokenizer's own chat template.

The mask is 1 exactly on what the model should learn to produce: the content of every assistant
message and the end-of-turn token(s) that close it (`<|im_end|>` for ChatML). Role headers
("<|im_start|>assistant\\n"), user and system turns, and whatever whitespace the template adds after
the end-of-turn token are 0. The model never emits that whitespace: generation stops at the end token.

Templates are treated as black boxes. The boundaries of assistant turn i come from rendering prefixes
of the conversation:

    start = tokens of messages[:i] with the generation prompt (the assistant header opened)
    end   = tokens of messages[:i + 1] (the turn closed), less the template's trailing whitespace

which is only sound if the template is prefix-stable: every prefix renders to a prefix of the whole
conversation's tokens. That is checked, and a template that is not (one that renders the last turn
differently, or drops earlier reasoning) is refused rather than masked wrongly.
"""

from __future__ import annotations

import sys
from hashlib import sha256

import datasets

from draftsmith.speculative.errors import InvalidInputError, first_line
from draftsmith.speculative.loading import tokenizer_hash
from draftsmith.speculative.prompts import encode_prompt

_ROLES = ("system", "user", "assistant")


def render_conversation(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of the whole conversation, without a generation prompt at the end.

    Both lists have the same length; loss_mask[t] is 1 on assistant content and end-of-turn tokens.
    """
    _check_messages(tokenizer, messages)
    full = _tokenize(tokenizer, _render(tokenizer, messages, opened=False))
    mask = [0] * len(full)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, end = _turn_span(tokenizer, messages, i, full)
        mask[start:end] = [1] * (end - start)
    return full, mask


def render_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` with the assistant turn opened: what the runtime decodes from.

    The same ids `draftsmith generate --chat` feeds the target (speculative.prompts.encode_prompt).
    """
    _check_messages(tokenizer, messages)
    return encode_prompt(tokenizer, messages, chat=True)


def tokenize_dataset(dataset: datasets.Dataset, tokenizer, max_length: int) -> datasets.Dataset:
    """`dataset` plus columns input_ids, loss_mask and prompt_len, truncated to `max_length` tokens.

    prompt_len is the number of tokens before the first masked one. Rows that already carry
    input_ids and loss_mask (regenerate's output: exactly the ids the target produced) are truncated,
    not re-rendered. Rows left with no masked token (no assistant turn, or one that starts past
    `max_length`) are dropped, and how many is said in one line on stderr.
    """
    if not isinstance(max_length, int) or max_length < 1:
        raise InvalidInputError(f"max_length must be a positive integer, got {max_length!r}")
    if "messages" not in dataset.column_names and "input_ids" not in dataset.column_names:
        raise InvalidInputError("the dataset has neither a messages nor an input_ids column to tokenize")
    pretokenized = {"input_ids", "loss_mask"} <= set(dataset.column_names)

    def tokenize(row: dict) -> dict:
        if pretokenized:
            ids, mask = list(row["input_ids"]), list(row["loss_mask"])
        else:
            ids, mask = render_conversation(tokenizer, row["messages"])
        ids, mask = ids[:max_length], mask[:max_length]
        first = next((t for t, m in enumerate(mask) if m), len(mask))
        return {"input_ids": ids, "loss_mask": mask, "prompt_len": first}

    fingerprint = sha256(
        f"{dataset._fingerprint}|{tokenizer_hash(tokenizer)}|{max_length}|render-v1".encode()
    ).hexdigest()[:32]
    features = dataset.features.copy()
    features.update(TOKEN_FEATURES)
    tokenized = dataset.map(tokenize, features=features, new_fingerprint=fingerprint, desc="tokenizing")
    kept = tokenized.filter(lambda row: row["prompt_len"] < len(row["loss_mask"]), desc="dropping unmasked rows")
    dropped = len(tokenized) - len(kept)
    if dropped:
        print(f"tokenize: dropped {dropped} of {len(tokenized)} rows with no assistant tokens within "
              f"{max_length} tokens", file=sys.stderr)
    return kept


def render_user_turn(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` (possibly none) followed by an opened user turn, with no content yet.

    From here an instruction-tuned model writes a user's request itself, in the style of the requests
    it was tuned on (Magpie, Xu et al. 2024): the way draftsmith.data.self_prompts gets prompts from the
    target alone. The template is rendered with a placeholder user message and cut before it; refused
    with a one-line error when the template does not show the placeholder verbatim, or when the cut
    text does not tokenize to a prefix of the whole rendering.
    """
    if messages:
        _check_messages(tokenizer, messages)
    elif not getattr(tokenizer, "chat_template", None):
        raise InvalidInputError("rendering conversations needs a tokenizer with a chat template; this one has none")
    whole = _render(tokenizer, list(messages) + [{"role": "user", "content": _PLACEHOLDER}], opened=False)
    cut = whole.find(_PLACEHOLDER)
    if cut < 0:
        raise InvalidInputError("the chat template does not render a user message verbatim, so a user turn "
                                "cannot be opened for the target to write")
    ids = _tokenize(tokenizer, whole[:cut])
    if not ids or ids != _tokenize(tokenizer, whole)[: len(ids)]:
        raise _not_prefix_stable(len(messages) + 1, "with a user turn opened")
    return ids


_PLACEHOLDER = "DRAFTSMITH_USER_TURN_7f3a"

TOKEN_FEATURES = {
    "input_ids": datasets.List(datasets.Value("int32")),
    "loss_mask": datasets.List(datasets.Value("int8")),
    "prompt_len": datasets.Value("int32"),
}


def _turn_span(tokenizer, messages: list[dict], i: int, full: list[int]) -> tuple[int, int]:
    """[start, end) token span of assistant message i within `full`: content + end-of-turn token(s)."""
    if i == 0:
        raise InvalidInputError("the conversation starts with an assistant message; "
                                "the chat template cannot render its header alone")
    opened_text = _render(tokenizer, messages[:i], opened=True)
    closed_text = _render(tokenizer, messages[: i + 1], opened=False)
    opened = _prefix_tokens(tokenizer, opened_text, full, i, "with the assistant turn opened")
    closed = _prefix_tokens(tokenizer, closed_text, full, i + 1, "")
    if not closed_text.startswith(opened_text) or len(closed) < len(opened):
        raise _not_prefix_stable(i, "with the assistant turn opened")
    cut = _end_of_turn(closed_text, len(opened_text), messages[i]["content"])
    if cut < len(closed_text):
        trimmed = _tokenize(tokenizer, closed_text[:cut])
        if trimmed == full[: len(trimmed)] and len(trimmed) >= len(opened):
            return len(opened), len(trimmed)
        # The trailing whitespace merged into the end token; keep the whole closed turn.
    return len(opened), len(closed)


def _end_of_turn(closed_text: str, turn_start: int, content: str) -> int:
    """Character offset where the assistant turn ends: after the end-of-turn marker, before the
    template's trailing whitespace. A template with no marker after the content (the turn ends in
    whitespace alone) keeps that whitespace: it is then what tells the model the turn is over."""
    turn = closed_text[turn_start:]
    found = turn.find(content) if content else -1
    after_content = found + len(content) if found >= 0 else 0
    tail = turn[after_content:]
    if not tail.strip():
        return len(closed_text)
    return len(closed_text) - (len(tail) - len(tail.rstrip()))


def _prefix_tokens(tokenizer, text: str, full: list[int], n: int, how: str) -> list[int]:
    ids = _tokenize(tokenizer, text)
    if ids != full[: len(ids)]:
        raise _not_prefix_stable(n, how)
    return ids


def _not_prefix_stable(n: int, how: str) -> InvalidInputError:
    how = f" {how}" if how else ""
    return InvalidInputError(
        f"the chat template is not prefix-stable: the first {n} message(s){how} do not render to a prefix "
        "of the whole conversation, so assistant turns cannot be masked"
    )


def _render(tokenizer, messages: list[dict], *, opened: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=opened)
    except Exception as exc:  # jinja raises many kinds (TemplateError, TypeError, ...)
        raise InvalidInputError(f"the chat template failed on this conversation: {first_line(exc)}") from exc


def _tokenize(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _check_messages(tokenizer, messages) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidInputError("rendering conversations needs a tokenizer with a chat template; this one has none")
    if not isinstance(messages, list) or not messages:
        raise InvalidInputError("a conversation must be a non-empty list of messages")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
            raise InvalidInputError(f"message {k} needs a role (system/user/assistant) and a string content")
