"""Speed figures of speculative and plain passes measured in the same run.

Per (mode, batch size, decoder, D):
- tokens_per_s: generated tokens / summed wall time of the `generate` calls (prefill included);
- time to first token: per prompt, from the start of its `generate` call to its first emission;
- per-token latency p50/p95/p99 in ms, pooled over all tokens after each prompt's first emission,
  with the tokens of one emission sharing its wait evenly (see decoding.Trace.token_gaps);
- compute_s_per_1k_tokens: device-seconds spent per 1,000 generated tokens (1000 / tokens_per_s; one
  device, so the batch shares it);
- speedup: tokens_per_s over the plain pass of the same mode and batch size.

The adaptive row (decoder "adaptive", D its most per round) decodes as `draftsmith generate` and `serve`
do by default; mean_draft_len says how much it drafted. `by_category` sets each batch-size-1 row beside
plain decoding per prompt category, with a CI from resampling prompts (plain and speculative paired on
the same prompts): the question "is the default ever slower than not drafting at all?".
"""

from __future__ import annotations

import numpy as np

from draftsmith.eval.decoding import Pass
from draftsmith.eval.settings import EvalSettings
from draftsmith.eval.stats import paired_ratio_change, percentile

# A percentile bootstrap over fewer prompts than this is no confidence interval (over 2 prompts it spans little
# more than their two ratios): such a category keeps its figures but gets no slower / faster verdict.
MIN_PROMPTS_FOR_VERDICT = 5


def speed_row(decoded: Pass, plain: Pass | None) -> dict:
    seconds, tokens = decoded.seconds, decoded.tokens
    rate = tokens / seconds if seconds > 0 else 0.0
    ttft = [t.first_token_s for t in decoded.traces if t.first_token_s is not None]
    gaps = np.array([g for t in decoded.traces for g in t.token_gaps()]) * 1000
    row = {
        "mode": decoded.mode,
        "batch_size": decoded.batch_size,
        "decoder": decoded.decoder,
        "draft_len": decoded.draft_len,  # the adaptive row: the most it drafts per round
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": rate,
        "ttft_s": {"mean": float(np.mean(ttft)) if ttft else None, "p50": percentile(ttft, 50),
                   "p95": percentile(ttft, 95)},
        "latency_ms": {"p50": percentile(gaps, 50), "p95": percentile(gaps, 95), "p99": percentile(gaps, 99)},
        "compute_s_per_1k_tokens": 1000 * seconds / tokens if tokens else None,
        "al": _pooled_al(decoded) if decoded.draft_len else 1.0,
        "mean_draft_len": _mean_draft_len(decoded),
        "time_split_s": _time_split(decoded),
    }
    if plain is not None and plain.seconds > 0 and seconds > 0:
        row["speedup"] = rate / (plain.tokens / plain.seconds)
    return row


def _pooled_al(decoded: Pass) -> float:
    emitted = sum(sum(k * n for k, n in enumerate(s.emitted_hist)) for s in decoded.calls)
    rounds = sum(s.rounds for s in decoded.calls)
    return emitted / rounds if rounds else float("nan")


def _mean_draft_len(decoded: Pass) -> float:
    """Draft tokens proposed per row round (D at a fixed length; less when adaptive or confidence-stopped)."""
    rounds = sum(s.rounds for s in decoded.calls)
    return sum(s.drafted for s in decoded.calls) / rounds if rounds else 0.0


def by_category(decoded: Pass, plain: Pass, categories: list[str], settings: EvalSettings, seed: int) -> dict:
    """Speedup of a batch-size-1 pass over plain decoding of the same prompts, over all prompts and per
    category: tokens/s summed per side (tokens over seconds, prefill included), with a CI from resampling
    prompts jointly on both sides. A category is `slower` only when its whole CI lies below 1, `faster`
    when it lies above; in between the prompts cannot tell it from plain decoding, and with fewer than
    MIN_PROMPTS_FOR_VERDICT prompts there is no verdict. Each prompt is decoded once per side (the sides
    taking turns, decoding.decode_passes), so the CI holds the timing noise only as far as it differs from
    prompt to prompt."""
    assert decoded.batch_size == plain.batch_size == 1, "per-prompt timings need batch-size-1 passes"
    by_index = {t.index: t for t in plain.traces}
    units = [(categories[t.index] or "(none)", by_index[t.index].stats, t.stats) for t in decoded.traces]
    groups = {"all": units}
    if any(c for c in categories):
        for name in sorted({u[0] for u in units}):
            groups[name] = [u for u in units if u[0] == name]
    out = {}
    for name, rows in groups.items():
        change = paired_ratio_change([p.new_tokens for _, p, _ in rows], [p.total_s for _, p, _ in rows],
                                     [s.new_tokens for _, _, s in rows], [s.total_s for _, _, s in rows],
                                     resamples=settings.bootstrap, confidence=settings.confidence, seed=seed)
        low, high = (1 + v for v in change["relative_ci"])
        verdict = ("too few prompts" if len(rows) < MIN_PROMPTS_FOR_VERDICT else "slower" if high < 1
                   else "faster" if low > 1 else "not told apart")
        out[name] = {"prompts": len(rows), "plain_tokens_per_s": change["old"], "tokens_per_s": change["new"],
                     "speedup": 1 + change["relative"], "speedup_ci": [low, high], "verdict": verdict}
    return {"mode": decoded.mode, "decoder": decoded.decoder, "draft_len": decoded.draft_len,
            "all": out.pop("all"), "categories": out,
            "slower": [name for name, c in out.items() if c["verdict"] == "slower"],
            "too_few_prompts": [name for name, c in out.items() if c["verdict"] == "too few prompts"]}


def _time_split(decoded: Pass) -> dict:
    parts = ("prefill_s", "draft_s", "target_s", "verify_s", "other_s")
    return {p.removesuffix("_s"): sum(getattr(s, p) for s in decoded.calls) for p in parts}


def round_overhead_s(decoded: Pass) -> float:
    """Seconds per batch round spent outside the model passes (verification, bookkeeping)."""
    rounds = decoded.batch_rounds
    spent = sum(s.verify_s + s.other_s for s in decoded.calls)
    return spent / rounds if rounds else 0.0
