"""Adaptive draft length: each row drafts what its own acceptance pays for, backs off where drafts are
rejected, and no output changes (greedy equals the target's decoding; seeded rows repeat in any batch:
test_engine.py runs its exactness tests with the policy on too)."""

import copy

import pytest

from draftsmith.speculative import kinds
from draftsmith.speculative.adaptive import MAX_WAIT, AdaptiveDraftLength, best_draft_len, expected_tokens
from draftsmith.speculative.draft_lm import DraftModelProposer
from draftsmith.speculative.eagle3 import Eagle3Drafter, Eagle3Proposer
from draftsmith.speculative.early_exit import EarlyExitProposer
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.lookup import LookupFirstProposer
from draftsmith.speculative.ngram import NGramProposer
from draftsmith.speculative.options import DecodeOptions

PROMPTS = [[1, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100], [1, 65, 66, 67, 65, 66, 67, 65, 66, 67]]


def test_expected_tokens_and_the_best_length():
    assert expected_tokens(0.5, 0) == 1 and expected_tokens(0.5, 2) == 1.75
    assert best_draft_len(0.0, 0.1, 4) == 0  # nothing is ever accepted: plain decoding
    assert best_draft_len(0.05, 0.1, 4) == 0  # (1 + a) / (1 + c) < 1 while a < c
    assert best_draft_len(0.95, 0.0, 6) == 6  # free drafts: as many as allowed
    assert best_draft_len(0.6, 0.25, 8) == 2  # (1.96 / 1.5 beats 1.6 / 1.25 and 2.176 / 1.75)
    lengths = [best_draft_len(a / 20, 0.1, 8) for a in range(20)]
    assert lengths == sorted(lengths) and lengths[0] == 0 and lengths[-1] == 8  # more acceptance, longer


def run_policy(policy, accept, rounds, max_len=4):
    """Drive one row: `accept(d)` says how many of d draft tokens are accepted. The lengths drafted."""
    drafted = []
    for _ in range(rounds):
        d = policy.lengths([max_len])[0]
        drafted.append(d)
        policy.observe([d], [accept(d)])
    return drafted


def test_rejected_rows_back_off_exponentially_and_accepted_ones_draft_at_full_length():
    policy = AdaptiveDraftLength(0.15)
    policy.add_rows(1)
    drafted = run_policy(policy, lambda d: 0, 400)
    probes = [i for i, d in enumerate(drafted) if d > 0]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] == MAX_WAIT + 1  # waits double up to the cap
    assert sum(drafted) < 30  # after the first rounds, about one draft token every MAX_WAIT rounds

    good = AdaptiveDraftLength(0.05)
    good.add_rows(1)
    assert run_policy(good, lambda d: d, 20)[1:] == [4] * 19  # every draft accepted: D every round


def test_a_row_that_becomes_predictable_drafts_again():
    policy = AdaptiveDraftLength(0.1)
    policy.add_rows(1)
    run_policy(policy, lambda d: 0, 100)  # prose the drafter cannot guess
    after = run_policy(policy, lambda d: d, 2 * MAX_WAIT + 10)  # then text it guesses every time
    assert after[-5:] == [4] * 5


def test_rows_are_independent_and_follow_joins_and_leaves():
    policy = AdaptiveDraftLength(0.1)
    policy.add_rows(2)
    for _ in range(10):
        d = policy.lengths([4, 4])
        policy.observe(d, [0, d[1]])  # row 0 always rejected, row 1 always accepted
    assert policy.lengths([4, 4])[1] == 4 and policy.acceptance(0) < 0.2 < 0.9 < policy.acceptance(1)
    start = policy.starting_acceptance()  # what the rows so far saw (one always rejected, one accepted)
    assert 0.2 < start < 0.9
    policy.add_rows(1)  # a new greedy row starts from it
    policy.select([2, 1])  # row 0 leaves
    assert policy.acceptance(0) == pytest.approx(start) and policy.acceptance(1) > 0.9
    assert policy.lengths([0, 0]) == [0, 0]  # no room: nothing drafted, no wait spent


