"""Prompt sources by name: builtin sets, `hf:` datasets (a local dataset repository, as no hub is
reachable here), streaming in resumable shards, and the one-line errors for bad sources."""

import json
import shutil

import pytest

from draftsmith.data.prompts import ColumnMap, load_conversations
from draftsmith.data.sources import HfSource, builtin_names, builtin_path, hf_fingerprint
from draftsmith.data.stream import stream_conversations
from draftsmith.speculative.errors import InvalidInputError

QUERY = ColumnMap(prompt="query", category="topic")


def texts(dataset):
    return [m[0]["content"] for m in dataset["messages"]]


def test_every_builtin_set_loads_and_unknown_names_list_the_known_ones():
    assert {"quickstart", "arithmetic", "seed_tasks", "user_oriented_instructions", "gsm8k_train",
            "vicuna_bench", "arena_hard_v0.1"} <= set(builtin_names())
    sizes = {"seed_tasks": 175, "user_oriented_instructions": 252, "vicuna_bench": 80, "arena_hard_v0.1": 500}
    for name, size in sizes.items():
        assert len(load_conversations(f"builtin:{name}")) == size
    gsm8k = load_conversations("builtin:gsm8k_train", limit=3)  # shipped gzip-compressed
    assert builtin_path("builtin:gsm8k_train").name == "gsm8k_train.jsonl.gz" and gsm8k[0]["reference"]
    with pytest.raises(InvalidInputError, match=r"no builtin prompt set 'nope' \(builtin sets: .*vicuna_bench"):
        load_conversations("builtin:nope")


@pytest.mark.parametrize("spec, parsed", [
    ("hf:org/name", ("org/name", None, None)),
    ("hf:org/name:chat", ("org/name", "chat", None)),
    ("hf:org/name@test", ("org/name", None, "test")),
    ("hf:org/name:chat@train[:10]", ("org/name", "chat", "train[:10]")),
    ("hf:/data/v@2/repo@test", ("/data/v@2/repo", None, "test")),  # an "@" before a "/" is the path's
])
def test_hf_specs_parse(spec, parsed):
    source = HfSource.parse(spec)
    assert (source.name, source.config, source.split) == parsed


def test_a_local_dataset_repository_by_config_and_split(dataset_repo):
    train = load_conversations(f"hf:{dataset_repo}", QUERY)
    assert len(train) == 24 and train[0]["category"] == "t0" and texts(train)[0].startswith("question 0:")
    test = load_conversations(f"hf:{dataset_repo}@test", QUERY)
    assert texts(test) == [f"held {i}" for i in range(4)]
    sliced = load_conversations(f"hf:{dataset_repo}@train[:5]", QUERY)
    assert texts(sliced) == texts(train)[:5]
    chat = load_conversations(f"hf:{dataset_repo}:chat", ColumnMap(messages="dialog"))
    assert chat[3]["messages"] == [{"role": "user", "content": "hello 3"},
                                   {"role": "assistant", "content": "hi 3, how are you"}]


def test_limit_and_seeded_shuffle_are_reproducible(dataset_repo):
    spec = f"hf:{dataset_repo}"
    first = load_conversations(spec, QUERY, limit=6)
    assert texts(first) == texts(load_conversations(spec, QUERY))[:6]  # no shuffle: the head
    sample = load_conversations(spec, QUERY, limit=6, shuffle_seed=1)
    assert texts(sample) == texts(load_conversations(spec, QUERY, limit=6, shuffle_seed=1))
    assert texts(sample) != texts(first) and texts(sample) != texts(load_conversations(spec, QUERY, limit=6,
                                                                                          shuffle_seed=2))


