"""Exact speculative sampling through the whole runtime, on tiny models with a 32-token vocabulary.

The exact distribution of the first three emitted tokens is computable here (32 + 32^2 contexts), so
each test compares the runtime's empirical token counts at positions 1, 2 and 3 against it with a
chi-square goodness-of-fit test: N = 3,000 sequences per run, fixed seeds, p-value > 1e-3 to pass; the
negative control (a verifier that accepts every draft) must give p < 1e-6 on the same test.
"""

import pytest
import torch
from scipy import stats

from draftsmith.speculative.eagle import EagleDrafter, EagleProposer
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.draft_lm import DraftModelProposer
from draftsmith.speculative.early_exit import EarlyExitProposer
from draftsmith.speculative.lookup import LookupFirstProposer
from draftsmith.speculative.ngram import NGramProposer
from draftsmith.speculative.sampling import BatchSampling, SamplingParams, processed_probs
from draftsmith.speculative.tiny import tiny_model
from draftsmith.speculative.verify import VerifyOutput, verify_native
from draftsmith.speculative.options import DecodeOptions

VOCAB, N, PROMPT = 32, 3000, [1, 7, 12, 7, 12, 3]


@pytest.fixture(scope="module")
def small_target():
    return tiny_model(10, num_layers=3, vocab_size=VOCAB, init_std=0.15)


@pytest.fixture(scope="module")
def small_drafter():
    return tiny_model(11, num_layers=1, vocab_size=VOCAB, init_std=0.15)


def exact_marginals(model, params: SamplingParams, positions=3):
    """P(token at position j) for j = 1..positions, by enumerating every continuation."""
    with torch.no_grad():
        marginals, prefixes, weights = [], torch.tensor([PROMPT]), torch.ones(1, dtype=torch.float64)
        sampling = BatchSampling.from_params([params])
        for _ in range(positions):
            logits = model(prefixes).logits[:, -1:]
            probs = processed_probs(logits, sampling.select(torch.zeros(len(prefixes), dtype=torch.long)))[:, 0]
            joint = weights[:, None] * probs.double()  # [prefixes, V]
            marginals.append(joint.sum(0))
            prefixes = torch.cat([prefixes.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(len(prefixes))[:, None]], 1)
            weights = joint.reshape(-1)
            alive = weights > 0
            prefixes, weights = prefixes[alive], weights[alive]
    return marginals


def sample_runtime(target, proposer, params, draft_len=3, verifier=verify_native, draft_confidence=0.0):
    decoder = SpeculativeDecoder(target, proposer, verifier=verifier)
    rows = [SamplingParams(params.temperature, params.top_k, params.top_p, seed=1000 + i) for i in range(N)]
    result = decoder.generate([PROMPT] * N, rows, options=DecodeOptions(max_new_tokens=3, draft_len=draft_len,
                                                                        draft_confidence=draft_confidence))
    return torch.tensor(result.tokens), result.stats


def fit_pvalues(tokens, marginals, min_count=20):
    pvalues = []
    for j, p in enumerate(marginals):
        counts = torch.bincount(tokens[:, j], minlength=VOCAB).double()
        if counts[p == 0].sum() > 0:
            return [0.0]  # a token outside the target's support was emitted
        expected = p / p.sum() * counts.sum()
        big = expected >= min_count
        obs = torch.cat([counts[big], counts[~big].sum()[None]])
        exp = torch.cat([expected[big], expected[~big].sum()[None]])
        keep = exp > 0
        pvalues.append(stats.chisquare(obs[keep].numpy(), exp[keep].numpy()).pvalue)
    return pvalues


def masked_drafter(seed):
    """A drafter that puts q = 0 on every odd token, where the target has p > 0."""
    model = tiny_model(seed, num_layers=1, vocab_size=VOCAB, init_std=0.15)

    def hook(module, args, out):
        out = out.clone()
        out[..., 1::2] = float("-inf")
        return out

    model.lm_head.register_forward_hook(hook)
    return model


def eagle_drafter(target, draft_vocab=None):
    """An untrained EAGLE drafter on `target`: its q is the target's lm_head on a random-ish feature."""
    torch.manual_seed(13)
    drafter = EagleDrafter(target.config, 1).attach_target(target, init_norm=True).eval()
    drafter.set_draft_vocab(draft_vocab)
    return drafter


PARAMS = SamplingParams(temperature=1.0)
FILTERED = SamplingParams(temperature=0.7, top_k=12, top_p=0.9)