def test_draft_cost_is_the_drafters_matmuls_over_the_targets(target, random_drafter):
    cost = lambda p: kinds.of(p).draft_cost(p, target)  # noqa: E731
    assert cost(NGramProposer()) == 0.0
    assert cost(DraftModelProposer(target)) == pytest.approx(1.0)
    assert 0.0 < cost(EarlyExitProposer(target, 1)) < cost(EarlyExitProposer(target, 2)) < 1.0
    assert 0.0 < cost(DraftModelProposer(random_drafter)) < 1.0  # one layer against the target's three
    lookup = LookupFirstProposer(NGramProposer(3, 2), DraftModelProposer(random_drafter))
    assert cost(lookup) == cost(DraftModelProposer(random_drafter))


@pytest.mark.parametrize("kind", ["random", "ngram", "lookup-first", "eagle3"])
def test_greedy_output_is_the_targets_whatever_the_lengths(kind, target, random_drafter, hf_greedy):
    proposer = {"random": lambda: DraftModelProposer(random_drafter), "ngram": lambda: NGramProposer(3, 1),
                "lookup-first": lambda: LookupFirstProposer(NGramProposer(3, 2), DraftModelProposer(random_drafter)),
                "eagle3": lambda: Eagle3Proposer(Eagle3Drafter(target.config, [0, 1, 2]).attach_target(target,
                                                                                                      init=True)),
                }[kind]()
    decoder = SpeculativeDecoder(target, proposer)
    result = decoder.generate(PROMPTS, options=DecodeOptions(max_new_tokens=40, draft_len=4, adaptive=True))
    assert result.tokens == [hf_greedy(target, p, 40) for p in PROMPTS]
    fixed = decoder.generate(PROMPTS, options=DecodeOptions(max_new_tokens=40, draft_len=4))
    assert result.stats.mean_draft_len < fixed.stats.mean_draft_len  # rejected drafts were cut back


def test_options_are_checked():
    from draftsmith.speculative.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="verify cost"):
        DecodeOptions(adaptive=True, verify_cost=-0.1)


def test_a_per_round_cost_stops_short_drafts_that_do_not_pay_and_favours_long_ones():
    assert best_draft_len(0.45, 0.15, 4) >= 1  # per-token costs alone: drafting pays
    assert best_draft_len(0.45, 0.15, 4, round_cost=0.4) == 0  # a drafting round's own cost: it does not
    assert best_draft_len(0.8, 0.15, 4, round_cost=0.4) == 4  # well-accepted rows amortise it over D
    assert best_draft_len(0.8, 0.15, 1, round_cost=0.4) == 1


def test_without_calibration_the_default_costs_follow_the_device_and_the_weight_width(target, monkeypatch):
    import torch

    from draftsmith.speculative.adaptive import ROUND_COST, VERIFY_COST, adaptive_lengths, cost_key

    monkeypatch.setenv("DRAFTSMITH_CALIBRATE", "0")
    assert cost_key(torch.device("cpu"), torch.float32) == "cpu"
    assert cost_key(torch.device("cpu"), torch.bfloat16) == cost_key("cpu", torch.float16) == "cpu-16bit"
    assert cost_key(torch.device("cuda", 0), torch.bfloat16) == "cuda"
    options = DecodeOptions(draft_len=4, adaptive=True)
    proposer = EarlyExitProposer(target, 1)
    draft = kinds.of(proposer).draft_cost(proposer, target)
    wide = adaptive_lengths(options, SpeculativeDecoder(target, proposer))
    assert (wide.cost, wide.round_cost, wide.pass_costs) == pytest.approx((draft + VERIFY_COST["cpu"],
                                                                         ROUND_COST["cpu"], None))
    narrow_target = copy.deepcopy(target).to(torch.bfloat16)
    narrow = adaptive_lengths(options, SpeculativeDecoder(narrow_target, EarlyExitProposer(narrow_target, 1)))
    assert narrow.round_cost == ROUND_COST["cpu-16bit"] < wide.round_cost and narrow.cost < wide.cost


