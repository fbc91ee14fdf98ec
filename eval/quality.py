"""Quality of the generated text: the target's NLL per token and, where the prompts carry references,
ROUGE-L F1 against them, for plain and speculative outputs of every mode.

Both metrics are `evaluate` modules shipped in eval/metrics/ and loaded from their local path, so they
work offline. Exact decoding changes no distribution: greedy speculative outputs are the plain ones
token for token, and sampled ones agree with plain sampling up to sampling noise (the CIs say how much).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from draftsmith.eval.decoding import Pass
from draftsmith.eval.settings import EvalSettings
from draftsmith.eval.stats import bootstrap_mean_ci, bootstrap_ratio_ci

METRICS_DIR = Path(__file__).resolve().parent / "metrics"


def load_metric(name: str):
    """An evaluate module shipped with draftsmith (eval/metrics/<name>/<name>.py), loaded offline."""
    import evaluate  # slow to import; only the quality step needs it

    return evaluate.load(str(METRICS_DIR / name), keep_in_memory=True)


class QualityScorer:
    def __init__(self, target, tokenizer, prompts: list[list[int]], references: list[str], settings: EvalSettings):
        self.target, self.tokenizer, self.prompts = target, tokenizer, prompts
        self.references = references
        self.settings = settings
        self.nll = load_metric("nll")
        self.rouge = load_metric("rouge_l") if any(r.strip() for r in references) else None

    def score(self, decoded: Pass, plain: Pass | None, seed: int) -> dict:
        outputs = decoded.outputs()
        boot = dict(resamples=self.settings.bootstrap, confidence=self.settings.confidence, seed=seed)
        nll = self.nll.compute(prompt_ids=[self.prompts[t.index] for t in decoded.traces], completion_ids=outputs,
                               model=self.target)
        row = {
            "mode": decoded.mode,
            "decoder": decoded.decoder,
            "draft_len": decoded.draft_len,
            "nll_per_token": nll["nll_per_token"],
            "nll_ci": list(bootstrap_ratio_ci(nll["nll_sums"], nll["token_counts"], **boot)),
            "reference_metric": None,
        }
        if plain is not None:
            row["identical_to_plain"] = sum(a == b for a, b in zip(outputs, plain.outputs()))
        if self.rouge is not None:
            scored = [(self.text(t.tokens), self.references[t.index]) for t in decoded.traces
                      if self.references[t.index].strip()]
            result = self.rouge.compute(predictions=[p for p, _ in scored], references=[r for _, r in scored])
            row["reference_metric"] = {
                "name": "rougeL_f1",
                "value": result["rougeL_f1"],
                "ci": list(bootstrap_mean_ci(np.array(result["scores"]), **boot)),
                "prompts": len(scored),
            }
        return row

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)
