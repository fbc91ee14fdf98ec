"""Training on existing conversations without regeneration (`regenerate: false` per source): rendered with
the target's chat template, loss on the assistant turns only, teacher signals from one teacher-forced
pass; beside a source whose prompts the target answers."""

import json

import pytest
import torch

from draftsmith.data.render import render_conversation
from draftsmith.data.teacher import ConcatTeacher
from draftsmith.speculative.loading import load_model
from draftsmith.train.config import load_recipe
from draftsmith.train.data_prep import prepare_data

CONVERSATIONS = [
    [{"role": "user", "content": f"name {i}?"}, {"role": "assistant", "content": f"it is {i}."},
     {"role": "user", "content": "and twice?"}, {"role": "assistant", "content": f"{2 * i}, twice {i}."}]
    for i in range(5)
]


@pytest.fixture(scope="module")
def target():
    return load_model("tiny:0")


@pytest.fixture
def chats(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"id": f"c{i}", "messages": m}) + "\n" for i, m in enumerate(CONVERSATIONS)))
    return path


def recipe(dataset_repo, chats, cache, *extra):
    sources = (f"[{{source: 'hf:{dataset_repo}', columns: {{prompt: query}}, limit: 6}}, "
               f"{{source: '{chats}', regenerate: false}}]")
    return load_recipe("tiny-eagle", ["target=tiny:0", f"data.prompts={sources}", "data.heldout=2",
                                      "data.max_new_tokens=6", f"data.cache_dir={cache}", "teacher.mode=offline",
                                      "teacher.top_k=3", *extra])


def test_fixed_conversations_train_as_they_are_beside_regenerated_answers(target, dataset_repo, chats, tmp_path):
    data = prepare_data(recipe(dataset_repo, chats, tmp_path), target, is_main=True, progress=False)
    assert data.source["regenerated"] == [True, False] and data.source["records"] == 9
    rendered = [render_conversation(target.tokenizer, m) for m in CONVERSATIONS]
    fixed = [i for i, ids in enumerate(data.train["input_ids"]) if any(ids == r[0] for r in rendered)]
    answered = json.loads(next(tmp_path.glob("regen-*/manifest.json")).read_text())["settings"]["num_records"]
    assert len(fixed) + answered == 9 and len(data.train) == 9 and 3 <= len(fixed) <= 5
    for i in fixed:
        row = data.train[i]
        ids, mask = next(r for r in rendered if r[0] == row["input_ids"])
        assert row["loss_mask"] == mask  # the assistant turns, token for token
        learnt = target.tokenizer.decode([t for t, m in zip(ids, mask) if m])
        assert "it is" in learnt and "twice" in learnt and "name" not in learnt and "and twice?" not in learnt
    # One teacher-forced pass per row, in the order of data.train, whichever part the row came from.
    assert isinstance(data.teacher, ConcatTeacher) and len(data.teacher) == 9
    for i in (fixed[0], next(k for k in range(9) if k not in fixed)):
        ids = torch.tensor(data.train[i]["input_ids"])
        with torch.no_grad():
            logits = target.model(ids[None]).logits[0]
        signals = data.teacher[i]
        assert signals["hidden"].shape[0] == len(ids) and torch.equal(signals["topk_ids"][:, 0], logits.argmax(-1))


def test_one_source_without_regeneration_is_the_fixed_path_alone(target, dataset_repo, chats, tmp_path):
    data = prepare_data(recipe(dataset_repo, chats, tmp_path, f"data.prompts=[{{source: '{chats}', regenerate: false}}]"),
                        target, is_main=True, progress=False)
    assert data.source["regenerated"] is False and not list(tmp_path.glob("regen-*"))
    assert len(data.train) == 3 and all(sum(m) > 0 for m in data.train["loss_mask"])


def test_prompt_and_answer_records_train_on_their_answers_without_regeneration(target, dataset_repo, tmp_path):
    qa = tmp_path / "qa.jsonl"
    rows = [{"question": f"what is {i} and {i}?", "answer": f"{i} and {i} make {2 * i}."} for i in range(6)]
    rows.append({"question": "unanswered?", "answer": ""})  # nothing to learn: dropped
    qa.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = prepare_data(recipe(dataset_repo, qa, tmp_path, f"data.prompts=[{{source: '{qa}', regenerate: false}}]"),
                        target, is_main=True, progress=False)
    assert not list(tmp_path.glob("regen-*")) and len(data.train) == 7 - 2 - 1  # 2 held out, 1 unanswered
    for ids, mask in zip(data.train["input_ids"], data.train["loss_mask"]):
        learnt = target.tokenizer.decode([t for t, m in zip(ids, mask) if m])
        question = target.tokenizer.decode([t for t, m in zip(ids, mask) if not m])
        assert " make " in learnt and "what is" not in learnt and "what is" in question
