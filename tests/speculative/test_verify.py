"""The reference verifier on hand-made and random inputs (the rules in speculative/verify.py's docstring)."""

import math

import pytest
import torch
from scipy import stats

from draftsmith.speculative.errors import InvalidInputError, NumericalError
from draftsmith.speculative.verify import verify_native


def noise(batch, draft_len, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(batch, draft_len, generator=g)
    e = torch.empty(batch, vocab).exponential_(generator=g).clamp_(min=1e-30)
    return u, e


def run(logits, tokens, lens=None, probs=None, temperature=1.0, top_k=0, top_p=1.0, seed=0):
    batch, width, vocab = logits.shape
    lens = torch.full((batch,), width - 1) if lens is None else lens
    u, e = noise(batch, width - 1, vocab, seed)
    temp = torch.as_tensor(temperature, dtype=torch.float32).expand(batch).clone()
    k = torch.as_tensor(top_k).expand(batch).clone()
    p = torch.as_tensor(top_p, dtype=torch.float32).expand(batch).clone()
    return verify_native(logits, tokens, lens, probs, temp, k, p, u, e)


def one_hot_logits(tokens, vocab):  # [B, T] -> [B, T, V]: a near-deterministic target
    logits = torch.full((*tokens.shape, vocab), -30.0)
    return logits.scatter(-1, tokens[..., None], 30.0)


# ---------------------------------------------------------------- fixed cases (requirement 4)

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_all_accepted_emits_bonus(temperature):
    target_tokens = torch.tensor([[3, 1, 4, 1]])
    out = run(one_hot_logits(target_tokens, 8), target_tokens[:, :3], temperature=temperature)
    assert out.tokens.tolist() == [[3, 1, 4, 1]]
    assert out.num_emitted.tolist() == [4]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("mismatch", [0, 1, 2])
def test_first_mismatch_at_each_position(temperature, mismatch):
    target_tokens = torch.tensor([[3, 1, 4, 1]])
    draft = target_tokens[:, :3].clone()
    draft[0, mismatch] = 7
    out = run(one_hot_logits(target_tokens, 8), draft, temperature=temperature)
    expected = target_tokens[0, : mismatch + 1].tolist() + [-1] * (3 - mismatch)
    assert out.tokens.tolist() == [expected]  # accepted prefix, recovered target token, -1 padding
    assert out.num_accepted.tolist() == [mismatch]


def test_empty_and_ragged_drafts():
    target_tokens = torch.tensor([[5, 6, 7, 0], [1, 2, 3, 4], [2, 2, 2, 2]])
    draft = torch.tensor([[5, 6, 7], [1, 2, 0], [0, 0, 0]])  # row 2: empty draft, row 1: two tokens
    lens = torch.tensor([3, 2, 0])
    out = run(one_hot_logits(target_tokens, 8), draft, lens=lens, temperature=0.0)
    assert out.tokens.tolist() == [[5, 6, 7, 0], [1, 2, 3, -1], [2, -1, -1, -1]]
    assert out.num_emitted.tolist() == [4, 3, 1]


def test_empty_draft_width_zero():
    logits = one_hot_logits(torch.tensor([[4], [6]]), 8)
    out = run(logits, torch.zeros(2, 0, dtype=torch.long), temperature=0.0)
    assert out.tokens.tolist() == [[4], [6]]


def test_argmax_tie_goes_to_lowest_index():
    logits = torch.zeros(1, 2, 6)
    logits[0, :, 2] = logits[0, :, 4] = 5.0  # tokens 2 and 4 tie at both positions
    out = run(logits, torch.tensor([[4]]), temperature=0.0)
    assert out.tokens.tolist() == [[2, -1]]  # the draft's 4 loses the tie; 2 is recovered
    out = run(logits, torch.tensor([[2]]), temperature=0.0)
    assert out.tokens.tolist() == [[2, 2]]


# ---------------------------------------------------------------- requirement 1 and 2 edge cases

def test_q_zero_never_accepts_and_p_zero_always_rejects():
    batch, vocab = 2000, 6
    logits = torch.log(torch.tensor([0.5, 0.5, 0, 0, 0, 0]).clamp(min=1e-38)).expand(batch, 2, vocab).clone()
    logits[..., 2:] = float("-inf")  # p = 0 on tokens 2..5
    q = torch.tensor([0.0, 0.0, 1.0, 0, 0, 0]).expand(batch, 1, vocab).clone()
    # draft token 0 has q = 0 (as if padded from an invalid draw) but p = 0.5: must never accept
    out = run(logits, torch.zeros(batch, 1, dtype=torch.long), probs=q)
    assert not bool(torch.isnan(out.tokens.float()).any())
    assert out.num_accepted.sum() == 0
    # draft token 2 has p = 0: always rejected, and the recovered token is never outside p's support
    out = run(logits, torch.full((batch, 1), 2), probs=q)
    assert out.num_accepted.sum() == 0
    assert set(out.tokens[:, 0].tolist()) <= {0, 1}


def test_zero_residual_still_yields_valid_token():
    # p == q except rounding; force a rejection with u close to 1 and a q slightly above p at the draft.
    vocab = 5
    p = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])
    q = p.clone()
    q[1] += 1e-6
    logits = p.log().expand(1, 2, vocab).clone()
    u = torch.tensor([[0.9999999]])
    e = torch.ones(1, vocab)
    out = verify_native(logits, torch.tensor([[1]]), torch.tensor([1]), q.expand(1, 1, vocab).clone(),
                        torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1), u, e)
    token = int(out.tokens[0, 0])
    assert 0 <= token < vocab
    if int(out.num_accepted[0]) == 0:  # residual is ~0 everywhere: falls back to p, still a real token
        assert token != -1