@pytest.mark.parametrize(
    "name",
    ["random-drafter", "same-as-target", "q-zero-where-p-positive", "early-exit", "ngram", "plain", "filtered",
     "dynamic-length", "dynamic-length-filtered", "lookup-first", "lookup-first-filtered", "eagle", "eagle-filtered",
     "eagle-draft-vocab"],
)
def test_emitted_distribution_matches_target(name, small_target, small_drafter):
    params = FILTERED if name.endswith("filtered") else PARAMS
    proposer = {
        "random-drafter": lambda: DraftModelProposer(small_drafter),
        "same-as-target": lambda: DraftModelProposer(small_target),  # p == q
        "q-zero-where-p-positive": lambda: DraftModelProposer(masked_drafter(12)),
        "early-exit": lambda: EarlyExitProposer(small_target, 1),
        "ngram": lambda: NGramProposer(),
        "plain": lambda: None,
        "filtered": lambda: DraftModelProposer(small_drafter),
        # Drafts stop after a token with q below the threshold: a length decided by the drafted tokens.
        "dynamic-length": lambda: DraftModelProposer(small_drafter),
        "dynamic-length-filtered": lambda: DraftModelProposer(small_drafter),
        # Rows whose context repeats a token draft by lookup (one-hot q), the others by the draft LM.
        "lookup-first": lambda: LookupFirstProposer(NGramProposer(3, 1), DraftModelProposer(small_drafter)),
        "lookup-first-filtered": lambda: LookupFirstProposer(NGramProposer(3, 1), DraftModelProposer(small_drafter)),
        # Drafts sampled from the EAGLE drafter's q, its features its own guesses after the first step.
        "eagle": lambda: EagleProposer(eagle_drafter(small_target)),
        "eagle-filtered": lambda: EagleProposer(eagle_drafter(small_target)),
        # Drafting among the even tokens only: q = 0 where p > 0, the residual covers the rest.
        "eagle-draft-vocab": lambda: EagleProposer(eagle_drafter(small_target, torch.arange(0, VOCAB, 2))),
    }[name]()
    if name.startswith("dynamic-length"):
        tokens, decode_stats = sample_runtime(small_target, proposer, params, draft_confidence=0.1)
        _, fixed = sample_runtime(small_target, DraftModelProposer(small_drafter), params)
        # The rule cut some drafts short and let others reach the second position.
        assert decode_stats.drafted < fixed.drafted and decode_stats.offered[1] > 0
    else:
        tokens, decode_stats = sample_runtime(small_target, proposer, params)
    pvalues = fit_pvalues(tokens, exact_marginals(small_target, params))
    assert len(pvalues) == 3 and min(pvalues) > 1e-3, pvalues
    if name == "same-as-target":
        assert decode_stats.acceptance_length > 2.9  # p == q: every draft accepted (3 tokens, D = 3)
    if name.startswith("lookup-first"):  # both kinds of draft were verified, in the same batches
        assert proposer.lookup_rounds > 100 and proposer.model_rounds > 100
    if name.startswith("eagle"):  # second drafts (built on a guessed feature) were verified and accepted
        assert decode_stats.offered[1] > 100 and decode_stats.accepted[1] > 0


def always_accept(target_logits, draft_tokens, draft_lens, *rest):
    """A broken verifier that keeps every draft token (then adds the target's argmax). Must fail."""
    batch, width = draft_tokens.shape
    tokens = torch.full((batch, width + 1), -1)
    live = torch.arange(width)[None] < draft_lens[:, None]
    tokens[:, :width] = torch.where(live, draft_tokens, tokens[:, :width])
    tokens[torch.arange(batch), draft_lens] = target_logits.argmax(-1)[torch.arange(batch), draft_lens]
    return VerifyOutput(tokens, draft_lens + 1, draft_lens)


def test_negative_control_always_accept_fails(small_target, small_drafter):
    tokens, _ = sample_runtime(small_target, DraftModelProposer(small_drafter), PARAMS, verifier=always_accept)
    assert min(fit_pvalues(tokens, exact_marginals(small_target, PARAMS))) < 1e-6


def test_filtered_sampling_never_leaves_the_allowed_set(small_target, small_drafter):
    params = SamplingParams(temperature=1.3, top_k=4, top_p=0.7)
    tokens, _ = sample_runtime(small_target, DraftModelProposer(small_drafter), params, draft_len=2)
    sampling = BatchSampling.from_params([params] * len(tokens))
    with torch.no_grad():
        contexts = torch.cat([torch.tensor([PROMPT]).expand(len(tokens), -1), tokens], 1)
        probs = processed_probs(small_target(contexts).logits[:, len(PROMPT) - 1 : -1], sampling)
    assert bool((probs.gather(-1, tokens[..., None]) > 0).all())


