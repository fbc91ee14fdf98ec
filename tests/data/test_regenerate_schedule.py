"""Regeneration's schedule: one engine keeps its batch full across rows and shards, prompts join in order of
length within their shard, and the answers are those of any other batch size."""

import collections
import json

import pytest

import draftsmith.data.regenerate as regen_module
from draftsmith.data.prompts import load_conversations
from draftsmith.data.regenerate import regenerate
from draftsmith.speculative.engine import Engine
from draftsmith.speculative.loading import load_model

MAX_NEW = 12
PROMPTS = ["Say hi", "What is 2+2? Explain at length please.", "x", "abcabcabc", "Why?", "Tell me a story about a cat",
           "ok", "List three colours", "Is the sky blue today, or is it grey?", "no"]


@pytest.fixture(scope="module")
def target():
    return load_model("tiny:0")


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    return load_conversations(path)


def stop_early(target, conversations, tmp_path, monkeypatch, **sampling) -> None:
    """The random target seldom ends an answer: make regeneration stop at a token its answers hold at
    different places, so that rows leave the batch at different rounds and others join in their place."""
    first = regenerate(target, conversations, tmp_path / "first", max_new_tokens=MAX_NEW, progress=False, **sampling)
    answers = [row["input_ids"][row["prompt_len"]:] for row in first]
    common = collections.Counter(t for a in answers for t in set(a[1:-1]))
    stop = next(t for t, _ in common.most_common() if len({a.index(t) if t in a else -1 for a in answers}) > 2)
    monkeypatch.setattr(regen_module, "stop_token_ids", lambda model, tokenizer: [stop])


@pytest.fixture
def engine_log(monkeypatch):
    """Every request added (its shard's order, prompt length) and the running rows of every step."""
    log = {"added": [], "running": []}
    real_add, real_step = Engine.add, Engine.step

    def add(self, request):
        log["added"].append(len(request.prompt))
        return real_add(self, request)

    def step(self):
        out = real_step(self)
        log["running"].append(len(out))
        return out

    monkeypatch.setattr(Engine, "add", add)
    monkeypatch.setattr(Engine, "step", step)
    return log


def test_the_batch_stays_full_until_no_prompt_waits(target, conversations, tmp_path, engine_log, monkeypatch):
    stop_early(target, conversations, tmp_path, monkeypatch)
    engine_log["added"].clear(), engine_log["running"].clear()
    out = regenerate(target, conversations, tmp_path / "run", max_new_tokens=MAX_NEW, shard_size=3, batch_size=4,
               progress=False)
    running = engine_log["running"]
    assert sum(running) >= len(PROMPTS) and max(running) == 4
    first_short = next(i for i, n in enumerate(running) if n < 4)
    # Once a step runs fewer than 4 rows, every prompt has joined: the batch only drains at the very end
    # (the earlier schedule drained at the end of every batch and every shard).
    assert running[first_short:] == sorted(running[first_short:], reverse=True)
    assert len(engine_log["added"]) == len(PROMPTS)
    assert len({len(row["input_ids"]) - row["prompt_len"] for row in out}) > 2  # rows left at different rounds


def test_prompts_join_in_order_of_length_within_their_shard(target, conversations, tmp_path, engine_log):
    out = regenerate(target, conversations, tmp_path / "run", max_new_tokens=MAX_NEW, shard_size=4, batch_size=2,
                     progress=False)
    added = engine_log["added"]
    for begin in range(0, len(PROMPTS), 4):  # shards of 4 records, queued one after another
        assert added[begin: begin + 4] == sorted(added[begin: begin + 4])
    assert sorted(added) == sorted(row["prompt_len"] for row in out)
    assert [row["id"] for row in out] == [str(i) for i in range(len(PROMPTS))]  # written in record order


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_answers_do_not_depend_on_batch_or_shard_size(target, conversations, tmp_path, temperature, monkeypatch):
    stop_early(target, conversations, tmp_path, monkeypatch, temperature=temperature, seed=3)
    runs = [regenerate(target, conversations, tmp_path / f"run-{b}-{s}", max_new_tokens=MAX_NEW, shard_size=s,
                       batch_size=b, temperature=temperature, seed=3, progress=False).to_list()
            for b, s in ((1, 10), (3, 2), (10, 4), (16, 3))]
    assert all(run == runs[0] for run in runs[1:])
    assert {row["finish_reason"] for row in runs[0]} == {"stop", "length"}
    assert len({len(row["input_ids"]) - row["prompt_len"] for row in runs[0]}) > 2


def test_shards_are_written_as_they_finish(target, conversations, tmp_path, monkeypatch):
    written, real_write = [], regen_module._write_shard
    monkeypatch.setattr(regen_module, "_write_shard", lambda path, rows: (written.append(path.name),
                                                                           real_write(path, rows)))
    regenerate(target, conversations, tmp_path / "run", max_new_tokens=MAX_NEW, shard_size=2, batch_size=6,
               progress=False)
    assert sorted(written) == [f"shard-{s:05d}.jsonl" for s in range(5)]
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["shards_done"] == list(range(5)) and manifest["complete"]
