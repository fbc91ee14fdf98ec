"""The evaluate modules shipped with draftsmith load offline from their path and compute the right numbers;
the acceptance figures of a report agree with each other and with what the runtime decodes."""

import hashlib
import os

import pytest
import torch

from draftsmith.eval.quality import METRICS_DIR, load_metric
from draftsmith.speculative.tiny import tiny_model


def test_metric_modules_ship_with_the_package():
    assert (METRICS_DIR / "nll" / "nll.py").is_file() and (METRICS_DIR / "rouge_l" / "rouge_l.py").is_file()
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # set by tests/conftest.py: no hub access


def test_rouge_l():
    rouge = load_metric("rouge_l")
    result = rouge.compute(predictions=["the cat sat", "a b c d", "x", ""],
                           references=["the cat sat", "a c d e", "y", "z"])
    assert result["scores"] == pytest.approx([1.0, 0.75, 0.0, 0.0])
    assert result["rougeL_f1"] == pytest.approx(0.4375)


def test_nll_matches_a_direct_computation():
    model = tiny_model(0, num_layers=1)
    prompt, completion = [1, 72, 105], [33, 10, 2]
    result = load_metric("nll").compute(prompt_ids=[prompt], completion_ids=[completion], model=model)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + completion])).logits[0], dim=-1)
    expected = -sum(float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(completion))
    assert result["nll_sums"][0] == pytest.approx(expected, rel=1e-5)
    assert result["nll_per_token"] == pytest.approx(expected / 3, rel=1e-5)


# --- the acceptance figures of a report against what was decoded ------------------------------------


@pytest.fixture(scope="module")
def early_exit_report(models, prompt_file):
    """An early-exit:2 drafter on the 3-layer target: some drafts accepted, some not (greedy and sampled)."""
    from draftsmith.data.prompts import load_conversations
    from draftsmith.eval.run import evaluate
    from draftsmith.eval.settings import EvalSettings
    from draftsmith.speculative.loading import load_model

    target, prompts = load_model(str(models / "target")), load_conversations(prompt_file)
    settings = EvalSettings(modes=["greedy", "sample:1.0"], draft_lens=[3], batch_sizes=[1], max_new_tokens=16,
                            fidelity_contexts=0, timing_reps=1)
    return target, prompts, settings, evaluate(target, "early-exit:2", prompts, settings, progress=False).data


def test_acceptance_figures_add_up(early_exit_report):
    """Every figure of the acceptance table follows from the per-prompt counts, and they from each other:
    a round that emits k tokens accepted k - 1 drafts (then the bonus or a recovered token), so position i
    was accepted in exactly the rounds that emitted more than i tokens."""
    from draftsmith.eval.stats import predicted_al

    _, _, settings, report = early_exit_report
    assert [(row["mode"], row["draft_len"]) for row in report["acceptance"]] == [("greedy", 3), ("sample:1.0", 3)]
    for row in report["acceptance"]:
        d = row["draft_len"]
        records = [r for r in report["per_prompt"] if (r["mode"], r["draft_len"]) == (row["mode"], d)]
        assert len(records) == row["prompts"] == 4
        hist = row["emitted_hist"]
        assert len(hist) == d + 2 and hist[0] == 0
        assert sum(hist) == row["rounds"] == sum(r["rounds"] for r in records)
        emitted = sum(k * n for k, n in enumerate(hist))
        assert emitted == sum(r["emitted"] for r in records) == row["tokens"] == 4 * settings.max_new_tokens
        assert row["al"] == pytest.approx(emitted / row["rounds"])
        assert 1 < row["al"] < d + 1  # some drafts accepted, not all
        assert row["al_ci"][0] <= row["al"] <= row["al_ci"][1]
        for i, position in enumerate(row["positions"]):
            assert position["position"] == i + 1
            assert position["accepted"] == sum(hist[i + 2:])  # rounds that emitted more than i + 1 tokens
            assert position["offered"] == sum(r["offered"][i] for r in records) <= row["rounds"]
            assert position["rate"] == pytest.approx(position["accepted"] / position["offered"])
        # a position is offered only where the one before it was accepted (and the budget allows it)
        offered = [p["offered"] for p in row["positions"]]
        accepted = [p["accepted"] for p in row["positions"]]
        assert all(o <= a for o, a in zip(offered[1:], accepted)) and all(a <= o for a, o in zip(accepted, offered))
        assert row["predicted_al"] == pytest.approx(predicted_al([p["rate"] for p in row["positions"]], d))
        assert 1 <= row["predicted_al"] <= d + 1
        for category, figures in row["by_category"].items():
            members = [r for r in records if r["category"] == category]
            assert figures["prompts"] == len(members) == 2
            assert figures["al"] == pytest.approx(sum(r["emitted"] for r in members) / sum(r["rounds"] for r in members))
        assert row["emitted_share"] == pytest.approx([n / row["rounds"] for n in hist])


def test_per_prompt_records_are_what_the_runtime_decodes(early_exit_report):
    """Decoding each prompt again, alone, with the same drafter, seed and options gives the same tokens and
    the same counts as the report's record of it."""
    from draftsmith.eval.run import encode_messages
    from draftsmith.speculative.drafters import load_drafter
    from draftsmith.speculative.generate import SpeculativeDecoder
    from draftsmith.speculative.prompts import stop_token_ids

    target, prompts, settings, report = early_exit_report
    proposer, _ = load_drafter("early-exit:2", target)
    decoder = SpeculativeDecoder(target.model, proposer, stop_token_ids=stop_token_ids(target.model, target.tokenizer))
    for record in report["per_prompt"]:
        index = list(prompts["id"]).index(record["id"])
        ids = encode_messages(target.tokenizer, prompts[index]["messages"], settings.chat)
        result = decoder.generate([ids], [settings.sampling(record["mode"], index)], settings.options(3))
        stats, tokens = result.stats, result.tokens[0]
        assert record["new_tokens"] == len(tokens) == settings.max_new_tokens and record["finish"] == "length"
        assert record["output_sha"] == hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()[:16]
        assert (record["rounds"], record["emitted_hist"]) == (stats.rounds, list(stats.emitted_hist))
        assert (record["offered"], record["accepted"]) == (list(stats.offered), list(stats.accepted))
        assert record["emitted"] == len(tokens)
