"""Shared fixtures: tiny random models built in the tests (no network, no ../shared)."""

import os

import pytest
import torch

# Offline and quiet everywhere in the suite: nothing may reach a hub or W&B's servers.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# CI has no GPU: Triton kernels run on its CPU interpreter, which reads this before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from draftsmith.speculative.tiny import tiny_model, tiny_tokenizer  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def target():
    """A 3-layer tiny target over the 259-token byte-level vocabulary."""
    return tiny_model(0, num_layers=3)


@pytest.fixture(scope="session")
def random_drafter():
    """An unrelated random model with the same vocabulary: nearly every draft is rejected."""
    return tiny_model(1, num_layers=1)
