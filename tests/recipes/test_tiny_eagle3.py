"""End to end on the tiny EAGLE-3 recipe: train, serve exactly, export to both engines' layouts and
import back."""

import pytest
from draftsmith.speculative import formats
from draftsmith.speculative.checkpoint import read_drafter_info
from draftsmith.speculative.drafters import build_proposer
from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.loading import load_model
from draftsmith.speculative.options import DecodeOptions
from draftsmith.train.config import load_recipe
from draftsmith.train.loop import train


def test_offline_teacher_is_refused_before_any_work():
    with pytest.raises(InvalidInputError, match="eagle3 needs teacher.mode: online"):
        load_recipe("tiny-eagle3", ["teacher.mode=offline"])


def test_shipped_recipes_validate():
    assert load_recipe("tiny-eagle3").drafter.target_layers == [1, 2, 3]
    recipe = load_recipe("eagle3-smollm2")
    assert recipe.drafter.kind == "eagle3" and recipe.drafter.target_layers is None  # [2, 15, 27] of 30
    assert all(p.startswith("builtin:") for p in recipe.data.prompts)


@pytest.mark.slow
def test_trained_eagle3_drafter_beats_untrained_serves_exactly_and_exports(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    out, data = tmp_path / "run", f"data.cache_dir={tmp_path / 'data'}"
    summary = train(load_recipe("tiny-eagle3", [f"output_dir={out}", data, "tracking.report_to=none"]), progress=False)
    before, after = summary["al_before"]["acceptance_length"], summary["al_after"]["acceptance_length"]
    assert after > before + 0.3, (before, after)
    drafter = out / "drafter"
    info = read_drafter_info(drafter)
    assert info.kind == "eagle3" and info.recipe["name"] == "tiny-eagle3"

    target = load_model("tiny-lm:0:4")
    prompts = [[1, 72, 101, 108, 108, 111], [1, 87, 104, 121, 63]]
    options = DecodeOptions(max_new_tokens=24, draft_len=3)
    plain = SpeculativeDecoder(target.model, None, stop_token_ids=[2]).generate(prompts, options=options).tokens
    results = {}
    for name, spec in [("own", str(drafter)),
                       *((fmt, str(formats.export(drafter, fmt, tmp_path / fmt))) for fmt in formats.FORMATS)]:
        result = SpeculativeDecoder(target.model, build_proposer(spec, target), stop_token_ids=[2]).generate(
            prompts, options=options)
        assert result.tokens == plain, name
        results[name] = result.stats.emitted_hist
    assert results["own"] == results["speculators"] == results["sglang"]  # the same drafts, the same rounds

    # Training further from a drafter in an engine's layout: it starts where the first run ended.
    again = train(load_recipe("tiny-eagle3", [f"output_dir={tmp_path / 'again'}", data, "tracking.report_to=none",
                                              f"drafter.init_from={tmp_path / 'sglang'}", "train.steps=3",
                                              "train.eval_every=0", "train.checkpoint_every=0"]), progress=False)
    assert again["al_before"]["acceptance_length"] == after
