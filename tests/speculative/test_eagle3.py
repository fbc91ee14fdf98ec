"""The EAGLE-3 drafter: training-time test equals drafting, the runtime stays exact with it (greedy
equals Hugging Face `generate`, sampling emits the target's distribution, batches equal rows alone,
sibling leaves), and its checkpoints round-trip."""

import json

import pytest
import torch
from draftsmith.speculative import kinds
from draftsmith.speculative.checkpoint import (
    DrafterInfo,
    load_drafter_dir,
    read_drafter_info,
    save_drafter,
)
from draftsmith.speculative.drafters import build_proposer
from draftsmith.speculative.eagle3 import (
    Eagle3Drafter,
    Eagle3Proposer,
    default_target_layers,
)
from draftsmith.speculative.errors import InvalidInputError, ModelLoadError
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.loading import load_model
from draftsmith.speculative.lookup import LookupFirstProposer
from draftsmith.speculative.ngram import NGramProposer
from draftsmith.speculative.options import DecodeOptions
from draftsmith.speculative.sampling import (
    BatchSampling,
    SamplingParams,
    processed_probs,
)
from draftsmith.speculative.tiny import tiny_model
from draftsmith.speculative.verify import VerifyOutput, verify_native
from scipy import stats
from transformers import DynamicCache

# Ragged lengths, a one-token prompt (no pair before its first round) and a repeating one (lookup).
PROMPTS = [[1, 72, 101, 108, 108, 111, 32, 119], [1], [1, 65, 66, 67, 65, 66, 67, 65], [1, 50, 43, 50, 43]]
MAX_NEW = 24
LAYERS = [1, 2, 3]  # of the 4-layer tiny target: three increasing layers, none of them the embeddings


