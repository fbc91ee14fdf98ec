"""A chain drafter's rollback, unit by unit: after any verification outcome its cache holds exactly the
accepted context, so its next draft equals a fresh forward over the whole context."""

import pytest
import torch

from draftsmith.speculative.draft_lm import DraftModelProposer
from draftsmith.speculative.options import DecodeOptions
from draftsmith.speculative.proposers import RoundContext
from draftsmith.speculative.rng import RowGenerators
from draftsmith.speculative.sampling import BatchSampling, SamplingParams

PROMPTS = [[1, 72, 101, 108, 108, 111], [1, 65, 66], [1, 40, 41, 42, 43, 44, 45, 46]]


def context(history, draft_len):
    params = [SamplingParams()] * len(history)
    return RoundContext([list(h) for h in history], [draft_len] * len(history), BatchSampling.from_params(params),
                        RowGenerators([0] * len(history), "cpu"), DecodeOptions(draft_len=draft_len))


def fresh_greedy(model, history, steps):
    """The model's own greedy continuation of a context by full forwards (no cache)."""
    ids = list(history)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(history):]


@pytest.mark.parametrize("accepted", [[0, 0, 0], [4, 4, 4], [1, 3, 0], [2, 4, 1]])
def test_rollback_keeps_exactly_the_accepted_prefix(random_drafter, accepted):
    """Rows accept 0..D of their drafts and emit a recovered token (or the bonus); the next round's drafts
    are then the model's greedy continuation of the whole new context, row by row (a cache that kept a
    rejected slot, or lost an accepted one, drafts from the wrong context)."""
    draft_len, vocab = 4, random_drafter.config.vocab_size
    proposer = DraftModelProposer(random_drafter)
    history = [list(p) for p in PROMPTS]
    with torch.no_grad():
        proposer.begin(history, None, None)
        draft = proposer.propose(context(history, draft_len))
        emitted = []
        for b, n in enumerate(accepted):
            drafts = draft.tokens[b, :n].tolist()
            other = (int(draft.tokens[b, n]) + 7) % vocab if n < draft_len else 33  # a rejected draft's stand-in
            emitted.append(drafts + [other])
        proposer.rollback(accepted, emitted)
        history = [h + e for h, e in zip(history, emitted)]
        # The cache holds the context minus what is still pending, nothing more.
        assert proposer.kv.lengths.tolist() == [len(h) - len(p) for h, p in zip(history, proposer.pending)]
        after = proposer.propose(context(history, draft_len))
    for b, h in enumerate(history):
        assert after.tokens[b].tolist() == fresh_greedy(random_drafter, h, draft_len), b


def test_rollback_after_a_round_drafted_elsewhere(random_drafter):
    """A round the model did not draft (prompt lookup drafted it: `skip_round`) feeds nothing; the emitted
    tokens wait as pending input and the next draft still continues the whole context."""
    proposer = DraftModelProposer(random_drafter)
    history = [list(p) for p in PROMPTS]
    with torch.no_grad():
        proposer.begin(history, None, None)
        proposer.skip_round()
        emitted = [[5, 6, 7], [8], [9, 10]]
        proposer.rollback([2, 0, 1], emitted)
        history = [h + e for h, e in zip(history, emitted)]
        after = proposer.propose(context(history, 3))
    for b, h in enumerate(history):
        assert after.tokens[b].tolist() == fresh_greedy(random_drafter, h, 3), b


def test_rollback_keeps_a_guessed_prefix_of_rows_drafted_by_lookup(random_drafter):
    """When the model drafted a round but a row's emitted tokens came from elsewhere, its fed draft slots
    stay only as far as they equal what was emitted."""
    proposer = DraftModelProposer(random_drafter)
    history = [list(p) for p in PROMPTS[:2]]
    with torch.no_grad():
        proposer.begin(history, None, None)
        draft = proposer.propose(context(history, 4))
        guess = draft.tokens[0].tolist()
        emitted = [guess[:2] + [(guess[2] + 1) % 259, 3], [11, 12]]  # row 0 agrees on two tokens, row 1 on none
        proposer.rollback([3, 1], emitted)
        history = [h + e for h, e in zip(history, emitted)]
        kept = [len(h) - len(p) for h, p in zip(history, proposer.pending)]
        assert kept[0] - len(PROMPTS[0]) == 2  # the two agreeing draft slots stayed in the cache
        after = proposer.propose(context(history, 3))
    for b, h in enumerate(history):
        assert after.tokens[b].tolist() == fresh_greedy(random_drafter, h, 3), b
