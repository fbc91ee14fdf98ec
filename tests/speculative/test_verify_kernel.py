"""The fused Triton verifier against the reference `verify_native` (speculative/verify.py).

Without CUDA the kernels run on Triton's CPU interpreter. TRITON_INTERPRET=1 has to be set before
triton is first imported, and transformers imports triton, so in this suite it must come from the
environment or from the top of tests/conftest.py; setting it here only helps when this file is the
first to import triton. If the interpreter is not active the module is skipped with that reason.
Sizes are small because the interpreter pays per operation (rows are tiled to keep that cheap).
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from scipy import stats  # noqa: E402

from draftsmith.speculative import kernels  # noqa: E402
from draftsmith.speculative.errors import InvalidInputError  # noqa: E402
from draftsmith.speculative.kernels import select_verifier, verify_fused  # noqa: E402
from draftsmith.speculative.kernels import verify_triton  # noqa: E402
from draftsmith.speculative.sampling import filter_logits  # noqa: E402
from draftsmith.speculative.generate import SpeculativeDecoder  # noqa: E402
from draftsmith.speculative.options import DecodeOptions  # noqa: E402
from draftsmith.speculative.tiny import tiny_model  # noqa: E402
from draftsmith.speculative.verify import verify_native  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not kernels.interpreting():
    pytest.skip("no CUDA and the Triton interpreter is off: set TRITON_INTERPRET=1 before triton is imported "
                "(environment or top of tests/conftest.py)", allow_module_level=True)

# Kernel p differs from torch.softmax by a few ulps (docstring of verify_triton), so explicit-noise
# comparisons keep u * q at least this far (relative) from p; greedy rows need no such care.
MARGIN = 1e-4


def make_batch(batch, draft_len, vocab, seed, *, temperature=1.0, lens=None, dtype=torch.float32,
               with_probs=True, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, draft_len + 1, vocab, generator=g) * scale).to(dtype)
    tokens = torch.randint(0, vocab, (batch, draft_len), generator=g)
    probs = torch.softmax(torch.randn(batch, draft_len, vocab, generator=g) * scale, -1) if with_probs else None
    lens = torch.full((batch,), draft_len) if lens is None else torch.as_tensor(lens)
    temp = torch.as_tensor(temperature, dtype=torch.float32).expand(batch).clone()
    return dict(target_logits=logits, draft_tokens=tokens, draft_lens=lens, draft_probs=probs,
                temperature=temp, top_k=torch.zeros(batch, dtype=torch.long), top_p=torch.ones(batch))


def safe_noise(b, seed):
    """accept_u / race_exp with every u * q at least MARGIN (relative) away from the reference's p."""
    batch, width, vocab = b["target_logits"].shape
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(batch, width - 1, generator=g)
    e = torch.empty(batch, vocab).exponential_(generator=g).clamp_(min=1e-30)
    p = torch.softmax(filter_logits(b["target_logits"], b["temperature"], b["top_k"], b["top_p"]), -1)
    p_tok = p[:, :-1].gather(-1, b["draft_tokens"][..., None]).squeeze(-1)
    q_tok = torch.ones_like(p_tok) if b["draft_probs"] is None else b["draft_probs"].gather(
        -1, b["draft_tokens"][..., None]).squeeze(-1)
    close = (u * q_tok - p_tok).abs() <= MARGIN * p_tok
    u = torch.where(close, (u + 0.5) % 1.0, u)  # moved by 0.5: now far from the boundary
    assert not bool(((u * q_tok - p_tok).abs() <= MARGIN * p_tok).any())
    return u, e


def to_device(b):
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in b.items()}


def assert_same(b, u, e):
    ref = verify_native(**b, accept_u=u, race_exp=e)
    d = to_device(b)
    out = verify_fused(**d, accept_u=u.to(DEVICE), race_exp=e.to(DEVICE))
    assert out.tokens.cpu().tolist() == ref.tokens.tolist()
    assert out.num_emitted.cpu().tolist() == ref.num_emitted.tolist()
    assert out.num_accepted.cpu().tolist() == ref.num_accepted.tolist()
    return out


