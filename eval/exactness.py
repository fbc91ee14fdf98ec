"""Greedy exactness: every speculative greedy output must be the target's plain greedy output.

The reference is plain greedy decoding of each prompt alone (batch size 1, `SpeculativeDecoder(target,
None)`). Every other greedy pass (speculative at each D, adaptive, batched speculative and batched plain) is
compared with it token for token. A divergence is reported with the first differing position and the
target's logit margin there (top-1 minus top-2 logit, from one forward pass over the prompt and the
reference prefix): a margin within the tie tolerance is a near-tie that a different arithmetic order
(a wider verification pass, another batch shape) can flip, and counts as numerics, not an error; a
larger margin is a real error, and fails the run.
"""

from __future__ import annotations

import torch

from draftsmith.eval.decoding import Pass

MAX_REPORTED_DIVERGENCES = 20


def greedy_exactness(target: torch.nn.Module, prompts: list[list[int]], ids: list[str], reference: Pass,
                     others: list[Pass], tie_tolerance: float) -> dict:
    checks, divergences = [], []
    plain = reference.outputs()
    for other in others:
        identical = 0
        for trace in other.traces:
            expected = plain[trace.index]
            if trace.tokens == expected:
                identical += 1
                continue
            if len(divergences) < MAX_REPORTED_DIVERGENCES:
                divergences.append(describe_divergence(target, prompts[trace.index], ids[trace.index],
                                                       expected, trace.tokens, other, tie_tolerance))
        checks.append({"decoder": other.decoder, "draft_len": other.draft_len,
                       "batch_size": other.batch_size, "prompts": len(other.traces), "identical": identical,
                       "share": identical / max(len(other.traces), 1)})
    errors = [d for d in divergences if d["kind"] == "error"]
    total = sum(c["prompts"] for c in checks)
    return {
        "reference": "plain greedy decoding, batch size 1",
        "tie_tolerance": tie_tolerance,
        "checks": checks,
        "share_identical": sum(c["identical"] for c in checks) / max(total, 1),
        "divergences": divergences,
        "near_ties": sum(d["kind"] == "near-tie" for d in divergences),
        "errors": len(errors),
        "passed": not errors,
    }


def describe_divergence(target, prompt: list[int], prompt_id: str, expected: list[int], got: list[int],
                        where: Pass, tie_tolerance: float) -> dict:
    position = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    margin, top = logit_margin(target, prompt + expected[:position])
    return {
        "prompt_id": prompt_id,
        "decoder": where.decoder,
        "draft_len": where.draft_len,
        "batch_size": where.batch_size,
        "position": position,  # index into the generated tokens
        "plain_token": expected[position] if position < len(expected) else None,
        "got_token": got[position] if position < len(got) else None,
        "target_top2": top,
        "margin": margin,
        "kind": "near-tie" if margin <= tie_tolerance else "error",
    }


@torch.inference_mode()
def logit_margin(target: torch.nn.Module, context: list[int]) -> tuple[float, list[int]]:
    """Top-1 minus top-2 logit of the target's next-token logits after `context`, and the two ids."""
    device = next(target.parameters()).device
    logits = target(input_ids=torch.tensor([context], device=device), logits_to_keep=1).logits[0, -1].float()
    values, indices = torch.topk(logits, 2)
    return float(values[0] - values[1]), indices.tolist()
