"""The statistics of the evaluation: bootstrap CIs, the AL a set of acceptance rates predicts, and a
pooled chi-square homogeneity test.

Acceptance length over a set of prompts is a ratio estimator, tokens emitted per target pass summed
over all prompts: sum_i emitted_i / sum_i rounds_i. Its CI resamples prompts (not rounds), because
rounds of one prompt are correlated; a paired difference resamples the same prompt indices on both sides.
"""

from __future__ import annotations

import numpy as np
from scipy import stats as scipy_stats

# Chi-square needs expected counts of about 5 per cell; categories whose two sides together hold fewer
# than this are pooled into one "other" cell (pooling keeps the test valid, it only loses power).
MIN_POOLED_COUNT = 10


def ratio(num: np.ndarray, den: np.ndarray) -> float:
    total = float(np.sum(den))
    return float(np.sum(num)) / total if total > 0 else float("nan")


def bootstrap_ratio_ci(num, den, *, resamples: int, confidence: float, seed: int) -> tuple[float, float]:
    """Percentile CI of sum(num) / sum(den), resampling the per-prompt pairs (num_i, den_i)."""
    num, den = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    if len(num) == 0:
        return float("nan"), float("nan")
    idx = np.random.default_rng(seed).integers(0, len(num), size=(resamples, len(num)))
    with np.errstate(invalid="ignore", divide="ignore"):
        values = num[idx].sum(axis=1) / den[idx].sum(axis=1)
    return _percentiles(values, confidence)


def bootstrap_mean_ci(values, *, resamples: int, confidence: float, seed: int) -> tuple[float, float]:
    values = np.asarray(values, dtype=float)
    return bootstrap_ratio_ci(values, np.ones_like(values), resamples=resamples, confidence=confidence, seed=seed)


def paired_ratio_change(num_old, den_old, num_new, den_new, *, resamples: int, confidence: float,
                        seed: int) -> dict:
    """Change of a ratio estimator between two paired samples (same prompts, same order).

    Returns the absolute change (new - old) and the relative change (new / old - 1), each with a
    percentile CI from resampling prompt indices jointly on both sides.
    """
    arrays = [np.asarray(a, dtype=float) for a in (num_old, den_old, num_new, den_new)]
    old, new = ratio(arrays[0], arrays[1]), ratio(arrays[2], arrays[3])
    idx = np.random.default_rng(seed).integers(0, len(arrays[0]), size=(resamples, len(arrays[0])))
    with np.errstate(invalid="ignore", divide="ignore"):
        old_b = arrays[0][idx].sum(1) / arrays[1][idx].sum(1)
        new_b = arrays[2][idx].sum(1) / arrays[3][idx].sum(1)
    return {
        "old": old,
        "new": new,
        "change": new - old,
        "change_ci": list(_percentiles(new_b - old_b, confidence)),
        "relative": new / old - 1 if old > 0 else float("nan"),
        "relative_ci": list(_percentiles(new_b / old_b - 1, confidence)),
    }


def predicted_al(rates: list[float | None], draft_len: int) -> float:
    """E[AL](D) = 1 + sum_{i=1..D} prod_{j<=i} alpha_j, from conditional acceptance rates alpha_j.

    A position never offered (rate None) ends the product: nothing beyond it is known to be accepted.
    """
    expected, reach = 1.0, 1.0
    for rate in rates[:draft_len]:
        if rate is None:
            break
        reach *= rate
        expected += reach
    return expected


def pooled_table(a: dict, b: dict) -> np.ndarray:
    """A 2 x K table of counts for two samples of categories, rare categories pooled (see MIN_POOLED_COUNT)."""
    keys = sorted(set(a) | set(b), key=lambda k: -(a.get(k, 0) + b.get(k, 0)))
    kept = [k for k in keys if a.get(k, 0) + b.get(k, 0) >= MIN_POOLED_COUNT]
    rare = [k for k in keys if k not in kept]
    columns = [[a.get(k, 0), b.get(k, 0)] for k in kept]
    if rare:
        other = [sum(a.get(k, 0) for k in rare), sum(b.get(k, 0) for k in rare)]
        if sum(other) >= MIN_POOLED_COUNT or not columns:
            columns.append(other)
        else:  # too small even pooled: fold it into the smallest kept category
            columns[-1] = [columns[-1][0] + other[0], columns[-1][1] + other[1]]
    return np.array(columns, dtype=float).T.reshape(2, -1)


def chi_square_homogeneity(table: np.ndarray) -> tuple[float, int]:
    """Pearson chi-square statistic and degrees of freedom for a 2 x K table (no continuity correction)."""
    if table.shape[1] < 2:
        return 0.0, 0
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    statistic = float(((table - expected) ** 2 / np.where(expected > 0, expected, 1)).sum())
    return statistic, table.shape[1] - 1


def chi_square_p(statistic: float, dof: int) -> float:
    return float(scipy_stats.chi2.sf(statistic, dof)) if dof > 0 else 1.0


def total_variation(a: dict, b: dict) -> float:
    """TV distance between the empirical distributions of two count dictionaries (unpooled)."""
    na, nb = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a.get(k, 0) / na - b.get(k, 0) / nb) for k in set(a) | set(b))


def percentile(values, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def _percentiles(values: np.ndarray, confidence: float) -> tuple[float, float]:
    values = values[np.isfinite(values)]
    if len(values) == 0:
        return float("nan"), float("nan")
    tail = (1 - confidence) / 2 * 100
    return float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))