@pytest.fixture(params=["default", "tiny_blocks"])
def blocks(request, monkeypatch):
    """tiny_blocks: 16-wide vocab blocks (V = 37 spans three, the last one partial), 2-row tiles."""
    if request.param == "tiny_blocks":
        monkeypatch.setattr(verify_triton, "_launch_config", lambda batch, vocab: (2, 16, 4))
    return request.param


# ---------------------------------------------------------------- kernel == reference, explicit noise

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("batch", [1, 7])
def test_matches_reference_mixed_batch(blocks, dtype, with_probs, batch):
    temps = [0.0, 1.0, 0.7, 1.6, 0.0, 1.0, 0.3][:batch]
    lens = [3, 2, 0, 1, 3, 3, 2][:batch]
    b = make_batch(batch, 3, 37, seed=batch, temperature=temps, lens=lens, dtype=dtype, with_probs=with_probs)
    u, e = safe_noise(b, seed=1)
    assert_same(b, u, e)


def test_matches_reference_on_many_rows():
    # Near-target drafts so that later positions, bonus tokens and recoveries all occur.
    rows = 32
    b = make_batch(rows, 4, 37, seed=3, temperature=torch.rand(rows, generator=torch.Generator().manual_seed(0)) + 0.2,
                   lens=torch.arange(rows) % 5)
    target_p = torch.softmax(b["target_logits"].float() / b["temperature"][:, None, None], -1)
    b["draft_probs"] = (0.8 * target_p[:, :-1] + 0.2 * b["draft_probs"])
    b["draft_tokens"] = torch.multinomial(b["draft_probs"].reshape(-1, 37), 1,
                                          generator=torch.Generator().manual_seed(4)).reshape(rows, 4)
    u, e = safe_noise(b, seed=5)
    out = assert_same(b, u, e)
    assert len(set(out.num_accepted.tolist())) >= 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_identical_with_tied_logits(blocks, dtype):
    # Integer logits in 0..3 tie everywhere, also across block boundaries: lowest index wins.
    g = torch.Generator().manual_seed(6)
    b = make_batch(9, 3, 37, seed=6, temperature=0.0, lens=[3, 3, 2, 1, 0, 3, 3, 2, 3], dtype=dtype)
    b["target_logits"] = torch.randint(0, 4, b["target_logits"].shape, generator=g).to(dtype)
    top = b["target_logits"].argmax(-1)
    b["draft_tokens"] = torch.where(torch.rand(9, 3, generator=g) < 0.7, top[:, :-1], b["draft_tokens"])
    out = assert_same(b, *safe_noise(b, 7))
    assert out.num_accepted.max() > 0


# ---------------------------------------------------------------- fixed cases

