"""The step-level engine: requests join and leave a running batch between rounds, and every request
emits what it would alone (greedy: the target's own decoding; seeded sampling: the same tokens)."""

import pytest
import torch

from draftsmith.speculative.draft_lm import DraftModelProposer
from draftsmith.speculative.eagle import EagleProposer
from draftsmith.speculative.early_exit import EarlyExitProposer
from draftsmith.speculative.engine import Engine
from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.kv import KVState
from draftsmith.speculative.lookup import LookupFirstProposer
from draftsmith.speculative.medusa import MedusaHeads, MedusaProposer
from draftsmith.speculative.ngram import NGramProposer
from draftsmith.speculative.options import DecodeOptions, Request
from draftsmith.speculative.proposers import Proposer
from draftsmith.speculative.sampling import SamplingParams

# Ragged prompts, a one-token prompt (nothing to prefill) and a repeating one (lookup finds drafts).
PROMPTS = [
    [1, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100],
    [1, 50, 43, 50],
    [1],
    [1, 84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110, 32, 102, 111, 120],
    [1, 65, 66, 67, 65, 66, 67, 65],
]
# (step at which the request arrives, prompt index, max_new_tokens, its own draft length)
SCHEDULE = [(0, 0, 14, None), (0, 1, 6, None), (2, 2, 12, 2), (3, 3, 16, None), (3, 4, 9, 0), (9, 1, 7, None)]
D = 4


@pytest.fixture(scope="module")
def eagle_drafter(target, fit_eagle):
    return fit_eagle(target, PROMPTS, 16)


def make_proposer(kind, target, random_drafter, eagle_drafter):
    return {
        "none": lambda: None,
        "random": lambda: DraftModelProposer(random_drafter),
        "same": lambda: DraftModelProposer(target),
        "early-exit": lambda: EarlyExitProposer(target, 1),
        "ngram": lambda: NGramProposer(),
        "lookup-first": lambda: LookupFirstProposer(NGramProposer(3, 2), DraftModelProposer(random_drafter)),
        "medusa": lambda: MedusaProposer(MedusaHeads(target.config.hidden_size, target.config.vocab_size, 4)
                                         .attach_lm_head(target.lm_head)),
        "eagle": lambda: EagleProposer(eagle_drafter),
        "lookup-first-eagle": lambda: LookupFirstProposer(NGramProposer(3, 2), EagleProposer(eagle_drafter)),
    }[kind]()


def run_schedule(engine, requests, schedule=SCHEDULE, cancel_at=None):
    """Add request i at its step; step until done. Returns per request its tokens and finish reason,
    and the largest running batch seen. `cancel_at`: (step, request index) to cancel."""
    arrivals = sorted((step, i) for i, (step, *_) in enumerate(schedule))
    ids, tokens, reasons, peak, step = {}, {}, {}, 0, 0
    while arrivals or engine.busy:
        while arrivals and arrivals[0][0] <= step:
            i = arrivals.pop(0)[1]
            ids[engine.add(requests[i])] = i
            tokens[i] = []
        if cancel_at is not None and cancel_at[0] == step:
            assert engine.cancel(next(r for r, i in ids.items() if i == cancel_at[1]))
        for e in engine.step():
            tokens[ids[e.request_id]].extend(e.tokens)
            if e.finish_reason is not None:
                reasons[ids[e.request_id]] = e.finish_reason
        peak = max(peak, engine.running)
        step += 1
    return [tokens[i] for i in range(len(schedule))], [reasons.get(i) for i in range(len(schedule))], peak


def requests_for(params, schedule=SCHEDULE):
    return [Request(PROMPTS[p], s, max_new, draft_len) for (_, p, max_new, draft_len), s in zip(schedule, params)]


