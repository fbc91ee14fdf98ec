"""A target's weight hash is computed once per model directory and cached beside it."""

import os

import pytest

from draftsmith.speculative import loading
from draftsmith.speculative.loading import WEIGHT_HASH_RECORD, load_model, state_dict_hash
from draftsmith.speculative.tiny import tiny_model, tiny_tokenizer


@pytest.fixture()
def model_dir(tmp_path):
    model = tiny_model(3, num_layers=1)
    model.save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def test_the_hash_is_cached_beside_the_weights_and_read_back_without_hashing(model_dir, monkeypatch):
    first = load_model(str(model_dir)).weight_hash()
    assert first == state_dict_hash(load_model(str(model_dir)).model)
    assert (model_dir / WEIGHT_HASH_RECORD).is_file()

    def no_hashing(model):
        raise AssertionError("hashed all weights again")

    monkeypatch.setattr(loading, "state_dict_hash", no_hashing)
    assert load_model(str(model_dir)).weight_hash() == first


def test_changed_weights_are_hashed_again(model_dir):
    first = load_model(str(model_dir)).weight_hash()
    other = tiny_model(4, num_layers=1)
    other.save_pretrained(model_dir)  # new weights, new size/mtime
    weights = model_dir / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    second = load_model(str(model_dir)).weight_hash()
    assert second != first and second == state_dict_hash(other)


def test_a_corrupt_record_is_replaced(model_dir):
    expected = load_model(str(model_dir)).weight_hash()
    (model_dir / WEIGHT_HASH_RECORD).write_text("{not json")
    assert load_model(str(model_dir)).weight_hash() == expected
    assert expected in (model_dir / WEIGHT_HASH_RECORD).read_text()


def test_a_directory_that_cannot_be_written_still_gets_its_hash(model_dir, monkeypatch):
    def refuse(path, value):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(loading, "atomic_write_json", refuse)
    assert load_model(str(model_dir)).weight_hash() == state_dict_hash(load_model(str(model_dir)).model)
    assert not (model_dir / WEIGHT_HASH_RECORD).exists()