def one_hot_logits(tokens, vocab):  # [B, T] -> [B, T, V]: a near-deterministic target
    return torch.full((*tokens.shape, vocab), -30.0).scatter(-1, tokens[..., None], 30.0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_all_accepted_emits_bonus(temperature):
    target = torch.tensor([[3, 1, 4, 1], [2, 7, 1, 8]])
    b = make_batch(2, 3, 40, seed=8, temperature=temperature, with_probs=False)
    b["target_logits"], b["draft_tokens"] = one_hot_logits(target, 40), target[:, :3]
    out = assert_same(b, *safe_noise(b, 9))
    assert out.tokens.tolist() == target.tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_all_rejected(temperature):
    target = torch.tensor([[3, 1, 4, 1], [2, 7, 1, 8]])
    b = make_batch(2, 3, 40, seed=10, temperature=temperature, with_probs=False)
    b["target_logits"], b["draft_tokens"] = one_hot_logits(target, 40), (target[:, :3] + 1) % 40
    out = assert_same(b, *safe_noise(b, 11))
    assert out.tokens.tolist() == [[3, -1, -1, -1], [2, -1, -1, -1]]


def test_q_zero_where_p_positive_never_accepts():
    b = make_batch(16, 2, 12, seed=12)
    b["draft_probs"][..., :6] = 0.0  # drafted tokens 0..5 have q = 0 but p > 0
    b["draft_tokens"] = b["draft_tokens"] % 6
    u, e = safe_noise(b, 13)
    out = assert_same(b, u, e)
    assert int(out.num_accepted.sum()) == 0
    assert bool((out.tokens[:, 0] >= 0).all() & (out.tokens[:, 0] < 12).all())


def test_p_equal_q_accepts_everything():
    b = make_batch(16, 3, 23, seed=14)
    b["draft_probs"] = torch.softmax(b["target_logits"][:, :-1].float(), -1)
    out = assert_same(b, *safe_noise(b, 15))
    assert bool((out.num_accepted == 3).all())


def test_zero_residual_falls_back_to_p():
    # q >= p everywhere (by 0.1 %, far above rounding) and u close to 1: every draft is rejected
    # and max(0, p - q) is all zero, so the recovered token is drawn from p.
    b = make_batch(16, 2, 23, seed=16)
    b["draft_probs"] = torch.softmax(b["target_logits"][:, :-1].float(), -1) * 1.001
    u = torch.full((16, 2), 0.99995)
    e = torch.empty(16, 23).exponential_(generator=torch.Generator().manual_seed(17))
    out = assert_same(b, u, e)
    assert int(out.num_accepted.sum()) == 0
    assert bool((out.tokens[:, 0] >= 0).all())


def test_empty_draft_width_zero():
    b = make_batch(3, 0, 19, seed=18, temperature=[0.0, 1.0, 0.5])
    out = assert_same(b, *safe_noise(b, 19))
    assert out.tokens.shape == (3, 1)


# ---------------------------------------------------------------- top-k / top-p

def test_top_k_top_p_rows_match_reference(blocks):
    batch = 8
    b = make_batch(batch, 2, 37, seed=20, temperature=[0.8, 1.0, 0.0, 1.3, 0.6, 1.0, 2.0, 1.0])
    g = torch.Generator().manual_seed(21)
    # Integer-valued logits put ties at the k-th value (top-k keeps them all).
    b["target_logits"] = torch.randint(-4, 5, b["target_logits"].shape, generator=g).float()
    b["top_k"] = torch.tensor([5, 0, 3, 1, 8, 36, 4, 0])
    b["top_p"] = torch.tensor([1.0, 0.6, 0.5, 1.0, 0.7, 1.0, 1.0, 0.9])
    target_p = torch.softmax(filter_logits(b["target_logits"], b["temperature"], b["top_k"], b["top_p"]), -1)
    b["draft_probs"] = 0.5 * target_p[:, :-1] + 0.5 * b["draft_probs"]
    for seed in range(2):
        u, e = safe_noise(b, 22 + seed)
        out = assert_same(b, u, e)
        allowed = torch.isfinite(filter_logits(b["target_logits"], b["temperature"], b["top_k"], b["top_p"]))
        emitted = out.tokens.cpu()
        inside = allowed.gather(-1, emitted.clamp(min=0)[..., None]).squeeze(-1) | (emitted < 0)
        assert bool(inside[b["temperature"] > 0].all())


# ---------------------------------------------------------------- in-kernel random numbers

VOCAB, D, N = 10, 3, 50_000


def random_dists(seed, shape, zero_frac=0.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, generator=g) * 1.5
    if zero_frac:
        logits[torch.rand(*shape, generator=g) < zero_frac] = float("-inf")
        logits[..., 0] = logits[..., 0].clamp(min=-1.0)
    return torch.softmax(logits, -1)


def philox_run(p, q, seed=0, offset=0):
    """N rows verified with in-kernel noise (per-row seeds), drafts drawn from q."""
    g = torch.Generator().manual_seed(seed)
    draft = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=g) for i in range(D)], 1)
    b = dict(target_logits=p.log().expand(N, D + 1, VOCAB).clone(), draft_tokens=draft,
             draft_lens=torch.full((N,), D), draft_probs=q.expand(N, D, VOCAB).clone(),
             temperature=torch.ones(N), top_k=torch.zeros(N, dtype=torch.long), top_p=torch.ones(N))
    seeds = torch.arange(N, dtype=torch.long) + 1000 * seed
    out = verify_fused(**to_device(b), seeds=seeds.to(DEVICE), offsets=torch.full((N,), offset, device=DEVICE))
    return out.tokens.cpu(), out.num_emitted.cpu(), out.num_accepted.cpu(), draft