def target_states(model, ids, layers, attention_mask=None):
    hidden = model(ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
    return torch.cat([hidden[i] for i in layers], dim=-1)


def fit_eagle3(target, prompts, max_new_tokens, layers=LAYERS, steps=40, seed=0):
    """An EAGLE-3 drafter that has learnt the target's greedy continuations of `prompts` by heart
    (teacher-forced states, hard labels, two unrolled steps, one padded batch; seconds): most of its
    drafts are accepted, but only if the runtime hands it the right states for the right tokens."""
    with torch.no_grad():
        seqs = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            seqs.append(target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                        do_sample=False, pad_token_id=0)[0])
        width = max(len(q) for q in seqs)
        ids = torch.stack([torch.cat([q, q.new_zeros(width - len(q))]) for q in seqs])
        mask = torch.stack([torch.arange(width) < len(q) for q in seqs]).long()
        states = target_states(target, ids, layers, mask)
        # Slot t reads (s_t, x_{t+1}) and guesses token t + 2, the target's argmax at t + 1.
        labels = target(ids, attention_mask=mask).logits.argmax(-1)[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(target.config, layers, 1).attach_target(target, init=True)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = 0.0
        for k, g in enumerate(drafter.predict_unrolled(ids[:, 1:], states[:, :-1], mask[:, 1:], 2)):
            logits = drafter.draft_vocab_logits(g)[:, k:]
            loss = loss + torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, k:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def loaded_target():
    return load_model("tiny:0:4")


@pytest.fixture(scope="module")
def drafter(loaded_target):
    return fit_eagle3(loaded_target.model, PROMPTS, MAX_NEW)


@pytest.fixture(scope="module")
def reference(loaded_target, hf_greedy):
    return [hf_greedy(loaded_target.model, p, MAX_NEW) for p in PROMPTS]


def test_default_layers_are_eagle3s_and_shallow_targets_must_name_theirs():
    assert default_target_layers(30) == [2, 15, 27]  # SmolLM2-135M
    assert default_target_layers(32) == [2, 16, 29]
    with pytest.raises(InvalidInputError, match="drafter.target_layers"):
        default_target_layers(4)
    config = tiny_model(0, num_layers=4).config
    for bad in ([3, 2, 1], [1, 1, 2], [1, 2, 4], []):
        with pytest.raises(InvalidInputError, match="strictly increasing"):
            Eagle3Drafter(config, bad)


@pytest.mark.parametrize("steps", [2, 3])
def test_unrolled_training_steps_equal_drafting_from_own_outputs(loaded_target, steps):
    """Training-time test: step k at slot s gives what drafting gives at its k-th step of the round
    after true slot s-k+1 (a cache of the true pairs up to there, then the chain of the drafter's own
    outputs fed back), for a 2-layer drafter and a padded row."""
    target = loaded_target.model
    torch.manual_seed(0)
    drafter = Eagle3Drafter(target.config, LAYERS, num_layers=2).attach_target(target, init=True).eval()
    ids = torch.tensor([[1, 72, 101, 108, 108, 111, 32, 119, 111, 114], [1, 65, 66, 67, 65, 66, 0, 0, 0, 0]])
    mask = torch.tensor([[1] * 10, [1] * 6 + [0] * 4])
    with torch.no_grad():
        states = target_states(target, ids, LAYERS, mask)
        x, f, m = ids[:, 1:], states[:, :-1], mask[:, 1:]
        outs = drafter.predict_unrolled(x, f, m, steps)
        assert len(outs) == steps
        torch.testing.assert_close(outs[0], drafter(x, features=f, attention_mask=m).hidden, rtol=1e-5, atol=1e-4)
        checked = 0
        for b, length in enumerate(m.sum(1).tolist()):
            for k in range(2, steps + 1):
                for s in range(k - 1, length):
                    base = s - k + 1  # the round's last true slot
                    cache = DynamicCache(config=drafter.config)
                    g = drafter(x[b:b + 1, :base + 1], features=f[b:b + 1, :base + 1], cache=cache,
                                use_cache=True).hidden[:, -1:]
                    for n in range(2, k + 1):  # draft step n reads step n-1's output and token x_{base+n}
                        g = drafter(x[b:b + 1, base + n - 1:base + n], hidden=g, cache=cache, use_cache=True).hidden
                    torch.testing.assert_close(outs[k - 1][b, s], g[0, -1], rtol=1e-5, atol=1e-3)
                    checked += 1
        assert checked >= 10
        # The fed-back outputs are not the true states' projections: the test can tell them apart.
        assert not torch.allclose(outs[0][:, :-1], drafter.fc(f[:, 1:]), atol=1e-2)


def make_proposer(kind, drafter):
    return {
        "eagle3": lambda: Eagle3Proposer(drafter),
        # Lookup rows and EAGLE-3 rows mix within a batch and alternate within a row.
        "lookup-first-eagle3": lambda: LookupFirstProposer(NGramProposer(3, 2), Eagle3Proposer(drafter)),
    }[kind]()


@pytest.mark.parametrize("kind", ["eagle3", "lookup-first-eagle3"])
@pytest.mark.parametrize("draft_len", [1, 2, 3, 5, 8])
def test_greedy_matches_target_generate(kind, draft_len, loaded_target, drafter, reference):
    decoder = SpeculativeDecoder(loaded_target.model, make_proposer(kind, drafter))
    batch = decoder.generate(PROMPTS, options=DecodeOptions(max_new_tokens=MAX_NEW, draft_len=draft_len))
    assert batch.tokens == reference
    solo = decoder.generate([PROMPTS[0]], options=DecodeOptions(max_new_tokens=MAX_NEW, draft_len=draft_len))
    assert solo.tokens == reference[:1]
    assert batch.stats.rounds >= 2 * len(PROMPTS)
    if kind == "eagle3" and draft_len >= 2:  # states and tokens paired right: most drafts accepted
        assert batch.stats.position_acceptance[0] > 0.8, batch.stats.position_acceptance
        assert batch.stats.position_acceptance[1] > 0.6, batch.stats.position_acceptance


@pytest.mark.parametrize("alternatives", [1, 3])
def test_greedy_with_sibling_leaves_matches_target_generate(loaded_target, drafter, reference, alternatives):
    # Trained on two draft steps only, the drafter's third drafts are mostly wrong: leaves get their chance.
    decoder = SpeculativeDecoder(loaded_target.model, Eagle3Proposer(drafter))
    result = decoder.generate(PROMPTS, options=DecodeOptions(max_new_tokens=MAX_NEW, draft_len=3,
                                                             draft_alternatives=alternatives))
    assert result.tokens == reference
    if alternatives == 3:
        assert result.stats.leaf_accepts > 0


class RecordingEagle3(Eagle3Proposer):
    """Records, at each round's first draft step, every row's context and the logits it drafted from."""

    def __init__(self, drafter):
        super().__init__(drafter)
        self.records = []

    def propose(self, ctx):
        self._context, self._first = [list(h) for h in ctx.history], True
        return super().propose(ctx)

    def _draft_forward(self, tokens, valid):
        logits = super()._draft_forward(tokens, valid)
        if self._first:
            self.records.append((self._context, logits[:, 0].clone()))
            self._first = False
        return logits


@pytest.mark.parametrize("with_lookup, sampled", [(False, False), (True, True)])
def test_first_draft_step_equals_a_fresh_pass_over_the_true_pairs(loaded_target, drafter, with_lookup, sampled):
    """After any number of rounds (drafts accepted, rejected, drafted by lookup instead), the first
    step in a row with context x_0..x_n gives the logits of a fresh pass over the pairs (s_t, x_{t+1}),
    t < n, with s the target's teacher-forced states: its cache holds exactly those."""
    target = loaded_target.model
    recorder = RecordingEagle3(drafter)
    proposer = LookupFirstProposer(NGramProposer(3, 2), recorder) if with_lookup else recorder
    params = SamplingParams(0.5, seed=3) if sampled else SamplingParams()
    SpeculativeDecoder(target, proposer).generate(PROMPTS, params, options=DecodeOptions(max_new_tokens=MAX_NEW,
                                                                                         draft_len=3))
    checked = 0
    with torch.no_grad():
        for contexts, logits in recorder.records:
            for b, context in enumerate(contexts):
                if len(context) < 2:  # a one-token prompt's first round: no pair, no draft
                    continue
                ids = torch.tensor([context])
                fresh = drafter(ids[:, 1:], features=target_states(target, ids[:, :-1], LAYERS)).logits[0, -1]
                torch.testing.assert_close(logits[b], fresh, atol=2e-3, rtol=1e-4)
                checked += 1
    assert checked > 2 * len(PROMPTS)


def test_one_token_prompt_drafts_nothing_in_its_first_round(loaded_target, drafter, reference):
    decoder = SpeculativeDecoder(loaded_target.model, Eagle3Proposer(drafter))
    solo = decoder.generate([[1]], options=DecodeOptions(max_new_tokens=MAX_NEW, draft_len=3))
    assert solo.stats.emitted_hist[1] >= 1 and solo.tokens == reference[1:2]


def with_draft_vocab(drafter, target, token_ids):
    """A copy of `drafter` (whole vocabulary) that drafts only among `token_ids`, with its head's rows."""
    other = Eagle3Drafter(target.config, drafter.target_layers, drafter.num_layers).attach_target(target)
    other.load_state_dict(drafter.state_dict())
    other.set_draft_vocab(token_ids)
    return other.eval()


def test_draft_vocabulary_logits_are_the_heads_rows_there_and_minus_inf_elsewhere(loaded_target, drafter):
    target = loaded_target.model
    vocab = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(0))[:40]
    small = with_draft_vocab(drafter, target, vocab)
    assert len(small.d2t) == 40 and int(small.t2d.sum()) == 40 and bool(small.t2d[vocab].all())
    torch.testing.assert_close(small.d2t + torch.arange(40), vocab.sort().values)  # d2t[i] = target id - i
    torch.testing.assert_close(small.lm_head.weight, drafter.lm_head.weight[vocab.sort().values])
    ids, states = torch.tensor([[5, 6, 7]]), torch.randn(1, 3, small.fc.in_features)
    full, restricted = drafter(ids, features=states).logits, small(ids, features=states).logits
    torch.testing.assert_close(restricted[..., small.t2d], full[..., small.t2d])
    assert bool(torch.isneginf(restricted[..., ~small.t2d]).all())
    # Sampled drafts: q is zero outside the draft vocabulary and every drafted token lies inside it.
    params = [SamplingParams(1.0, seed=s) for s in range(len(PROMPTS))]
    seen = []

    class Spy(Eagle3Proposer):
        def propose(self, ctx):
            draft = super().propose(ctx)
            seen.append(draft)
            return draft

    SpeculativeDecoder(target, Spy(small)).generate(PROMPTS, params, options=DecodeOptions(max_new_tokens=12,
                                                                                           draft_len=3))
    drafted = [d for d in seen if d.probs is not None and d.tokens.numel()]
    assert drafted
    for d in drafted:
        assert float(d.probs[..., ~small.t2d].abs().sum()) == 0.0
        live = torch.arange(d.tokens.shape[1])[None] < d.lens[:, None]
        assert bool(small.t2d[d.tokens[live]].all())


