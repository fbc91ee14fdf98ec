"""ROUGE-L F1 (Lin 2004) between predictions and references, as an `evaluate` module.

Shipped with draftsmith and loaded offline from its path: `evaluate.load("<draftsmith>/eval/metrics/rouge_l")`.

Words are lower-cased runs of letters and digits (`\\w+`, Unicode aware); no stemming, no stop words.
Per pair: P = LCS / len(prediction), R = LCS / len(reference), F1 = 2PR / (P + R) (0 when either is empty).
Output: `rougeL_f1` (mean over pairs) and `scores` (per pair).
"""

import re

import datasets
import evaluate

_WORD = re.compile(r"\w+", re.UNICODE)
_DESCRIPTION = "ROUGE-L F1 on lower-cased word tokens, computed in-process (no downloads)."
_KWARGS_DESCRIPTION = """
Args:
    predictions: list of str
    references: list of str
Returns:
    rougeL_f1: float (mean), scores: list of float
"""


class RougeL(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="Lin, ROUGE: A Package for Automatic Evaluation of Summaries, 2004",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}),
        )

    def _compute(self, predictions, references):
        scores = [rouge_l_f1(p, r) for p, r in zip(predictions, references)]
        return {"rougeL_f1": sum(scores) / len(scores) if scores else float("nan"), "scores": scores}


def words(text):
    return _WORD.findall(text.lower())


def lcs_length(a, b):
    """Length of the longest common subsequence (O(len(a) * len(b)) time, O(len(b)) memory)."""
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def rouge_l_f1(prediction, reference):
    p, r = words(prediction), words(reference)
    if not p or not r:
        return 0.0
    lcs = lcs_length(p, r)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(p), lcs / len(r)
    return 2 * precision * recall / (precision + recall)
