"""EAGLE-3 drafters in the speculators/vLLM and SGLang layouts: the exports hold what those engines
read (checked with speculators' own classes where it is installed), an import drafts exactly what
the exported drafter drafts, and what a format cannot hold is refused before anything is written."""

import importlib.util
import json

import pytest
import torch
from draftsmith.cli import main
from draftsmith.speculative import formats
from draftsmith.speculative.checkpoint import DrafterInfo, save_drafter
from draftsmith.speculative.drafters import build_proposer
from draftsmith.speculative.eagle3 import Eagle3Drafter, Eagle3Proposer
from draftsmith.speculative.errors import InvalidInputError, ModelLoadError
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.loading import load_model
from draftsmith.speculative.medusa import MedusaHeads
from draftsmith.speculative.options import DecodeOptions
from draftsmith.speculative.sampling import SamplingParams
from draftsmith.speculative.tiny import tiny_model, tiny_tokenizer
from safetensors.torch import load_file, save_file

LAYERS = [1, 2, 3]
PROMPTS = [[1, 72, 101, 108, 108, 111, 32, 119], [1, 65, 66, 67, 65, 66, 67, 65], [1, 50, 43, 50, 43]]
HAS_SPECULATORS = importlib.util.find_spec("speculators") is not None


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A 4-layer tiny target saved as a Hugging Face directory (a verifier an engine can load)."""
    root = tmp_path_factory.mktemp("target") / "tiny-target"
    tiny_model(0, num_layers=4, attention_scale=0.02).save_pretrained(root)
    tiny_tokenizer().save_pretrained(root)
    return load_model(str(root))


@pytest.fixture(scope="module")
def drafter_dir(target, tmp_path_factory):
    """A draftsmith eagle3 checkpoint: random weights (not the target's) and a draft vocabulary."""
    torch.manual_seed(0)
    drafter = Eagle3Drafter(target.model.config, LAYERS, 1).attach_target(target.model, init=True)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # norms and lm_head are no longer the target's
    drafter.set_draft_vocab(torch.arange(3, 200))
    info = DrafterInfo.for_target("eagle3", target, recipe={"name": "t", "loss": {"draft_steps": 3}})
    return save_drafter(tmp_path_factory.mktemp("own") / "eagle3", drafter.eval(), target.tokenizer, info)


def own_tensors(drafter_dir):
    return load_file(str(drafter_dir / "eagle3.safetensors"))


def test_speculators_export_holds_the_fields_vllm_reads(drafter_dir, target, tmp_path):
    out = formats.export(drafter_dir, "speculators", tmp_path / "spec")
    config = json.loads((out / "config.json").read_text())
    assert "model_type" not in config
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3DraftModel"]
    assert config["speculators_version"] == "0.9.0"
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                         "accept_tolerance": 0.0}]
    assert spec["verifier"] == {"name_or_path": str(target.path), "architectures": ["LlamaForCausalLM"]}
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == 259
    assert layer["hidden_size"] == 64 and "architectures" not in layer
    assert config["draft_vocab_size"] == 197 and config["norm_before_residual"] is False
    assert config["target_hidden_size"] == 64 and config["eagle_aux_hidden_state_layer_ids"] == LAYERS
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == set(own_tensors(drafter_dir))  # fc, layers.0.*, norm, lm_head, d2t, t2d; no embeddings
    assert tensors["fc.weight"].shape == (64, 3 * 64) and tensors["layers.0.self_attn.q_proj.weight"].shape[1] == 128
    assert tensors["lm_head.weight"].shape == (197, 64)
    assert tensors["d2t"].dtype == torch.int64 and tensors["d2t"].shape == (197,)
    assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].shape == (259,)
    assert torch.equal(tensors["d2t"] + torch.arange(197), torch.arange(3, 200))  # d2t[i] = target id - i


def test_sglang_export_counts_layers_one_lower_and_names_the_midlayer(drafter_dir, tmp_path):
    out = formats.export(drafter_dir, "sglang", tmp_path / "sgl")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == 197
    assert config["tie_word_embeddings"] is False and config["vocab_size"] == 259
    # SGLang captures the output of layer j, the state entering layer j + 1.
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True}
    tensors = load_file(str(out / "model.safetensors"))
    own = own_tensors(drafter_dir)
    assert {k.replace("midlayer.", "layers.0.") for k in tensors} == set(own)
    assert torch.equal(tensors["midlayer.hidden_norm.weight"], own["layers.0.hidden_norm.weight"])