# --- sampling: the emitted distribution is the target's -----------------------------------------------

VOCAB, N, SAMPLE_PROMPT = 32, 3000, [1, 7, 12, 7, 12, 3]


@pytest.fixture(scope="module")
def small_target():
    return tiny_model(10, num_layers=3, vocab_size=VOCAB, init_std=0.15)


def small_drafter(target, draft_vocab=None):
    """An untrained EAGLE-3 drafter on `target`: the target's lm_head rows on a random-ish state."""
    torch.manual_seed(13)
    drafter = Eagle3Drafter(target.config, [0, 1, 2], 1).attach_target(target, init=True)
    if draft_vocab is not None:
        drafter.set_draft_vocab(draft_vocab, from_target=True)
    return drafter.eval()


def exact_marginals(model, params, positions=3):
    """P(token at position j), j = 1..positions, by enumerating every continuation."""
    with torch.no_grad():
        marginals, prefixes, weights = [], torch.tensor([SAMPLE_PROMPT]), torch.ones(1, dtype=torch.float64)
        sampling = BatchSampling.from_params([params])
        for _ in range(positions):
            logits = model(prefixes).logits[:, -1:]
            probs = processed_probs(logits, sampling.select(torch.zeros(len(prefixes), dtype=torch.long)))[:, 0]
            joint = weights[:, None] * probs.double()
            marginals.append(joint.sum(0))
            prefixes = torch.cat([prefixes.repeat_interleave(VOCAB, 0),
                                  torch.arange(VOCAB).repeat(len(prefixes))[:, None]], 1)
            weights = joint.reshape(-1)
            prefixes, weights = prefixes[weights > 0], weights[weights > 0]
    return marginals