def test_a_step_in_the_measured_pass_cost_caps_the_drafts_below_it():
    # An Intel Xeon with AMX in float32: passes over 2-3 positions cost a one-token step, 4-5 far more.
    steps = [1.0, 1.05, 1.1, 1.6, 1.65]
    assert best_draft_len(0.7, 0.05, 4, 0.1, steps) == 2
    assert best_draft_len(0.7, 0.05, 4, 0.1, [1.0, 1.05, 1.1, 1.15, 1.2]) == 4  # no step: the longest
    assert best_draft_len(0.2, 0.05, 4, 0.1, steps) == 0  # rejected drafts still do not pay
    from draftsmith.speculative.adaptive import pass_cost

    assert pass_cost(None, 7) == 1.0 and pass_cost(steps, 3) == 1.1
    assert pass_cost(steps, 10) == pytest.approx(1.65 * 10 / 5)  # beyond the measured: in proportion


def test_measured_costs_are_used_by_default_and_explicit_ones_win(target, machine_cache):
    from draftsmith.speculative.adaptive import ROUND_COST, ROUND_OVERHEAD, adaptive_lengths

    proposer = EarlyExitProposer(target, 1)
    draft = kinds.of(proposer).draft_cost(proposer, target)
    decoder = SpeculativeDecoder(target, proposer)
    policy = adaptive_lengths(DecodeOptions(draft_len=4, adaptive=True), decoder)
    measured = decoder.draft_costs  # the drafter's steps, timed in rounds at fixed lengths
    assert (policy.cost, policy.round_cost) == (measured["per_token"], measured["per_round"])
    assert policy.round_costs == measured["rounds"]  # rounds of batches 1, 2 and 4 priced as timed
    assert sorted(policy.pass_costs) == [1, 2, 4, 8, 16]  # per running batch size
    for costs in policy.pass_costs.values():
        assert len(costs) == 9 and costs[0] == 1.0 and all(c > 0 for c in costs)
    assert "pass costs" in machine_cache.read_text() and "draft costs" in machine_cache.read_text()
    lookup = adaptive_lengths(DecodeOptions(draft_len=4, adaptive=True), SpeculativeDecoder(target, NGramProposer()))
    assert lookup.cost == 0.0 and lookup.round_cost == ROUND_OVERHEAD["cpu"]  # no drafter module to time
    overhead = adaptive_lengths(DecodeOptions(draft_len=4, adaptive=True, round_cost=0.2),
                                SpeculativeDecoder(target, proposer))
    assert overhead.pass_costs == policy.pass_costs and overhead.round_cost == 0.2  # measured passes stay
    assert overhead.round_costs is None  # a given round cost prices batch 1 through the model
    linear = adaptive_lengths(DecodeOptions(draft_len=4, adaptive=True, verify_cost=0.3),
                              SpeculativeDecoder(target, proposer))
    assert linear.pass_costs is None and linear.cost == pytest.approx(draft + 0.3)
    assert linear.round_cost == ROUND_COST["cpu"]


# Passes measured per running batch size (Intel Xeon with AMX, float32, shaped after the measured ones):
# one row's 3-position pass costs 1.1 steps; four rows' cost 1.5 four-row steps; eight rows' 2.
BATCH_COSTS = {1: [1.0, 1.05, 1.1, 1.6, 1.65], 4: [1.0, 1.3, 1.5, 2.2, 2.5], 8: [1.0, 1.6, 2.0, 3.0, 3.6]}


def test_a_batch_pass_is_priced_at_its_size_between_and_beyond_the_measured_ones():
    from draftsmith.speculative.adaptive import pass_cost

    assert pass_cost(BATCH_COSTS, 3, 1) == 1.1 and pass_cost(BATCH_COSTS, 3, 4) == 1.5
    assert pass_cost(BATCH_COSTS, 3, 6) == pytest.approx(1.75)  # halfway between 4 and 8 rows
    assert pass_cost(BATCH_COSTS, 3, 32) == 2.0  # beyond the largest measured batch: its costs
    assert pass_cost(BATCH_COSTS, 10, 4) == pytest.approx(2.5 * 10 / 5)
    assert pass_cost(BATCH_COSTS[1], 3) == pass_cost(BATCH_COSTS, 3)  # a list is batch 1's


