"""Greedy speculative decoding reproduces the target's own greedy `generate`, token for token."""

import pytest

from draftsmith.speculative.eagle import EagleProposer
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.draft_lm import DraftModelProposer
from draftsmith.speculative.early_exit import EarlyExitProposer
from draftsmith.speculative.lookup import LookupFirstProposer
from draftsmith.speculative.ngram import NGramProposer
from draftsmith.speculative.options import DecodeOptions

PROMPTS = [
    [1, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100],
    [1, 50, 43, 50],
    [1, 84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110, 32, 102, 111, 120],
    [1, 65, 66, 67, 65, 66, 67, 65],
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def reference(target, hf_greedy):
    return [hf_greedy(target, p, MAX_NEW) for p in PROMPTS]


@pytest.fixture(scope="module")
def eagle_drafter(target, fit_eagle):
    """Knows the continuations of PROMPTS by heart: most drafts accepted, when fed the right features."""
    return fit_eagle(target, PROMPTS, MAX_NEW)


def make_proposer(kind, target, random_drafter, eagle_drafter=None):
    return {
        "same": lambda: DraftModelProposer(target),
        "random": lambda: DraftModelProposer(random_drafter),
        "early-exit": lambda: EarlyExitProposer(target, 1),
        "ngram": lambda: NGramProposer(),
        # Lookup rows and model rows mix within a batch and alternate within a row.
        "lookup-first": lambda: LookupFirstProposer(NGramProposer(3, 2), DraftModelProposer(random_drafter)),
        # The model guesses right where lookup is wrong: its fed tokens on lookup rows match emitted ones.
        "lookup-first-same": lambda: LookupFirstProposer(NGramProposer(3, 1), DraftModelProposer(target)),
        "eagle": lambda: EagleProposer(eagle_drafter),
        "lookup-first-eagle": lambda: LookupFirstProposer(NGramProposer(3, 2), EagleProposer(eagle_drafter)),
        "none": lambda: None,
    }[kind]()


@pytest.mark.parametrize("kind", ["same", "random", "early-exit", "ngram", "lookup-first", "lookup-first-same", "eagle",
                                  "lookup-first-eagle", "none"])
@pytest.mark.parametrize("draft_len", range(1, 9))
def test_greedy_matches_target_generate(kind, draft_len, target, random_drafter, eagle_drafter, reference):
    decoder = SpeculativeDecoder(target, make_proposer(kind, target, random_drafter, eagle_drafter))
    batch = decoder.generate(PROMPTS, options=DecodeOptions(max_new_tokens=MAX_NEW, draft_len=draft_len))
    assert batch.tokens == reference
    solo = decoder.generate([PROMPTS[0]], options=DecodeOptions(max_new_tokens=MAX_NEW, draft_len=draft_len))
    assert solo.tokens == reference[:1]
    stats = batch.stats
    assert stats.rounds >= 2 * len(PROMPTS)  # more than one verification round per row
    if kind == "same":
        # Everything is accepted: every round but the budget-clipped last one emits D + 1 tokens.
        assert stats.acceptance_length > min(draft_len + 1, MAX_NEW) * 0.75
        assert all(a == 1.0 for a in stats.position_acceptance if a is not None)
    if kind == "random":
        assert stats.acceptance_length < 1.3
    if kind == "none":
        assert stats.acceptance_length == 1.0
    if kind == "eagle" and draft_len >= 2:  # features and tokens paired right: most drafts accepted
        assert stats.position_acceptance[0] > 0.8, stats.position_acceptance
    if kind.startswith("lookup-first"):
        assert decoder.proposer.lookup_rounds > 0 and decoder.proposer.model_rounds > 0


@pytest.mark.parametrize("draft_len", [3, 8])
def test_stop_token_inside_an_accepted_block(target, reference, draft_len, hf_greedy):
    # Pick a stop token that first occurs mid-output, so it lands inside an all-accepted draft.
    ref = reference[2]
    index = next(i for i in range(4, len(ref)) if ref[i] not in ref[:i])
    stop = ref[index]
    expected = hf_greedy(target, PROMPTS[2], MAX_NEW, eos=stop)
    assert expected == ref[: index + 1]
    decoder = SpeculativeDecoder(target, DraftModelProposer(target), stop_token_ids=[stop])
    result = decoder.generate(PROMPTS, options=DecodeOptions(max_new_tokens=MAX_NEW, draft_len=draft_len))
    assert result.tokens[2] == expected  # ends at the stop token; nothing after it
    assert result.finish_reasons[2] == "stop"
    for row, ref_row in zip(result.tokens, reference):  # other rows stop at their own first `stop`, if any
        cut = ref_row.index(stop) + 1 if stop in ref_row else len(ref_row)
        assert row == ref_row[:cut]


@pytest.mark.parametrize("max_new", [1, 2, 7])
def test_budget_inside_an_accepted_block(target, reference, max_new):
    decoder = SpeculativeDecoder(target, DraftModelProposer(target))
    result = decoder.generate(PROMPTS, options=DecodeOptions(max_new_tokens=max_new, draft_len=4))
    assert result.tokens == [r[:max_new] for r in reference]
    assert result.finish_reasons == ["length"] * len(PROMPTS)


@pytest.mark.parametrize("alternatives", [0, 3])
def test_prefix_is_never_reencoded(target, random_drafter, monkeypatch, alternatives):
    """After prefill the target only ever sees [last, drafts] (<= D + 1 slots; with A sibling leaves per
    draft position, D * A more), and after every round its cache holds exactly the context minus the
    newest token: rejected slots are rolled back, not re-encoded (a leaf taken leaves holes behind)."""
    from draftsmith.speculative import generate as gen

    widths, lengths = [], []
    decoder = SpeculativeDecoder(target, EarlyExitProposer(target, 1))  # before the hook: the view keeps its own
    hook = target.register_forward_pre_hook(lambda m, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                            with_kwargs=True)
    original = gen._Run.rollback

    def spy(run, out, draft, emitted, hidden, path):
        original(run, out, draft, emitted, hidden, path)
        row = run.rows[0]
        if run.finish_reasons[row] == "length" and len(run.outputs[row]) < run.options.max_new_tokens:  # not finished
            kv = run.target_kv
            lengths.append((int(kv.lengths[0]), len(run.history[0]) - 1))
            if path is None:  # a chain leaves no holes behind in a batch of one
                assert kv.cache.get_seq_length() == int(kv.lengths[0])

    monkeypatch.setattr(gen._Run, "rollback", spy)
    try:
        result = decoder.generate([PROMPTS[2]], options=DecodeOptions(max_new_tokens=MAX_NEW, draft_len=4,
                                                                      draft_alternatives=alternatives))
    finally:
        hook.remove()
    assert widths[0] == len(PROMPTS[2]) - 1  # the prefill
    assert len(widths) == 1 + result.stats.rounds and max(widths[1:]) <= 5 + 4 * alternatives
    assert lengths and all(cache == context for cache, context in lengths)


def test_ragged_batch_holes_are_compacted(target, random_drafter, monkeypatch, hf_greedy):
    """Ragged rows leave holes in the shared cache; compaction packs them and decoding stays exact."""
    from draftsmith.speculative import kv

    calls = []
    original = kv.KVState._compact
    monkeypatch.setattr(kv, "COMPACT_MIN_SLOTS", 8)
    monkeypatch.setattr(kv, "COMPACT_WASTE", 0.02)
    monkeypatch.setattr(kv.KVState, "_compact", lambda self: (calls.append(self.mask.shape[1]), original(self)))
    prompts = [PROMPTS[3] * 2, PROMPTS[2], PROMPTS[0] + PROMPTS[3]]  # similar lengths, different acceptance
    reference = [hf_greedy(target, p, 60) for p in prompts]
    decoder = SpeculativeDecoder(target, NGramProposer())
    result = decoder.generate(prompts, options=DecodeOptions(max_new_tokens=60, draft_len=8))
    assert result.tokens == reference
    assert calls, "the run never compacted its cache"
