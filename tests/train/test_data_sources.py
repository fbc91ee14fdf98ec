"""A recipe's records: data.limit, data.shuffle and data.seed give the same records and the same held-out
split every time, and recipes that set none of the newer data keys keep their cache keys."""

import pytest

from draftsmith.speculative.errors import InvalidInputError
from draftsmith.train.config import load_recipe
from draftsmith.train.data_prep import data_options, load_records, split_heldout


def records(dataset_repo, *extra):
    recipe = load_recipe("tiny-draft-lm", [f"data.prompts=[hf:{dataset_repo}, hf:{dataset_repo}@test]",
                                           "data.columns.prompt=query", "data.limit=10", "data.heldout=4", *extra])
    train, heldout = split_heldout(load_records(recipe), recipe.data.heldout)
    return [m[0]["content"] for m in train["messages"]], [m[0]["content"] for m in heldout["messages"]]


def test_the_same_seed_gives_the_same_records_and_held_out_split(dataset_repo):
    train, heldout = records(dataset_repo)
    assert len(train) == 10 and len(heldout) == 4  # 10 of train, the 4 of test
    assert records(dataset_repo) == (train, heldout)
    assert records(dataset_repo, "data.seed=0") == (train, heldout)  # data.seed defaults to train.seed
    other_train, other_heldout = records(dataset_repo, "data.seed=5")
    assert sorted(other_train + other_heldout) == sorted(train + heldout) and other_heldout != heldout


def test_shuffle_takes_a_seeded_sample_before_the_limit(dataset_repo):
    head = records(dataset_repo)
    sample = records(dataset_repo, "data.shuffle=true")
    assert sample == records(dataset_repo, "data.shuffle=true")
    assert set(sum(sample, [])) != set(sum(head, []))  # other records, not only another order
    assert sample != records(dataset_repo, "data.shuffle=true", "data.seed=7")


def test_only_the_newer_data_keys_that_are_set_enter_the_cache_key():
    assert data_options(load_recipe("eagle-smollm2")) == {}
    options = data_options(load_recipe("tiny-eagle", ["data.seed=3", "data.columns.prompt=q", "data.shuffle=true"]))
    assert options == {"data_seed": 3, "columns": {"prompt": "q"}, "shuffle": True}


def test_conflicting_column_names_are_refused(dataset_repo):
    with pytest.raises(InvalidInputError, match="data.prompt_column and data.columns"):
        records(dataset_repo, "data.prompt_column=topic")
    with pytest.raises(InvalidInputError, match="name one of data.columns.prompt, .conversation and .turns"):
        load_recipe("tiny-eagle", ["data.columns.prompt=a", "data.columns.turns=b"])