# ---------------------------------------------------------------- distribution tests (requirements 5, 6)

VOCAB, D, N = 10, 3, 60_000


def random_dists(seed, shape, zero_frac=0.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, generator=g) * 1.5
    if zero_frac:
        logits[torch.rand(*shape, generator=g) < zero_frac] = float("-inf")
        logits[..., 0] = logits[..., 0].clamp(min=-1.0)  # keep every distribution non-empty
    return torch.softmax(logits, -1)


def sample_drafts(q, seed):  # q: [D, V] -> tokens [N, D] drawn from q
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.multinomial(q[i], N, replacement=True, generator=g) for i in range(q.shape[0])], 1)


def emitted_matches_target(out, p, min_count=20):
    """Chi-square goodness-of-fit p-values of the tokens emitted at each position against p[position];
    positions reached too rarely for the test (under two usable bins) are left out."""
    pvalues = []
    for j in range(p.shape[0]):
        reached = out.num_emitted > j
        counts = torch.bincount(out.tokens[reached, j], minlength=VOCAB).double()
        total = counts.sum()
        if counts[p[j] == 0].sum() > 0:  # a token with p = 0 was emitted: certainly wrong
            return [0.0]
        expected = p[j].double() / p[j].double().sum() * total
        bins = expected >= min_count  # pool the tiny bins so the chi-square approximation holds
        obs = torch.cat([counts[bins], counts[~bins].sum()[None]])
        exp = torch.cat([expected[bins], expected[~bins].sum()[None]])
        keep = exp > 0
        if int(keep.sum()) < 2:
            continue
        pvalues.append(stats.chisquare(obs[keep].numpy(), exp[keep].numpy()).pvalue)
    return pvalues


def verify_batch(p, q, draft, seed, deterministic_draft=False):
    logits = p.log().expand(N, D + 1, VOCAB).clone()
    probs = None if deterministic_draft else q.expand(N, D, VOCAB).clone()  # q is ignored when deterministic
    return run(logits, draft, probs=probs, seed=seed)


