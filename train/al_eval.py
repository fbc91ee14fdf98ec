"""Acceptance length of the drafter being trained, measured with the real runtime.

Greedy decoding of the held-out prompts with the current weights, D = `train.eval_draft_len`. Greedy
speculation is exact, so AL is the only thing that changes as the drafter trains.
"""

from __future__ import annotations

import torch

from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.eagle import EagleDrafter, EagleProposer
from draftsmith.speculative.loading import LoadedModel
from draftsmith.speculative.medusa import MedusaHeads, MedusaProposer
from draftsmith.speculative.prompts import stop_token_ids
from draftsmith.speculative.proposers import DraftModelProposer, Proposer
from draftsmith.train.modules import inference_model


def proposer_for(drafter: torch.nn.Module) -> Proposer:
    if isinstance(drafter, MedusaHeads):
        return MedusaProposer(drafter)
    if isinstance(drafter, EagleDrafter):
        return EagleProposer(drafter)
    return DraftModelProposer(inference_model(drafter))


def acceptance_length(drafter: torch.nn.Module, target: LoadedModel, prompts: list[list[int]], *,
                      draft_len: int, max_new_tokens: int, batch_size: int = 8) -> dict:
    was_training = drafter.training
    drafter.eval()
    try:
        decoder = SpeculativeDecoder(target.model, proposer_for(drafter),
                                     stop_token_ids=stop_token_ids(target.model, target.tokenizer))
        rounds = tokens = 0
        offered, accepted = [0] * draft_len, [0] * draft_len
        for start in range(0, len(prompts), batch_size):
            stats = decoder.generate(prompts[start:start + batch_size], max_new_tokens=max_new_tokens,
                                     draft_len=draft_len).stats
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
