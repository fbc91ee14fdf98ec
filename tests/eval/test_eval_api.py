"""`evaluate` called directly: a random drafter, a lossy verifier, sampling fidelity."""

import json

import pytest
import torch

from draftsmith.data.prompts import load_conversations
from draftsmith.eval.fidelity import fidelity_check, make_contexts
from draftsmith.eval.report import EXIT_INEXACT
from draftsmith.eval.run import evaluate
from draftsmith.eval.settings import EvalSettings
from draftsmith.speculative.drafters import build_proposer
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.loading import load_model
from draftsmith.speculative.verify import verify_native
from draftsmith.speculative.options import DecodeOptions
from draftsmith.speculative.sampling import SamplingParams


def accept_everything(logits, tokens, lens, probs, temperature, top_k, top_p, accept_u, race_exp):
    """A lossy verifier: u = 0 accepts every draft token with p > 0 (all of them at T = 1)."""
    return verify_native(logits, tokens, lens, probs, temperature, top_k, top_p, torch.zeros_like(accept_u), race_exp)


@pytest.fixture(scope="module")
def target(models):
    return load_model(str(models / "target"))


@pytest.fixture(scope="module")
def prompts(prompt_file):
    return load_conversations(prompt_file)


def small(**overrides):
    values = dict(modes=["greedy"], draft_lens=[2], batch_sizes=[1], max_new_tokens=9,
                  fidelity_contexts=2, fidelity_samples=100, timing_reps=1)
    return EvalSettings(**{**values, **overrides})


def test_random_drafter_gives_al_near_one(target, prompts, models, tmp_path):
    report = evaluate(target, str(models / "random"), prompts, small(), progress=False, out_dir=tmp_path / "r")
    assert json.loads((tmp_path / "r" / "report.json").read_text())["acceptance"] == report.data["acceptance"]
    (row,) = report.data["acceptance"]
    assert 1.0 <= row["al"] < 1.3
    assert row["positions"][0]["rate"] < 0.3
    assert report.data["exactness"]["greedy"]["share_identical"] == 1.0
    assert report.exit_code == 0 and report.verdict is None


def test_lossy_verifier_fails_the_run(target, prompts, models):
    report = evaluate(target, str(models / "random"), prompts.select(range(2)),
                              small(modes=["sample:1.0"], max_new_tokens=6), verifier=accept_everything,
                              progress=False)
    (fidelity,) = report.data["exactness"]["sampling"]
    assert not fidelity["passed"] and fidelity["p_value"] < 1e-6
    assert report.exit_code == EXIT_INEXACT


@pytest.mark.parametrize("verifier, passes", [(verify_native, True), (accept_everything, False)])
def test_fidelity_check_tells_exact_from_lossy(target, models, verifier, passes):
    proposer = build_proposer(str(models / "random"), target)
    spec = SpeculativeDecoder(target.model, proposer, verifier=verifier)
    plain = SpeculativeDecoder(target.model, None)
    prompts = [[1, 104, 105, 32, 116, 104, 101, 114, 101], [1, 97, 98, 99]]
    greedy = [plain.generate([p], options=DecodeOptions(max_new_tokens=8)).tokens[0] for p in prompts]
    contexts = make_contexts(prompts, greedy, 4, window=64)
    assert [c["generated_prefix"] for c in contexts] == [int(len(greedy[k % 2]) * (k + 0.5) / 4) for k in range(4)]
    settings = small(modes=["sample:1.0"], fidelity_samples=200)
    result = fidelity_check(spec, plain, contexts, "sample:1.0", 2, settings)
    assert result["passed"] is passes
    assert result["samples_per_side"] == 200 and result["dof"] > 0
    assert (result["p_value"] >= 0.01) if passes else (result["p_value"] < 1e-6)


