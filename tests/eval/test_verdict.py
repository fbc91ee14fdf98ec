"""The keep / retune verdict on hand-made per-prompt records whose right answer is known."""

import pytest

from draftsmith.eval.settings import EvalSettings
from draftsmith.eval.verdict import EXIT_KEEP, EXIT_RETUNE, BaselineError, check_compatible, compare

FINGERPRINT, TOKENIZER = "f" * 64, "t" * 64


def record(prompt, emitted, rounds=10, mode="greedy", draft_len=2, category="chat", offered=None, accepted=None):
    return {"id": prompt, "category": category, "mode": mode, "draft_len": draft_len, "rounds": rounds,
            "emitted": emitted, "offered": offered or [rounds] * draft_len,
            "accepted": accepted or [rounds // 2] * draft_len}


def records(emitted, **kwargs):
    """One record per prompt p0, p1, ... with the given tokens emitted over 10 rounds each."""
    return [record(f"p{i}", e, **kwargs) for i, e in enumerate(emitted)]


def baseline(per_prompt, settings=None):
    settings = settings or EvalSettings(modes=["greedy"], draft_lens=[2])
    return {"_path": "old/report.json", "settings": settings.to_dict(), "per_prompt": per_prompt,
            "prompts": {"fingerprint": FINGERPRINT, "count": 4},
            "target": {"name": "old-target", "weight_hash": "a" * 64, "tokenizer_hash": TOKENIZER},
            "drafter": {"spec": "drafter-v1", "weight_hash": "b" * 64}}


def settings(**overrides):
    return EvalSettings(**{"modes": ["greedy"], "draft_lens": [2], **overrides})


def test_unchanged_acceptance_keeps():
    old = records([20, 25, 30, 15])
    result = compare(baseline(old), records([20, 25, 30, 15]), settings())
    (row,) = result["rows"]
    assert row["al"]["old"] == row["al"]["new"] == pytest.approx(90 / 40)
    assert row["al"]["change"] == 0 and row["al"]["change_ci"] == [0, 0] and row["al"]["relative"] == 0
    assert row["decision"] == "keep"
    verdict = result["verdict"]
    assert verdict["decision"] == "keep" and verdict["exit_code"] == EXIT_KEEP == 0
    assert verdict["reason"].startswith("keep:") and "greedy at D=2" in verdict["reason"]
    assert result["baseline"] == "old/report.json"
    assert result["baseline_target"] == {"name": "old-target", "weight_hash": "a" * 64}
    assert result["baseline_drafter"] == {"spec": "drafter-v1", "weight_hash": "b" * 64}


def test_a_uniform_drop_beyond_the_threshold_retunes():
    """Every prompt loses 20% of its AL: every resample says -20%, so the CI is [-0.2, -0.2]."""
    result = compare(baseline(records([20, 25, 30, 15])), records([16, 20, 24, 12]), settings())
    (row,) = result["rows"]
    assert row["al"]["relative"] == pytest.approx(-0.2)
    assert row["al"]["relative_ci"] == pytest.approx([-0.2, -0.2])
    assert row["al"]["change"] == pytest.approx(72 / 40 - 90 / 40)
    assert row["decision"] == "retune"
    verdict = result["verdict"]
    assert verdict["decision"] == "retune" and verdict["exit_code"] == EXIT_RETUNE == 3
    assert verdict["reason"].startswith("retune: with greedy at D=2 the AL fell from 2.25 to 1.80 (-20.0%")
    assert verdict["threshold"] == 0.05


@pytest.mark.parametrize("threshold, decision", [(0.25, "retune"), (0.2500001, "keep"), (0.0, "retune")])
def test_the_threshold_is_inclusive(threshold, decision):
    """AL 2.0 -> 1.5 is exactly -25% (exact in binary floating point): a 25% threshold retunes."""
    result = compare(baseline(records([20, 20, 20, 20])), records([15, 15, 15, 15]),
                     settings(retune_threshold=threshold))
    assert result["rows"][0]["al"]["relative"] == -0.25
    assert result["verdict"]["decision"] == decision
    assert result["rows"][0]["decision"] == decision


def test_a_gain_never_retunes_even_at_threshold_zero():
    result = compare(baseline(records([20, 20, 20, 20])), records([25, 25, 25, 25]), settings(retune_threshold=0.0))
    assert result["rows"][0]["al"]["relative"] == pytest.approx(0.25)
    assert result["verdict"]["decision"] == "keep"


def test_a_drop_carried_by_one_prompt_is_noise_and_keeps():
    """One prompt of four falls from AL 3 to 1, the rest are unchanged: -22% overall, but a third of the
    resamples leave that prompt out (change 0), so the CI reaches 0 and the rule keeps."""
    result = compare(baseline(records([30, 20, 20, 20])), records([10, 20, 20, 20]), settings())
    al = result["rows"][0]["al"]
    assert al["relative"] == pytest.approx(1.75 / 2.25 - 1)
    assert al["relative"] < -0.05 and al["relative_ci"][1] == 0
    assert result["verdict"]["decision"] == "keep"


def test_any_row_that_retunes_decides_and_the_worst_is_named():
    both = settings(modes=["greedy", "sample:1.0"], draft_lens=[1, 2])
    old, new = [], []
    for mode in ("greedy", "sample:1.0"):
        for d in (1, 2):
            old += records([20, 20, 20, 20], mode=mode, draft_len=d)
            # greedy unchanged; sampled D=1 loses 10%, sampled D=2 loses 30%
            drop = {("greedy", 1): 20, ("greedy", 2): 20, ("sample:1.0", 1): 18, ("sample:1.0", 2): 14}[mode, d]
            new += records([drop] * 4, mode=mode, draft_len=d)
    result = compare(baseline(old, both), new, both)
    decisions = {(r["mode"], r["draft_len"]): r["decision"] for r in result["rows"]}
    assert decisions == {("greedy", 1): "keep", ("greedy", 2): "keep",
                         ("sample:1.0", 1): "retune", ("sample:1.0", 2): "retune"}
    assert result["verdict"]["decision"] == "retune"
    assert "sample:1.0 at D=2" in result["verdict"]["reason"] and "(-30.0%" in result["verdict"]["reason"]


def test_position_rates_and_categories_are_paired():
    old = [record("a", 20, category="chat", offered=[10, 8], accepted=[8, 4]),
           record("b", 20, category="code", offered=[10, 6], accepted=[6, 3])]
    new = [record("a", 15, category="chat", offered=[10, 5], accepted=[5, 1]),
           record("b", 20, category="code", offered=[10, 6], accepted=[6, 3])]
    (row,) = compare(baseline(old), new, settings())["rows"]
    assert row["prompts"] == 2
    first, second = row["positions"]
    assert first["position"] == 1 and first["old"] == pytest.approx(14 / 20) and first["new"] == pytest.approx(11 / 20)
    assert second["position"] == 2 and second["old"] == pytest.approx(7 / 14) and second["new"] == pytest.approx(4 / 11)
    assert set(row["by_category"]) == {"chat", "code"}
    assert row["by_category"]["chat"]["relative"] == pytest.approx(-0.25)
    assert row["by_category"]["code"]["change"] == 0


def test_records_without_categories_have_no_category_split():
    (row,) = compare(baseline(records([20, 20], category="")), records([18, 18], category=""), settings())["rows"]
    assert row["by_category"] == {}


def test_records_that_do_not_pair_are_refused():
    old = records([20, 20, 20, 20])
    with pytest.raises(BaselineError, match="no records for greedy at D=3"):
        compare(baseline(old), records([20, 20, 20, 20], draft_len=3), settings())
    with pytest.raises(BaselineError, match="not this run's prompts"):
        compare(baseline(old), records([20, 20, 20]), settings())


def test_compatibility_with_the_baseline():
    old = baseline(records([20]))
    check_compatible(old, settings(), FINGERPRINT, 4, TOKENIZER)  # the same run: no error
    check_compatible(old, settings(bootstrap=2000, batch_sizes=[1, 4]), FINGERPRINT, 4, TOKENIZER)  # not compared
    with pytest.raises(BaselineError, match="max_new_tokens is 64 here but 128"):
        check_compatible(old, settings(max_new_tokens=64), FINGERPRINT, 4, TOKENIZER)
    with pytest.raises(BaselineError, match="prompt set"):
        check_compatible(old, settings(), "0" * 64, 4, TOKENIZER)
    with pytest.raises(BaselineError, match="tokenizer differs"):
        check_compatible(old, settings(), FINGERPRINT, 4, "0" * 64)
    # A setting newer than the baseline's report: absent there means its default.
    del old["settings"]["leaf_min_prob"]
    check_compatible(old, settings(), FINGERPRINT, 4, TOKENIZER)
    with pytest.raises(BaselineError, match="leaf_min_prob"):
        check_compatible(old, settings(leaf_min_prob=0.1), FINGERPRINT, 4, TOKENIZER)
