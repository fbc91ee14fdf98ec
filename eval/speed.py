"""Speed figures of speculative and plain passes measured in the same run.

Per (mode, batch size, decoder, D):
- tokens_per_s: generated tokens / summed wall time of the `generate` calls (prefill included);
- time to first token: per prompt, from the start of its `generate` call to its first emission;
- per-token latency p50/p95/p99 in ms, pooled over all tokens after each prompt's first emission,
  with the tokens of one emission sharing its wait evenly (see decoding.Trace.token_gaps);
- compute_s_per_1k_tokens: device-seconds spent per 1,000 generated tokens (1000 / tokens_per_s; one
  device, so the batch shares it);
- speedup: tokens_per_s over the plain pass of the same mode and batch size.
"""

from __future__ import annotations

import numpy as np

from draftsmith.eval.decoding import Pass
from draftsmith.eval.stats import percentile


def speed_row(decoded: Pass, plain: Pass | None) -> dict:
    seconds, tokens = decoded.seconds, decoded.tokens
    rate = tokens / seconds if seconds > 0 else 0.0
    ttft = [t.first_token_s for t in decoded.traces if t.first_token_s is not None]
    gaps = np.array([g for t in decoded.traces for g in t.token_gaps()]) * 1000
    row = {
        "mode": decoded.mode,
        "batch_size": decoded.batch_size,
        "decoder": "speculative" if decoded.draft_len else "plain",
        "draft_len": decoded.draft_len,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": rate,
        "ttft_s": {"mean": float(np.mean(ttft)) if ttft else None, "p50": percentile(ttft, 50),
                   "p95": percentile(ttft, 95)},
        "latency_ms": {"p50": percentile(gaps, 50), "p95": percentile(gaps, 95), "p99": percentile(gaps, 99)},
        "compute_s_per_1k_tokens": 1000 * seconds / tokens if tokens else None,
        "al": _pooled_al(decoded) if decoded.draft_len else 1.0,
        "time_split_s": _time_split(decoded),
    }
    if plain is not None and plain.seconds > 0 and seconds > 0:
        row["speedup"] = rate / (plain.tokens / plain.seconds)
    return row


def _pooled_al(decoded: Pass) -> float:
    emitted = sum(sum(k * n for k, n in enumerate(s.emitted_hist)) for s in decoded.calls)
    rounds = sum(s.rounds for s in decoded.calls)
    return emitted / rounds if rounds else float("nan")


def _time_split(decoded: Pass) -> dict:
    parts = ("prefill_s", "draft_s", "target_s", "verify_s", "other_s")
    return {p.removesuffix("_s"): sum(getattr(s, p) for s in decoded.calls) for p in parts}


def round_overhead_s(decoded: Pass) -> float:
    """Seconds per batch round spent outside the model passes (verification, bookkeeping)."""
    rounds = decoded.batch_rounds
    spent = sum(s.verify_s + s.other_s for s in decoded.calls)
    return spent / rounds if rounds else 0.0