def test_the_fingerprint_follows_the_files(dataset_repo, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(dataset_repo, copy)
    before = hf_fingerprint(f"hf:{copy}")
    assert hf_fingerprint(f"hf:{copy}@test") != before
    shard = copy / "data" / "test-00000-of-00001.parquet"
    shard.write_bytes(shard.read_bytes())  # same bytes, new modification time
    assert hf_fingerprint(f"hf:{copy}") != before


@pytest.mark.parametrize("spec, message", [
    ("hf:{repo}@validation", "has no split 'validation' (splits: train, test)"),
    ("hf:{repo}:nope", "BuilderConfig 'nope' not found"),
    ("hf:./no/such/dir", "no such dataset directory"),
    ("hf:", "hf:NAME[:CONFIG][@SPLIT]"),
    ("hf:{repo}", "has no prompt column; name it with --prompt-column (in a recipe: data.columns.prompt"),
])
def test_bad_dataset_sources(dataset_repo, spec, message):
    with pytest.raises(InvalidInputError) as info:
        load_conversations(spec.format(repo=dataset_repo))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_loading_scripts_are_refused_in_one_line(tmp_path):
    # datasets >= 4 no longer runs dataset loading scripts; such a repository is one clear error.
    repo = tmp_path / "scripted"
    repo.mkdir()
    (repo / "scripted.py").write_text("import datasets\n")
    with pytest.raises(InvalidInputError, match="Dataset scripts are no longer supported"):
        load_conversations(f"hf:{repo}")


def test_a_column_of_the_wrong_shape_is_one_error(dataset_repo):
    with pytest.raises(InvalidInputError, match="column 'query' holds no list of messages"):
        load_conversations(f"hf:{dataset_repo}", ColumnMap(messages="query"))


def test_a_file_that_is_not_utf8_is_refused_with_its_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(InvalidInputError, match=r"not UTF-8 text \(line 2: byte 0xe9\)"):
        load_conversations(path)


def test_streaming_reads_the_head_in_resumable_shards(dataset_repo, tmp_path, capsys):
    spec = f"hf:{dataset_repo}"
    streamed = stream_conversations(spec, tmp_path / "plain", QUERY, limit=14, shard_size=5, progress=False)
    whole = load_conversations(spec, QUERY)
    assert texts(streamed) == texts(whole)[:14] and streamed["category"] == whole["category"][:14]
    manifest = json.loads((tmp_path / "plain" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["num_shards"] == 3 and manifest["shards_done"] == [0, 1, 2]

    shuffled = stream_conversations(spec, tmp_path / "run", QUERY, limit=14, shuffle_seed=3, buffer_size=8,
                                    shard_size=5, progress=False)
    assert sorted(texts(shuffled)) != texts(shuffled) and len(set(texts(shuffled))) == 14
    # Interrupted after its first shard: the rerun reads on from there and ends with the same records.
    run = tmp_path / "run"
    manifest = json.loads((run / "manifest.json").read_text())
    manifest.update(complete=False, shards_done=[0], num_shards=None)
    (run / "manifest.json").write_text(json.dumps(manifest))
    shutil.rmtree(run / "dataset")
    for shard in ("shard-00001.jsonl", "shard-00002.jsonl"):
        (run / "shards" / shard).unlink()
    first_shard = (run / "shards" / "shard-00000.jsonl").read_text()
    capsys.readouterr()
    resumed = stream_conversations(spec, run, QUERY, limit=14, shuffle_seed=3, buffer_size=8, shard_size=5,
                                   progress=False)
    assert "resuming" in capsys.readouterr().err
    assert resumed["messages"] == shuffled["messages"] and resumed["id"] == shuffled["id"]
    assert (run / "shards" / "shard-00000.jsonl").read_text() == first_shard  # kept, not rewritten

    with pytest.raises(InvalidInputError, match="other settings"):
        stream_conversations(spec, run, QUERY, limit=10, shuffle_seed=3, buffer_size=8, shard_size=5, progress=False)


def test_a_comma_list_of_sources_reads_as_one_set_with_unique_ids(tmp_path):
    from draftsmith.data.prompts import load_prompt_sets

    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "category": "mine", "prompt": f"q{i}"}) + "\n" for i in range(3)))
    both = load_prompt_sets(f"builtin:unlike_training,{path}", limit=2)
    assert len(both) == 4  # the first 2 of each
    assert both["id"][:2] == [f"builtin:unlike_training/{i}" for i in load_conversations("builtin:unlike_training",
                                                                                          limit=2)["id"]]
    assert both["id"][2:] == [f"{path}/0", f"{path}/1"] and both["category"][2:] == ["mine", "mine"]
    assert both["messages"][3] == [{"role": "user", "content": "q1"}]
    assert load_prompt_sets(str(path))["id"] == ["0", "1", "2"]  # one source: its own ids
    with pytest.raises(InvalidInputError, match="named twice"):
        load_prompt_sets(f"{path},{path}")
    with pytest.raises(InvalidInputError):
        load_prompt_sets(f"{path},{tmp_path / 'absent.jsonl'}")
