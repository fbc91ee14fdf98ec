"""The EAGLE-style drafter: its cache holds exactly the target's features paired with the next tokens,
and its checkpoints round-trip."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.speculative.checkpoint import DrafterInfo, load_drafter_dir, read_drafter_info, save_drafter
from draftsmith.speculative.drafters import build_proposer
from draftsmith.speculative.eagle import EagleDrafter, EagleProposer
from draftsmith.speculative.errors import ModelLoadError
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.loading import load_model
from draftsmith.speculative.lookup import LookupFirstProposer
from draftsmith.speculative.ngram import NGramProposer
from draftsmith.speculative.sampling import SamplingParams
from draftsmith.speculative.options import DecodeOptions

# Ragged lengths, a one-token prompt (no feature before its first round) and a repeating one (lookup).
PROMPTS = [[1, 72, 101, 108, 108, 111, 32, 119], [1], [1, 65, 66, 67, 65, 66, 67, 65], [1, 50, 43]]
MAX_NEW = 20


@pytest.fixture(scope="module")
def loaded_target():
    return load_model("tiny:0:3")


@pytest.fixture(scope="module")
def drafter(loaded_target, fit_eagle):
    return fit_eagle(loaded_target.model, PROMPTS, MAX_NEW)


class RecordingEagle(EagleProposer):
    """Records, at each round's first draft step, every row's context and the logits the drafter gave."""

    def __init__(self, drafter):
        super().__init__(drafter)
        self.records = []

    def propose(self, ctx):
        self._context = [list(h) for h in ctx.history]
        self._first = True
        return super().propose(ctx)

    def _draft_forward(self, tokens, valid):
        logits = super()._draft_forward(tokens, valid)
        if self._first:
            self.records.append((self._context, logits[:, 0].clone()))
            self._first = False
        return logits


@pytest.mark.parametrize("with_lookup", [False, True])
@pytest.mark.parametrize("sampled", [False, True])
def test_first_draft_step_equals_a_fresh_pass_over_the_teacher_forced_pairs(loaded_target, drafter, with_lookup,
                                                                             sampled):
    """After any number of rounds (drafts accepted, rejected, drafted by lookup instead), the drafter's
    first step in a row with context x_0..x_n gives the logits of a fresh pass over the pairs
    (f_t, x_{t+1}), t < n, with f the target's teacher-forced features: its cache is exactly those."""
    target = loaded_target.model
    recorder = RecordingEagle(drafter)
    proposer = LookupFirstProposer(NGramProposer(3, 2), recorder) if with_lookup else recorder
    params = SamplingParams(0.5, seed=3) if sampled else SamplingParams()
    result = SpeculativeDecoder(target, proposer).generate(PROMPTS, params, options=DecodeOptions(max_new_tokens=MAX_NEW,
                                                                                                  draft_len=3))
    # Greedy: most drafts accepted. Sampled: the rows soon leave the learnt continuations, after some.
    assert recorder.records and (result.stats.accepted[0] > 0 if sampled else result.stats.acceptance_length > 1.5)
    if with_lookup:
        assert proposer.lookup_rounds > 0 and proposer.model_rounds > 0
    checked = 0
    with torch.no_grad():
        for contexts, logits in recorder.records:
            for b, context in enumerate(contexts):
                if len(context) < 2:  # a one-token prompt's first round: no pair, no draft
                    continue
                ids = torch.tensor([context])
                features = target(ids[:, :-1], output_hidden_states=True).hidden_states[-1]
                fresh = drafter(ids[:, 1:], features).logits[0, -1]
                torch.testing.assert_close(logits[b], fresh, atol=2e-4, rtol=1e-4)
                checked += 1
    assert checked > 2 * len(PROMPTS)


def test_one_token_prompt_drafts_nothing_in_its_first_round(loaded_target, drafter):
    proposer = EagleProposer(drafter)
    decoder = SpeculativeDecoder(loaded_target.model, proposer)
    solo = decoder.generate([[1]], options=DecodeOptions(max_new_tokens=MAX_NEW, draft_len=3))
    assert solo.stats.emitted_hist[1] >= 1  # the first round emitted one token: nothing was drafted
    assert solo.stats.acceptance_length > 1.5
    plain = SpeculativeDecoder(loaded_target.model, None).generate([[1]], options=DecodeOptions(max_new_tokens=MAX_NEW))
    assert solo.tokens == plain.tokens


def with_draft_vocab(drafter, size):
    """A copy of `drafter` that drafts only among `size` random tokens."""
    other = copy.deepcopy(drafter)
    other._target = drafter._target  # still the target's embeddings and lm_head, not copies
    other.set_draft_vocab(torch.randperm(drafter.config.vocab_size, generator=torch.Generator().manual_seed(0))[:size])
    return other


def test_draft_vocabulary_logits_are_the_full_ones_there_and_minus_inf_elsewhere(drafter):
    small = with_draft_vocab(drafter, 40)
    ids, features = torch.tensor([[5, 6, 7]]), torch.randn(1, 3, drafter.config.hidden_size)
    full, restricted = drafter(ids, features).logits, small(ids, features).logits
    inside = torch.zeros(drafter.config.vocab_size, dtype=torch.bool)
    inside[small.draft_vocab] = True
    torch.testing.assert_close(restricted[..., inside], full[..., inside])
    assert bool(torch.isneginf(restricted[..., ~inside]).all())