def chi_square_pvalues(tokens, emitted, p, min_count=20):
    """Per position: chi-square goodness of fit of the tokens emitted there against p (tiny bins pooled)."""
    pvalues = []
    for j in range(p.shape[0]):
        counts = torch.bincount(tokens[emitted > j, j], minlength=VOCAB).double()
        if counts[p[j] == 0].sum() > 0:
            return [0.0]
        expected = p[j].double() / p[j].double().sum() * counts.sum()
        bins = expected >= min_count
        obs = torch.cat([counts[bins], counts[~bins].sum()[None]])
        exp = torch.cat([expected[bins], expected[~bins].sum()[None]])
        if int((exp > 0).sum()) >= 2:
            pvalues.append(stats.chisquare(obs[exp > 0].numpy(), exp[exp > 0].numpy()).pvalue)
    return pvalues


@pytest.mark.parametrize("zero_frac", [0.0, 0.5])
def test_in_kernel_noise_emits_the_target_distribution(zero_frac):
    # N = 50,000 rows, vocab 10, D = 3, fixed seeds; zero_frac 0.5 puts q = 0 where p > 0.
    p = random_dists(30, (D + 1, VOCAB))
    q = random_dists(31, (D, VOCAB), zero_frac)
    tokens, emitted, accepted, draft = philox_run(p, q)
    pvalues = chi_square_pvalues(tokens, emitted, p)
    assert len(pvalues) >= 2 and min(pvalues) > 1e-3
    expected = torch.minimum(p[0], q[0]).sum().item()  # P(accept draft 1) = sum min(p, q)
    rate = (accepted > 0).double().mean().item()
    assert abs(rate - expected) < 4 * math.sqrt(expected * (1 - expected) / N)

    # Negative control: the same draws, accepted wholesale, emit q rather than p and must fail.
    forced = tokens.clone()
    forced[:, :D], forced[:, D] = draft, forced[:, D].clamp(min=0)
    assert min(chi_square_pvalues(forced, torch.full((N,), D + 1), p)) < 1e-6


def test_in_kernel_noise_is_per_row_and_batch_invariant(monkeypatch):
    b = make_batch(12, 3, 37, seed=40, temperature=[1.0, 0.7, 0.0, 1.2] * 3, lens=[3, 2, 1, 0] * 3)
    seeds = torch.arange(12) * 7919
    offsets = torch.arange(12) + 5
    full = verify_fused(**to_device(b), seeds=seeds.to(DEVICE), offsets=offsets.to(DEVICE))
    again = verify_fused(**to_device(b), seeds=seeds.to(DEVICE), offsets=offsets.to(DEVICE))
    assert torch.equal(full.tokens, again.tokens)
    for rows in ([3], [7, 1, 10]):  # alone, or in a different batch in a different order
        sub = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in b.items()}
        part = verify_fused(**to_device(sub), seeds=seeds[rows].to(DEVICE), offsets=offsets[rows].to(DEVICE))
        assert torch.equal(part.tokens.cpu(), full.tokens.cpu()[rows])
    fresh = verify_fused(**to_device(b), seeds=seeds.to(DEVICE), offsets=(offsets + 1).to(DEVICE))
    assert not torch.equal(fresh.tokens, full.tokens)  # a new offset is a new draw
    # The counter layout does not depend on the block sizes either.
    monkeypatch.setattr(verify_triton, "_launch_config", lambda batch, vocab: (2, 16, 4))
    tiled = verify_fused(**to_device(b), seeds=seeds.to(DEVICE), offsets=offsets.to(DEVICE))
    assert torch.equal(tiled.tokens, full.tokens)


