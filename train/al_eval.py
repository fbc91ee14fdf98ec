"""Acceptance length of the drafter being trained, measured with the real runtime.

Greedy decoding of the held-out prompts with the current weights, D = `train.eval_draft_len`. Greedy
speculation is exact, so AL is the only thing that changes as the drafter trains.
"""

from __future__ import annotations

import torch

from draftsmith.speculative import kinds
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.loading import LoadedModel
from draftsmith.speculative.options import DecodeOptions
from draftsmith.speculative.prompts import stop_token_ids


def acceptance_length(drafter: torch.nn.Module, kind: str, target: LoadedModel, prompts: list[list[int]], *,
                      draft_len: int, max_new_tokens: int, batch_size: int = 8) -> dict:
    """Held-out AL of a drafter module of `kind` (a registry name)."""
    was_training = drafter.training
    drafter.eval()
    try:
        decoder = SpeculativeDecoder(target.model, kinds.get(kind).proposer(drafter),
                                     stop_token_ids=stop_token_ids(target.model, target.tokenizer),
                                     measure_costs=False)  # a fixed draft length: no adaptive costs needed
        options = DecodeOptions(max_new_tokens=max_new_tokens, draft_len=draft_len)
        rounds = tokens = 0
        offered, accepted = [0] * draft_len, [0] * draft_len
        for start in range(0, len(prompts), batch_size):
            stats = decoder.generate(prompts[start:start + batch_size], options=options).stats
            rounds += stats.rounds
            tokens += sum(k * n for k, n in enumerate(stats.emitted_hist))
            offered = [a + b for a, b in zip(offered, stats.offered)]
            accepted = [a + b for a, b in zip(accepted, stats.accepted)]
    finally:
        drafter.train(was_training)
    return {
        "acceptance_length": tokens / max(rounds, 1),
        "position_acceptance": [a / o if o else None for a, o in zip(accepted, offered)],
        "rounds": rounds,
    }
