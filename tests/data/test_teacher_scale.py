"""Teacher caches at scale: memory-mapped reads equal what was written, bounded shards, float16/bfloat16
storage, resume after a crash inside a shard, repair of a damaged shard, reuse across recipes."""

import json
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch

import draftsmith.data.teacher as teacher_module
from draftsmith.data.teacher import (ConcatTeacher, TeacherCache, cache_teacher_signals, default_shard_size,
                                     teacher_signals)
from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.loading import load_model
from draftsmith.train.config import load_recipe
from draftsmith.train.data_prep import prepare_data
from draftsmith.train.loop import padded_cache_field

LENGTHS = (5, 9, 3, 7, 4, 6)
TOP_K = 4
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def target():
    return load_model("tiny:0")


@pytest.fixture(scope="module")
def dataset():
    g = torch.Generator().manual_seed(1)
    return datasets.Dataset.from_list([{"input_ids": torch.randint(3, 259, (n,), generator=g).tolist()} for n in LENGTHS])


@pytest.fixture(scope="module")
def full(target, dataset, tmp_path_factory):
    """float32, top-4, hidden states: what the other caches are compared with."""
    return cache_teacher_signals(target, dataset, tmp_path_factory.mktemp("full") / "c", top_k=TOP_K, batch_size=2,
                                 shard_size=2, dtype=torch.float32, progress=False)


def written_tensors(monkeypatch) -> dict[int, dict[str, torch.Tensor]]:
    """Spy on the shards as they are saved: shard index -> a copy of its tensors."""
    seen, real_save = {}, teacher_module.save_file

    def spy(tensors, path, metadata=None):
        start = int(metadata["examples"].split(":")[0])
        seen[start] = {k: v.clone() for k, v in tensors.items()}
        return real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(teacher_module, "save_file", spy)
    return seen


