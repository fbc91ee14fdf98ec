"""Prompts the target writes itself, for training a drafter without a prompt set of one's own.

An instruction-tuned model given its chat template with a user turn opened and nothing in it writes a
user's request, in the style of the requests it was tuned on (Magpie, Xu et al. 2024). The target's
answers to those requests are the text it produces when serving such users, which is what a drafter
has to predict, so `self:N` in a recipe's `data.prompts` adds N such prompts beside (or instead of)
prompt files. They are sampled at temperature 1 through `regenerate(..., role="user")`, so they are
written in resumable shards and cached like answers. Requests cut off by the length limit, empty ones
and repeats are dropped: a `self:N` source yields at most N prompts.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

import datasets

from draftsmith.data.regenerate import regenerate
from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.loading import LoadedModel

PREFIX = "self:"
TEMPERATURE = 1.0
MAX_PROMPT_TOKENS = 128
_SEED_FEATURES = datasets.Features({
    "id": datasets.Value("string"),
    "category": datasets.Value("string"),
    "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
})


def is_self_spec(spec: str) -> bool:
    return spec.startswith(PREFIX)


def self_prompt_count(spec: str) -> int:
    """N of a `self:N` prompt source; a one-line error for anything else after `self:`."""
    text = spec.removeprefix(PREFIX)
    if not text.isdigit() or int(text) < 1:
        raise InvalidInputError(f"'{spec}': a self-written prompt source is self:N with N a positive integer")
    return int(text)


def write_prompts(target: LoadedModel, count: int, out_dir: Path, *, seed: int = 0, batch_size: int = 16,
                  progress: bool = True, reuse: Iterable[Path] = ()) -> datasets.Dataset:
    """`count` user requests written by `target` (see the module docstring), as a conversations dataset
    (id, category "self", messages = [the user turn]) with the unusable ones dropped; cached in `out_dir`.
    `reuse`: directories of earlier `write_prompts` runs; request i is drawn from its own seed (seed, i),
    so the ones an earlier run with the same seed wrote are taken, not written again."""
    blank = datasets.Dataset.from_dict({"id": [f"self-{i}" for i in range(count)], "category": ["self"] * count,
                                        "messages": [[] for _ in range(count)]}, features=_SEED_FEATURES)
    written = regenerate(target, blank, out_dir, max_new_tokens=MAX_PROMPT_TOKENS, temperature=TEMPERATURE,
                         seed=seed, batch_size=batch_size, progress=progress, role="user", desc="writing prompts",
                         reuse=reuse)
    seen, keep = set(), []
    for index, (reason, messages) in enumerate(zip(written["finish_reason"], written["messages"])):
        text = messages[-1]["content"].strip()
        if reason == "stop" and text and text not in seen:
            seen.add(text)
            keep.append(index)
    if len(keep) < count:
        print(f"self prompts: kept {len(keep)} of {count} (dropped {count - len(keep)} cut off by the "
              f"{MAX_PROMPT_TOKENS}-token limit, empty or repeated)", file=sys.stderr)
    if not keep:
        raise InvalidInputError(f"the target wrote no usable prompt in {count} tries; list prompt files instead")
    prompts = written.select(keep).select_columns(["id", "category", "messages"])
    return prompts.map(lambda row: {"messages": [{"role": "user", "content": row["messages"][-1]["content"].strip()}]},
                       desc="self prompts")
