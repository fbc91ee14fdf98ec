"""The machine's measured costs (speculative/calibrate.py): measured once, remembered across processes,
shared under a lock, and skipped when calibration is off."""

import json
import multiprocessing

import pytest

from draftsmith.speculative import calibrate
from draftsmith.speculative.adaptive import AdaptiveDraftLength, round_price


def test_remembered_measures_once_and_later_processes_read_it(machine_cache):
    calls = []
    assert calibrate.remembered("k", lambda: calls.append(1) or [1.0, 2.0]) == [1.0, 2.0]
    assert calibrate.remembered("k", lambda: calls.append(1) or [9.0]) == [1.0, 2.0] and len(calls) == 1
    stored = json.loads(machine_cache.read_text())
    (key,) = stored
    assert key.endswith("|k") and calibrate.device_name() in key and "threads" in key
    calibrate._memory.clear()  # another process: the file answers
    assert calibrate.remembered("k", lambda: calls.append(1) or [9.0]) == [1.0, 2.0] and len(calls) == 1
    machine_cache.write_text("{not json")  # a damaged file: measured again and rewritten
    calibrate._memory.clear()
    assert calibrate.remembered("k", lambda: [3.0]) == [3.0] and json.loads(machine_cache.read_text())


def _measure_in_child(args):
    cache, key = args
    import os

    os.environ["DRAFTSMITH_CACHE"] = cache
    from draftsmith.speculative import calibrate as c

    return c.remembered(key, lambda: [float(os.getpid())])


def test_parallel_processes_agree_on_one_measurement(machine_cache):
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        answers = pool.map(_measure_in_child, [(str(machine_cache.parent), "race")] * 6)
    assert len({tuple(a) for a in answers}) == 1  # one process measured; the others read its value


def test_pass_costs_of_a_tiny_target(target, machine_cache, monkeypatch):
    costs = calibrate.pass_costs(target)
    assert len(costs) == calibrate.MAX_POSITIONS and costs[0] == 1.0 and all(c > 0 for c in costs)
    assert calibrate.pass_costs(target) == costs
    timed = []
    monkeypatch.setattr(calibrate, "time_passes", lambda *a: timed.append(1) or {n: 1.0 for n in range(1, 10)})
    assert calibrate.pass_costs(target, path="3f2a+gqa") == [1.0] * 9 and timed  # another linear path: timed anew
    assert calibrate.pass_costs(target) == costs and len(timed) == 1
    monkeypatch.setenv("DRAFTSMITH_CALIBRATE", "0")
    assert calibrate.pass_costs(target) is None


def test_an_unwritable_cache_still_measures(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(blocker / "sub"))  # under a file: cannot be created
    monkeypatch.setattr(calibrate, "_memory", {})
    assert calibrate.remembered("k", lambda: [4.0]) == [4.0]


def test_measured_pass_costs_are_made_non_decreasing():
    assert calibrate.monotone([1.0, 1.05, 1.1, 1.6]) == [1.0, 1.05, 1.1, 1.6]  # already monotone: kept
    assert calibrate.monotone([1.0, 0.96, 1.2, 1.34]) == [1.0, 1.0, 1.2, 1.34]  # a dip below a step: 1
    assert calibrate.monotone([1.0, 1.46, 1.5, 1.79, 1.94, 1.82]) == [1.0, 1.46, 1.5, 1.79, 1.88, 1.88]
    smoothed = calibrate.monotone([1.0, 1.3, 1.1, 1.2, 2.0])
    assert smoothed == sorted(smoothed) and smoothed[1:4] == [pytest.approx(1.2)] * 3 and smoothed[4] == 2.0


def test_rounds_timed_per_running_batch_price_those_batches_and_the_model_prices_larger_ones():
    # Passes alone say 4 rows of 3 positions are cheap; the rounds timed at 4 rows say drafting does not pay.
    cheap_passes = {1: [1.0, 1.05, 1.1, 1.15, 1.2], 4: [1.0, 1.1, 1.2, 1.3, 1.4], 8: [1.0, 1.2, 1.4, 1.6, 1.8]}
    timed = {1: [1.2, 1.3, 1.4, 1.5], 4: [1.6, 2.0, 2.5, 3.0]}
    assert round_price(1, 0.05, 0.01, cheap_passes, 4, timed) == 1.6
    assert round_price(2, 0.05, 0.01, cheap_passes, 2, timed) == pytest.approx(1.3 + (2.0 - 1.3) / 3)  # between
    assert round_price(2, 0.05, 0.01, cheap_passes, 8, timed) == pytest.approx(1.4 + 0.11)  # beyond: the model
    policy = AdaptiveDraftLength(0.05, round_cost=0.01, pass_costs=cheap_passes, round_costs=timed, prior=0.5)
    policy.add_rows(4)
    assert policy.lengths([4] * 4) == [0] * 4  # 4 rows at a = 0.5: 1.5 tokens each for 1.6 steps does not pay
    untimed = AdaptiveDraftLength(0.05, round_cost=0.01, pass_costs=cheap_passes, round_costs=timed[1], prior=0.5)
    untimed.add_rows(4)
    assert untimed.lengths([4] * 4) == [2] * 4  # batch 1 timed only: the cheap batch-4 passes say D=2 pays
    policy.add_rows(4)
    assert policy.lengths([4] * 8) == [1] * 8  # 8 rows: priced by the model (P_8(2) + r + c = 1.26)


