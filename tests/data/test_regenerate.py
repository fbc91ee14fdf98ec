"""Regeneration: the target's own answers, exact, batch-independent, resumable, never mixed."""

import copy
import dataclasses
import json

import datasets
import pytest
import torch

import draftsmith.data.regenerate as regen_module
from draftsmith.data.prompts import load_conversations
from draftsmith.data.regenerate import load_regenerated, regenerate
from draftsmith.data.render import render_prompt
from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.loading import load_model
from draftsmith.speculative.prompts import stop_token_ids
from draftsmith.speculative.ngram import NGramProposer

MAX_NEW = 8
RECORDS = [
    {"id": "a", "prompt": "Say hi", "category": "chat", "answer": "hi"},
    {"id": "b", "prompt": "What is 2+2? Explain at length please."},
    {"id": "c", "prompt": "x"},
    {"id": "e", "prompt": "abcabcabc"},
    {"id": "f", "prompt": "Why?"},
]


@pytest.fixture(scope="module")
def target():
    return load_model("tiny:0")


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return load_conversations(path)


@pytest.fixture(scope="module")
def reference(target, conversations, tmp_path_factory):
    """An uninterrupted greedy run, for comparisons."""
    out = regenerate(target, conversations, tmp_path_factory.mktemp("ref") / "run", max_new_tokens=MAX_NEW,
                     shard_size=3, batch_size=2, progress=False)
    return out.to_list()


def snapshot(root):
    return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file()}


def test_greedy_equals_hf_generate(target, conversations, reference, hf_greedy):
    eos = stop_token_ids(target.model, target.tokenizer)
    for record, row in zip(conversations, reference):
        prompt = render_prompt(target.tokenizer, record["messages"])
        assert row["input_ids"][: row["prompt_len"]] == prompt
        assert row["input_ids"][row["prompt_len"]:] == hf_greedy(target.model, prompt, MAX_NEW, eos)


def test_rows_and_mask(target, conversations, reference):
    assert list(reference[0]) == ["id", "category", "reference", "messages", "input_ids", "loss_mask",
                                  "prompt_len", "finish_reason"]
    assert [r["id"] for r in reference] == [r["id"] for r in RECORDS]
    assert reference[0]["category"] == "chat" and reference[0]["reference"] == "hi"
    for record, row in zip(conversations, reference):
        generated = row["input_ids"][row["prompt_len"]:]
        assert 1 <= len(generated) <= MAX_NEW
        assert row["loss_mask"] == [0] * row["prompt_len"] + [1] * len(generated)
        assert sum(row["loss_mask"]) == len(generated)
        assert row["messages"][:-1] == record["messages"]
        assert row["messages"][-1] == {"role": "assistant",
                                       "content": target.tokenizer.decode(generated, skip_special_tokens=True)}
        assert row["finish_reason"] == ("stop" if generated[-1] == 2 else "length")


def test_trailing_assistant_turns_are_replaced(target, conversations, reference, tmp_path):
    answered = conversations.map(lambda r: {"messages": r["messages"] + [{"role": "assistant", "content": "old"}]})
    out = regenerate(target, answered, tmp_path / "run", max_new_tokens=MAX_NEW, progress=False)
    assert [r["input_ids"] for r in out] == [r["input_ids"] for r in reference]


def test_outputs_do_not_depend_on_batching_or_proposer(target, conversations, reference, tmp_path):
    settings = dict(max_new_tokens=MAX_NEW, shard_size=2, progress=False)
    solo = regenerate(target, conversations, tmp_path / "solo", batch_size=1, **settings)
    drafted = regenerate(target, conversations, tmp_path / "ngram", batch_size=3, proposer=NGramProposer(), **settings)
    assert solo.to_list() == reference and drafted.to_list() == reference

    sampled = dict(settings, temperature=0.8, seed=5)
    one = regenerate(target, conversations, tmp_path / "t1", batch_size=1, **sampled)
    three = regenerate(target, conversations, tmp_path / "t3", batch_size=3, **sampled)
    assert one.to_list() == three.to_list()
    assert [r["input_ids"] for r in one] != [r["input_ids"] for r in reference]  # it did sample