def test_in_kernel_noise_needs_seeds_and_offsets():
    b = to_device(make_batch(2, 2, 11, seed=41))
    with pytest.raises(InvalidInputError, match="seeds"):
        verify_fused(**b)
    with pytest.raises(InvalidInputError, match="race_exp must be"):
        verify_fused(**b, accept_u=torch.rand(2, 2, device=DEVICE), race_exp=torch.ones(2, 3, device=DEVICE))


def test_rejects_what_the_reference_rejects():
    b = to_device(make_batch(2, 2, 11, seed=42))
    b["draft_tokens"][0, 1] = 11
    with pytest.raises(InvalidInputError, match="draft token ids"):
        verify_fused(**b, accept_u=torch.rand(2, 2, device=DEVICE), race_exp=torch.ones(2, 11, device=DEVICE))


# ---------------------------------------------------------------- select_verifier

def test_select_verifier_modes(monkeypatch):
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    assert select_verifier(torch.device("cpu")) is verify_native
    assert select_verifier("cuda") is verify_fused
    assert select_verifier("cuda", "native") is verify_native
    assert select_verifier(DEVICE, "triton") is verify_fused  # CPU: allowed because the interpreter is on
    with pytest.raises(InvalidInputError, match="mode must be one of"):
        select_verifier("cpu", "fast")


def test_select_verifier_env_chooses_only_without_an_explicit_mode(monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, "native")
    assert select_verifier("cuda") is verify_native
    assert select_verifier("cuda", "triton") is verify_fused  # an explicit mode wins over the environment
    assert SpeculativeDecoder(tiny_model(0), verifier="triton").verifier.kernel_noise
    assert not SpeculativeDecoder(tiny_model(0)).verifier.kernel_noise  # the environment's native
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    assert select_verifier(DEVICE) is verify_fused
    monkeypatch.setenv(kernels.ENV_VAR, "bogus")
    with pytest.raises(InvalidInputError, match="DRAFTSMITH_VERIFIER"):
        select_verifier("cpu")


def test_select_verifier_without_gpu_or_triton(monkeypatch):
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    monkeypatch.setattr(kernels, "interpreting", lambda: False)
    with pytest.raises(InvalidInputError, match="CUDA"):
        select_verifier("cpu", "triton")
    monkeypatch.setattr(kernels, "HAS_TRITON", False)
    assert select_verifier("cuda") is verify_native
    with pytest.raises(InvalidInputError, match="needs triton"):
        select_verifier("cuda", "triton")


def test_sibling_leaves_with_the_fused_verifier(target):
    """The leaves' extra slots widen the target's logits past the chain's D + 1: the kernel reads the
    chain's part through its strides and must decide exactly what the reference decides."""
    from draftsmith.speculative.generate import SpeculativeDecoder
    from draftsmith.speculative.early_exit import EarlyExitProposer

    prompts = [[1, 72, 101, 108, 108, 111, 32, 119], [1, 50, 43, 50]]
    runs = [SpeculativeDecoder(target, EarlyExitProposer(target, 2), verifier=mode).generate(prompts, options=DecodeOptions(max_new_tokens=16,
                                                                                                                            draft_len=3,
                                                                                                                            draft_alternatives=3)) for mode in ("native", "triton")]
    assert runs[0].tokens == runs[1].tokens
    assert runs[1].stats.leaf_accepts == runs[0].stats.leaf_accepts > 0