@pytest.mark.skipif(not HAS_SPECULATORS, reason="speculators is not installed (.ci/run installs it)")
def test_speculators_loads_the_export_with_its_own_classes(drafter_dir, target, tmp_path):
    """The client check: speculators' config class validates the export, its model class loads it
    (every tensor ours) and, given the verifier's embeddings, drafts what draftsmith drafts at every
    training-time-test step."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    out = formats.export(drafter_dir, "speculators", tmp_path / "spec")
    config = Eagle3SpeculatorConfig.from_pretrained(str(out))
    assert config.speculators_config.verifier.name_or_path == str(target.path)
    assert config.eagle_aux_hidden_state_layer_ids == LAYERS and config.draft_vocab_size == 197
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention wants a GPU
    model = Eagle3DraftModel.from_pretrained(str(out), config=config).eval()
    ours = own_tensors(drafter_dir)
    theirs = model.state_dict()
    assert set(ours) <= set(theirs)
    for name, tensor in ours.items():
        assert torch.equal(theirs[name], tensor), name
    # speculators 0.9 (written for transformers <= 5.19) expects from_pretrained to leave the embeddings
    # it does not find NaN and then loads the verifier's; newer transformers initialise them instead.
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)
    drafter = kinds_load(drafter_dir, target)
    ids = torch.tensor([PROMPTS[0] + [100, 101, 102, 103]])
    with torch.no_grad():
        hidden = target.model(ids, output_hidden_states=True).hidden_states
        states = torch.cat([hidden[i] for i in LAYERS], dim=-1)[:, :-1]
        x = ids[:, 1:]
        drafts = model(hidden_states=states, input_ids=x, document_ids=torch.zeros_like(x), ttt_steps=3)
        ours_steps = drafter.predict_unrolled(x, states, None, 3)
    for step, (draft, g) in enumerate(zip(drafts, ours_steps)):
        # speculators indexes step j by the round's last true slot i, draftsmith by the slot i + j.
        mine = drafter.draft_logits(g)[0].argmax(-1)[step:]
        theirs_ids = draft[0] + model.d2t[draft[0]]
        assert torch.equal(theirs_ids[: len(mine)], mine), step


def kinds_load(path, target):
    from draftsmith.speculative import kinds

    return kinds.get("eagle3").load(path, target)


class DraftRecorder(Eagle3Proposer):
    """Keeps every round's drafts (tokens up to each row's length)."""

    def __init__(self, drafter):
        super().__init__(drafter)
        self.drafts = []

    def propose(self, ctx):
        draft = super().propose(ctx)
        self.drafts.append([row[:n] for row, n in zip(draft.tokens.tolist(), draft.lens.tolist())])
        return draft


def drafts_of(drafter, target, params):
    recorder = DraftRecorder(drafter)
    decoder = SpeculativeDecoder(target.model, recorder)
    recorder.drafts.clear()  # the drafts of the rounds that timed the drafter when the decoder was built
    result = decoder.generate(PROMPTS, params, options=DecodeOptions(max_new_tokens=60, draft_len=4))
    return recorder.drafts, result.tokens


@pytest.mark.parametrize("fmt", ["speculators", "sglang"])
def test_export_then_import_drafts_the_same_tokens(drafter_dir, target, tmp_path, fmt):
    out = formats.export(drafter_dir, fmt, tmp_path / fmt)
    imported = build_proposer(str(out), target)  # what --drafter DIR does
    assert isinstance(imported, Eagle3Proposer) and imported.target_layers == tuple(LAYERS)
    original = build_proposer(str(drafter_dir), target)
    for name, tensor in original.model.state_dict().items():
        assert torch.equal(imported.model.state_dict()[name], tensor), name
    params = [SamplingParams(), SamplingParams(0.8, seed=4), SamplingParams(1.0, top_k=30, seed=7)]
    expected, expected_tokens = drafts_of(original.model, target, params)
    got, tokens = drafts_of(imported.model, target, params)
    assert len(expected) >= 50 and got == expected and tokens == expected_tokens


def test_import_takes_d2t_in_any_order_and_full_vocabularies_without_maps(drafter_dir, target, tmp_path):
    out = formats.export(drafter_dir, "speculators", tmp_path / "spec")
    tensors = load_file(str(out / "model.safetensors"))
    ids = tensors["d2t"] + torch.arange(197)
    order = torch.randperm(197, generator=torch.Generator().manual_seed(0))  # a frequency order, say
    tensors["d2t"] = ids[order] - torch.arange(197)
    tensors["lm_head.weight"] = tensors["lm_head.weight"][order]
    save_file(tensors, str(out / "model.safetensors"))
    shuffled = build_proposer(str(out), target).model
    original = build_proposer(str(drafter_dir), target).model
    assert torch.equal(shuffled.d2t, original.d2t) and torch.equal(shuffled.lm_head.weight, original.lm_head.weight)

    # A drafter over the whole vocabulary: no d2t/t2d in either format, identity maps on import.
    full = Eagle3Drafter(target.model.config, LAYERS, 1).attach_target(target.model, init=True).eval()
    whole = save_drafter(tmp_path / "whole", full, target.tokenizer, DrafterInfo.for_target("eagle3", target))
    for fmt in formats.FORMATS:
        exported = formats.export(whole, fmt, tmp_path / f"whole-{fmt}")
        assert not {"d2t", "t2d"} & set(load_file(str(exported / "model.safetensors")))
        loaded = build_proposer(str(exported), target).model
        assert torch.equal(loaded.draft_to_target, torch.arange(259)) and bool(loaded.t2d.all())


def rewrite_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def test_imports_whose_config_and_tensors_disagree_are_refused(drafter_dir, target, tmp_path):
    out = formats.export(drafter_dir, "speculators", tmp_path / "a")
    rewrite_config(out, draft_vocab_size=150)
    with pytest.raises(ModelLoadError, match="config and tensors of .* disagree: draft_vocab_size 150"):
        build_proposer(str(out), target)
    out = formats.export(drafter_dir, "speculators", tmp_path / "b")
    rewrite_config(out, eagle_aux_hidden_state_layer_ids=[1, 2])  # fc reads three states
    with pytest.raises(ModelLoadError, match="disagree"):
        build_proposer(str(out), target)
    out = formats.export(drafter_dir, "sglang", tmp_path / "c")
    tensors = load_file(str(out / "model.safetensors"))
    tensors["t2d"] = tensors["t2d"].roll(1)
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="t2d is not the set d2t maps to"):
        build_proposer(str(out), target)
    out = formats.export(drafter_dir, "sglang", tmp_path / "d")
    tensors = load_file(str(out / "model.safetensors"))
    del tensors["midlayer.hidden_norm.weight"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="disagree: no tensor layers.0.hidden_norm.weight"):
        build_proposer(str(out), target)
    out = formats.export(drafter_dir, "speculators", tmp_path / "e")
    rewrite_config(out, fc_norm=True)
    with pytest.raises(ModelLoadError, match="fc_norm: true is not supported"):
        build_proposer(str(out), target)


def test_a_target_of_another_width_is_refused(drafter_dir, tmp_path):
    wide = tmp_path / "wide-target"
    tiny_model(0, num_layers=4, hidden_size=32).save_pretrained(wide)
    tiny_tokenizer().save_pretrained(wide)
    other = load_model(str(wide))
    for fmt in formats.FORMATS:
        out = formats.export(drafter_dir, fmt, tmp_path / fmt)
        with pytest.raises(ModelLoadError, match=f"{fmt} drafter in .* reads 64-wide states; the target .* is 32 wide"):
            build_proposer(str(out), other)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_cli_exports_and_refuses_bad_input_with_one_line(drafter_dir, target, tmp_path, capsys):
    assert main(["export", str(drafter_dir), "--format", "speculators", "--out", str(tmp_path / "ok")]) == 0
    assert (tmp_path / "ok" / "config.json").is_file()
    heads = MedusaHeads(64, 259, 2)
    medusa = save_drafter(tmp_path / "medusa", heads, target.tokenizer, DrafterInfo.for_target("medusa", target))
    capsys.readouterr()
    assert main(["export", str(medusa), "--format", "speculators", "--out", str(tmp_path / "m")]) == 2
    assert "holds a medusa drafter" in one_error_line(capsys) and not (tmp_path / "m").exists()
    # What the sglang format cannot hold: two layers, norm_before_residual, the embeddings' state.
    for name, drafter in [("two", Eagle3Drafter(target.model.config, LAYERS, 2)),
                          ("nbr", Eagle3Drafter(target.model.config, LAYERS, 1, norm_before_residual=True)),
                          ("zero", Eagle3Drafter(target.model.config, [0, 2, 3], 1))]:
        path = save_drafter(tmp_path / name, drafter.attach_target(target.model), target.tokenizer,
                            DrafterInfo.for_target("eagle3", target))
        assert main(["export", str(path), "--format", "sglang", "--out", str(tmp_path / f"{name}-out")]) == 2
        one_error_line(capsys)
        assert not (tmp_path / f"{name}-out").exists()
    assert main(["export", str(tmp_path / "nothing"), "--format", "sglang", "--out", str(tmp_path / "n")]) == 2
    assert "not a draftsmith drafter" in one_error_line(capsys)
    # An existing directory is never overwritten.
    assert main(["export", str(drafter_dir), "--format", "sglang", "--out", str(tmp_path / "ok")]) == 2
    one_error_line(capsys)
    assert json.loads((tmp_path / "ok" / "config.json").read_text())["speculators_model_type"] == "eagle3"


def test_generate_cli_refuses_an_import_for_a_target_of_another_width(drafter_dir, tmp_path, capsys):
    out = formats.export(drafter_dir, "sglang", tmp_path / "sgl")
    wide = tmp_path / "wide"
    tiny_model(0, num_layers=4, hidden_size=32).save_pretrained(wide)
    tiny_tokenizer().save_pretrained(wide)
    code = main(["generate", "--target", str(wide), "--drafter", str(out), "--prompt", "hi", "--max-new-tokens", "4"])
    assert code == 2 and "reads 64-wide states" in one_error_line(capsys)


def test_unknown_format_is_refused(drafter_dir, tmp_path):
    with pytest.raises(InvalidInputError, match="unknown export format"):
        formats.export(drafter_dir, "onnx", tmp_path / "x")
