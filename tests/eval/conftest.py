"""Fixtures of the eval tests: tiny model directories and prompt files, all built in tmp dirs."""

import json

import pytest
import torch

from draftsmith.speculative.tiny import tiny_model, tiny_tokenizer

PROMPTS = [
    {"id": "p1", "category": "chat", "prompt": "hello hello hello", "reference": "hello there"},
    {"id": "p2", "category": "chat", "prompt": "abc abc abc", "reference": "abc abc"},
    {"id": "p3", "category": "code", "prompt": "def f(x): return x", "reference": "return x + 1"},
    {"id": "p4", "category": "code", "prompt": "1 2 3 4 5", "reference": "6 7 8"},
]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models on a shared 2-core machine run far faster on one thread (no spin-waiting)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """target: tiny:0 (3 layers); copy: the same weights saved again (a perfect drafter); changed: the
    target with perturbed weights (a target update); random: an unrelated 1-layer model; other_tok: a
    model whose tokenizer has an extra special token."""
    root = tmp_path_factory.mktemp("eval-models")
    tok = tiny_tokenizer()
    target = tiny_model(0, num_layers=3)
    for name in ("target", "copy"):
        target.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    changed = tiny_model(0, num_layers=3)
    generator = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=generator))
    changed.save_pretrained(root / "changed")
    tok.save_pretrained(root / "changed")
    tiny_model(1, num_layers=1).save_pretrained(root / "random")
    tok.save_pretrained(root / "random")
    tiny_model(2, num_layers=1).save_pretrained(root / "other_tok")
    other = tiny_tokenizer()
    other.add_special_tokens({"additional_special_tokens": ["<|x|>"]})
    other.save_pretrained(root / "other_tok")
    return root


@pytest.fixture(scope="session")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval-prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path