def sample_runtime(target, proposer, params, verifier=verify_native):
    rows = [SamplingParams(params.temperature, params.top_k, params.top_p, seed=1000 + i) for i in range(N)]
    result = SpeculativeDecoder(target, proposer, verifier=verifier).generate(
        [SAMPLE_PROMPT] * N, rows, options=DecodeOptions(max_new_tokens=3, draft_len=3))
    return torch.tensor(result.tokens), result.stats


def fit_pvalues(tokens, marginals, min_count=20):
    """Chi-square p-value of the emitted tokens at each position against the exact marginals."""
    pvalues = []
    for j, p in enumerate(marginals):
        counts = torch.bincount(tokens[:, j], minlength=VOCAB).double()
        if counts[p == 0].sum() > 0:
            return [0.0]  # a token outside the target's support was emitted
        expected = p / p.sum() * counts.sum()
        big = expected >= min_count
        observed = torch.cat([counts[big], counts[~big].sum()[None]])
        wanted = torch.cat([expected[big], expected[~big].sum()[None]])
        keep = wanted > 0
        pvalues.append(stats.chisquare(observed[keep].numpy(), wanted[keep].numpy()).pvalue)
    return pvalues


def always_accept(target_logits, tokens, lens, *rest):
    """A broken verifier that keeps every draft token (then adds the target's argmax). Must fail."""
    batch, width = tokens.shape
    out = torch.full((batch, width + 1), -1)
    live = torch.arange(width)[None] < lens[:, None]
    out[:, :width] = torch.where(live, tokens, out[:, :width])
    out[torch.arange(batch), lens] = target_logits.argmax(-1)[torch.arange(batch), lens]
    return VerifyOutput(out, lens + 1, lens)


