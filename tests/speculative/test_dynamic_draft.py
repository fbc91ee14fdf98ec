"""Dynamic draft length (`draft_confidence`): drafts stop after the first token the drafter is unsure of.

The rule must cut each draft exactly where the drafter's own probabilities say, and it must not change
any output: greedy decoding still equals the target's `generate`, a sampled batch still equals its
rows run alone. (The sampled distribution under the rule is tested in test_generate_sampling.py.)
"""

import pytest
import torch

from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.medusa import MedusaHeads, MedusaProposer
from draftsmith.speculative.draft_lm import DraftModelProposer
from draftsmith.speculative.early_exit import EarlyExitProposer
from draftsmith.speculative.proposers import RoundContext
from draftsmith.speculative.rng import RowGenerators
from draftsmith.speculative.sampling import BatchSampling, SamplingParams
from draftsmith.speculative.options import DecodeOptions

PROMPTS = [
    [1, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100],
    [1, 50, 43, 50],
    [1, 84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110, 32, 102, 111, 120],
]


def greedy_chain(model, prompt, steps):
    """The drafter's own greedy continuation and the probability it gives each token, by full forwards."""
    ids, confidence = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            probs = model(torch.tensor([ids])).logits[0, -1].softmax(-1)
            ids.append(int(probs.argmax()))
            confidence.append(float(probs.max()))
    return ids[len(prompt):], confidence


def context(prompts, draft_len, threshold, params=None):
    params = params or [SamplingParams()] * len(prompts)
    return RoundContext([list(p) for p in prompts], [draft_len] * len(prompts), BatchSampling.from_params(params),
                        RowGenerators([p.seed for p in params], "cpu"),
                        DecodeOptions(draft_len=draft_len, draft_confidence=threshold))


@pytest.mark.parametrize("threshold", [0.2, 0.4, 0.6])
def test_draft_stops_after_the_first_unconfident_token(target, threshold):
    draft_len = 6
    proposer = EarlyExitProposer(target, 2)
    ctx = context(PROMPTS, draft_len, threshold)
    proposer.begin(ctx.history, ctx.sampling, ctx.rng)
    draft = proposer.propose(ctx)
    lens = []
    for b, prompt in enumerate(PROMPTS):
        tokens, confidence = greedy_chain(proposer.model, prompt, draft_len)
        expected = next((i + 1 for i, c in enumerate(confidence) if c < threshold), draft_len)
        lens.append(expected)
        assert int(draft.lens[b]) == expected, (b, confidence)
        assert draft.tokens[b, :expected].tolist() == tokens[:expected]
    assert draft.tokens.shape[1] == max(lens)  # no draft step once every row has stopped
    assert len(set(lens)) > 1 or threshold == 0.6  # the thresholds cut these rows at different places


@pytest.mark.parametrize("kind", ["same", "random", "early-exit"])
@pytest.mark.parametrize("threshold", [0.3, 0.7])
@pytest.mark.parametrize("draft_len", [2, 5, 8])
def test_greedy_output_unchanged(kind, threshold, draft_len, target, random_drafter, hf_greedy):
    reference = [hf_greedy(target, p, 24) for p in PROMPTS]
    proposer = {"same": lambda: DraftModelProposer(target), "random": lambda: DraftModelProposer(random_drafter),
                "early-exit": lambda: EarlyExitProposer(target, 1)}[kind]()
    decoder = SpeculativeDecoder(target, proposer)
    result = decoder.generate(PROMPTS, options=DecodeOptions(max_new_tokens=24, draft_len=draft_len,
                                                             draft_confidence=threshold))
    assert result.tokens == reference
    fixed = decoder.generate(PROMPTS, options=DecodeOptions(max_new_tokens=24, draft_len=draft_len))
    assert result.stats.mean_draft_len <= fixed.stats.mean_draft_len
    if kind == "same" and draft_len > 2:
        assert 1.0 <= result.stats.mean_draft_len < fixed.stats.mean_draft_len  # some drafts were cut


def test_sampled_batch_equals_rows_alone_when_rows_stop_at_different_steps(target):
    params = [SamplingParams(0.8, seed=5), SamplingParams(0.0), SamplingParams(1.1, top_p=0.95, seed=9)]
    decoder = SpeculativeDecoder(target, EarlyExitProposer(target, 2))
    batch = decoder.generate(PROMPTS, params, options=DecodeOptions(max_new_tokens=20, draft_len=5,
                                                                    draft_confidence=0.25))
    assert 1.0 < batch.stats.mean_draft_len < 5.0  # drafts of several lengths in one batch
    solo = [decoder.generate([p], [s], options=DecodeOptions(max_new_tokens=20, draft_len=5, draft_confidence=0.25)).tokens[0]
            for p, s in zip(PROMPTS, params)]
    assert batch.tokens == solo
    again = decoder.generate(PROMPTS, params, options=DecodeOptions(max_new_tokens=20, draft_len=5,
                                                                    draft_confidence=0.25))
    assert again.tokens == batch.tokens


def test_medusa_chain_is_cut_after_the_first_unconfident_head(target):
    torch.manual_seed(0)
    heads = MedusaHeads(target.config.hidden_size, target.config.vocab_size, num_heads=4)
    with torch.no_grad():
        for block in heads.blocks:
            block[0].linear.weight.normal_(std=0.5)
    heads.attach_lm_head(target.get_output_embeddings())
    hidden = torch.randn(6, target.config.hidden_size) * 3
    with torch.no_grad():
        top = heads(hidden).softmax(-1).amax(-1)  # [6, 4]
    threshold = float(top.median())
    ctx = context([[1, 2]] * 6, 4, threshold)
    ctx.target_hidden = hidden
    with torch.no_grad():
        draft = MedusaProposer(heads).propose(ctx)
    for b in range(6):
        expected = next((k + 1 for k in range(4) if top[b, k] < threshold), 4)
        assert int(draft.lens[b]) == expected
    assert len(set(draft.lens.tolist())) > 1


def test_bad_confidence_is_refused(target):
    from draftsmith.speculative.errors import InvalidInputError

    decoder = SpeculativeDecoder(target, EarlyExitProposer(target, 1))
    for bad in (-0.1, 1.0):
        with pytest.raises(InvalidInputError, match="draft confidence"):
            decoder.generate(PROMPTS[:1], options=DecodeOptions(max_new_tokens=4, draft_confidence=bad))
