"""The evaluate modules shipped with draftsmith load offline from their path and compute the right numbers."""

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