@pytest.mark.parametrize("lookup_first", [False, True])
def test_seeded_runs_repeat_and_batches_equal_solo_rows(target, random_drafter, lookup_first):
    prompts = [[1, 72, 105, 33], [1, 65, 66, 67, 68, 69, 70], [1, 40]]
    params = [SamplingParams(0.9, seed=5), SamplingParams(0.0), SamplingParams(1.2, top_k=20, top_p=0.95, seed=9)]
    proposer = DraftModelProposer(random_drafter)
    if lookup_first:  # rows switch between lookup and the model at different rounds
        proposer = LookupFirstProposer(NGramProposer(2, 1), proposer)
    decoder = SpeculativeDecoder(target, proposer)
    first = decoder.generate(prompts, params, options=DecodeOptions(max_new_tokens=20, draft_len=3)).tokens
    again = decoder.generate(prompts, params, options=DecodeOptions(max_new_tokens=20, draft_len=3)).tokens
    assert first == again
    solo = [decoder.generate([p], [s], options=DecodeOptions(max_new_tokens=20, draft_len=3)).tokens[0] for p, s in zip(prompts, params)]
    assert first == solo  # a mixed greedy / sampled batch equals its rows run alone
    other_seed = decoder.generate(prompts[:1], [SamplingParams(0.9, seed=6)], options=DecodeOptions(max_new_tokens=20,
                                                                                                    draft_len=3)).tokens
    assert other_seed[0] != first[0]


def test_greedy_row_in_sampled_batch_is_exact(target, random_drafter):
    prompt = [1, 72, 101, 108, 108, 111]
    reference = target.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0)
    decoder = SpeculativeDecoder(target, EarlyExitProposer(target, 2))
    result = decoder.generate([prompt, prompt], [SamplingParams(1.0, seed=3), SamplingParams(0.0)], options=DecodeOptions(max_new_tokens=16,
                                                                                                                          draft_len=4))
    assert result.tokens[1] == reference[0, len(prompt):].tolist()


def fused_kernel_on_cpu() -> bool:
    """The runtime's tiny models live on the CPU, so the fused path runs there under the Triton interpreter."""
    from draftsmith.speculative import kernels

    return kernels.interpreting()


needs_interpreter = pytest.mark.skipif(not fused_kernel_on_cpu(), reason="needs triton with TRITON_INTERPRET=1")


@needs_interpreter
@pytest.mark.parametrize("name", ["random-drafter", "filtered"])
def test_fused_verifier_draws_in_kernel_and_emits_the_target_distribution(name, small_target, small_drafter):
    params = FILTERED if name == "filtered" else PARAMS
    assert SpeculativeDecoder(small_target, None, verifier="triton").verifier.kernel_noise
    tokens, _ = sample_runtime(small_target, DraftModelProposer(small_drafter), params, verifier="triton")
    pvalues = fit_pvalues(tokens, exact_marginals(small_target, params))
    assert len(pvalues) == 3 and min(pvalues) > 1e-3, pvalues


@needs_interpreter
def test_fused_verifier_seeded_runs_repeat_and_batches_equal_solo_rows(target, random_drafter):
    prompts = [[1, 72, 105, 33], [1, 65, 66, 67, 68, 69, 70], [1, 40]]
    params = [SamplingParams(0.9, seed=5), SamplingParams(0.0), SamplingParams(1.2, top_k=20, top_p=0.95, seed=9)]
    decoder = SpeculativeDecoder(target, DraftModelProposer(random_drafter), verifier="triton")
    first = decoder.generate(prompts, params, options=DecodeOptions(max_new_tokens=8, draft_len=3)).tokens
    assert decoder.generate(prompts, params, options=DecodeOptions(max_new_tokens=8, draft_len=3)).tokens == first
    solo = [decoder.generate([p], [s], options=DecodeOptions(max_new_tokens=8, draft_len=3)).tokens[0] for p, s in zip(prompts, params)]
    assert first == solo
    greedy = SpeculativeDecoder(target, None).generate(prompts[1:2], options=DecodeOptions(max_new_tokens=8)).tokens[0]
    assert first[1] == greedy  # the greedy row of the mixed batch is the target's greedy decoding
    other_seed = decoder.generate(prompts[:1], [SamplingParams(0.9, seed=6)], options=DecodeOptions(max_new_tokens=8,
                                                                                                    draft_len=3)).tokens
    assert other_seed[0] != first[0]
