"""Prompts the target writes itself (Magpie-style): the opened user turn, the target's own words in it,
and the filter that keeps finished, distinct requests."""

import contextlib
import copy

import datasets
import pytest

import draftsmith.data.regenerate as regen_module
from draftsmith.data.regenerate import load_regenerated, regenerate
from draftsmith.data.render import render_conversation, render_user_turn
from draftsmith.data.self_prompts import self_prompt_count, write_prompts
from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.loading import load_model
from draftsmith.speculative.prompts import stop_token_ids

EARLIER = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]


@pytest.fixture(scope="module")
def target():
    return load_model("tiny:0")


@pytest.mark.parametrize("messages", [[], EARLIER], ids=["first-turn", "follow-up"])
def test_user_turn_is_opened_where_the_users_words_go(target, messages):
    tok = target.tokenizer
    opened = render_user_turn(tok, messages)
    whole, _ = render_conversation(tok, messages + [{"role": "user", "content": "Why is the sky blue?"}])
    assert whole[: len(opened)] == opened
    assert tok.decode(whole[len(opened):]).startswith("Why is the sky blue?")
    assert tok.decode(opened).endswith("user\n")


def test_a_template_that_changes_the_users_words_is_refused(target):
    tok = copy.deepcopy(target.tokenizer)
    tok.chat_template = tok.chat_template.replace("message['content']", "message['content'] | upper")
    with pytest.raises(InvalidInputError, match="does not render a user message verbatim"):
        render_user_turn(tok, [])


def test_the_user_turn_is_the_targets_own_greedy_continuation(target, tmp_path, hf_greedy):
    blank = datasets.Dataset.from_list([{"id": "a", "messages": EARLIER}, {"id": "b", "messages": EARLIER[:0]}],
                                       features=datasets.Features({
                                           "id": datasets.Value("string"),
                                           "messages": datasets.List({"role": datasets.Value("string"),
                                                                      "content": datasets.Value("string")})}))
    rows = regenerate(target, blank, tmp_path / "w", max_new_tokens=10, role="user", progress=False)
    eos = stop_token_ids(target.model, target.tokenizer)
    for row, before in zip(rows, (EARLIER, [])):
        prompt = render_user_turn(target.tokenizer, before)
        assert row["input_ids"][: row["prompt_len"]] == prompt
        assert row["input_ids"][row["prompt_len"]:] == hf_greedy(target.model, prompt, 10, eos)
        assert row["messages"][:-1] == before and row["messages"][-1]["role"] == "user"


def test_write_prompts_keeps_finished_distinct_requests_and_reuses_its_cache(target, tmp_path, monkeypatch):
    prompts = write_prompts(target, 12, tmp_path / "p", seed=3, progress=False)
    raw = load_regenerated(tmp_path / "p")
    expected, seen = [], set()
    for row in raw:
        text = row["messages"][-1]["content"].strip()
        if row["finish_reason"] == "stop" and text and text not in seen:
            seen.add(text)
            expected.append((row["id"], text))
    assert 0 < len(expected) < 12  # the tiny target ends some requests and runs past the limit on others
    assert [(r["id"], r["messages"][0]["content"]) for r in prompts] == expected
    assert all(r["messages"][0]["role"] == "user" and len(r["messages"]) == 1 for r in prompts)
    assert set(prompts["category"]) == {"self"}

    def no_generation(*args, **kwargs):
        raise AssertionError("the cached prompts were written again")

    monkeypatch.setattr(regen_module, "SpeculativeDecoder", no_generation)
    assert write_prompts(target, 12, tmp_path / "p", seed=3, progress=False)["messages"] == prompts["messages"]
    with pytest.raises(InvalidInputError, match="other settings"):  # another seed never mixes into it
        write_prompts(target, 12, tmp_path / "p", seed=4, progress=False)


def test_more_prompts_write_only_the_new_ones(target, tmp_path, monkeypatch):
    """Request i is drawn from its own seed, so a larger N takes the requests a smaller one wrote."""
    write_prompts(target, 6, tmp_path / "six", seed=3, batch_size=4, progress=False)
    fresh = write_prompts(target, 10, tmp_path / "fresh", seed=3, batch_size=3, progress=False)
    drawn = []
    real_add = regen_module.Engine.add
    monkeypatch.setattr(regen_module.Engine, "add", lambda self, request: (drawn.append(request), real_add(self, request))[1])
    grown = write_prompts(target, 10, tmp_path / "ten", seed=3, batch_size=4, progress=False,
                          reuse=[tmp_path / "six", tmp_path / "fresh-elsewhere"])
    assert len(drawn) == 4  # requests 6..9 only
    assert load_regenerated(tmp_path / "ten").to_list() == load_regenerated(tmp_path / "fresh").to_list()
    assert grown.to_list() == fresh.to_list()
    drawn.clear()
    with contextlib.suppress(InvalidInputError):  # (the tiny target may finish none of them)
        write_prompts(target, 6, tmp_path / "other-seed", seed=4, progress=False, reuse=[tmp_path / "ten"])
    assert len(drawn) == 6  # another seed draws other requests


@pytest.mark.parametrize("spec", ["self:", "self:0", "self:ten", "self:-3"])
def test_a_malformed_self_source_is_a_one_line_error(spec):
    with pytest.raises(InvalidInputError, match="self:N with N a positive integer"):
        self_prompt_count(spec)
