"""Sibling leaves (speculative/tree.py): a draft tree verified in one target pass, greedy rows only.

Greedy output must stay the target's greedy output with any leaves; a leaf that equals the target's
token must be accepted in place of the rejected draft token, with the bonus token read from the
target's logits at that leaf (so its position and attention must be exactly those of the chain token
it replaces); drafters reading the target's states must get the states of the emitted path; sampled
rows must not notice leaves at all.
"""

import pytest
import torch

from draftsmith.speculative.eagle import EagleProposer
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.medusa import MedusaHeads, MedusaProposer
from draftsmith.speculative.draft_lm import DraftModelProposer
from draftsmith.speculative.early_exit import EarlyExitProposer
from draftsmith.speculative.lookup import LookupFirstProposer
from draftsmith.speculative.ngram import NGramProposer
from draftsmith.speculative.proposers import Draft, Proposer
from draftsmith.speculative.sampling import SamplingParams
from draftsmith.speculative.tree import Leaves, runner_ups
from draftsmith.speculative.options import DecodeOptions

PROMPTS = [
    [1, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100],
    [1, 50, 43, 50],
    [1, 84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110, 32, 102, 111, 120],
    [1, 65, 66, 67, 65, 66, 67, 65],
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def continuations(target, hf_greedy):
    """Each prompt's greedy continuation, longer than any decode below reads."""
    return {tuple(p): hf_greedy(target, p, MAX_NEW + 12) for p in PROMPTS}


@pytest.fixture(scope="module")
def eagle_drafter(target, fit_eagle):
    return fit_eagle(target, PROMPTS, MAX_NEW)


def medusa(target):
    torch.manual_seed(0)
    heads = MedusaHeads(target.config.hidden_size, target.config.vocab_size, num_heads=5)
    return MedusaProposer(heads.attach_lm_head(target.get_output_embeddings()).eval())


def make_proposer(kind, target, random_drafter, eagle_drafter):
    return {
        "random": lambda: DraftModelProposer(random_drafter),
        "early-exit": lambda: EarlyExitProposer(target, 1),
        "eagle": lambda: EagleProposer(eagle_drafter),
        "medusa": lambda: medusa(target),
        "lookup-first-eagle": lambda: LookupFirstProposer(NGramProposer(3, 2), EagleProposer(eagle_drafter)),
        "ngram": lambda: NGramProposer(),
    }[kind]()


@pytest.mark.parametrize("kind", ["random", "early-exit", "eagle", "medusa", "lookup-first-eagle", "ngram"])
@pytest.mark.parametrize("draft_len", [1, 3, 5])
def test_greedy_with_leaves_equals_target_generate(kind, draft_len, target, random_drafter, eagle_drafter,
                                                   continuations):
    reference = [continuations[tuple(p)][:MAX_NEW] for p in PROMPTS]
    results = []
    for alternatives, min_prob in [(0, 0.0), (3, 0.0), (3, 0.05)]:
        decoder = SpeculativeDecoder(target, make_proposer(kind, target, random_drafter, eagle_drafter))
        result = decoder.generate(PROMPTS, options=DecodeOptions(max_new_tokens=MAX_NEW, draft_len=draft_len,
                                                                 draft_alternatives=alternatives,
                                                                 leaf_min_prob=min_prob))
        assert result.tokens == reference
        results.append(result.stats)
    chain, tree, _ = results
    if kind == "ngram":  # no logits, no runner-ups: the very same rounds
        assert tree.leaf_accepts == 0 and tree.rounds == chain.rounds
    elif kind == "early-exit":  # its runner-ups often hold the target's token (a random drafter's do not)
        assert tree.leaf_accepts > 0
        assert tree.acceptance_length > chain.acceptance_length


class Oracle(Proposer):
    """Knows each prompt's greedy continuation. Each round it drafts the true tokens up to a depth that
    varies by round and row, then a wrong token whose second runner-up (after a wrong first) is the true one.
    Records the target states it is handed."""

    name = "oracle"
    needs_target_states = True

    def __init__(self, continuations, vocab):
        self.full = {p: list(p) + c for p, c in continuations.items()}
        self.vocab = vocab
        self.round = 0
        self.states: list[list[torch.Tensor]] = []  # per row: the states handed over, in order

    def begin(self, prompts, sampling, rng):
        self.rows = [self.full[tuple(p)] for p in prompts]
        self.states = [[] for _ in prompts]
        self.index = list(range(len(prompts)))

    def target_states(self, states):
        for i, s in zip(self.index, states):
            self.states[i].append(s)

    def propose(self, ctx):
        draft_len = ctx.options.draft_len
        self.round += 1
        batch = len(ctx.history)
        tokens = torch.zeros(batch, draft_len, dtype=torch.int64)
        alternatives = torch.full((batch, draft_len, 2), -1, dtype=torch.int64)
        for b, history in enumerate(ctx.history):
            cut = (self.round + self.index[b]) % draft_len  # the 0-based depth of the wrong token, per row
            truth = self.rows[b][len(history): len(history) + draft_len]
            assert self.rows[b][: len(history)] == history
            tokens[b] = torch.tensor(truth)
            wrong = [(truth[cut] + k) % self.vocab for k in (1, 2)]
            tokens[b, cut] = wrong[0]
            alternatives[b, cut] = torch.tensor([wrong[1], truth[cut]])
        lens = torch.tensor([min(m, draft_len) for m in ctx.max_lens])
        return Draft(tokens, lens, None, alternatives)

    def select_rows(self, rows):
        keep = rows.tolist()
        self.rows = [self.rows[i] for i in keep]
        self.index = [self.index[i] for i in keep]


@pytest.mark.parametrize("draft_len", [1, 2, 4])
def test_the_true_leaf_is_taken_and_its_logits_give_the_bonus(target, continuations, draft_len):
    """Every round the chain is cut at a varying depth and the true token waits as a leaf there: it must
    be accepted, the bonus after it must be the target's greedy token (only right when the leaf sits
    at the right position and sees the right slots), and the states handed to the drafter must be those
    of a plain forward over the output."""
    oracle = Oracle(continuations, target.config.vocab_size)
    result = SpeculativeDecoder(target, oracle).generate(PROMPTS, options=DecodeOptions(max_new_tokens=MAX_NEW,
                                                                                        draft_len=draft_len,
                                                                                        draft_alternatives=2))
    assert result.tokens == [continuations[tuple(p)][:MAX_NEW] for p in PROMPTS]
    stats = result.stats
    # All rounds but the budget-clipped last ones of each row take the leaf.
    assert stats.leaf_accepts >= stats.rounds - 2 * len(PROMPTS)
    assert stats.leaf_accepts > stats.rounds // 2
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            full = torch.tensor([list(prompt) + result.tokens[i]])
            expected = target(full, output_hidden_states=True).hidden_states[-1][0]
            handed = torch.cat(oracle.states[i])  # the prompt's states but the last, then each round's
            assert handed.shape[0] == full.shape[1] - 1
            torch.testing.assert_close(handed, expected[:-1], atol=1e-4, rtol=1e-4)


def test_sampled_rows_ignore_leaves(target, random_drafter, continuations):
    """A mixed batch: greedy rows still equal the target's greedy output; sampled rows emit exactly what
    they emit without leaves (same draws), since only greedy rows get leaves."""
    params = [SamplingParams(), SamplingParams(temperature=0.9, seed=3), SamplingParams(),
              SamplingParams(temperature=0.7, top_p=0.9, seed=5)]
    outputs = []
    for alternatives in (0, 3):
        decoder = SpeculativeDecoder(target, DraftModelProposer(random_drafter), verifier="native")
        outputs.append(decoder.generate(PROMPTS, params, options=DecodeOptions(max_new_tokens=MAX_NEW, draft_len=3,
                                                                               draft_alternatives=alternatives)).tokens)
    assert outputs[0] == outputs[1]
    for b in (0, 2):
        assert outputs[1][b] == continuations[tuple(PROMPTS[b])][:MAX_NEW]


def test_runner_ups_rank_like_argmax_and_skip_what_cannot_be_leaves():
    logits = torch.tensor([[0.0, 5.0, 5.0, 3.0, float("-inf"), 4.0],
                           [1.0, 1.0, 1.0, float("-inf"), float("-inf"), float("-inf")],
                           [9.0, 8.0, 7.0, 6.0, 5.0, 4.0]])
    drafted = logits.argmax(dim=-1)  # [1, 0, 0]: lowest index on ties
    rows = torch.tensor([True, True, False])
    leaves, reach = runner_ups(logits, drafted, 3, rows)
    assert leaves.tolist() == [[2, 5, 3], [1, 2, -1], [-1, -1, -1]]
    probs = logits.softmax(dim=-1)
    torch.testing.assert_close(reach, probs[torch.arange(3), drafted])

    # With min_prob a leaf needs reach * q(leaf) >= min_prob: in row 0, q = 0.40 / 0.15 / 0.05 for tokens
    # 2 / 5 / 3; in row 1 (reach 0.5), 1/3 each, so 0.17.
    before = torch.tensor([1.0, 0.5, 1.0])
    leaves, reach = runner_ups(logits, drafted, 3, rows, before, min_prob=0.1)
    assert leaves.tolist() == [[2, 5, -1], [1, 2, -1], [-1, -1, -1]]
    torch.testing.assert_close(reach, before * probs[torch.arange(3), drafted])
    leaves, _ = runner_ups(logits, drafted, 3, rows, before, min_prob=0.2)
    assert leaves.tolist() == [[2, -1, -1], [-1, -1, -1], [-1, -1, -1]]


@pytest.mark.parametrize("kind", ["early-exit", "medusa"])
def test_leaf_min_prob_near_one_leaves_the_chain_alone(kind, target, random_drafter, eagle_drafter, continuations):
    runs = [SpeculativeDecoder(target, make_proposer(kind, target, random_drafter, eagle_drafter)).generate(PROMPTS, options=DecodeOptions(max_new_tokens=MAX_NEW,
                                                                                                                                           draft_len=3,
                                                                                                                                           draft_alternatives=a,
                                                                                                                                           leaf_min_prob=m)) for a, m in
        [(0, 0.0), (3, 0.999), (3, 0.0)]]
    assert runs[0].tokens == runs[1].tokens == runs[2].tokens == [continuations[tuple(p)][:MAX_NEW] for p in PROMPTS]
    assert runs[1].stats.leaf_accepts == 0 and runs[1].stats.rounds == runs[0].stats.rounds
    if kind == "early-exit":
        assert runs[2].stats.leaf_accepts > 0


def test_leaf_slots_sit_at_their_depth_and_see_only_their_ancestors():
    alternatives = torch.tensor([[[7, -1], [8, 9]],  # D = 2, A = 2, two rows
                                 [[5, -1], [-1, 4]]])
    leaves = Leaves.from_draft(alternatives, torch.tensor([2, 2]), torch.tensor([True, True]))
    # Rank 2 at depth 1 is used by no row: it gets no slot. The others keep their order.
    assert leaves.tokens.tolist() == [[7, 8, 9], [5, 0, 4]]
    assert leaves.valid.tolist() == [[True, True, True], [True, False, True]]
    depth, sees = leaves.structure(2)
    assert depth.tolist() == [0, 1, 2, 1, 2, 2]
    # Slots: last, d1, d2, leaf(depth 1), leaf(depth 2, rank 1), leaf(depth 2, rank 2).
    assert sees.int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 1],
    ]
    # Sampled rows and positions past the draft length have no leaves.
    assert Leaves.from_draft(alternatives, torch.tensor([2, 2]), torch.tensor([False, False])) is None
    short = Leaves.from_draft(alternatives, torch.tensor([1, 1]), torch.tensor([True, True]))
    assert short.tokens.tolist() == [[7], [5]] and short.depth.tolist() == [1]
