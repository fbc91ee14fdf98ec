"""The statistics of the evaluation on hand-made numbers."""

import numpy as np
import pytest

from draftsmith.eval.settings import EvalSettings, parse_mode
from draftsmith.eval.stats import (
    bootstrap_ratio_ci, chi_square_homogeneity, chi_square_p, paired_ratio_change, pooled_table, predicted_al,
    total_variation,
)
from draftsmith.speculative.errors import InvalidInputError


def test_predicted_al_from_position_rates():
    assert predicted_al([1.0, 1.0, 1.0], 3) == 4.0
    assert predicted_al([0.5, 0.5], 2) == pytest.approx(1.75)
    assert predicted_al([0.8, None, 0.9], 3) == pytest.approx(1.8)  # an unreached position ends the sum
    assert predicted_al([0.8, 0.5], 1) == pytest.approx(1.8)


def test_bootstrap_ratio_ci_brackets_the_estimate():
    rng = np.random.default_rng(0)
    rounds = rng.integers(5, 20, size=40)
    emitted = rounds * rng.uniform(1.5, 2.5, size=40)
    lo, hi = bootstrap_ratio_ci(emitted, rounds, resamples=1000, confidence=0.95, seed=1)
    assert lo < emitted.sum() / rounds.sum() < hi and hi - lo < 0.3
    assert bootstrap_ratio_ci([6, 6], [3, 3], resamples=200, confidence=0.95, seed=0) == (2.0, 2.0)


def test_paired_change_of_identical_runs_is_zero_and_of_a_drop_is_negative():
    same = paired_ratio_change([6, 8], [3, 4], [6, 8], [3, 4], resamples=200, confidence=0.95, seed=0)
    assert same["change"] == 0 and same["relative_ci"] == [0.0, 0.0]
    drop = paired_ratio_change([6, 8, 9], [3, 4, 3], [4, 5, 4], [3, 4, 3], resamples=200, confidence=0.95, seed=0)
    assert drop["relative"] < 0 and drop["relative_ci"][1] < 0


def test_chi_square_accepts_one_distribution_and_rejects_two():
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.3, 0.15, 0.05])

    def counts(probs, n):
        values, freq = np.unique(rng.choice(len(probs), size=n, p=probs), return_counts=True)
        return {int(v): int(f) for v, f in zip(values, freq)}

    same = chi_square_p(*chi_square_homogeneity(pooled_table(counts(p, 400), counts(p, 400))))
    other = chi_square_p(*chi_square_homogeneity(pooled_table(counts(p, 400), counts(p[::-1], 400))))
    assert same > 0.01 and other < 1e-10


def test_rare_categories_are_pooled():
    table = pooled_table({"a": 50, "b": 3, "c": 2}, {"a": 40, "b": 4, "d": 3})
    assert table.shape == (2, 2) and table.sum() == 102  # a, and b + c + d pooled (12 >= 10)
    tiny = pooled_table({"a": 50, "b": 1}, {"a": 50, "c": 1})
    assert tiny.shape == (2, 1) and chi_square_homogeneity(tiny) == (0.0, 0)
    assert total_variation({"a": 1}, {"b": 1}) == 1.0


def test_modes_and_settings_are_validated():
    assert parse_mode("greedy").greedy
    params = parse_mode("sample:0.7:0.9:50", seed=3)
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.7, 0.9, 50, 3)
    for bad in ("sample", "sample:x", "sample:0", "beam:4", "greedy:1"):
        with pytest.raises(InvalidInputError):
            parse_mode(bad)
    with pytest.raises(InvalidInputError, match="draft-lens"):
        EvalSettings(draft_lens=[0])
    with pytest.raises(InvalidInputError, match="unknown eval setting 'nope'"):
        EvalSettings.from_dict({"nope": 1})
    assert EvalSettings(draft_lens=[4, 1, 4]).draft_lens == [1, 4]