@pytest.mark.parametrize("kind", ["none", "random", "same", "early-exit", "ngram", "lookup-first", "medusa", "eagle",
                                  "lookup-first-eagle"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_requests_joining_and_leaving_equal_the_target_alone(kind, adaptive, target, random_drafter,
                                                                      eagle_drafter, hf_greedy):
    decoder = SpeculativeDecoder(target, make_proposer(kind, target, random_drafter, eagle_drafter))
    engine = Engine(decoder, DecodeOptions(draft_len=D, adaptive=adaptive))
    tokens, reasons, peak = run_schedule(engine, requests_for([SamplingParams()] * len(SCHEDULE)))
    assert tokens == [hf_greedy(target, PROMPTS[p], n) for _, p, n, _ in SCHEDULE]
    assert reasons == ["length"] * len(SCHEDULE) and peak >= 3  # rows really ran side by side
    assert engine.run.target_kv is None and not engine.reserved  # an empty batch holds no cache
    stats = engine.finish()
    assert stats.new_tokens == sum(n for _, _, n, _ in SCHEDULE)
    if kind == "same" and not adaptive:
        assert stats.acceptance_length > 2.0
    if adaptive and kind in ("random", "same"):  # rejected drafts, or a drafter as costly as the target:
        assert 0 < stats.mean_draft_len < 1.0    # rows back off to plain decoding, and still probe


SAMPLED = [SamplingParams(0.9, seed=5), SamplingParams(0.0), SamplingParams(1.2, top_k=20, top_p=0.95, seed=9),
           SamplingParams(0.7, seed=1), SamplingParams(1.0, seed=2), SamplingParams(0.8, top_p=0.9, seed=3)]


@pytest.mark.parametrize("kind", ["random", "same", "lookup-first", "eagle", "none"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_seeded_requests_repeat_whatever_joins_or_leaves(kind, adaptive, target, random_drafter, eagle_drafter):
    decoder = SpeculativeDecoder(target, make_proposer(kind, target, random_drafter, eagle_drafter))
    requests = requests_for(SAMPLED)
    options = DecodeOptions(draft_len=D, adaptive=adaptive)
    tokens, _, _ = run_schedule(Engine(decoder, options), requests)
    solo = [decoder.generate([list(r.prompt)], [r.sampling], DecodeOptions(max_new_tokens=r.max_new_tokens,
                                                                           draft_len=D if r.draft_len is None
                                                                           else r.draft_len,
                                                                           adaptive=adaptive)).tokens[0]
            for r in requests]
    assert tokens == solo
    # Another arrival order and batch limit: the same tokens per request.
    shuffled = [(5 - step, *rest) for step, *rest in SCHEDULE]
    again, _, peak = run_schedule(Engine(decoder, options, max_batch=3), requests, shuffled)
    assert again == solo and peak <= 3
    other = run_schedule(Engine(decoder, options),
                         [Request(requests[0].prompt, SamplingParams(0.9, seed=6), requests[0].max_new_tokens)] +
                         requests[1:])[0]
    assert other[0] != tokens[0] and other[1:] == tokens[1:]


def test_a_cancelled_request_leaves_and_the_others_stay_exact(target, random_drafter, hf_greedy):
    decoder = SpeculativeDecoder(target, DraftModelProposer(random_drafter))
    engine = Engine(decoder, DecodeOptions(draft_len=D))
    tokens, reasons, _ = run_schedule(engine, requests_for([SamplingParams()] * len(SCHEDULE)), cancel_at=(4, 3))
    assert reasons[3] is None and 0 < len(tokens[3]) < 16
    for i, (_, p, n, _) in enumerate(SCHEDULE):
        if i != 3:
            assert tokens[i] == hf_greedy(target, PROMPTS[p], n)
    assert not engine.cancel(0)  # finished: the engine no longer holds it


def test_the_kv_budget_queues_requests_and_refuses_what_never_fits(target, random_drafter, hf_greedy):
    decoder = SpeculativeDecoder(target, EarlyExitProposer(target, 1))
    requests = requests_for([SamplingParams()] * len(SCHEDULE))
    engine = Engine(decoder, DecodeOptions(draft_len=D), kv_budget=70)
    needs = [engine.need(r) for r in requests]
    assert needs == [len(r.prompt) + r.max_new_tokens + D for r in requests]
    seen = []
    original = engine._admit

    def admit():
        original()
        seen.append((engine.reserved_tokens, engine.queued))
    engine._admit = admit
    tokens, _, _ = run_schedule(engine, requests)
    assert tokens == [hf_greedy(target, PROMPTS[p], n) for _, p, n, _ in SCHEDULE]
    assert max(r for r, _ in seen) <= 70 and any(q > 0 for _, q in seen)  # someone waited
    ledger = engine.ledger()
    assert ledger["reserved_tokens"] == 0 and ledger["kv_budget_tokens"] == 70
    with pytest.raises(InvalidInputError, match="KV tokens"):
        engine.add(Request(PROMPTS[3], max_new_tokens=60))
    with pytest.raises(InvalidInputError, match="outside"):
        engine.add(Request([1, 100000]))
    with pytest.raises(InvalidInputError):
        Request([], max_new_tokens=3)


def test_the_ledger_counts_target_and_drafter_kv_per_running_request(target):
    decoder = SpeculativeDecoder(target, EarlyExitProposer(target, 1))
    engine = Engine(decoder, DecodeOptions(draft_len=2))
    engine.add(Request(PROMPTS[0], max_new_tokens=8))
    engine.add(Request(PROMPTS[1], max_new_tokens=8))
    engine.step()
    ledger = engine.ledger()
    per_token = 2 * 2 * 16 * 4  # keys and values * kv heads * head dim * float32 bytes, per layer
    assert ledger["per_request_tokens"] == {0: len(PROMPTS[0]) + 10, 1: len(PROMPTS[1]) + 10}
    assert ledger["target_kv_bytes"] == ledger["reserved_tokens"] * per_token * 3
    assert ledger["drafter_kv_bytes"] == ledger["reserved_tokens"] * per_token * 1


def test_appended_rows_compute_what_they_computed_apart(target):
    """Two caches of different widths, one with holes, merged: each row's next logits are unchanged."""
    def prefilled(rows):
        kv = KVState(target, len(rows), "cpu")
        width = max(map(len, rows))
        tokens = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        valid = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows])
        kv.forward(tokens, valid)
        return kv

    with torch.no_grad():
        first, second = prefilled([PROMPTS[0], PROMPTS[1]]), prefilled([PROMPTS[3]])
        first.keep_last(torch.tensor([[True] * 10 + [False] * 2, [True] * 12]))  # holes at the end of row 0
        step = torch.tensor([[7], [8]]), torch.ones(2, 1, dtype=torch.bool)
        apart = [first.forward(*step).logits, second.forward(step[0][:1], step[1][:1]).logits]
        first.keep_last(torch.zeros(2, 1, dtype=torch.bool))
        second.keep_last(torch.zeros(1, 1, dtype=torch.bool))
        first.append_rows(second)
        assert first.batch_size == 3 and first.lengths.tolist() == [10, 4, 20]
        merged = first.forward(torch.tensor([[7], [8], [7]]), torch.ones(3, 1, dtype=torch.bool)).logits
    torch.testing.assert_close(merged, torch.cat(apart), atol=1e-4, rtol=1e-4)  # reduction order


def test_a_proposer_with_state_but_no_add_rows_is_refused():
    class Stateful(Proposer):
        def begin(self, prompts, sampling, rng):
            self.rows = len(prompts)

        def propose(self, ctx):
            raise AssertionError

    with pytest.raises(NotImplementedError, match="add_rows"):
        Stateful().add_rows([[1]], None, None)


def test_eagle3_rows_join_through_the_chain_default(hf_greedy):
    """EAGLE-3 defines no add_rows: the chain proposer's default (begin on a copy, then append) serves it."""
    from draftsmith.speculative.eagle3 import Eagle3Drafter, Eagle3Proposer
    from draftsmith.speculative.tiny import tiny_model

    target = tiny_model(0, num_layers=4)
    torch.manual_seed(0)
    proposer = Eagle3Proposer(Eagle3Drafter(target.config, [1, 2, 3], 1).attach_target(target, init=True).eval())
    decoder = SpeculativeDecoder(target, proposer)
    greedy, _, _ = run_schedule(Engine(decoder, DecodeOptions(draft_len=D)), requests_for([SamplingParams()] * 6))
    assert greedy == [hf_greedy(target, PROMPTS[p], n) for _, p, n, _ in SCHEDULE]
    requests = requests_for(SAMPLED)
    sampled, _, _ = run_schedule(Engine(decoder, DecodeOptions(draft_len=D)), requests)
    assert sampled == [decoder.generate([list(r.prompt)], [r.sampling], DecodeOptions(
        max_new_tokens=r.max_new_tokens, draft_len=D if r.draft_len is None else r.draft_len)).tokens[0]
        for r in requests]


def fused_kernel_on_cpu() -> bool:
    from draftsmith.speculative import kernels

    return kernels.interpreting()


@pytest.mark.skipif(not fused_kernel_on_cpu(), reason="needs triton with TRITON_INTERPRET=1")
def test_fused_verifier_rows_joining_later_repeat(target, random_drafter):
    """The kernel keys its draws by each row's seed and its own round count, so joining rows keep theirs."""
    decoder = SpeculativeDecoder(target, DraftModelProposer(random_drafter), verifier="triton")
    schedule = [(0, 0, 6, None), (2, 4, 6, None), (3, 1, 5, None)]
    params = [SamplingParams(0.9, seed=5), SamplingParams(1.0, seed=2), SamplingParams(0.0)]
    requests = requests_for(params, schedule)
    tokens, _, _ = run_schedule(Engine(decoder, DecodeOptions(draft_len=3)), requests, schedule)
    assert tokens == [decoder.generate([list(r.prompt)], [r.sampling], DecodeOptions(
        max_new_tokens=r.max_new_tokens, draft_len=3)).tokens[0] for r in requests]


def test_per_request_stop_ids_and_ignore_eos(target, hf_greedy):
    reference = hf_greedy(target, PROMPTS[0], 10)
    decoder = SpeculativeDecoder(target, NGramProposer(), stop_token_ids=[reference[2]])
    engine = Engine(decoder, DecodeOptions(draft_len=D))
    requests = [Request(PROMPTS[0], max_new_tokens=10), Request(PROMPTS[0], max_new_tokens=10, ignore_eos=True),
                Request(PROMPTS[0], max_new_tokens=10, ignore_eos=True, stop_token_ids=frozenset([reference[5]]))]
    tokens, reasons, _ = run_schedule(engine, requests, [(0, 0, 10, None)] * 3)
    cut = reference.index(reference[2]) + 1  # the decoder's stop id, wherever it first appears
    assert tokens == [reference[:cut], reference, reference[: reference.index(reference[5]) + 1]]
    assert reasons == ["stop", "length", "stop"]


def test_min_join_admits_waiting_requests_in_groups_and_stays_exact(target, random_drafter, hf_greedy, monkeypatch):
    decoder = SpeculativeDecoder(target, DraftModelProposer(random_drafter))
    joins = []
    real_join = type(Engine(decoder).run).join
    monkeypatch.setattr(type(Engine(decoder).run), "join", lambda self, ids, requests: (
        joins.append((len(self.rows), len(ids))), real_join(self, ids, requests))[1])
    lengths = [3, 5, 7, 9, 11, 4, 6, 8]
    engine = Engine(decoder, DecodeOptions(draft_len=2), max_batch=4, min_join=2)
    ids = [engine.add(Request(PROMPTS[i % len(PROMPTS)], SamplingParams(), n)) for i, n in enumerate(lengths)]
    tokens = {i: [] for i in ids}
    while engine.busy:
        for e in engine.step():
            tokens[e.request_id] += e.tokens
    assert [tokens[i] for i in ids] == [hf_greedy(target, PROMPTS[i % len(PROMPTS)], n) for i, n in enumerate(lengths)]
    assert joins[0] == (0, 4)  # an empty batch takes all that fit
    assert all(n >= 2 for running, n in joins[1:])  # later joins: never one row alone while others wait
    with pytest.raises(InvalidInputError, match="min_join"):
        Engine(decoder, min_join=0)


# Per request: (its sampling, draft_confidence, draft_alternatives, leaf_min_prob); None = the engine's.
OWN_DRAFTING = [(SamplingParams(), 0.5, None, None), (SamplingParams(), None, 2, 0.0),
                (SamplingParams(), None, 1, 0.2), (SamplingParams(), None, None, None),
                (SamplingParams(0.8, seed=4), 0.3, None, None), (SamplingParams(), 0.0, 0, None),
                (SamplingParams(), 0.9, 5, None)]


def chunks_of(engine, requests):
    """Every request added at once, stepped to the end: per request the list of its steps' emissions."""
    ids = {engine.add(r): i for i, r in enumerate(requests)}
    out = [[] for _ in requests]
    while engine.busy:
        for e in engine.step():
            if e.tokens:
                out[ids[e.request_id]].append(e.tokens)
    return out


@pytest.mark.parametrize("kind", ["eagle", "medusa", "random", "lookup-first-eagle"])
def test_each_request_drafts_with_its_own_confidence_and_leaves(kind, target, random_drafter, eagle_drafter,
                                                                  hf_greedy):
    decoder = SpeculativeDecoder(target, make_proposer(kind, target, random_drafter, eagle_drafter))
    engine_options = DecodeOptions(draft_len=D, draft_confidence=0.1, draft_alternatives=2, leaf_min_prob=0.05)
    requests = [Request(PROMPTS[i % len(PROMPTS)], s, 12, draft_confidence=c, draft_alternatives=a, leaf_min_prob=m)
                for i, (s, c, a, m) in enumerate(OWN_DRAFTING)]
    together = chunks_of(Engine(decoder, engine_options), requests)
    for i, (r, got) in enumerate(zip(requests, together)):
        own = DecodeOptions(  # what the request asked for, resolved against the engine's (A within its A)
            draft_len=D,
            draft_confidence=engine_options.draft_confidence if r.draft_confidence is None else r.draft_confidence,
            draft_alternatives=min(engine_options.draft_alternatives if r.draft_alternatives is None
                                   else r.draft_alternatives, engine_options.draft_alternatives),
            leaf_min_prob=engine_options.leaf_min_prob if r.leaf_min_prob is None else r.leaf_min_prob)
        alone = chunks_of(Engine(decoder, own), [Request(r.prompt, r.sampling, r.max_new_tokens)])[0]
        assert got == alone, f"request {i}: its rounds differ from decoding it alone with its own settings"
        if r.sampling.greedy:
            assert sum(got, []) == hf_greedy(target, list(r.prompt), r.max_new_tokens)
