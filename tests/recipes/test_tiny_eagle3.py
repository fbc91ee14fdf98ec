"""End to end on the tiny EAGLE-3 recipe: train, serve exactly, export to both engines' layouts and
import back."""

import json

import datasets
import pytest
import torch

from draftsmith.data.collate import pad_batch
from draftsmith.data.teacher import cache_teacher_signals
from draftsmith.speculative import formats, kinds
from draftsmith.speculative.checkpoint import read_drafter_info
from draftsmith.speculative.drafters import build_proposer
from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.loading import load_model
from draftsmith.speculative.options import DecodeOptions
from draftsmith.train.config import load_recipe
from draftsmith.train.data_prep import prepare_data
from draftsmith.train.loop import Teacher, train
from draftsmith.train.modules import freeze


def eagle3_recipe(prompts, cache, *extra):
    return load_recipe("tiny-eagle3", [f"data.prompts=[{prompts}]", "data.heldout=2", "data.max_new_tokens=8",
                                       f"data.cache_dir={cache}", "target=tiny:0", "drafter.target_layers=[0,1]",
                                       "drafter.draft_vocab=32", "teacher.top_k=4", *extra])


def test_offline_teacher_caches_the_layers_it_reads_and_trains_as_online(tmp_path):
    """The offline cache stores the states entering the drafter's target layers beside the last ones; the
    objective reads the same states and the same (restricted) teacher distribution from it as online."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"q{i}: {'xy' * (i + 1)}"}) + "\n" for i in range(10)))
    target = load_model("tiny:0")
    freeze(target.model)
    online, offline = (eagle3_recipe(prompts, tmp_path / "data", f"teacher.mode={mode}", "teacher.dtype=float32")
                       for mode in ("online", "offline"))
    data = {mode: prepare_data(recipe, target, is_main=True, progress=False)
            for mode, recipe in (("online", online), ("offline", offline))}
    cache = data["offline"].teacher
    assert cache.layers == [0, 1] and cache.has_hidden
    assert "layers-0_1" in cache.dir.name
    rows = [dict(data["offline"].train[i], index=i) for i in range(4)]
    batch = pad_batch(rows, pad_id=0)
    layers = (0, 1, -1)
    live, cached = (Teacher(target, data[mode], recipe).states(batch, layers)
                    for mode, recipe in (("online", online), ("offline", offline)))
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(cached[real], live[real], atol=1e-4, rtol=1e-3)  # (other batches, other padding)
    assert cached[real][:, :64].abs().sum() > 0 and not torch.equal(cached[..., :64], cached[..., 64:128])

    kind = kinds.get("eagle3")
    drafter = kind.build(online, target)
    kind.prepare(drafter, data["online"].train, online)
    module = kind.training_module(drafter)
    losses = [kind.objective(module, drafter, batch, Teacher(target, data[mode], recipe), recipe)
              for mode, recipe in (("online", online), ("offline", offline))]
    torch.testing.assert_close(losses[1][0], losses[0][0], atol=1e-4, rtol=1e-4)
    assert losses[0][1] == losses[1][1] > 0
    assert losses[0][2] == losses[1][2]  # agreement with the target's top token: argmax online, cached top-1 offline
    # The teacher's logits over the draft vocabulary come from its lm_head rows only, as the full lm_head's
    # columns; its top token from the cache is the full lm_head's argmax.
    teachers = {mode: Teacher(target, data[mode], recipe) for mode, recipe in (("online", online), ("offline", offline))}
    at = real.nonzero()
    vocab = drafter.draft_to_target
    torch.testing.assert_close(teachers["online"].logits(live[at[:, 0], at[:, 1], -64:], vocab=vocab),
                               teachers["online"].logits(live[at[:, 0], at[:, 1], -64:])[:, vocab])
    tops = [teachers[mode].top(at, batch, states[..., -64:]) for mode, states in (("online", live), ("offline", cached))]
    assert torch.equal(tops[0], tops[1]) and tops[0].unique().numel() > 1
    # loss.prompt_positions: every real position of the rows counts, not only the answers'
    wide = eagle3_recipe(prompts, tmp_path / "data", "teacher.mode=online", "loss.prompt_positions=true")
    counted = kind.objective(module, drafter, batch, Teacher(target, data["online"], wide), wide)[1]
    steps = online.loss.draft_steps
    assert counted == int(batch["attention_mask"][:, 2 + steps - 1:].sum()) > losses[0][1]

    # A recipe that needs fewer signals (the eagle kind: hidden states, no inner layers) reuses this cache.
    eagle = load_recipe("tiny-eagle", [f"data.prompts=[{prompts}]", "data.heldout=2", "data.max_new_tokens=8",
                                       f"data.cache_dir={tmp_path / 'data'}", "target=tiny:0", "teacher.top_k=4",
                                       "teacher.mode=offline", "teacher.dtype=float32"])
    assert prepare_data(eagle, target, is_main=True, progress=False).teacher.dir == cache.dir


def test_cache_layers_are_checked(tmp_path):
    target = load_model("tiny:0")
    dataset = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]]})
    for bad in ([2], [0, 0], ["a"]):
        with pytest.raises(InvalidInputError, match="layers"):
            cache_teacher_signals(target, dataset, tmp_path / "c", layers=bad, progress=False)


def test_shipped_recipes_validate():
    assert load_recipe("tiny-eagle3").drafter.target_layers == [1, 2, 3]
    recipe = load_recipe("eagle3-smollm2")
    assert recipe.drafter.kind == "eagle3" and recipe.drafter.target_layers is None  # [2, 15, 27] of 30
    # Prompts that ship with draftsmith, and requests the target writes itself: nothing outside the package.
    assert all(p.startswith(("builtin:", "self:")) for p in recipe.data.prompts)
    assert any(p.startswith("self:") for p in recipe.data.prompts) and recipe.data.regen_dtype == "auto"


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


@pytest.mark.slow
def test_drafter_gap_scores_the_training_rows_above_prompts_it_never_saw(tmp_path, monkeypatch, capsys, load_benchmark):
    """benchmarks/drafter_gap.py rebuilds a drafter's recipe from its record and scores its objective's
    agreement on its training rows, its held-out prompts and other prompts, side by side: the trained
    drafter above the same recipe's drafter one negligible step from its initialisation, on the rows it
    trained on and on its held-out prompts. (Which of a tiny random target's sets is easiest to predict
    is the target's accident, so the sets are not ranked against each other.)"""

    monkeypatch.setenv("WANDB_MODE", "offline")
    common = [f"data.cache_dir={tmp_path / 'data'}", "tracking.report_to=none"]
    out, untrained = tmp_path / "run", tmp_path / "untrained"
    train(load_recipe("tiny-eagle3", [f"output_dir={out}", *common]), progress=False)
    train(load_recipe("tiny-eagle3", [f"output_dir={untrained}", *common, "train.steps=1", "train.lr=1e-12",
                                      "train.warmup_steps=0", "train.eval_every=0"]), progress=False)
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"prompt": f"zq{'wv' * (i % 5)} {i}?"}) + "\n" for i in range(6)))
    drafter_gap = load_benchmark("drafter_gap")  # (it imports acceptance.py beside it)

    def gap(run):
        report = tmp_path / f"gap-{run.name}.json"
        assert drafter_gap.main(["--drafter", str(run / "drafter"), "--train-rows", "16", "--prompts", "6",
                                 "--prompt-sets", str(other), "--max-new-tokens", "16", "--json", str(report)]) == 0
        return json.loads(report.read_text())["results"]

    results, before = gap(out), gap(untrained)
    assert set(results) == {"train", "held-out", "eval"} and all(r["positions"] > 0 for r in results.values())
    assert results["train"]["rows"] == 16 and results["eval"]["rows"] == 6
    steps = [k for k in results["train"] if k.startswith("agreement/")]
    assert steps == ["agreement/pos1", "agreement/pos2", "agreement/pos3"]  # the recipe's draft steps
    for rows in ("train", "held-out"):  # the same rows and prompts for both drafters
        assert results[rows]["positions"] == before[rows]["positions"]
        assert results[rows]["agreement/pos1"] > before[rows]["agreement/pos1"] + 0.1
        assert results[rows]["loss"] < before[rows]["loss"]
    assert "held-out" in capsys.readouterr().out