def test_resume_after_interruption(target, conversations, reference, tmp_path, monkeypatch, capfd):
    out_dir = tmp_path / "run"
    calls = {"n": 0}
    real_complete = regen_module._complete_row

    def crashing_complete(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:  # shard 0's rows finish first (batches of 1); this is shard 1's second row
            raise KeyboardInterrupt
        return real_complete(*args, **kwargs)

    monkeypatch.setattr(regen_module, "_complete_row", crashing_complete)
    with pytest.raises(KeyboardInterrupt):
        regenerate(target, conversations, out_dir, max_new_tokens=MAX_NEW, shard_size=2, batch_size=1,
                   progress=False)
    shards = out_dir / "shards"
    assert sorted(p.name for p in shards.iterdir()) == ["shard-00000.jsonl"]  # no partial or temp files
    assert json.loads((out_dir / "manifest.json").read_text())["shards_done"] == [0]
    assert not (out_dir / "dataset").exists()
    with pytest.raises(InvalidInputError, match="unfinished"):
        load_regenerated(out_dir)

    monkeypatch.setattr(regen_module, "_complete_row", real_complete)
    first = shards / "shard-00000.jsonl"
    before = (first.stat().st_mtime_ns, first.read_bytes())
    written = []
    real_write = regen_module._write_shard
    monkeypatch.setattr(regen_module, "_write_shard",
                        lambda path, rows: (written.append(path.name), real_write(path, rows)))
    capfd.readouterr()
    resumed = regenerate(target, conversations, out_dir, max_new_tokens=MAX_NEW, shard_size=2, batch_size=2,
                         progress=False)
    out, err = capfd.readouterr()
    assert out == "" and "resuming, 1/3 shards done" in err
    assert sorted(written) == ["shard-00001.jsonl", "shard-00002.jsonl"]  # in the order they finish
    assert (first.stat().st_mtime_ns, first.read_bytes()) == before
    assert resumed.to_list() == reference
    assert load_regenerated(out_dir).to_list() == reference

    # Finished: a rerun only loads the saved dataset.
    monkeypatch.setattr(regen_module, "Engine", lambda *a, **k: pytest.fail("a finished run decoded again"))
    again = regenerate(target, conversations, out_dir, max_new_tokens=MAX_NEW, shard_size=2, progress=False)
    assert again.to_list() == reference


def test_other_settings_are_refused_and_nothing_is_overwritten(target, conversations, tmp_path):
    out_dir = tmp_path / "run"
    regenerate(target, conversations, out_dir, max_new_tokens=MAX_NEW, shard_size=4, progress=False)
    before = snapshot(out_dir)
    changes = [dict(temperature=0.5), dict(max_new_tokens=MAX_NEW + 1), dict(seed=1), dict(shard_size=3)]
    for change in changes:
        settings = {"max_new_tokens": MAX_NEW, "shard_size": 4, "progress": False, **change}
        with pytest.raises(InvalidInputError, match="other settings") as info:
            regenerate(target, conversations, out_dir, **settings)
        assert "\n" not in str(info.value) and next(iter(change)) in str(info.value)
    edited = conversations.map(lambda r, i: {"messages": r["messages"] if i else [{"role": "user", "content": "?"}]},
                               with_indices=True)
    with pytest.raises(InvalidInputError, match="input_hash"):
        regenerate(target, edited, out_dir, max_new_tokens=MAX_NEW, shard_size=4, progress=False)
    with pytest.raises(InvalidInputError, match="target"):
        regenerate(load_model("tiny:1"), conversations, out_dir, max_new_tokens=MAX_NEW, shard_size=4, progress=False)
    assert snapshot(out_dir) == before


def test_foreign_directory_is_refused(target, conversations, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(InvalidInputError, match="not a draftsmith-regenerated directory"):
        regenerate(target, conversations, tmp_path, max_new_tokens=MAX_NEW, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_bad_input_is_a_one_line_error(target, conversations, tmp_path):
    only_answers = datasets.Dataset.from_list([{"messages": [{"role": "assistant", "content": "hi"}]}])
    with pytest.raises(InvalidInputError, match="no user message"):
        regenerate(target, only_answers, tmp_path / "a", max_new_tokens=4, progress=False)
    assert not (tmp_path / "a").exists()  # refused before the run directory is made
    for bad in (dict(max_new_tokens=0), dict(batch_size=0), dict(temperature=-1.0), dict(top_p=0.0)):
        with pytest.raises(InvalidInputError) as info:
            regenerate(target, conversations, tmp_path / "b", **{"max_new_tokens": 4, "progress": False, **bad})
        assert "\n" not in str(info.value)
    assert not (tmp_path / "b").exists()


def test_quiet_without_progress(target, conversations, tmp_path, capfd):
    regenerate(target, conversations.select(range(3)), tmp_path / "run", max_new_tokens=4, progress=False)
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_progress_goes_to_stderr(target, conversations, tmp_path, capfd):
    regenerate(target, conversations.select(range(3)), tmp_path / "run", max_new_tokens=4, shard_size=2)
    out, err = capfd.readouterr()
    assert out == "" and "regenerating" in err
    assert sorted(p.name for p in (tmp_path / "run" / "shards").iterdir()) == ["shard-00000.jsonl",
                                                                             "shard-00001.jsonl"]


def test_regenerated_dataset_trains_on_its_exact_tokens(target, reference, tmp_path):
    """A regenerated dataset listed as training data keeps the target's own ids (not a re-rendering of
    the decoded text, which would close every cut-off answer with an end-of-turn token)."""
    from draftsmith.data.render import tokenize_dataset

    datasets.Dataset.from_list(reference).save_to_disk(str(tmp_path / "regen"))
    loaded = load_conversations(tmp_path / "regen")
    assert loaded["input_ids"] == [r["input_ids"] for r in reference]
    tokens = tokenize_dataset(loaded, target.tokenizer, max_length=10_000)
    assert tokens["input_ids"] == [r["input_ids"] for r in reference]
    assert tokens["loss_mask"] == [r["loss_mask"] for r in reference]


class CountingEngine(regen_module.Engine):
    """The regeneration engine, recording the prompts it is asked to decode."""

    prompts: list = []

    def add(self, request):
        CountingEngine.prompts.append(tuple(request.prompt))
        return super().add(request)


def test_answers_of_earlier_greedy_runs_are_reused(target, conversations, reference, tmp_path, monkeypatch, capfd):
    settings = dict(max_new_tokens=MAX_NEW, shard_size=2, batch_size=2, progress=False)
    regenerate(target, conversations.select([0, 1]), tmp_path / "first", **settings)
    partial = tmp_path / "partial"  # an unfinished run gives the shards it finished
    regenerate(target, conversations.select([2]), partial, **settings)
    (partial / "dataset").rename(tmp_path / "moved")
    manifest = json.loads((partial / "manifest.json").read_text())
    (partial / "manifest.json").write_text(json.dumps(manifest | {"complete": False}))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "manifest.json").write_text("{not json")  # unreadable: ignored, not an error
    monkeypatch.setattr(CountingEngine, "prompts", [])
    monkeypatch.setattr(regen_module, "Engine", CountingEngine)
    capfd.readouterr()

    order = [3, 1, 4, 0, 2]  # two new prompts among three answered before, in another order
    out = regenerate(target, conversations.select(order), tmp_path / "more",
                     reuse=sorted(tmp_path.iterdir()), **settings)
    assert out.to_list() == [reference[i] for i in order]  # exactly what decoding them gives
    new = {tuple(reference[i]["input_ids"][: reference[i]["prompt_len"]]) for i in (3, 4)}
    assert set(CountingEngine.prompts) == new and len(CountingEngine.prompts) == 2
    assert "3 of 5 answers taken from earlier runs" in capfd.readouterr().err

    # Nothing is reused across other settings: another max_new_tokens, or sampling (greedy answers are not samples).
    CountingEngine.prompts.clear()
    shorter = regenerate(target, conversations.select([0, 1]), tmp_path / "shorter", reuse=[tmp_path / "first"],
                         **(settings | {"max_new_tokens": MAX_NEW - 2}))
    assert len(CountingEngine.prompts) == 2 and all(len(r["input_ids"]) <= r["prompt_len"] + MAX_NEW - 2 for r in shorter)
    CountingEngine.prompts.clear()
    regenerate(target, conversations.select([0, 1]), tmp_path / "sampled", reuse=[tmp_path / "first"],
               temperature=0.8, seed=1, **settings)
    assert len(CountingEngine.prompts) == 2


def test_a_lower_precision_target_is_cached_apart_and_takes_float32_answers(target, conversations, reference,
                                                                            tmp_path, monkeypatch):
    settings = dict(max_new_tokens=MAX_NEW, shard_size=2, batch_size=2, progress=False)
    bf16 = dataclasses.replace(target, model=copy.deepcopy(target.model).to(torch.bfloat16))
    monkeypatch.setattr(CountingEngine, "prompts", [])
    monkeypatch.setattr(regen_module, "Engine", CountingEngine)

    own = regenerate(bf16, conversations, tmp_path / "bf16", **settings)  # decoded in bfloat16
    manifest = json.loads((tmp_path / "bf16" / "manifest.json").read_text())
    assert manifest["settings"]["dtype"] == "bfloat16" and len(CountingEngine.prompts) == len(RECORDS)
    assert [r["input_ids"][: r["prompt_len"]] for r in own] == [r["input_ids"][: r["prompt_len"]] for r in reference]
    with pytest.raises(InvalidInputError, match="other settings"):  # never mixed with float32 answers in one run
        regenerate(target, conversations, tmp_path / "bf16", **settings)

    regenerate(target, conversations.select([0]), tmp_path / "f32", **settings)
    assert "dtype" not in json.loads((tmp_path / "f32" / "manifest.json").read_text())["settings"]
    CountingEngine.prompts.clear()  # float32 answers stand in for a bfloat16 run's...
    taken = regenerate(bf16, conversations, tmp_path / "bf16-reusing", reuse=[tmp_path / "f32"], **settings)
    assert len(CountingEngine.prompts) == len(RECORDS) - 1 and taken[0] == reference[0]
    CountingEngine.prompts.clear()  # ...never the reverse
    again = regenerate(target, conversations, tmp_path / "f32-more", reuse=[tmp_path / "bf16", tmp_path / "f32"],
                       **settings)
    assert len(CountingEngine.prompts) == len(RECORDS) - 1 and again.to_list() == reference
