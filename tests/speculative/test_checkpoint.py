"""Drafter definitions (draft LM, Medusa heads) and the checkpoint format."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from draftsmith.speculative.checkpoint import DrafterInfo, TargetMismatchError, load_drafter_dir, read_drafter_info, save_drafter
from draftsmith.speculative.draft_lm import build_draft_lm
from draftsmith.speculative.drafters import build_proposer
from draftsmith.speculative.errors import InvalidInputError, ModelLoadError
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.loading import load_model
from draftsmith.speculative.medusa import MedusaHeads, MedusaProposer
from draftsmith.speculative.draft_lm import DraftModelProposer
from draftsmith.speculative.early_exit import truncated_model
from draftsmith.speculative.lookup import LookupFirstProposer
from draftsmith.speculative.prompts import stop_token_ids
from draftsmith.speculative.sampling import SamplingParams
from draftsmith.speculative.options import DecodeOptions

PROMPTS = [[1, 72, 101, 108, 108, 111, 32], [1, 65, 66]]


@pytest.fixture(scope="module")
def loaded_target():
    return load_model("tiny:0:3")


@pytest.fixture(scope="module")
def other_target():
    return load_model("tiny:5:3")


def greedy(model, prompt, n=16):
    x = torch.tensor([prompt])
    return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                          pad_token_id=0)[0, len(prompt):].tolist()


def test_untrained_draft_lm_is_the_early_exit_model(loaded_target):
    target = loaded_target.model
    draft = build_draft_lm(target, 2)
    x = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        torch.testing.assert_close(draft(x).logits, truncated_model(target, 2)(x).logits)
    narrow = build_draft_lm(target, 1, hidden_size=32)
    assert narrow.config.hidden_size == 32 and narrow.config.num_attention_heads == 2
    with pytest.raises(InvalidInputError, match="layers"):
        build_draft_lm(target, 9)


def test_draft_lm_checkpoint_round_trip_and_hf_assistant(loaded_target, tmp_path):
    draft = build_draft_lm(loaded_target.model, 1)
    info = DrafterInfo.for_target("draft-lm", loaded_target, recipe={"name": "t"}, training={"steps": 3})
    out = save_drafter(tmp_path / "drafter", draft, loaded_target.tokenizer, info)
    record = read_drafter_info(out)
    assert record.kind == "draft-lm" and record.target_hash == loaded_target.weight_hash()
    assert record.recipe == {"name": "t"}
    proposer = build_proposer(str(out), loaded_target)
    assert isinstance(proposer, DraftModelProposer)
    expected = greedy(loaded_target.model, PROMPTS[0])
    decoder = SpeculativeDecoder(loaded_target.model, proposer)
    assert decoder.generate([PROMPTS[0]], options=DecodeOptions(max_new_tokens=16, draft_len=3)).tokens[0] == expected
    # The same directory is a plain HF model: it works as `assistant_model` in HF generate.
    assistant = AutoModelForCausalLM.from_pretrained(out)
    x = torch.tensor([PROMPTS[0]])
    hf = loaded_target.model.generate(x, attention_mask=torch.ones_like(x), assistant_model=assistant,
                                      max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert hf[0, len(PROMPTS[0]):].tolist() == expected


def test_drafter_for_another_target_is_refused(loaded_target, other_target, tmp_path):
    draft = build_draft_lm(loaded_target.model, 1)
    out = save_drafter(tmp_path / "d", draft, loaded_target.tokenizer, DrafterInfo.for_target("draft-lm", loaded_target))
    with pytest.raises(TargetMismatchError, match="trained for target 'tiny:0:3'") as err:
        build_proposer(str(out), other_target)
    assert err.value.exit_code == 2 and "\n" not in str(err.value)
    proposer = build_proposer(str(out), other_target, allow_target_mismatch=True)  # exact all the same
    stops = stop_token_ids(other_target.model, other_target.tokenizer)  # HF greedy stops at EOS too
    decoder = SpeculativeDecoder(other_target.model, proposer, stop_token_ids=stops)
    assert decoder.generate([PROMPTS[1]], options=DecodeOptions(max_new_tokens=12, draft_len=2)).tokens[0] == greedy(other_target.model, PROMPTS[1], 12)


def test_existing_directory_is_never_overwritten(loaded_target, tmp_path):
    out = tmp_path / "d"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    draft = build_draft_lm(loaded_target.model, 1)
    with pytest.raises(InvalidInputError, match="already holds files"):
        save_drafter(out, draft, loaded_target.tokenizer, DrafterInfo.for_target("draft-lm", loaded_target))
    assert (out / "keep.txt").read_text() == "mine" and len(list(out.iterdir())) == 1


def trained_looking_heads(target, seed=0, own_lm_head=False):
    lm_head = target.get_output_embeddings()
    heads = MedusaHeads(target.config.hidden_size, target.config.vocab_size, num_heads=3, own_lm_head=own_lm_head)
    heads.attach_lm_head(lm_head)
    if own_lm_head:
        heads.init_own_heads_from_shared()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.blocks.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return heads


def test_untrained_heads_repeat_the_lm_head(loaded_target):
    target = loaded_target.model
    heads = MedusaHeads(target.config.hidden_size, target.config.vocab_size, 4).attach_lm_head(target.lm_head)
    hidden = torch.randn(2, target.config.hidden_size)
    logits = heads(hidden)
    assert logits.shape == (2, 4, target.config.vocab_size)
    for k in range(4):
        torch.testing.assert_close(logits[:, k], target.lm_head(hidden))


@pytest.mark.parametrize("own_lm_head", [False, True])
def test_medusa_round_trip_and_exact_decoding(loaded_target, tmp_path, own_lm_head):
    target = loaded_target.model
    heads = trained_looking_heads(target, own_lm_head=own_lm_head)
    out = save_drafter(tmp_path / "heads", heads, loaded_target.tokenizer, DrafterInfo.for_target("medusa", loaded_target))
    proposer, info = load_drafter_dir(out, loaded_target)
    assert isinstance(proposer, MedusaProposer) and info.kind == "medusa"
    hidden = torch.randn(3, target.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(proposer.heads(hidden), heads(hidden))
    decoder = SpeculativeDecoder(target, proposer)
    result = decoder.generate(PROMPTS, options=DecodeOptions(max_new_tokens=16, draft_len=3))
    assert result.tokens == [greedy(target, p) for p in PROMPTS]
    assert result.stats.rounds > 0
    sampled = decoder.generate(PROMPTS, SamplingParams(0.8, seed=1), options=DecodeOptions(max_new_tokens=8,
                                                                                           draft_len=3))
    assert all(len(t) == 8 for t in sampled.tokens)


def test_lookup_first_combinations_from_specs_decode_exactly(loaded_target, tmp_path):
    """`ngram[:MAX[:MIN]]+DIR`: prompt lookup in front of a trained drafter (heads or draft LM)."""
    target = loaded_target.model
    info = DrafterInfo.for_target("medusa", loaded_target)
    heads_dir = save_drafter(tmp_path / "heads", trained_looking_heads(target), loaded_target.tokenizer, info)
    lm_dir = save_drafter(tmp_path / "lm", build_draft_lm(target, 1), loaded_target.tokenizer,
                           DrafterInfo.for_target("draft-lm", loaded_target))
    prompts = PROMPTS + [[1, 65, 66, 67, 65, 66, 67, 65, 66]]  # a repeating context: lookup has matches
    expected = [greedy(target, p, 24) for p in prompts]
    for spec, sizes in [(f"ngram+{heads_dir}", (3, 2)), (f"ngram:4:1+{lm_dir}", (4, 1)), (f"ngram:1+{lm_dir}", (1, 1))]:
        proposer = build_proposer(spec, loaded_target)
        assert isinstance(proposer, LookupFirstProposer)
        assert (proposer.lookup.max_ngram, proposer.lookup.min_ngram) == sizes
        result = SpeculativeDecoder(target, proposer).generate(prompts, options=DecodeOptions(max_new_tokens=24,
                                                                                              draft_len=3))
        assert result.tokens == expected, spec
        assert proposer.lookup_rounds > 0 and proposer.model_rounds > 0, spec
    for bad in ["ngram+ngram", "ngram+", "ngram:0+early-exit:1", f"ngram:x+{lm_dir}"]:
        with pytest.raises(InvalidInputError):
            build_proposer(bad, loaded_target)


def test_medusa_heads_see_the_state_that_produced_the_newest_token(loaded_target, monkeypatch):
    """Under greedy decoding, the hidden state handed to the heads must be the one whose lm_head argmax
    is the newest token: the heads then predict the tokens after it."""
    target = loaded_target.model
    heads = trained_looking_heads(target)
    proposer = MedusaProposer(heads)
    checked = []
    original = MedusaProposer.propose

    def spy(self, ctx):
        newest = target.lm_head(ctx.target_hidden).argmax(-1).tolist()
        assert newest == [h[-1] for h in ctx.history]
        checked.append(len(newest))
        return original(self, ctx)

    monkeypatch.setattr(MedusaProposer, "propose", spy)
    SpeculativeDecoder(target, proposer).generate(PROMPTS, options=DecodeOptions(max_new_tokens=16, draft_len=3))
    assert checked  # the heads were consulted, every time with the right state


def test_corrupt_checkpoints_give_one_line_errors(loaded_target, tmp_path):
    heads = trained_looking_heads(loaded_target.model)
    out = save_drafter(tmp_path / "heads", heads, loaded_target.tokenizer, DrafterInfo.for_target("medusa", loaded_target))
    weights = out / "heads.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="cannot load medusa weights"):
        load_drafter_dir(out, loaded_target)
    (out / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="corrupt"):
        load_drafter_dir(out, loaded_target)
    (out / "config.json").write_text('{"draftsmith": {"kind": "wizard"}}')
    with pytest.raises(ModelLoadError):
        load_drafter_dir(out, loaded_target)
