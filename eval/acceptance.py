"""Acceptance figures from batch-size-1 speculative passes.

Per (mode, D): the mean AL over all rounds of all prompts (tokens emitted per target pass, bonus or
recovered token included) with a bootstrap CI over prompts; the histogram of tokens emitted per round;
the per-position conditional acceptance rates alpha_i = accepted_i / offered_i with CIs; the AL these
rates predict, E[AL](D) = 1 + sum_i prod_{j<=i} alpha_j (lower measured ALs than predicted come from
rounds whose draft the token budget shortened); and the same AL split by prompt category.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from draftsmith.eval.decoding import Pass
from draftsmith.eval.settings import EvalSettings
from draftsmith.eval.stats import bootstrap_ratio_ci, predicted_al, ratio


def per_prompt_records(spec_pass: Pass, ids: list[str], categories: list[str]) -> list[dict]:
    """One record per prompt of a batch-size-1 pass: the raw counts a later comparison pairs up."""
    records = []
    for trace in spec_pass.traces:
        s = trace.stats
        records.append({
            "id": ids[trace.index],
            "category": categories[trace.index],
            "mode": spec_pass.mode,
            "draft_len": spec_pass.draft_len,
            "rounds": s.rounds,
            "emitted": sum(k * n for k, n in enumerate(s.emitted_hist)),
            "emitted_hist": list(s.emitted_hist),
            "offered": list(s.offered),
            "accepted": list(s.accepted),
            "leaf_accepts": s.leaf_accepts,
            "new_tokens": s.new_tokens,
            "finish": trace.finish,
            "output_sha": trace.output_sha(),
        })
    return records


def summarize(records: list[dict], settings: EvalSettings, seed: int) -> dict:
    """The acceptance figures of one (mode, D) from its per-prompt records."""
    draft_len = records[0]["draft_len"]
    emitted = np.array([r["emitted"] for r in records], dtype=float)
    rounds = np.array([r["rounds"] for r in records], dtype=float)
    boot = dict(resamples=settings.bootstrap, confidence=settings.confidence)
    hist = np.sum([r["emitted_hist"] for r in records], axis=0).astype(int).tolist()
    positions = position_rates(records, settings, seed)
    rates = [p["rate"] for p in positions]
    return {
        "mode": records[0]["mode"],
        "draft_len": draft_len,
        "prompts": len(records),
        "rounds": int(rounds.sum()),
        "tokens": int(sum(r["new_tokens"] for r in records)),
        "al": ratio(emitted, rounds),
        "al_ci": list(bootstrap_ratio_ci(emitted, rounds, seed=seed, **boot)),
        "predicted_al": predicted_al(rates, draft_len),
        "emitted_hist": hist,  # [D + 2]: rounds that emitted k tokens, k = 0 .. D + 1 (k = 0 never happens)
        "emitted_share": [n / max(sum(hist), 1) for n in hist],
        # --draft-alternatives: share of rounds in which a sibling leaf replaced a rejected draft token
        "leaf_share": sum(r.get("leaf_accepts", 0) for r in records) / max(int(rounds.sum()), 1),
        "positions": positions,
        "by_category": by_category(records, settings, seed),
    }


def position_rates(records: list[dict], settings: EvalSettings, seed: int) -> list[dict]:
    offered = np.array([r["offered"] for r in records], dtype=float)  # [prompts, D]
    accepted = np.array([r["accepted"] for r in records], dtype=float)
    out = []
    for i in range(offered.shape[1]):
        total = int(offered[:, i].sum())
        ci = bootstrap_ratio_ci(accepted[:, i], offered[:, i], resamples=settings.bootstrap,
                                confidence=settings.confidence, seed=seed + i + 1)
        out.append({
            "position": i + 1,
            "offered": total,
            "accepted": int(accepted[:, i].sum()),
            "rate": float(accepted[:, i].sum() / total) if total else None,
            "rate_ci": list(ci) if total else None,
        })
    return out


def by_category(records: list[dict], settings: EvalSettings, seed: int) -> dict:
    """AL per prompt category; empty when the prompt set has no categories."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        groups[r["category"]].append(r)
    if set(groups) <= {""}:
        return {}
    out = {}
    for name in sorted(groups):
        rows = groups[name]
        emitted = [r["emitted"] for r in rows]
        rounds = [r["rounds"] for r in rows]
        out[name or "(none)"] = {
            "prompts": len(rows),
            "al": ratio(np.array(emitted), np.array(rounds)),
            "al_ci": list(bootstrap_ratio_ci(emitted, rounds, resamples=settings.bootstrap,
                                             confidence=settings.confidence, seed=seed)),
        }
    return out
