"""Offline teacher cache: equals a live target forward, says its size first, resumes, fails cleanly."""

import json
import shutil

import datasets
import pytest
import torch
from safetensors import safe_open

import draftsmith.data.teacher as teacher_module
from draftsmith.data.collate import pad_batch
from draftsmith.data.teacher import TeacherCache, cache_teacher_signals, sparse_teacher_probs, teacher_forward
from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.loading import load_model

LENGTHS = (5, 9, 3, 7, 4)
TOP_K = 4


@pytest.fixture(scope="module")
def target():
    return load_model("tiny:0")


@pytest.fixture(scope="module")
def dataset():
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, 259, (n,), generator=g).tolist(), "loss_mask": [0, 0] + [1] * (n - 2)}
            for n in LENGTHS]
    return datasets.Dataset.from_list(rows)


@pytest.fixture(scope="module")
def reference(target, dataset, tmp_path_factory):
    return cache_teacher_signals(target, dataset, tmp_path_factory.mktemp("ref") / "cache", top_k=TOP_K,
                                 batch_size=2, shard_size=2, progress=False)


def direct(target, ids):
    with torch.no_grad():
        out = target.model(torch.tensor([ids]), output_hidden_states=True)
    return torch.log_softmax(out.logits[0].float(), -1), out.hidden_states[-1][0]


def test_cache_equals_a_direct_forward(target, dataset, reference):
    assert len(reference) == len(LENGTHS) and reference.top_k == TOP_K and reference.has_hidden
    for i, n in enumerate(LENGTHS):
        logprobs, hidden = direct(target, dataset[i]["input_ids"])
        item = reference[i]
        assert item["topk_logprobs"].shape == (n, TOP_K) and item["topk_logprobs"].dtype == torch.float32
        assert item["topk_ids"].dtype == torch.int64 and item["hidden"].shape == (n, 64)
        # The k largest values, descending, and each is the log-prob of the id stored beside it
        # (compared through the ids, so a near-tie ordered differently in a batch cannot fail this).
        torch.testing.assert_close(item["topk_logprobs"], logprobs.topk(TOP_K, -1).values, atol=1e-2, rtol=1e-3)
        torch.testing.assert_close(item["topk_logprobs"], logprobs.gather(-1, item["topk_ids"]), atol=1e-2, rtol=1e-3)
        torch.testing.assert_close(item["hidden"], hidden, atol=1e-2, rtol=1e-3)
    assert reference[-1]["topk_ids"].shape[0] == LENGTHS[-1]
    with pytest.raises(IndexError):
        reference[len(LENGTHS)]


def test_teacher_forward_hidden_feeds_the_lm_head(target, dataset):
    rows = [dataset[i] for i in range(3)]
    batch = pad_batch(rows, pad_id=0)
    logits, hidden = teacher_forward(target.model, batch["input_ids"], batch["attention_mask"], want_hidden=True)
    assert logits.shape[:2] == hidden.shape[:2] == batch["input_ids"].shape and not logits.requires_grad
    torch.testing.assert_close(target.model.get_output_embeddings()(hidden), logits, atol=1e-5, rtol=1e-5)
    for b, row in enumerate(rows):  # right padding leaves every row's real positions as they are alone
        n = len(row["input_ids"])
        torch.testing.assert_close(torch.log_softmax(logits[b, :n], -1), direct(target, row["input_ids"])[0],
                                   atol=1e-5, rtol=1e-5)
    assert teacher_forward(target.model, batch["input_ids"], batch["attention_mask"], want_hidden=False)[1] is None


