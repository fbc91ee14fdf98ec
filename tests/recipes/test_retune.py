"""The re-tune loop on tiny models: a drafter for one target, a changed target, retune recovers AL."""

import json

import pytest

from draftsmith.cli import main
from draftsmith.speculative.checkpoint import read_drafter_info
from draftsmith.speculative.drafters import build_proposer
from draftsmith.speculative.errors import DraftsmithError
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.loading import load_model
from draftsmith.speculative.options import DecodeOptions
from draftsmith.speculative.prompts import encode_prompt, stop_token_ids

pytestmark = pytest.mark.slow


def test_retune_recovers_acceptance_after_a_target_update(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    v1 = tmp_path / "v1"
    assert main(["train", "tiny-draft-lm", f"output_dir={v1}", "tracking.report_to=none", "train.eval_every=0",
                 "--no-progress"]) == 0
    assert main(["train", "tiny-target-v2", f"output_dir={tmp_path / 'target-v2'}", "--no-progress"]) == 0
    new_target = tmp_path / "target-v2" / "model"

    # The drafter is refused for the new target unless re-tuned (or explicitly allowed).
    with pytest.raises(DraftsmithError, match="trained for target 'tiny-lm:0:4'"):
        build_proposer(str(v1 / "drafter"), load_model(str(new_target)))

    out = tmp_path / "v2"
    assert main(["retune", "--drafter", str(v1 / "drafter"), "--target", str(new_target), "--budget-steps", "80",
                 "--eval-every", "20", "--out", str(out), "--no-progress"]) == 0
    result = json.loads((out / "retune.json").read_text())
    assert result["al_before"] < result["al_old_target"] - 0.5  # the update cost the old drafter AL
    assert result["al_after"] > result["al_before"] + 0.5  # and the re-tune won much of it back
    assert result["steps"] <= 80
    # The verdict: recovered means back at the old target's level; the weights written are those of the
    # best held-out check (every 20 steps, or the last step).
    assert result["recovered"] == (result["al_after"] >= result["al_old_target"])
    assert result["kept_step"] <= result["steps"] and (result["kept_step"] % 20 == 0
                                                       or result["kept_step"] == result["steps"])
    if not result["recovered"]:
        assert result["steps"] == 80  # not back at the old level: the whole budget was spent
    old_info = read_drafter_info(v1 / "drafter")
    assert result["from_scratch"]["steps"] == old_info.training["steps"] == 60
    assert result["drafter"] == str(out / "drafter")
    err = capsys.readouterr().err
    assert "re-tuned: held-out AL" in err and f"{result['al_before']:.3f} -> {result['al_after']:.3f}" in err

    target_v2 = load_model(str(new_target))
    info = read_drafter_info(out / "drafter")
    assert info.kind == old_info.kind == "draft-lm"
    assert info.target_hash == target_v2.weight_hash() != old_info.target_hash
    assert info.training["al_after"]["acceptance_length"] == result["al_after"]
    assert info.lineage["previous_drafter"] == str((v1 / "drafter").resolve())
    assert info.lineage["previous_target"] == {"name": "tiny-lm:0:4", "weight_hash": old_info.target_hash}
    assert info.lineage["new_target"]["weight_hash"] == target_v2.weight_hash()
    assert info.lineage["al_old_target"] == result["al_old_target"]
    assert info.lineage["al_new_target_before"] == result["al_before"]
    assert info.lineage["budget_steps"] == 80

    # The new drafter serves the new target exactly, and drafts for it better than the old one does.
    prompts = [encode_prompt(target_v2.tokenizer, text, chat=True)
               for text in ["Tell me about the sea.", "What is a good name for a cat?", "Write a short poem."]]
    stops = stop_token_ids(target_v2.model, target_v2.tokenizer)
    options = DecodeOptions(max_new_tokens=32, draft_len=4)
    plain = SpeculativeDecoder(target_v2.model, None, stop_token_ids=stops).generate(prompts, options=options)
    runs = {}
    for name, drafter in [("new", out / "drafter"), ("old", v1 / "drafter")]:
        proposer = build_proposer(str(drafter), target_v2, allow_target_mismatch=name == "old")
        runs[name] = SpeculativeDecoder(target_v2.model, proposer, stop_token_ids=stops).generate(prompts,
                                                                                                  options=options)
        assert runs[name].tokens == plain.tokens
    assert runs["new"].stats.acceptance_length > runs["old"].stats.acceptance_length
