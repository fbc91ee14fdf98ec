"""Draft-length advice on hand-made costs and sweeps whose right answer is computed by hand.

Costs are powers of two where a comparison is exact, so ties are ties in floating point too."""

import pytest

from draftsmith.eval.advice import advise, measure_costs
from draftsmith.eval.decoding import Pass
from draftsmith.speculative.draft_lm import DraftModelProposer
from draftsmith.speculative.generate import DecodeStats
from draftsmith.speculative.tiny import tiny_model


def swept(draft_len, tokens, seconds, rounds=10, mode="greedy", batch_size=1, verify_s=0.0, other_s=0.0,
          draft_s=0.0):
    """A measured pass: one generate call of `rounds` batch rounds."""
    call = DecodeStats(draft_len=draft_len, new_tokens=tokens, total_s=seconds, round_s=[seconds / rounds] * rounds,
                       verify_s=verify_s, other_s=other_s, draft_s=draft_s)
    return Pass(mode, draft_len, batch_size, [], [call])


def costs(plain=0.010, verify=(0.012, 0.014, 0.016), draft=0.002):
    return {"plain_step_s": plain, "verify_s": {d + 1: v for d, v in enumerate(verify)}, "draft_step_s": draft,
            "draft_step_source": "timed"}


SWEEP = [swept(1, 120, 1.0), swept(2, 130, 1.0), swept(3, 110, 1.0)]
PLAIN = swept(0, 100, 1.0)


def test_expected_throughput_by_hand():
    """alphas 0.8, 0.5, 0.5: E[AL] = 1.8, 2.2, 2.4; a round costs D * 2 ms + verify(D); plain 10 ms/token."""
    advice = advise(costs(), [0.8, 0.5, 0.5], SWEEP, PLAIN, batch_size=1)
    expected = {row["draft_len"]: row for row in advice["expected"]}
    assert list(expected) == [0, 1, 2, 3]  # D_max = 3 measured positions: nothing extrapolated past them
    assert [expected[d]["expected_al"] for d in range(4)] == pytest.approx([1.0, 1.8, 2.2, 2.4])
    rates = [1 / 0.010, 1.8 / 0.014, 2.2 / 0.018, 2.4 / 0.022]
    assert [expected[d]["expected_tokens_per_s"] for d in range(4)] == pytest.approx(rates)
    assert [expected[d]["expected_speedup"] for d in range(4)] == pytest.approx([r / rates[0] for r in rates])
    assert advice["recommended_draft_len"] == 1
    assert advice["relative_costs"]["draft_step"] == pytest.approx(0.2)
    assert advice["relative_costs"]["verify"] == pytest.approx({1: 1.2, 2: 1.4, 3: 1.6})
    assert advice["costs"]["overhead_spec_s"] == 0 and advice["costs"]["overhead_plain_s"] == 0


def test_measured_side_and_agreement():
    advice = advise(costs(), [0.8, 0.5, 0.5], SWEEP, PLAIN, batch_size=1)
    assert advice["measured"] == [{"draft_len": 0, "tokens_per_s": 100.0}, {"draft_len": 1, "tokens_per_s": 120.0},
                                  {"draft_len": 2, "tokens_per_s": 130.0}, {"draft_len": 3, "tokens_per_s": 110.0}]
    assert advice["measured_best_draft_len"] == 2 and not advice["agrees"]
    assert advice["recommended_vs_best"] == pytest.approx(120 / 130)
    assert advice["mode"] == "greedy" and advice["batch_size"] == 1


def test_poor_acceptance_recommends_not_speculating():
    advice = advise(costs(), [0.05, 0.05, 0.05], SWEEP, PLAIN, batch_size=1)
    assert advice["recommended_draft_len"] == 0
    assert all(row["expected_speedup"] < 1 for row in advice["expected"][1:])


def test_a_tie_with_plain_decoding_does_not_speculate():
    """D = 1: AL 1.5 per 0.25 + 0.5 s is 2 tokens/s, exactly plain's 1 / 0.5 s: no gain, so D = 0."""
    advice = advise(costs(plain=0.5, verify=(0.5,), draft=0.25), [0.5], SWEEP[:1], PLAIN, batch_size=1)
    assert [row["expected_tokens_per_s"] for row in advice["expected"]] == [2.0, 2.0]
    assert advice["recommended_draft_len"] == 0
    # A hair cheaper drafting breaks the tie the other way.
    assert advise(costs(plain=0.5, verify=(0.5,), draft=0.2499), [0.5], SWEEP[:1], PLAIN,
                  batch_size=1)["recommended_draft_len"] == 1


