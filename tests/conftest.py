"""Shared fixtures: tiny random models built in the tests (no network, no files from outside the repository)."""

import importlib.util
import os
from pathlib import Path

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

# One thread: the tiny models gain nothing from a second one, and on a busy 2-core machine the idle
# thread spin-waits; with two, the suite ran 10 to 20 times slower there. Subprocesses inherit it.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _hf_greedy(model, prompt, max_new_tokens, eos=None):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def pytest_xdist_auto_num_workers(config):
    """Workers for `-n auto` (pyproject's addopts): one per core, at most 4, for a whole tier (no test
    paths given); none for a run of chosen files, where starting a worker costs more than it saves."""
    if config.args_source != pytest.Config.ArgsSource.TESTPATHS:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(cores or 1, 4)


@pytest.fixture(scope="session")
def hf_greedy():
    """Hugging Face `generate`'s greedy continuation of one prompt: the reference exactness is judged by."""
    return _hf_greedy


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


def _fit_eagle(target, prompts, max_new_tokens, steps=150, seed=0):
    """An EAGLE drafter that has learnt the target's greedy continuations of `prompts` by heart
    (teacher-forced features, hard labels; a few seconds). Decoding those prompts, most of its drafts
    are accepted, but only if the runtime hands it the right features for the right tokens."""
    from draftsmith.speculative.eagle import EagleDrafter

    examples = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            seq = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, pad_token_id=0)
            out = target(seq, output_hidden_states=True)
            examples.append((seq, out.hidden_states[-1], out.logits.argmax(-1)))
    torch.manual_seed(seed)
    drafter = EagleDrafter(target.config, 1).attach_target(target, init_norm=True)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = 0.0
        for seq, features, labels in examples:
            # Slot t reads (f_t, x_{t+1}); its output guesses f_{t+1}, whose argmax is token t + 2.
            predicted = drafter.predict_features(seq[:, 1:], features[:, :-1])
            logits = drafter.lm_head(predicted)[0]
            loss = loss + torch.nn.functional.cross_entropy(logits, labels[0, 1:]) + \
                torch.nn.functional.smooth_l1_loss(predicted, features[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval()


@pytest.fixture(scope="session")
def fit_eagle():
    """fit_eagle(target, prompts, max_new_tokens): an EAGLE drafter that knows those continuations."""
    return _fit_eagle


DATASET_CARD = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*.parquet
  - split: test
    path: data/test-*.parquet
- config_name: chat
  data_files:
  - split: train
    path: chat/train-*.parquet
---
# A tiny dataset repository for draftsmith's tests
"""


@pytest.fixture(scope="session")
def dataset_repo(tmp_path_factory):
    """A local dataset repository laid out as on the hub: a README dataset card naming two configs,
    parquet shards. default: `query` (a prompt, under a name draftsmith does not infer) and `topic`,
    train = 2 shards of 12 records, test = 4; chat: ShareGPT `dialog` conversations, 8 records."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("datasets") / "tiny-repo"
    (root / "data").mkdir(parents=True)
    (root / "chat").mkdir()
    (root / "README.md").write_text(DATASET_CARD)
    for shard in range(2):
        rows = [f"question {shard * 12 + i}: {'ab' * (i % 5)} ?" for i in range(12)]
        pq.write_table(pa.table({"query": rows, "topic": [f"t{i % 3}" for i in range(12)]}),
                       root / "data" / f"train-{shard:05d}-of-00002.parquet")
    pq.write_table(pa.table({"query": [f"held {i}" for i in range(4)], "topic": ["t"] * 4}),
                   root / "data" / "test-00000-of-00001.parquet")
    dialogs = [[{"from": "human", "value": f"hello {i}"}, {"from": "gpt", "value": f"hi {i}, how are you"}]
               for i in range(8)]
    pq.write_table(pa.table({"dialog": dialogs}), root / "chat" / "train-00000-of-00001.parquet")
    return root


@pytest.fixture
def machine_cache(tmp_path, monkeypatch):
    """A fresh store of this machine's measured costs (calibrate.py), in memory and on disk: the file."""
    from draftsmith.speculative import calibrate, small_gemm

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    monkeypatch.delenv("DRAFTSMITH_CALIBRATE", raising=False)
    monkeypatch.setattr(calibrate, "_memory", {})
    monkeypatch.setattr(small_gemm, "_chosen", {})
    return tmp_path / "machine.json"


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def load_benchmark(monkeypatch):
    """`load_benchmark(name)`: the script benchmarks/NAME.py as a module (the benchmarks are scripts, not a
    package), with its folder on sys.path as when it runs, for the scripts that import a sibling."""
    def load(name: str):
        monkeypatch.syspath_prepend(str(BENCHMARKS))
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return load