def test_drafters_share_one_plain_pass(target, prompts, models, monkeypatch):
    """Evaluating several drafters with one `PlainPasses` decodes plainly once; the reports carry the
    same plain figures; a cache filled under other decoding settings is refused."""
    from draftsmith.eval import run as eval_run
    from draftsmith.eval.run import PlainPasses
    from draftsmith.speculative.errors import InvalidInputError

    plain_decodes = []
    original = eval_run.decode_passes

    def counting(systems, *args, **kwargs):
        plain_decodes.extend(s.mode for s in systems if s.decoder.proposer is None)
        return original(systems, *args, **kwargs)

    monkeypatch.setattr(eval_run, "decode_passes", counting)
    shared = PlainPasses()
    first = evaluate(target, str(models / "random"), prompts, small(), progress=False, plain_passes=shared)
    second = evaluate(target, "ngram", prompts, small(), progress=False, plain_passes=shared)
    assert plain_decodes == ["greedy"]
    plain = [next(r for r in rep.data["speed"] if r["decoder"] == "plain") for rep in (first, second)]
    assert plain[0] == plain[1]
    assert second.data["exactness"]["passed"] and second.data["drafter"]["kind"] == "ngram"
    alone = evaluate(target, "ngram", prompts, small(), progress=False)
    assert [r["al"] for r in alone.data["acceptance"]] == [r["al"] for r in second.data["acceptance"]]
    with pytest.raises(InvalidInputError, match="plain_passes"):
        evaluate(target, "ngram", prompts, small(max_new_tokens=5), progress=False, plain_passes=shared)


def test_dynamic_draft_length_is_recorded_and_exact(target, prompts, models):
    report = evaluate(target, str(models / "copy"), prompts, small(draft_lens=[4], draft_confidence=0.5),
                      progress=False)
    assert report.data["settings"]["draft_confidence"] == 0.5
    assert report.data["exactness"]["passed"]


def test_sibling_leaves_are_recorded_and_exact(target, prompts, models):
    report = evaluate(target, "early-exit:2", prompts,
                      small(draft_lens=[2], draft_alternatives=4, leaf_min_prob=0.01), progress=False)
    assert report.data["settings"]["draft_alternatives"] == 4
    assert report.data["settings"]["leaf_min_prob"] == 0.01
    acceptance = report.data["acceptance"][0]
    taken = sum(r["leaf_accepts"] for r in report.data["per_prompt"])
    assert taken > 0 and acceptance["leaf_share"] == taken / acceptance["rounds"]
    from draftsmith.eval import markdown

    assert "Sibling leaves (greedy, D=2)" in markdown.render(report.data, {})
    assert report.data["exactness"]["passed"]


def test_adaptive_row_decodes_as_generate_does_and_is_checked(target, prompts, models, machine_cache, monkeypatch):
    """The adaptive row (generate's and serve's default) is decoded, checked against plain greedy, scored
    and timed per category; its costs are measured by its untimed warm-up. adaptive_draft_len=0 drops it."""
    seen = []
    original = SpeculativeDecoder.generate

    def spying(self, prompts, sampling=SamplingParams(), options=DecodeOptions(), **kwargs):
        seen.append((options.draft_len, options.adaptive))
        return original(self, prompts, sampling, options, **kwargs)

    monkeypatch.setattr(SpeculativeDecoder, "generate", spying)
    report = evaluate(target, str(models / "copy"), prompts, small(adaptive_draft_len=3), progress=False).data
    # warm-ups, then each prompt by plain, D=2 and adaptive up to 3 in turn
    assert seen.count((3, True)) == 1 + len(prompts) and seen.count((2, False)) == 1 + len(prompts)
    (row,) = [v for v in report["speed"] if v["decoder"] == "adaptive"]
    assert row["draft_len"] == 3 and row["speedup"] > 0 and 0 <= row["mean_draft_len"] <= 3
    check = next(c for c in report["exactness"]["greedy"]["checks"] if c["decoder"] == "adaptive")
    assert check["identical"] == len(prompts) and report["exactness"]["passed"]
    assert any(q["decoder"] == "adaptive" and q["identical_to_plain"] == len(prompts) for q in report["quality"])
    assert [c["decoder"] for c in report["speed_by_category"]] == ["speculative", "adaptive"]
    (advice,) = report["advice"]
    assert advice["adaptive"]["max_draft_len"] == 3 and advice["adaptive"]["tokens_per_s"] == row["tokens_per_s"]
    assert machine_cache.is_file()  # the adaptive length's costs were measured for it
    fixed_only = evaluate(target, str(models / "copy"), prompts, small(adaptive_draft_len=0), progress=False).data
    assert [v["decoder"] for v in fixed_only["speed"]] == ["plain", "speculative"]
    assert [c["decoder"] for c in fixed_only["speed_by_category"]] == ["speculative"]
    assert fixed_only["advice"][0]["adaptive"] is None
    assert all(c["decoder"] != "adaptive" for c in fixed_only["exactness"]["greedy"]["checks"])