@pytest.mark.parametrize("draft_vocab", [None, 64])
def test_eagle_checkpoint_round_trip(loaded_target, drafter, tmp_path, draft_vocab):
    if draft_vocab:
        drafter = with_draft_vocab(drafter, draft_vocab)
    info = DrafterInfo.for_target("eagle", loaded_target, recipe={"name": "t"})
    out = save_drafter(tmp_path / "eagle", drafter, loaded_target.tokenizer, info)
    assert read_drafter_info(out).kind == "eagle"
    assert {p.name for p in out.iterdir()} >= {"config.json", "eagle.safetensors"}
    # The target's embeddings and lm_head are shared, never stored.
    stored = set(load_file(str(out / "eagle.safetensors")))
    assert stored == set(drafter.state_dict()) and not any("embed" in k or "lm_head" in k for k in stored)
    proposer, loaded_info = load_drafter_dir(out, loaded_target)
    assert isinstance(proposer, EagleProposer) and loaded_info.kind == "eagle"
    for name, tensor in drafter.state_dict().items():
        torch.testing.assert_close(proposer.model.state_dict()[name], tensor)
    expected = SpeculativeDecoder(loaded_target.model, None).generate(PROMPTS, options=DecodeOptions(max_new_tokens=MAX_NEW)).tokens
    for spec in [str(out), f"ngram+{out}"]:
        result = SpeculativeDecoder(loaded_target.model, build_proposer(spec, loaded_target)).generate(PROMPTS, options=DecodeOptions(max_new_tokens=MAX_NEW,
                                                                                                                                      draft_len=4))
        assert result.tokens == expected and result.stats.acceptance_length > (1.1 if draft_vocab else 1.5), spec
    if draft_vocab:
        assert json.loads((out / "config.json").read_text())["eagle"]["draft_vocab_size"] == draft_vocab
        torch.testing.assert_close(proposer.model.draft_vocab, drafter.draft_vocab)


def test_corrupt_or_mismatched_eagle_checkpoints_give_one_line_errors(loaded_target, drafter, tmp_path):
    info = DrafterInfo.for_target("eagle", loaded_target)
    out = save_drafter(tmp_path / "eagle", drafter, loaded_target.tokenizer, info)
    config = json.loads((out / "config.json").read_text())
    config["eagle"]["hidden_size"] = 32
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="eagle drafter in .* is 32x"):
        load_drafter_dir(out, loaded_target)
    del config["eagle"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="corrupt eagle config"):
        load_drafter_dir(out, loaded_target)
    out2 = save_drafter(tmp_path / "eagle2", drafter, loaded_target.tokenizer, info)
    weights = out2 / "eagle.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="cannot load eagle weights"):
        load_drafter_dir(out2, loaded_target)


def test_untrained_drafter_outputs_live_on_the_targets_scale(loaded_target):
    target = loaded_target.model
    drafter = EagleDrafter(target.config, 2).attach_target(target, init_norm=True)
    torch.testing.assert_close(drafter.decoder.norm.weight, target.get_decoder().norm.weight)
    assert len(drafter.decoder.layers) == 2 and drafter.decoder.embed_tokens is None
    out = drafter(torch.tensor([[5, 6, 7]]), torch.randn(1, 3, target.config.hidden_size), logits_to_keep=1)
    assert out.logits.shape == (1, 1, target.config.vocab_size) and out.features.shape == (1, 1, target.config.hidden_size)


@pytest.mark.parametrize("steps", [2, 3])
def test_unrolled_training_steps_equal_drafting_from_own_guesses(loaded_target, steps):
    """Training-time test: the unrolled step k at slot s gives what drafting gives at its k-th step of
    the round after true slot s-k+1 (a fresh causal pass over the true pairs up to there and the chain
    of the drafter's own guessed features after them), for a 2-layer drafter and a padded row."""
    target = loaded_target.model
    torch.manual_seed(0)
    drafter = EagleDrafter(target.config, num_layers=2).attach_target(target, init_norm=True).eval()
    ids = torch.tensor([[1, 72, 101, 108, 108, 111, 32, 119, 111, 114], [1, 65, 66, 67, 65, 66, 0, 0, 0, 0]])
    mask = torch.tensor([[1] * 10, [1] * 6 + [0] * 4])
    with torch.no_grad():
        features = target(ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
        x, f, m = ids[:, 1:], features[:, :-1], mask[:, 1:]
        outs = drafter.predict_unrolled(x, f, m, steps)
        assert len(outs) == steps
        torch.testing.assert_close(outs[0], drafter.predict_features(x, f, m))
        checked = 0
        for b, length in enumerate(m.sum(1).tolist()):
            for k in range(2, steps + 1):
                for s in range(k - 1, length):
                    base = s - k + 1  # the round's last true slot
                    chain = [outs[n - 2][b, base + n - 2] for n in range(2, k + 1)]  # step n's input guess
                    fresh = drafter.predict_features(x[b:b + 1, :s + 1], torch.stack([*f[b, :base + 1], *chain])[None])
                    torch.testing.assert_close(outs[k - 1][b, s], fresh[0, -1], atol=1e-5, rtol=1e-4)
                    checked += 1
                # and the guesses differ from the true features, so the test can tell them apart
                assert not torch.allclose(outs[k - 2][b, : length - 1], f[b, 1:length], atol=1e-3)
        assert checked >= 10