def test_an_unreached_position_adds_cost_and_no_tokens():
    """alphas 0.9, None, None: positions 2 and 3 were never offered, so E[AL] stays 1.9 and longer
    drafts only cost more."""
    advice = advise(costs(), [0.9, None, None], SWEEP, PLAIN, batch_size=1)
    assert [row["expected_al"] for row in advice["expected"]] == pytest.approx([1.0, 1.9, 1.9, 1.9])
    assert advice["recommended_draft_len"] == 1


def test_round_overheads_and_batch_size():
    """Overheads per batch round come from the sweep's passes (spec: the mean over passes); throughput
    counts every row of the batch."""
    sweep = [swept(1, 120, 1.0, rounds=10, verify_s=0.005, other_s=0.005),  # 1 ms per round
             swept(2, 130, 1.0, rounds=10, other_s=0.03)]  # 3 ms per round
    plain = swept(0, 100, 1.0, rounds=20, other_s=0.04)  # 2 ms per round
    advice = advise(costs(verify=(0.012, 0.014)), [0.8, 0.5], sweep, plain, batch_size=4)
    assert advice["costs"]["overhead_spec_s"] == pytest.approx(0.002)
    assert advice["costs"]["overhead_plain_s"] == pytest.approx(0.002)
    rates = [4 / 0.012, 4 * 1.8 / 0.016, 4 * 2.2 / 0.020]
    assert [row["expected_tokens_per_s"] for row in advice["expected"]] == pytest.approx(rates)


def test_draft_cost_from_the_sweep_when_there_is_no_model_to_time():
    """n-gram and Medusa drafters have no draft model: the cost of one draft position is the sweep's
    draft time per batch round and drafted position, averaged over the passes."""
    sweep = [swept(1, 120, 1.0, rounds=10, draft_s=0.02),  # 2 ms per round, 1 position
             swept(2, 130, 1.0, rounds=10, draft_s=0.06)]  # 6 ms per round, 2 positions: 3 ms each
    advice = advise({**costs(verify=(0.012, 0.014)), "draft_step_s": None, "draft_step_source": "sweep"},
                    [0.8, 0.5], sweep, PLAIN, batch_size=1)
    assert advice["costs"]["draft_step_s"] == pytest.approx(0.0025)
    assert advice["expected"][1]["expected_tokens_per_s"] == pytest.approx(1.8 / (0.0025 + 0.012))


def test_an_unswept_recommendation_has_no_measured_ratio():
    advice = advise(costs(verify=(0.012, 0.014, 0.030)), [0.9, 0.9, 0.9], [SWEEP[0], SWEEP[2]], PLAIN,
                    batch_size=1)
    assert advice["recommended_draft_len"] == 2  # E[AL] 2.71 in 18 ms beats 1.9 in 14 ms and 3.44 in 36 ms
    assert advice["recommended_vs_best"] is None


def test_measured_costs_leave_the_caches_as_they_were(monkeypatch):
    """Each timed step is rolled back: the caches end where the prefill left them."""
    from draftsmith.eval import advice as advice_module

    states = []
    original = advice_module._prefilled
    monkeypatch.setattr(advice_module, "_prefilled", lambda *a, **k: states.append(original(*a, **k)) or states[-1])
    target, drafter = tiny_model(0, num_layers=2), tiny_model(1, num_layers=1)
    prompts = [[1, 72, 105], [1, 65, 66, 67, 68]]
    result = measure_costs(target, DraftModelProposer(drafter), prompts, batch_size=3, max_draft_len=3,
                           extra_context=4, reps=2)
    assert result["plain_step_s"] > 0 and result["draft_step_s"] > 0 and result["draft_step_source"] == "timed"
    assert sorted(result["verify_s"]) == [1, 2, 3] and all(v > 0 for v in result["verify_s"].values())
    assert len(states) == 2  # the target's cache and the drafter's
    for kv in states:
        assert kv.lengths.tolist() == [7, 9, 7]  # each context: prompt + 4 padded tokens
        assert kv.mask.shape[1] == 9 and kv.cache.get_seq_length() == 9
    assert measure_costs(target, None, prompts, 1, 2, 4, 1)["draft_step_source"] == "sweep"
