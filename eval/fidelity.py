"""Sampling fidelity: speculative sampling must emit the target's own distribution, on the real models.

For a handful of contexts cut from plain greedy outputs (prompt + the first k generated tokens, at
positions spread over the outputs; the last `fidelity_window` tokens kept, which bounds the cost
and weakens nothing, since exactness holds for every context), draw N samples of the first
`fidelity_tokens` emitted tokens with the speculative decoder and N with plain target sampling. Each
side is one batch of N copies of the context with per-row seeds, all distinct, so the 2N samples are
independent. Per context the joint values of those tokens are compared by total variation and by a
chi-square homogeneity test on the 2 x K table (rare values pooled); contexts are independent, so their
statistics and degrees of freedom add up to one pooled test, which passes when p >= fidelity_alpha.

A budget of fidelity_tokens = 2 lets the drafter propose one token per round (it never drafts past the
budget), so the check exercises draft position 1 plus the recovered/bonus token, the part of the
algorithm where a lossy verifier shows first.
"""

from __future__ import annotations

from collections import Counter

from draftsmith.eval.settings import EvalSettings, parse_mode
from draftsmith.eval.stats import chi_square_homogeneity, chi_square_p, pooled_table, total_variation
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.sampling import SamplingParams
from draftsmith.speculative.options import DecodeOptions


def make_contexts(prompts: list[list[int]], greedy_outputs: list[list[int]], count: int, window: int) -> list[dict]:
    """`count` contexts, cycling through the prompts, each cut at a different share of its output."""
    contexts = []
    for k in range(count):
        i = k % len(prompts)
        output = greedy_outputs[i]
        cut = int(len(output) * (k + 0.5) / count) if output else 0
        tokens = prompts[i] + output[:cut]
        if window:
            tokens = tokens[-window:]
        contexts.append({"prompt_index": i, "generated_prefix": cut, "tokens": tokens})
    return contexts


def fidelity_check(speculative: SpeculativeDecoder, plain: SpeculativeDecoder, contexts: list[dict], mode: str,
                   draft_len: int, settings: EvalSettings, progress=None) -> dict:
    n = settings.fidelity_samples
    base = parse_mode(mode)
    per_context, chi2_total, dof_total = [], 0.0, 0
    for c, context in enumerate(contexts):
        seed0 = (settings.seed + 1) * 1_000_003 + c * 2 * n
        spec = sample_counts(speculative, context["tokens"], base, seed0, n, settings.fidelity_tokens, draft_len)
        ref = sample_counts(plain, context["tokens"], base, seed0 + n, n, settings.fidelity_tokens, 0)
        table = pooled_table(spec, ref)
        chi2, dof = chi_square_homogeneity(table)
        chi2_total, dof_total = chi2_total + chi2, dof_total + dof
        per_context.append({
            "prompt_index": context["prompt_index"],
            "generated_prefix": context["generated_prefix"],
            "context_tokens": len(context["tokens"]),
            "distinct_values": len(set(spec) | set(ref)),
            "cells_after_pooling": table.shape[1],
            "tv": total_variation(spec, ref),
            "chi2": chi2,
            "dof": dof,
            "p_value": chi_square_p(chi2, dof),
        })
        if progress is not None:
            progress.update(1)
    p_value = chi_square_p(chi2_total, dof_total)
    return {
        "mode": mode,
        "draft_len": draft_len,
        "samples_per_side": n,
        "tokens_per_sample": settings.fidelity_tokens,
        "contexts": per_context,
        "mean_tv": sum(c["tv"] for c in per_context) / max(len(per_context), 1),
        "chi2": chi2_total,
        "dof": dof_total,
        "p_value": p_value,
        "alpha": settings.fidelity_alpha,
        "passed": p_value >= settings.fidelity_alpha,
    }


def sample_counts(decoder: SpeculativeDecoder, context: list[int], base: SamplingParams, seed0: int, n: int,
                  tokens: int, draft_len: int) -> Counter:
    """Counts of the joint value of the first `tokens` emitted tokens over n seeded rows (one batch)."""
    params = [SamplingParams(base.temperature, base.top_k, base.top_p, seed0 + r) for r in range(n)]
    result = decoder.generate([context] * n, params, options=DecodeOptions(max_new_tokens=tokens, draft_len=draft_len))
    return Counter(",".join(map(str, row)) for row in result.tokens)
