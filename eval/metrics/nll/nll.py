"""Negative log-likelihood per token of completions under a causal LM, as an `evaluate` module.

Shipped with draftsmith and loaded offline from its path: `evaluate.load("<draftsmith>/eval/metrics/nll")`.

Inputs: `prompt_ids` and `completion_ids` (token id lists, one pair per sample); `model=` a Hugging Face
causal LM (passed to `compute`, not stored). The model scores each completion token given the prompt
and the completion before it, with its raw (temperature 1, unfiltered) distribution.

Output: `nll_per_token` (nats, summed over all completion tokens of all samples / their count),
`nll_sums` and `token_counts` per sample (for bootstrap CIs over samples).
"""

import datasets
import evaluate
import torch

_DESCRIPTION = "Negative log-likelihood per token (nats) of completions under a causal LM."
_KWARGS_DESCRIPTION = """
Args:
    prompt_ids: list of token id lists (the context of each completion)
    completion_ids: list of token id lists (the scored tokens)
    model: a causal LM (torch.nn.Module returning `.logits`)
Returns:
    nll_per_token: float, nll_sums: list of float, token_counts: list of int
"""


class Nll(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({
                "prompt_ids": datasets.Sequence(datasets.Value("int64")),
                "completion_ids": datasets.Sequence(datasets.Value("int64")),
            }),
        )

    def _compute(self, prompt_ids, completion_ids, model=None):
        if model is None:
            raise ValueError("nll needs model= (a causal LM)")
        sums, counts = [], []
        for prompt, completion in zip(prompt_ids, completion_ids):
            sums.append(completion_nll(model, list(prompt), list(completion)))
            counts.append(len(completion))
        total = sum(counts)
        return {"nll_per_token": sum(sums) / total if total else float("nan"), "nll_sums": sums,
                "token_counts": counts}


@torch.inference_mode()
def completion_nll(model, prompt, completion):
    """Summed NLL (nats) of `completion` after `prompt`; 0 for an empty completion."""
    if not completion:
        return 0.0
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + completion], device=device)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [len(completion), V]
    logp = torch.log_softmax(logits, dim=-1)
    target = torch.tensor(completion, device=device)[:, None]
    return float(-logp.gather(-1, target).sum())