CASES = {
    "random": dict(p_seed=1, q_seed=2, zero_frac=0.0),
    "q_zero_where_p_positive": dict(p_seed=3, q_seed=4, zero_frac=0.5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_emitted_distribution_is_the_target(case):
    c = CASES[case]
    p = random_dists(c["p_seed"], (D + 1, VOCAB))
    q = random_dists(c["q_seed"], (D, VOCAB), zero_frac=c["zero_frac"])
    if c["zero_frac"]:
        assert bool(((q == 0) & (p[:D] > 0)).any())
    out = verify_batch(p, q, sample_drafts(q, 10), seed=11)
    pvalues = emitted_matches_target(out, p)
    assert len(pvalues) >= 2 and min(pvalues) > 1e-3  # the first position and at least one beyond it
    # Requirement 6: P(accept draft 1) = sum_v min(p, q), within a 4-sigma binomial interval.
    expected = torch.minimum(p[0], q[0]).sum().item()
    rate = (out.num_accepted > 0).double().mean().item()
    assert abs(rate - expected) < 4 * math.sqrt(expected * (1 - expected) / N)


def test_p_equal_q_accepts_everything():
    p = random_dists(5, (D + 1, VOCAB))
    out = verify_batch(p, p[:D], sample_drafts(p[:D], 12), seed=13)
    assert bool((out.num_accepted == D).all())
    pvalues = emitted_matches_target(out, p)
    assert len(pvalues) == D + 1 and min(pvalues) > 1e-3


def test_disjoint_supports_never_accept():
    p = torch.zeros(D + 1, VOCAB)
    p[:, :5] = 0.2
    q = torch.zeros(D, VOCAB)
    q[:, 5:] = 0.2
    out = verify_batch(p, q, sample_drafts(q, 14), seed=15)
    assert int(out.num_accepted.sum()) == 0
    assert min(emitted_matches_target(out, p)) > 1e-3


def test_one_hot_draft_is_exact():
    p = random_dists(6, (D + 1, VOCAB))
    # Drafted from p itself (so later positions are reached), verified as a deterministic proposal:
    # the verifier only sees the tokens, never the distribution they came from.
    draft = sample_drafts(p[:D], 100)
    out = verify_batch(p, None, draft, seed=200, deterministic_draft=True)
    pvalues = emitted_matches_target(out, p)
    assert len(pvalues) >= 3 and min(pvalues) > 1e-3


def test_negative_control_always_accept_fails():
    p = random_dists(1, (D + 1, VOCAB))
    q = random_dists(2, (D, VOCAB))
    draft = sample_drafts(q, 10)
    out = verify_batch(p, q, draft, seed=11)
    out.tokens[:, :D] = draft  # a verifier that accepts every draft token emits q, not p
    out.tokens[:, D] = out.tokens[:, D].clamp(min=0)
    out.num_emitted[:] = D + 1
    assert min(emitted_matches_target(out, p)) < 1e-6


# ---------------------------------------------------------------- requirement 9: filtered support

def test_top_k_top_p_never_emit_outside_allowed_set():
    batch, vocab = 4000, 50
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(batch, 3, vocab, generator=g) * 2
    draft = torch.randint(0, vocab, (batch, 2), generator=g)
    for top_k, top_p in [(5, 1.0), (0, 0.6), (8, 0.5)]:
        out = run(logits, draft, probs=None, temperature=0.8, top_k=top_k, top_p=top_p, seed=4)
        from draftsmith.speculative.sampling import filter_logits

        allowed = torch.isfinite(filter_logits(logits, torch.full((batch,), 0.8), torch.full((batch,), top_k),
                                               torch.full((batch,), top_p)))
        emitted = out.tokens.clamp(min=0)
        inside = allowed.gather(-1, emitted[..., None]).squeeze(-1) | (out.tokens < 0)
        assert bool(inside.all()), (top_k, top_p)


# ---------------------------------------------------------------- requirement 11: input validation

def test_rejects_bad_inputs():
    logits = torch.zeros(2, 3, 8)
    tokens = torch.zeros(2, 2, dtype=torch.long)
    with pytest.raises(InvalidInputError, match="draft token ids"):
        run(logits, torch.tensor([[1, 8], [0, 0]]))
    with pytest.raises(InvalidInputError, match="draft_tokens must be"):
        run(logits, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(InvalidInputError, match="draft_probs must be"):
        run(logits, tokens, probs=torch.full((2, 1, 8), 0.125))  # padded draft, unpadded probs
    with pytest.raises(InvalidInputError, match="draft_lens"):
        run(logits, tokens, lens=torch.tensor([3, 0]))
    with pytest.raises(NumericalError, match="NaN"):
        run(torch.full((2, 3, 8), float("nan")), tokens)


def test_out_of_vocab_padding_past_draft_len_is_ignored():
    logits = one_hot_logits(torch.tensor([[1, 2, 3]]), 8)
    out = run(logits, torch.tensor([[1, 99]]), lens=torch.tensor([1]), temperature=0.0)
    assert out.tokens.tolist() == [[1, 2, -1]]