def test_size_is_printed_before_anything_is_written(target, dataset, tmp_path, monkeypatch, capsys):
    out_dir = tmp_path / "cache"
    seen = []
    real_create = teacher_module.create_run_dir

    def spy(*args, **kwargs):
        seen.append((capsys.readouterr().err, out_dir.exists()))
        return real_create(*args, **kwargs)

    monkeypatch.setattr(teacher_module, "create_run_dir", spy)
    cache = cache_teacher_signals(target, dataset, out_dir, top_k=TOP_K, shard_size=2, progress=False)
    [(err, existed)] = seen
    assert not existed
    assert err.startswith(f"teacher cache: 5 examples, {sum(LENGTHS)} tokens, top-4 log-probs + 64-d hidden "
                          "states in float16 = ")
    stored = 0
    for shard in sorted(out_dir.glob("shard-*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            stored += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    assert err.strip().endswith(teacher_module._human_bytes(stored))  # the estimate is the tensors' size
    assert len(cache) == 5


def test_without_hidden_states(target, dataset, tmp_path, reference):
    cache = cache_teacher_signals(target, dataset, tmp_path / "c", top_k=TOP_K, hidden=False, dtype=torch.float32,
                                  progress=False)
    assert not cache.has_hidden and "hidden" not in cache[1]
    torch.testing.assert_close(cache[1]["topk_logprobs"], reference[1]["topk_logprobs"], atol=1e-2, rtol=1e-3)


def test_resume_after_interruption(target, dataset, reference, tmp_path, monkeypatch, capsys):
    out_dir = tmp_path / "cache"
    calls = []
    real_shard = teacher_module._shard_tensors

    def crash_on_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_shard(*args, **kwargs)

    monkeypatch.setattr(teacher_module, "_shard_tensors", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        cache_teacher_signals(target, dataset, out_dir, top_k=TOP_K, batch_size=2, shard_size=2, progress=False)
    assert sorted(p.name for p in out_dir.iterdir()) == ["manifest.json", "shard-00000.safetensors"]
    with pytest.raises(InvalidInputError, match="unfinished"):
        TeacherCache(out_dir)

    first = out_dir / "shard-00000.safetensors"
    stamp = first.stat().st_mtime_ns
    calls.clear()
    monkeypatch.setattr(teacher_module, "_shard_tensors", lambda *a, **k: (calls.append(1), real_shard(*a, **k))[1])
    cache = cache_teacher_signals(target, dataset, out_dir, top_k=TOP_K, batch_size=3, shard_size=2, progress=False)
    assert len(calls) == 2 and first.stat().st_mtime_ns == stamp
    assert "resuming, 1/3 shards done" in capsys.readouterr().err
    for i in range(len(LENGTHS)):
        for key in ("topk_logprobs", "topk_ids", "hidden"):
            torch.testing.assert_close(cache[i][key], reference[i][key], atol=1e-2, rtol=1e-3)

    calls.clear()  # finished: a rerun just opens it
    cache_teacher_signals(target, dataset, out_dir, top_k=TOP_K, batch_size=3, shard_size=2, progress=False)
    assert not calls


def test_other_settings_are_refused(target, dataset, tmp_path, capsys):
    out_dir = tmp_path / "cache"
    cache_teacher_signals(target, dataset, out_dir, top_k=TOP_K, shard_size=2, progress=False)
    before = {p.name: p.read_bytes() for p in out_dir.iterdir()}
    capsys.readouterr()
    for change in (dict(top_k=3), dict(hidden=False), dict(dtype=torch.bfloat16), dict(shard_size=3)):
        with pytest.raises(InvalidInputError, match="other settings") as info:
            cache_teacher_signals(target, dataset, out_dir, **{"top_k": TOP_K, "shard_size": 2, "progress": False,
                                                               **change})
        assert "\n" not in str(info.value)
    reversed_ids = dataset.map(lambda r: {"input_ids": r["input_ids"][::-1]})
    capsys.readouterr()
    with pytest.raises(InvalidInputError, match="dataset_fingerprint"):
        cache_teacher_signals(target, reversed_ids, out_dir, top_k=TOP_K, shard_size=2, progress=False)
    assert capsys.readouterr().err == ""  # refused before the size line
    assert {p.name: p.read_bytes() for p in out_dir.iterdir()} == before


@pytest.mark.parametrize("damage", ["truncate", "garbage", "delete", "wrong-tensors"])
def test_damaged_shard_is_a_one_line_error_naming_it(target, dataset, tmp_path, damage):
    out_dir = tmp_path / "cache"
    cache_teacher_signals(target, dataset, out_dir, top_k=TOP_K, shard_size=2, progress=False)
    shard = out_dir / "shard-00001.safetensors"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "garbage":
        shard.write_bytes(b"garbage")
    elif damage == "delete":
        shard.unlink()
    else:
        shutil.copy(out_dir / "shard-00002.safetensors", shard)  # a shard of another size
    with pytest.raises(InvalidInputError, match="shard-00001.safetensors") as info:
        TeacherCache(out_dir)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("damage", ["missing", "not-json", "other-kind"])
def test_damaged_manifest_is_a_one_line_error_naming_it(target, dataset, tmp_path, damage):
    out_dir = tmp_path / "cache"
    cache_teacher_signals(target, dataset, out_dir, top_k=TOP_K, shard_size=5, progress=False)
    manifest = out_dir / "manifest.json"
    if damage == "missing":
        manifest.unlink()
    elif damage == "not-json":
        manifest.write_text("{ nope")
    else:
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "kind": "something-else"}))
    with pytest.raises(InvalidInputError, match="manifest.json" if damage != "other-kind" else "something-else") as info:
        TeacherCache(out_dir)
    assert "\n" not in str(info.value)


def test_bad_arguments(target, dataset, tmp_path):
    for bad in (dict(top_k=0), dict(top_k=10_000), dict(batch_size=0), dict(dtype=torch.int8)):
        with pytest.raises(InvalidInputError) as info:
            cache_teacher_signals(target, dataset, tmp_path / "c", **{"progress": False, **bad})
        assert "\n" not in str(info.value)
    with pytest.raises(InvalidInputError, match="input_ids"):
        cache_teacher_signals(target, dataset.remove_columns("input_ids"), tmp_path / "c", progress=False)
    assert not (tmp_path / "c").exists()


def test_sparse_teacher_probs_is_the_renormalized_top_k():
    g = torch.Generator().manual_seed(0)
    full = torch.log_softmax(torch.randn(2, 3, 10, generator=g), -1)
    values, ids = full.topk(4, -1)
    dense = sparse_teacher_probs(values, ids, 10)
    assert dense.shape == (2, 3, 10)
    torch.testing.assert_close(dense.sum(-1), torch.ones(2, 3))
    outside = torch.ones_like(dense, dtype=torch.bool).scatter_(-1, ids, False)
    assert bool((dense[outside] == 0).all())
    kept = full.exp().gather(-1, ids)
    torch.testing.assert_close(dense.gather(-1, ids), kept / kept.sum(-1, keepdim=True))


def test_pad_batch():
    rows = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "index": 4}, {"input_ids": [8], "loss_mask": [1], "index": 0}]
    batch = pad_batch(rows, pad_id=9)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch["index"].tolist() == [4, 0]
    assert set(pad_batch([{"input_ids": [1]}], pad_id=0)) == {"input_ids", "attention_mask"}
    for bad in ([], [{"input_ids": []}], [{"input_ids": [1, 2], "loss_mask": [1]}], [{"loss_mask": [1]}]):
        with pytest.raises(InvalidInputError):
            pad_batch(bad, pad_id=0)
