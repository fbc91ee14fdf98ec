"""The re-tune loop on tiny models: a drafter for one target, a changed target, retune recovers AL."""

import json

import pytest

from draftsmith.cli import main
from draftsmith.speculative.checkpoint import read_drafter_info
from draftsmith.speculative.drafters import build_proposer
from draftsmith.speculative.errors import DraftsmithError
from draftsmith.speculative.loading import load_model

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
    err = capsys.readouterr().err
    assert "re-tuned: held-out AL" in err

    info = read_drafter_info(out / "drafter")
    assert info.target_hash == load_model(str(new_target)).weight_hash()
    assert info.lineage["previous_drafter"] == str((v1 / "drafter").resolve())
    assert info.lineage["previous_target"]["name"] == "tiny-lm:0:4"
    assert build_proposer(str(out / "drafter"), load_model(str(new_target))) is not None