def test_a_drafters_costs_are_a_line_fitted_to_what_its_rounds_add():
    assert calibrate.fit_draft_costs([1, 3], [0.15, 0.31]) == {"per_token": 0.08, "per_round": 0.07}
    assert calibrate.fit_draft_costs([1, 2, 4], [0.2, 0.19, 0.18]) == {"per_token": 0.0, "per_round": 0.19}
    # a negative intercept (noise): a line through the origin instead, never a negative cost
    assert calibrate.fit_draft_costs([1, 3], [0.02, 0.3]) == {"per_token": 0.092, "per_round": 0.0}


def test_draft_costs_are_measured_per_drafter_and_remembered(target, machine_cache, monkeypatch):
    from draftsmith.speculative.draft_lm import DraftModelProposer
    from draftsmith.speculative.generate import SpeculativeDecoder
    from draftsmith.speculative.ngram import NGramProposer
    from draftsmith.speculative.tiny import tiny_model

    small = SpeculativeDecoder(target, DraftModelProposer(tiny_model(1, num_layers=1)))
    large = SpeculativeDecoder(target, DraftModelProposer(tiny_model(2, num_layers=4, hidden_size=256)))
    assert set(small.draft_costs) == {"per_token", "per_round", "rounds"}
    assert small.draft_costs["per_token"] >= 0 and small.draft_costs["per_round"] >= 0
    rounds = small.draft_costs["rounds"]  # C_B(1..4) per running batch B, each against B rows drafting nothing
    assert sorted(rounds) == list(calibrate.ROUND_BATCHES) == [1, 2, 4]
    for costs in rounds.values():
        assert len(costs) == 4 and costs == sorted(costs) and costs[0] >= 1.0
    # each drafter shape is measured under its own key (which of the two costs more is a timing, left to the
    # benchmarks: on a shared machine a busy neighbour can invert two tiny drafters' costs)
    assert large.draft_costs is not small.draft_costs and set(large.draft_costs) == set(small.draft_costs)
    assert json.loads(machine_cache.read_text()).keys() >= {k for k in calibrate._memory if "draft costs" in k}
    assert len([k for k in calibrate._memory if "draft costs" in k]) == 2
    calls = []
    monkeypatch.setattr(calibrate, "time_rounds", lambda *a: calls.append(a))
    again = SpeculativeDecoder(target, DraftModelProposer(tiny_model(3, num_layers=1)))  # same shapes: read
    assert again.draft_costs == small.draft_costs and not calls
    calibrate._memory.clear()  # a later process: read back from machine.json, batch sizes as numbers again
    assert SpeculativeDecoder(target, DraftModelProposer(tiny_model(3, num_layers=1))).draft_costs == small.draft_costs
    assert not calls
    assert SpeculativeDecoder(target, NGramProposer()).draft_costs is None  # nothing of its own to time
    monkeypatch.setenv("DRAFTSMITH_CALIBRATE", "0")
    assert SpeculativeDecoder(target, DraftModelProposer(tiny_model(1, num_layers=1))).draft_costs is None


def test_a_decoder_built_for_fixed_draft_lengths_measures_only_when_an_adaptive_request_comes(target, machine_cache,
                                                                                             monkeypatch):
    from draftsmith.speculative.draft_lm import DraftModelProposer
    from draftsmith.speculative.generate import SpeculativeDecoder
    from draftsmith.speculative.options import DecodeOptions
    from draftsmith.speculative.tiny import tiny_model

    timed = []
    real_pass_costs, real_draft_costs = calibrate.batch_pass_costs, calibrate.draft_costs
    monkeypatch.setattr(calibrate, "batch_pass_costs", lambda *a: (timed.append("passes"), real_pass_costs(*a))[1])
    monkeypatch.setattr(calibrate, "draft_costs", lambda d: (timed.append("rounds"), real_draft_costs(d))[1])
    decoder = SpeculativeDecoder(target, DraftModelProposer(tiny_model(1, num_layers=1)), measure_costs=False)
    fixed = decoder.generate([[1, 2, 3]], options=DecodeOptions(max_new_tokens=6, draft_len=2))
    assert not timed and decoder.pass_costs is None and decoder.draft_costs is None
    adaptive = decoder.generate([[1, 2, 3]], options=DecodeOptions(max_new_tokens=6, draft_len=2, adaptive=True))
    assert timed == ["passes", "rounds"] and decoder.draft_costs is not None
    assert adaptive.tokens == fixed.tokens  # (exact either way)
    decoder.generate([[1, 2, 3]], options=DecodeOptions(max_new_tokens=6, draft_len=2, adaptive=True))
    assert timed == ["passes", "rounds"]  # once per decoder
    built = SpeculativeDecoder(target, DraftModelProposer(tiny_model(1, num_layers=1)))
    assert timed[2:] == ["passes", "rounds"] and built.draft_costs == decoder.draft_costs  # measured when built