def test_memory_mapped_reads_equal_what_was_written(target, dataset, tmp_path, monkeypatch):
    written = written_tensors(monkeypatch)
    cache = cache_teacher_signals(target, dataset, tmp_path / "c", top_k=TOP_K, shard_size=4, progress=False)
    assert sorted(written) == [0, 4]
    for i, n in enumerate(LENGTHS):
        shard = written[i // 4 * 4]
        start, stop = shard["offsets"][i % 4: i % 4 + 2].tolist()
        for name in ("topk_logprobs", "topk_ids", "hidden"):
            stored = cache.field(i, name)
            assert torch.equal(stored, shard[name][start:stop]) and stored.shape[0] == n
            assert stored.dtype == {"topk_ids": torch.int32}.get(name, torch.float16)
    indices = [5, 0, 2, 4]  # across both shards, out of order
    for name in ("topk_logprobs", "topk_ids", "hidden"):
        batch = cache.padded(indices, name)
        assert batch.shape[:2] == (4, max(LENGTHS[i] for i in indices))
        for b, i in enumerate(indices):
            assert torch.equal(batch[b, : LENGTHS[i]], cache.field(i, name)) and not batch[b, LENGTHS[i]:].any()
        assert torch.equal(cache.padded(indices, name, 4), batch[:, :4])  # cut to a given length
    item = cache[3]  # items stay float32 / int64 copies
    assert item["hidden"].dtype == torch.float32 and item["topk_ids"].dtype == torch.int64
    assert torch.equal(item["hidden"], cache.field(3, "hidden").float())


def test_the_training_loop_reads_batches_in_the_stored_dtype(target, dataset, full):
    class Data:
        teacher = full

    batch = {"index": torch.tensor([4, 1]), "input_ids": torch.zeros(2, 10, dtype=torch.int64)}
    hidden = padded_cache_field(batch, Data, "hidden")
    assert hidden.shape == (2, 10, 64) and hidden.dtype == torch.float32
    assert torch.equal(hidden[1, : LENGTHS[1]], full[1]["hidden"]) and not hidden[0, LENGTHS[4]:].any()


@pytest.mark.parametrize("dtype, tolerance", [(torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
def test_half_precision_storage_round_trips_within_tolerance(target, dataset, full, tmp_path, dtype, tolerance):
    cache = cache_teacher_signals(target, dataset, tmp_path / "c", top_k=TOP_K, batch_size=2, shard_size=2,
                                  dtype=dtype, progress=False)
    assert json.loads((tmp_path / "c" / "manifest.json").read_text())["settings"]["dtype"] == str(dtype)[6:]
    for i in range(len(LENGTHS)):
        assert cache.field(i, "hidden").dtype == cache.field(i, "topk_logprobs").dtype == dtype
        assert torch.equal(cache[i]["topk_ids"], full[i]["topk_ids"])  # chosen in float32, before storage
        for name in ("hidden", "topk_logprobs"):
            torch.testing.assert_close(cache[i][name], full[i][name], rtol=tolerance, atol=tolerance)


def test_chunked_log_probs_equal_a_full_forward(target, dataset, full, tmp_path, monkeypatch):
    monkeypatch.setattr(teacher_module, "POSITIONS", 2)  # every example's lm_head runs in several chunks
    cache = cache_teacher_signals(target, dataset, tmp_path / "c", top_k=TOP_K, batch_size=3, shard_size=3,
                                  dtype=torch.float32, progress=False)
    for i, ids in enumerate(dataset["input_ids"]):
        with torch.no_grad():
            out = target.model(torch.tensor([ids]), output_hidden_states=True)
        logprobs = torch.log_softmax(out.logits[0].float(), -1)
        torch.testing.assert_close(cache[i]["topk_logprobs"], logprobs.gather(-1, cache[i]["topk_ids"]),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache[i]["topk_logprobs"], logprobs.topk(TOP_K, -1).values, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache[i]["hidden"], out.hidden_states[-1][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache[i]["hidden"], full[i]["hidden"], atol=1e-5, rtol=1e-5)


def test_shards_are_bounded_in_bytes(target, dataset, tmp_path, monkeypatch):
    # The SmolLM2 recipes' caches (384 tokens, top-8, 576-d float16) keep today's 256 examples a shard.
    assert default_shard_size(384, 8, 576, torch.float16) == 256
    assert default_shard_size(4096, 32, 4096, torch.bfloat16) == 7  # 34 MB an example
    assert default_shard_size(200_000, 32, 8192, torch.float32) == 1  # an example alone is larger
    per_token = TOP_K * 6 + 64 * 2
    monkeypatch.setattr(teacher_module, "SHARD_BYTES", 2 * max(LENGTHS) * per_token)
    cache = cache_teacher_signals(target, dataset, tmp_path / "c", top_k=TOP_K, progress=False)
    assert cache.shard_size == 2 and len(list((tmp_path / "c").glob("shard-*.safetensors"))) == 3
    for shard in (tmp_path / "c").glob("shard-*.safetensors"):
        assert shard.stat().st_size < 2 * max(LENGTHS) * per_token + 1024  # + the header


def test_resume_after_a_crash_inside_a_shard(target, dataset, full, tmp_path, monkeypatch, capsys):
    out_dir = tmp_path / "c"
    calls, real_states = [], teacher_module.teacher_states

    def crash_in_shard_two(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # batch_size 1, shards of 3: the second batch of the second shard
            raise KeyboardInterrupt
        return real_states(*args, **kwargs)

    monkeypatch.setattr(teacher_module, "teacher_states", crash_in_shard_two)
    with pytest.raises(KeyboardInterrupt):
        cache_teacher_signals(target, dataset, out_dir, top_k=TOP_K, batch_size=1, shard_size=3,
                              dtype=torch.float32, progress=False)
    assert sorted(p.name for p in out_dir.iterdir()) == ["manifest.json", "shard-00000.safetensors"]  # no scratch
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert manifest["shards_done"] == [0] and not manifest["complete"]

    first = out_dir / "shard-00000.safetensors"
    stamp = first.stat().st_mtime_ns
    calls.clear()
    monkeypatch.setattr(teacher_module, "teacher_states", lambda *a, **k: (calls.append(1), real_states(*a, **k))[1])
    capsys.readouterr()
    cache = cache_teacher_signals(target, dataset, out_dir, top_k=TOP_K, batch_size=2, shard_size=3,
                                  dtype=torch.float32, progress=False)
    assert "resuming, 1/2 shards done" in capsys.readouterr().err
    assert len(calls) == 2 and first.stat().st_mtime_ns == stamp  # only the second shard, in 2 batches
    for i in range(len(LENGTHS)):
        for name in ("topk_logprobs", "topk_ids", "hidden"):
            torch.testing.assert_close(cache[i][name], full[i][name], atol=1e-5, rtol=1e-5)


def test_a_damaged_shard_is_a_one_line_error_and_a_rerun_computes_it_again(target, dataset, tmp_path, monkeypatch,
                                                                            capsys):
    out_dir = tmp_path / "c"
    settings = dict(top_k=TOP_K, batch_size=2, shard_size=2, progress=False)
    cache_teacher_signals(target, dataset, out_dir, **settings)
    before = {p.name: p.read_bytes() for p in out_dir.glob("shard-*")}
    damaged = out_dir / "shard-00001.safetensors"
    damaged.write_bytes(before[damaged.name][:-64])
    with pytest.raises(InvalidInputError, match="shard-00001.safetensors is unreadable or corrupt") as info:
        TeacherCache(out_dir)
    assert "\n" not in str(info.value) and "rerun" in str(info.value)

    calls, real_shard = [], teacher_module._shard_tensors
    monkeypatch.setattr(teacher_module, "_shard_tensors", lambda *a, **k: (calls.append(a[2]), real_shard(*a, **k))[1])
    capsys.readouterr()
    cache = cache_teacher_signals(target, dataset, out_dir, **settings)
    err = capsys.readouterr().err
    assert "shard-00001.safetensors is unreadable or corrupt" in err and "computing it again" in err
    assert calls == [range(2, 4)] and {p.name: p.read_bytes() for p in out_dir.glob("shard-*")} == before
    assert len(cache) == len(LENGTHS)


def test_a_shard_damaged_while_open_is_a_one_line_error(target, dataset, tmp_path):
    out_dir = tmp_path / "c"
    cache = cache_teacher_signals(target, dataset, out_dir, top_k=TOP_K, shard_size=2, progress=False)
    cache[0]
    (out_dir / "shard-00002.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(InvalidInputError, match="shard-00002.safetensors is unreadable") as info:
        cache.padded([0, 5], "hidden")
    assert "\n" not in str(info.value)


def test_views_of_fewer_signals(full):
    small = TeacherCache(full.dir, top_k=2, hidden=False)
    assert (small.top_k, small.has_hidden) == (2, False) and set(small[3]) == {"topk_logprobs", "topk_ids"}
    assert torch.equal(small[3]["topk_ids"], full[3]["topk_ids"][:, :2])
    assert torch.equal(small.padded([3, 1], "topk_logprobs"), full.padded([3, 1], "topk_logprobs")[..., :2])
    with pytest.raises(KeyError):
        small.field(0, "hidden")
    for bad, message in ((dict(top_k=5), "holds top-4 log-probs, not 5"), (dict(top_k=0), "not 0")):
        with pytest.raises(InvalidInputError, match=message):
            TeacherCache(full.dir, **bad)
    no_hidden = TeacherCache(full.dir, hidden=False)
    with pytest.raises(InvalidInputError, match="cannot be read as one"):
        ConcatTeacher([full, no_hidden])
    both = ConcatTeacher([small, small])
    assert torch.equal(both.padded([9, 0], "topk_ids")[0, : LENGTHS[3]], small.field(3, "topk_ids"))


def test_recipes_needing_fewer_signals_reuse_a_cache(target, dataset, full, tmp_path, monkeypatch, capsys):
    root = tmp_path / "data"
    big = teacher_signals(target, dataset, root, "teacher-abc", top_k=TOP_K, hidden=True, dtype=torch.float32,
                          progress=False)
    assert [p.name for p in root.iterdir()] == ["teacher-abc-k4-hidden-float32"]
    torch.testing.assert_close(big[2]["hidden"], full[2]["hidden"], atol=1e-5, rtol=1e-5)

    def no_work(*args, **kwargs):
        raise AssertionError("the signals were computed again")

    monkeypatch.setattr(teacher_module, "_shard_tensors", no_work)
    capsys.readouterr()
    for top_k, hidden in ((TOP_K, True), (2, False), (3, True)):
        view = teacher_signals(target, dataset, root, "teacher-abc", top_k=top_k, hidden=hidden, dtype=torch.float32,
                               progress=False)
        assert (view.top_k, view.has_hidden, view.dir) == (top_k, hidden, big.dir)
        assert torch.equal(view[4]["topk_logprobs"], big[4]["topk_logprobs"][:, :top_k])
    assert capsys.readouterr().err == ""  # not even a size line
    monkeypatch.undo()

    # More log-probs, another storage type or other data are other signals: cached beside it.
    teacher_signals(target, dataset, root, "teacher-abc", top_k=TOP_K + 1, hidden=False, dtype=torch.float32,
                    progress=False)
    teacher_signals(target, dataset, root, "teacher-abc", top_k=2, hidden=False, dtype=torch.float16, progress=False)
    other = dataset.map(lambda r: {"input_ids": r["input_ids"][::-1]})
    teacher_signals(target, other, root, "teacher-abc", top_k=2, hidden=False, dtype=torch.float32, progress=False)
    names = sorted(p.name for p in root.iterdir())
    assert names == ["teacher-abc-k2-logprobs-float16", "teacher-abc-k2-logprobs-float32",
                     "teacher-abc-k4-hidden-float32", "teacher-abc-k5-logprobs-float32"]
    # The smallest cache that covers a request is the one read: of this data's, k4 before k5 (k2-float32
    # holds the other data, k2-float16 another storage type).
    assert teacher_signals(target, dataset, root, "teacher-abc", top_k=2, hidden=False, dtype=torch.float32,
                           progress=False).dir.name == "teacher-abc-k4-hidden-float32"


def test_a_cache_named_before_signals_were_in_the_name_is_reused(target, dataset, full, tmp_path):
    root = tmp_path / "data"
    cache_teacher_signals(target, dataset, root / "teacher-abc-k4", top_k=TOP_K, dtype=torch.float32, progress=False)
    view = teacher_signals(target, dataset, root, "teacher-abc", top_k=TOP_K, hidden=False, dtype=torch.float32,
                           progress=False)
    assert view.dir.name == "teacher-abc-k4" and [p.name for p in root.iterdir()] == ["teacher-abc-k4"]


def test_a_damaged_cache_found_by_name_is_repaired_not_refused(target, dataset, tmp_path, capsys):
    root = tmp_path / "data"
    first = teacher_signals(target, dataset, root, "teacher-abc", top_k=TOP_K, hidden=False, progress=False)
    shard = first.dir / "shard-00000.safetensors"
    whole = shard.read_bytes()
    shard.write_bytes(b"garbage")
    capsys.readouterr()
    again = teacher_signals(target, dataset, root, "teacher-abc", top_k=TOP_K, hidden=False, progress=False)
    assert "computing it again" in capsys.readouterr().err
    assert again.dir == first.dir and shard.read_bytes() == whole and len(list(root.iterdir())) == 1


def test_two_recipes_share_one_teacher_pass(target, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}: {'ab' * i}"}) + "\n" for i in range(8)))
    data = [f"data.prompts=[{prompts}]", "data.heldout=2", "data.max_new_tokens=6", "data.max_length=64",
            f"data.cache_dir={tmp_path / 'cache'}", "teacher.mode=offline", "target=tiny:0"]
    eagle = prepare_data(load_recipe("tiny-eagle", [*data, "teacher.top_k=4"]), target, is_main=True, progress=False)
    draft_lm = prepare_data(load_recipe("tiny-draft-lm", [*data, "teacher.top_k=2"]), target, is_main=True,
                            progress=False)
    assert [p.name for p in (tmp_path / "cache").glob("teacher-*")] == [eagle.teacher.dir.name]
    assert eagle.teacher.has_hidden and not draft_lm.teacher.has_hidden and draft_lm.teacher.top_k == 2
    assert draft_lm.teacher.dir == eagle.teacher.dir
    assert torch.equal(draft_lm.teacher.padded([0, 3], "topk_ids"), eagle.teacher.padded([0, 3], "topk_ids")[..., :2])


def test_the_storage_type_is_a_recipe_key():
    assert load_recipe("tiny-medusa").teacher.dtype == "float16"
    assert load_recipe("tiny-medusa", ["teacher.dtype=bfloat16"]).teacher.dtype == "bfloat16"
    with pytest.raises(InvalidInputError, match="teacher.dtype") as info:
        load_recipe("tiny-medusa", ["teacher.dtype=int8"])
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_reading_a_cache_many_times_larger_than_a_shard_keeps_memory_bounded(tmp_path):
    """A 640 MB cache of 10 MB shards, every row read once in random batches: the process grows by far less
    than the cache (the file pages it maps and touches count in its resident memory too)."""
    script = REPO / "benchmarks" / "teacher_cache_rss.py"
    build = [sys.executable, str(script), "build", str(tmp_path / "c"), "--examples", "2048", "--length", "256",
             "--hidden-size", "1024", "--shard-size", "32"]
    subprocess.run(build, check=True, capture_output=True)
    one = subprocess.run([sys.executable, str(script), "read", str(tmp_path / "c"), "--steps", "1"], check=True,
                         capture_output=True, text=True)
    every = subprocess.run([sys.executable, str(script), "read", str(tmp_path / "c")], check=True,
                           capture_output=True, text=True)
    one, every = json.loads(one.stdout), json.loads(every.stdout)
    assert every["rows"] == 2048 and every["cache_gb"] > 0.6
    assert every["peak_rss_mb"] - one["peak_rss_mb"] < 100, (one, every)
