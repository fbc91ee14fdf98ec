"""Chat-template rendering: the loss mask covers exactly assistant content and its end-of-turn token."""

import datasets
import pytest

from draftsmith.data.prompts import ColumnMap, load_conversations
from draftsmith.data.render import render_conversation, render_prompt, tokenize_dataset
from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.tiny import tiny_tokenizer

ONE_TURN = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello!"}]
MULTI_TURN = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "and 3+3?"},
    {"role": "assistant", "content": "6, of course"},
]
NOT_PREFIX_STABLE = {
    # Marks the last message, so a prefix of the conversation renders differently from the whole.
    "marks-last": "{% for m in messages %}{% if loop.last %}[last]{% endif %}"
                  "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    # Renders only the last message.
    "last-only": "{{ '<|im_start|>' + messages[-1]['role'] + '\n' + messages[-1]['content'] + '<|im_end|>' }}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
}


def masked_text(tokenizer, ids, mask):
    return tokenizer.decode([t for t, m in zip(ids, mask) if m])


def masked_runs(ids, mask):
    """The masked tokens as maximal runs of consecutive positions."""
    runs, current = [], []
    for t, m in zip(ids, mask):
        if m:
            current.append(t)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


@pytest.mark.parametrize("messages", [ONE_TURN, MULTI_TURN], ids=["one-turn", "multi-turn"])
def test_mask_is_assistant_content_and_end_token(tokenizer, messages):
    ids, mask = render_conversation(tokenizer, messages)
    full_text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert ids == tokenizer(full_text, add_special_tokens=False)["input_ids"]
    assert len(mask) == len(ids) and set(mask) <= {0, 1}
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    assert masked_text(tokenizer, ids, mask) == "".join(a + "<|im_end|>" for a in answers)
    runs = masked_runs(ids, mask)
    assert [tokenizer.decode(r) for r in runs] == [a + "<|im_end|>" for a in answers]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    for i, m in enumerate(mask):
        if m and ids[i] == end:  # the template's newline after the end token is not learned
            assert ids[i + 1: i + 1 + len(newline)] == newline and mask[i + 1] == 0
    header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    first = mask.index(1)
    assert ids[first - len(header): first] == header


def test_system_and_user_tokens_are_not_masked(tokenizer):
    ids, mask = render_conversation(tokenizer, MULTI_TURN)
    prompt = render_prompt(tokenizer, MULTI_TURN[:2])
    assert ids[: len(prompt)] == prompt
    assert sum(mask[: len(prompt)]) == 0  # system + first user turn + the opened assistant header
    answer = tokenizer("4<|im_end|>", add_special_tokens=False)["input_ids"]
    assert ids[len(prompt): len(prompt) + len(answer)] == answer
    assert mask[len(prompt): len(prompt) + len(answer)] == [1] * len(answer)


def test_render_prompt_opens_the_assistant_turn(tokenizer):
    prompt = render_prompt(tokenizer, ONE_TURN[:1])
    assert tokenizer.decode(prompt) == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    ids, mask = render_conversation(tokenizer, ONE_TURN)
    assert ids[: len(prompt)] == prompt and mask.index(1) == len(prompt)


def test_template_without_end_marker_keeps_the_closing_newline():
    tok = tiny_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}### assistant: {% endif %}"
    )
    ids, mask = render_conversation(tok, ONE_TURN)
    assert masked_text(tok, ids, mask) == "hello!\n"  # the newline is what ends the turn here


@pytest.mark.parametrize("template", NOT_PREFIX_STABLE.values(), ids=NOT_PREFIX_STABLE.keys())
def test_template_that_is_not_prefix_stable_is_refused(template):
    tok = tiny_tokenizer()
    tok.chat_template = template
    with pytest.raises(InvalidInputError, match="not prefix-stable") as info:
        render_conversation(tok, MULTI_TURN)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty"),
    ([{"role": "user"}], "message 0"),
    ([{"role": "robot", "content": "x"}], "message 0"),
    ([{"role": "assistant", "content": "x"}], "starts with an assistant"),
])
def test_bad_conversations_are_one_line_errors(tokenizer, messages, match):
    with pytest.raises(InvalidInputError, match=match) as info:
        render_conversation(tokenizer, messages)
    assert "\n" not in str(info.value)


def test_tokenizer_without_template_is_refused():
    tok = tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(InvalidInputError, match="chat template"):
        render_prompt(tok, ONE_TURN[:1])


def test_tokenize_dataset_truncates_and_drops_unmasked_rows(tokenizer, tmp_path, capsys):
    path = tmp_path / "chat.jsonl"
    datasets.Dataset.from_list([{"messages": m} for m in (ONE_TURN, MULTI_TURN, ONE_TURN[:1])]).to_json(str(path))
    conversations = load_conversations(path)
    prompt_len = len(render_prompt(tokenizer, ONE_TURN[:1]))
    out = tokenize_dataset(conversations, tokenizer, max_length=prompt_len + 3)
    assert "dropped 2 of 3 rows" in capsys.readouterr().err  # the user-only row, and MULTI_TURN's long prompt
    assert len(out) == 1
    row = out[0]
    assert len(row["input_ids"]) == len(row["loss_mask"]) == prompt_len + 3
    assert row["prompt_len"] == prompt_len and row["loss_mask"][prompt_len:] == [1, 1, 1]
    full, _ = render_conversation(tokenizer, ONE_TURN)
    assert row["input_ids"] == full[: prompt_len + 3]
    assert row["id"] == "0" and row["messages"] == ONE_TURN  # the input columns are kept


def test_tokenize_dataset_keeps_given_ids(tokenizer):
    # Regenerated rows carry the target's own ids; they are truncated, never re-rendered.
    rows = [{"messages": ONE_TURN, "input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 1], "prompt_len": 2}]
    out = tokenize_dataset(datasets.Dataset.from_list(rows), tokenizer, max_length=4)
    assert out[0]["input_ids"] == [5, 6, 7, 8] and out[0]["loss_mask"] == [0, 0, 1, 1] and out[0]["prompt_len"] == 2


def test_tokenize_dataset_rejects_bad_max_length(tokenizer):
    with pytest.raises(InvalidInputError, match="max_length"):
        tokenize_dataset(datasets.Dataset.from_list([{"messages": ONE_TURN}]), tokenizer, max_length=0)


def test_prompt_files_in_every_format(tmp_path):
    # data.prompts feeds render; kept here from an earlier draft of this file (belongs in test_prompts.py).
    rows = [{"question": "Why?", "topic": "a", "answer": "Because."}, {"question": "How?", "topic": "b", "answer": "So."}]
    ds = datasets.Dataset.from_list(rows)
    ds.to_json(str(tmp_path / "q.jsonl"))
    ds.to_csv(str(tmp_path / "q.csv"))
    ds.to_parquet(str(tmp_path / "q.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    for name in ["q.jsonl", "q.csv", "q.parquet", "saved"]:
        loaded = load_conversations(tmp_path / name, ColumnMap(category="topic"))
        assert loaded[0]["messages"] == [{"role": "user", "content": "Why?"}]
        assert loaded[1]["category"] == "b" and loaded[1]["reference"] == "So."
    with pytest.raises(InvalidInputError, match="no column 'nope'"):
        load_conversations(tmp_path / "q.jsonl", ColumnMap(prompt="nope"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(InvalidInputError):
        load_conversations(tmp_path / "empty.jsonl")
    with pytest.raises(InvalidInputError, match="no such file"):
        load_conversations(tmp_path / "missing.jsonl")