def shared_policy(rows, alone=None, acceptance=0.7):
    policy = AdaptiveDraftLength(0.05, round_cost=0.1, pass_costs=BATCH_COSTS)
    policy.add_rows(rows, alone)
    for _ in range(12):  # each row has seen its drafts accepted at about `acceptance`
        for b in range(rows):
            policy.accepted[b] = policy.decay ** 2 * policy.accepted[b] + acceptance * 2
            policy.offered[b] = policy.decay ** 2 * policy.offered[b] + 2
    return policy


def test_a_fuller_batch_drafts_less_and_from_some_size_not_at_all():
    alone = shared_policy(1).lengths([4])
    assert alone == [best_draft_len(0.7, 0.05, 4, 0.1, BATCH_COSTS)] == [2]  # batch 1: as a row alone
    four = shared_policy(4).lengths([4] * 4)
    assert len(set(four)) == 1 and 0 < four[0] <= 2  # one common length, no longer than alone
    assert shared_policy(8).lengths([4] * 8) == [0] * 8  # an 8-row pass over 2 positions costs 1.6 steps
    # A row with a smaller cap drafts within it; rows with no room (cap 0) draft nothing.
    # (A capped row gains less from a longer pass, so the common length may shrink.)
    m = shared_policy(3).lengths([4, 4, 4])[0]
    capped = shared_policy(3).lengths([4, 1, 0])
    assert m == 2 and capped == [1, 1, 0]


def test_the_common_length_follows_the_rows_acceptance_and_backed_off_rows_still_probe():
    assert shared_policy(4).lengths([4] * 4) == [2] * 4
    middling = shared_policy(4, acceptance=0.4)  # its drafts pay alone, not in a pass over 4 rows
    assert best_draft_len(0.4, 0.05, 4, 0.1, BATCH_COSTS) > 0 and middling.lengths([4] * 4) == [0] * 4
    assert middling.wait == [0] * 4  # not backed off: no probes, it drafts again when the batch thins
    middling.select([0])  # the others leave: alone, the row drafts again
    assert middling.lengths([4])[0] > 0
    rejected = shared_policy(4, acceptance=0.0)
    assert rejected.lengths([4] * 4) == [1] * 4  # backed off, their waits over: each probes once
    rejected.observe([1] * 4, [0] * 4)
    assert rejected.lengths([4] * 4) == [0] * 4 and rejected.wait == [0] * 4  # then wait (1 round)


def probe_rounds(joins: tuple[int, ...], rounds: int = 96) -> list[int]:
    """The rounds in which a batch drafts at all, requests joining at `joins`, no draft ever accepted."""
    policy, rows, drafted = AdaptiveDraftLength(0.05, round_cost=0.1, pass_costs=BATCH_COSTS), 0, []
    for step in range(rounds):
        if step in joins:
            policy.add_rows(1)
            rows += 1
        lens = policy.lengths([4] * rows)
        assert len(set(lens)) == 1  # the rows draft in the same rounds, or none does
        if lens[0] > 0:
            drafted.append(step)
        policy.observe(lens, [0] * rows)
    return drafted


def test_backed_off_rows_of_a_batch_probe_in_the_same_rounds():
    alone = probe_rounds((0,))
    assert alone == [0, 1, 2, 4, 7, 12, 21, 38, 71]  # the waits double: 1, 2, 4 ... 32 rounds
    # Three requests join a running batch that has seen its drafts rejected: they take its schedule instead
    # of each probing at once and then on a schedule of their own (27 rounds of 96 drafted one token, each
    # widening the whole batch's pass, where every row probed on its own).
    assert probe_rounds((0, 8, 16, 24)) == alone