PARAMS = SamplingParams(temperature=1.0)
FILTERED = SamplingParams(temperature=0.7, top_k=12, top_p=0.9)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["eagle3", "eagle3-filtered", "eagle3-draft-vocab"])
def test_emitted_distribution_matches_target(name, small_target):
    params = FILTERED if name.endswith("filtered") else PARAMS
    # Drafting among the even tokens only: q = 0 where p > 0, the residual covers the rest.
    vocab = torch.arange(0, VOCAB, 2) if name.endswith("draft-vocab") else None
    tokens, decode_stats = sample_runtime(small_target, Eagle3Proposer(small_drafter(small_target, vocab)), params)
    pvalues = fit_pvalues(tokens, exact_marginals(small_target, params))
    assert len(pvalues) == 3 and min(pvalues) > 1e-3, pvalues
    # Second drafts (built on the drafter's own output) were verified and accepted.
    assert decode_stats.offered[1] > 30 and decode_stats.accepted[1] > 0


@pytest.mark.slow
def test_negative_control_always_accept_fails(small_target):
    tokens, _ = sample_runtime(small_target, Eagle3Proposer(small_drafter(small_target)), PARAMS,
                               verifier=always_accept)
    assert min(fit_pvalues(tokens, exact_marginals(small_target, PARAMS))) < 1e-6


@pytest.mark.parametrize("lookup_first", [False, True])
def test_seeded_runs_repeat_and_batches_equal_solo_rows(loaded_target, drafter, lookup_first):
    params = [SamplingParams(0.9, seed=5), SamplingParams(0.0), SamplingParams(1.2, top_k=20, top_p=0.95, seed=9),
              SamplingParams(0.7, seed=2)]
    proposer = Eagle3Proposer(drafter)
    if lookup_first:
        proposer = LookupFirstProposer(NGramProposer(2, 1), proposer)
    decoder = SpeculativeDecoder(loaded_target.model, proposer)
    options = DecodeOptions(max_new_tokens=20, draft_len=3)
    first = decoder.generate(PROMPTS, params, options=options).tokens
    assert decoder.generate(PROMPTS, params, options=options).tokens == first
    solo = [decoder.generate([p], [s], options=options).tokens[0] for p, s in zip(PROMPTS, params)]
    assert first == solo  # a mixed greedy / sampled batch equals its rows run alone


# --- checkpoints ----------------------------------------------------------------------------------


