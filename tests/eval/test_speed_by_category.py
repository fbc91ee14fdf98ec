"""Per-category speed against plain decoding (eval/speed.by_category), on passes with known timings, and
the adaptive row's settings."""

import pytest

from draftsmith.eval import markdown
from draftsmith.eval.decoding import Pass, Trace
from draftsmith.eval.settings import EvalSettings
from draftsmith.eval.speed import by_category
from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.generate import DecodeStats

# 18 prompts, 6 per category; plain decodes every prompt at 10 tok/s give or take 5%.
CATEGORIES = ["fast"] * 6 + ["slow"] * 6 + ["even"] * 6
JITTER = [1.0, 1.05, 0.95, 1.02, 0.98, 1.01]
# the speculative pass's speed over plain's, per category: always faster, always slower, and either way
RATIO = {"fast": [1.5, 1.45, 1.55, 1.5, 1.52, 1.48], "slow": [0.8, 0.82, 0.78, 0.8, 0.79, 0.81],
         "even": [1.3, 0.7, 1.25, 0.75, 1.2, 0.8]}


def make_pass(draft_len: int, seconds: list[float], adaptive: bool = False) -> Pass:
    traces = []
    for i, s in enumerate(seconds):
        stats = DecodeStats(draft_len=draft_len, new_tokens=100, total_s=s)
        traces.append(Trace(index=i, tokens=[1] * 100, finish="length", stats=stats))
    return Pass("greedy", draft_len, 1, traces, [t.stats for t in traces], adaptive)


def plain_and_spec():
    plain = [10.0 * JITTER[i % 6] for i in range(18)]
    spec = [p / RATIO[c][i % 6] for i, (p, c) in enumerate(zip(plain, CATEGORIES))]
    return make_pass(0, plain), make_pass(4, spec, adaptive=True)


def test_each_category_is_told_slower_faster_or_apart_by_its_ci():
    plain, spec = plain_and_spec()
    result = by_category(spec, plain, CATEGORIES, EvalSettings(), seed=0)
    assert (result["decoder"], result["draft_len"]) == ("adaptive", 4)
    cells = result["categories"]
    assert cells["fast"]["verdict"] == "faster" and cells["fast"]["speedup_ci"][0] > 1
    assert cells["slow"]["verdict"] == "slower" and cells["slow"]["speedup_ci"][1] < 1
    assert cells["even"]["verdict"] == "not told apart"
    assert cells["even"]["speedup_ci"][0] < 1 < cells["even"]["speedup_ci"][1]
    assert result["slower"] == ["slow"]
    # the speedup is the ratio of summed tokens over summed seconds on each side, not a mean of ratios
    slow = [i for i, c in enumerate(CATEGORIES) if c == "slow"]
    spec_rate = 100 * len(slow) / sum(spec.traces[i].stats.total_s for i in slow)
    plain_rate = 100 * len(slow) / sum(plain.traces[i].stats.total_s for i in slow)
    assert cells["slow"]["speedup"] == pytest.approx(spec_rate / plain_rate)
    assert cells["slow"]["plain_tokens_per_s"] == pytest.approx(plain_rate)
    assert result["all"]["prompts"] == 18 and cells["fast"]["prompts"] == 6


def test_a_prompt_set_without_categories_has_the_overall_row_only():
    plain, spec = plain_and_spec()
    result = by_category(spec, plain, [""] * 18, EvalSettings(), seed=0)
    assert result["categories"] == {} and result["slower"] == [] and result["all"]["prompts"] == 18


def test_report_names_the_slower_categories_of_the_default():
    plain, spec = plain_and_spec()
    fixed = make_pass(2, [t.stats.total_s for t in plain.traces])
    rows = [by_category(p, plain, CATEGORIES, EvalSettings(), seed=0) for p in (fixed, spec)]
    lines = markdown._speed_by_category({"speed_by_category": rows}, EvalSettings().to_dict())
    text = "\n".join(lines)
    assert "| greedy: category | prompts | plain tok/s | D=2 | adaptive D<=4 |" in text
    assert "greedy, adaptive D<=4 (the default): slower than plain decoding in: slow." in text
    assert text.count("**slower**") == 1


@pytest.mark.parametrize("value", [-1, 2.5])
def test_adaptive_draft_len_must_be_a_count(value):
    with pytest.raises(InvalidInputError, match="--adaptive-draft-len"):
        EvalSettings(adaptive_draft_len=value)


def test_systems_take_turns_on_each_batch_of_prompts_in_rotating_order(monkeypatch):
    """decode_passes: every system decodes batch k before any decodes batch k + 1, the first to go rotating,
    and each pass still holds its own traces in prompt order."""
    from draftsmith.eval import decoding

    calls = []

    def fake_decode_batch(decoder, prompts, indices, settings, mode, draft_len, adaptive):
        calls.append((draft_len, adaptive, indices))
        traces = [Trace(i, [draft_len], "length") for i in indices]
        return traces, DecodeStats(draft_len=draft_len, new_tokens=len(indices), total_s=1.0)

    monkeypatch.setattr(decoding, "decode_batch", fake_decode_batch)
    systems = [decoding.System(None, "greedy", 0), decoding.System(None, "greedy", 2),
               decoding.System(None, "greedy", 4, adaptive=True)]
    passes = decoding.decode_passes(systems, [[1]] * 5, EvalSettings(), batch_size=2)
    assert calls == [(0, False, [0, 1]), (2, False, [0, 1]), (4, True, [0, 1]),
                     (2, False, [2, 3]), (4, True, [2, 3]), (0, False, [2, 3]),
                     (4, True, [4]), (0, False, [4]), (2, False, [4])]
    assert [(p.draft_len, p.adaptive, p.decoder) for p in passes] == [
        (0, False, "plain"), (2, False, "speculative"), (4, True, "adaptive")]
    assert all([t.index for t in p.traces] == [0, 1, 2, 3, 4] and len(p.calls) == 3 for p in passes)


def test_a_category_of_few_prompts_gets_no_verdict():
    plain, spec = plain_and_spec()
    keep = [i for i, c in enumerate(CATEGORIES) if c != "slow" or i % 6 < 3]  # 3 "slow" prompts left
    for p in (plain, spec):
        p.traces = [p.traces[i] for i in keep]
    result = by_category(spec, plain, CATEGORIES, EvalSettings(), seed=0)
    assert result["categories"]["slow"]["verdict"] == "too few prompts" and result["slower"] == []
    assert result["too_few_prompts"] == ["slow"] and result["categories"]["slow"]["speedup"] < 1
    assert "too few prompts to tell in 1 of 3 categories: slow" in markdown.slower_line(result)