def test_a_row_whose_one_token_drafts_are_rejected_backs_off_where_such_rounds_are_cheap():
    """Rounds timed as on an AMD EPYC core after the few-row routes (a D=1 round at 1.08 plain steps): the
    break-even acceptance of one draft token is 8%. A row whose drafts are all rejected must back off even
    though it drafts one token a round (its estimate's window counts tokens, not rounds), and one whose
    drafts are accepted 30% of the time keeps drafting."""
    rounds = {1: [1.08, 1.24, 1.31, 1.70]}
    passes = {1: [1.0, 1.0, 1.12, 1.12, 1.49]}

    def drafting_rounds(accepted_share, n=200):
        policy = AdaptiveDraftLength(0.055, round_cost=0.029, pass_costs=passes, round_costs=rounds)
        policy.add_rows(1)
        drafted, owed = 0, 0.0
        for _ in range(n):
            d = policy.lengths([4])[0]
            owed += accepted_share if d else 0.0
            a = int(owed >= 1.0) if d else 0  # accepted at `accepted_share` of the drafting rounds
            owed -= a
            policy.observe([d], [a])
            drafted += d > 0
        return drafted

    assert drafting_rounds(0.0) <= 25  # the first rounds, then probes at waits 1, 2, 4 ... 32 (weighted per round: 200)
    assert drafting_rounds(0.3) >= 190


def test_sampled_rows_are_priced_alone_whatever_runs_beside_them():
    lens = shared_policy(8, alone=[True] + [False] * 7).lengths([4] * 8)
    assert lens[0] == 2  # the sampled row drafts what pays at batch 1, as in any batch
    assert len(set(lens[1:])) == 1  # the greedy rows share one length, given the pass it opened
    assert shared_policy(1, alone=[True]).lengths([4]) == [2]


def test_a_joining_greedy_row_starts_from_the_acceptance_the_rows_before_it_saw():
    policy = AdaptiveDraftLength(0.05, round_cost=0.1, pass_costs=BATCH_COSTS)
    policy.add_rows(1)
    assert policy.acceptance(0) == pytest.approx(0.6)  # nothing seen yet: the prior
    for _ in range(20):  # the drafter is rarely accepted on this traffic
        d = max(policy.lengths([4])[0], 1)
        policy.observe([d], [0])
    policy.add_rows(2, alone=[False, True])
    assert policy.acceptance(1) < 0.1  # a new greedy request does not start by drafting at 0.6
    assert policy.acceptance(2) == pytest.approx(0.6)  # a sampled one depends on nothing before it
    assert best_draft_len(policy.acceptance(1), 0.05, 4, 0.1, BATCH_COSTS) == 0  # it starts backed off
    policy.select([1, 2])  # rows leave: each keeps its own starting point
    assert policy.acceptance(0) < 0.1 and policy.acceptance(1) == pytest.approx(0.6)


def test_timed_rounds_price_batch_one_and_the_model_prices_the_rest():
    # Passes alone say a 5-position pass is cheap; the decoder's timed rounds say D=2..4 rounds are not.
    cheap_passes = {1: [1.0, 1.05, 1.1, 1.15, 1.2], 4: [1.0, 1.3, 1.5, 2.2, 2.5]}
    timed = [1.2, 1.9, 2.4, 2.9]
    assert best_draft_len(0.5, 0.05, 4, 0.01, cheap_passes[1]) >= 2
    assert best_draft_len(0.5, 0.05, 4, 0.01, cheap_passes[1], round_costs=timed) == 1
    assert best_draft_len(0.15, 0.05, 4, 0.01, cheap_passes[1], round_costs=timed) == 0
    policy = AdaptiveDraftLength(0.05, round_cost=0.01, pass_costs=cheap_passes, round_costs=timed, prior=0.5)
    policy.add_rows(1)
    assert policy.lengths([4]) == [1]  # one row: the timed rounds
    policy = AdaptiveDraftLength(0.05, round_cost=0.01, pass_costs=cheap_passes, round_costs=timed, prior=0.5)
    policy.add_rows(4)
    assert policy.lengths([4] * 4) == [1] * 4  # four rows: the passes at batch 4 (P_4(2) + r + c = 1.36)
    from draftsmith.speculative.adaptive import round_price

    assert round_price(0, 0.05, 0.01, cheap_passes, 1, timed) == 1.0
    assert round_price(2, 0.05, 0.01, cheap_passes, 1, timed) == 1.9
    assert round_price(5, 0.05, 0.01, cheap_passes, 1, timed) == pytest.approx(cheap_passes[1][-1] * 6 / 5 + 0.26)
    assert round_price(2, 0.05, 0.01, cheap_passes, 4, timed) == pytest.approx(1.5 + 0.11)