def test_checkpoint_round_trip(loaded_target, drafter, tmp_path):
    small = with_draft_vocab(drafter, loaded_target.model, torch.arange(3, 200))
    info = DrafterInfo.for_target("eagle3", loaded_target, recipe={"name": "t"})
    out = save_drafter(tmp_path / "eagle3", small, loaded_target.tokenizer, info)
    assert read_drafter_info(out).kind == "eagle3"
    spec = json.loads((out / "config.json").read_text())["eagle3"]
    assert spec["target_layers"] == LAYERS and spec["draft_vocab_size"] == 197 and spec["num_layers"] == 1
    proposer, record = load_drafter_dir(out, loaded_target)
    assert isinstance(proposer, Eagle3Proposer) and proposer.target_layers == tuple(LAYERS) and record.kind == "eagle3"
    assert not any("embed" in k for k in proposer.model.state_dict())  # the target's, never stored
    for name, tensor in small.state_dict().items():
        assert torch.equal(proposer.model.state_dict()[name], tensor), name
    expected = SpeculativeDecoder(loaded_target.model, None).generate(
        PROMPTS, options=DecodeOptions(max_new_tokens=MAX_NEW)).tokens
    for spec in [str(out), f"ngram+{out}"]:
        result = SpeculativeDecoder(loaded_target.model, build_proposer(spec, loaded_target)).generate(
            PROMPTS, options=DecodeOptions(max_new_tokens=MAX_NEW, draft_len=4))
        assert result.tokens == expected and result.stats.acceptance_length > 1.5, spec
    footprint = kinds.get("eagle3").footprint(proposer, loaded_target.model)
    assert footprint.weight_bytes > 0 and footprint.kv_bytes_per_token > 0


def test_corrupt_or_mismatched_checkpoints_give_one_line_errors(loaded_target, drafter, tmp_path):
    info = DrafterInfo.for_target("eagle3", loaded_target)
    out = save_drafter(tmp_path / "eagle3", drafter, loaded_target.tokenizer, info)
    config = json.loads((out / "config.json").read_text())
    config["eagle3"]["hidden_size"] = 32
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="eagle3 drafter in .* is 32 wide"):
        load_drafter_dir(out, loaded_target)
    config["eagle3"]["hidden_size"], config["eagle3"]["target_layers"] = 64, [1, 2, 7]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="does not fit"):
        load_drafter_dir(out, loaded_target)
    del config["eagle3"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="corrupt eagle3 config"):
        load_drafter_dir(out, loaded_target)
    out2 = save_drafter(tmp_path / "eagle3b", drafter, loaded_target.tokenizer, info)
    weights = out2 / "eagle3.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="cannot load eagle3 weights"):
        load_drafter_dir(out2, loaded_target)


@pytest.mark.embedded
@pytest.mark.slow
def test_on_the_embedded_smollm2_target_default_layers_exactness_and_engine_numbering(tmp_path):
    """The real architecture: SmolLM2-135M (30 layers, 9 heads over 3 KV heads) gets EAGLE-3's layers
    [2, 15, 27]; an untrained drafter stays exact; the exports number them 2/15/27 (vLLM) and 1/14/26
    (SGLang)."""
    from draftsmith.speculative import formats

    target = load_model("smollm2-135m-instruct")
    config = target.model.config
    torch.manual_seed(0)
    drafter = Eagle3Drafter(config, default_target_layers(config.num_hidden_layers), 1)
    drafter = drafter.attach_target(target.model, init=True)
    drafter.set_draft_vocab(torch.arange(2000), from_target=True)
    drafter = drafter.to(target.model.dtype).eval()
    assert drafter.target_layers == [2, 15, 27] and drafter.fc.in_features == 3 * config.hidden_size
    prompts = [target.tokenizer("The capital of France is")["input_ids"], target.tokenizer("1, 2, 3,")["input_ids"]]
    options = DecodeOptions(max_new_tokens=16, draft_len=3)
    plain = SpeculativeDecoder(target.model, None).generate(prompts, options=options).tokens
    assert SpeculativeDecoder(target.model, Eagle3Proposer(drafter)).generate(prompts, options=options).tokens == plain
    out = save_drafter(tmp_path / "e3", drafter, target.tokenizer, DrafterInfo.for_target("eagle3", target))
    spec = json.loads((formats.export(out, "speculators", tmp_path / "spec") / "config.json").read_text())
    assert spec["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert spec["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    sgl = json.loads((formats.export(out, "sglang", tmp_path / "sgl") / "config.json").read_text())
    assert sgl["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert sgl["num_attention_heads"] == 9 and sgl["num_key_value_heads"] == 3
