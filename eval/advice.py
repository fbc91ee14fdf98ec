"""Draft-length advice: which D to serve at each batch size, from a cost model fitted in this run.

Costs, timed directly with small loops of the real models at each batch size (median of
`timing_reps` after one warm-up; the context is each prompt padded to its length + max_new_tokens / 2,
a typical mid-decode cache):

    t_plain       one target forward over 1 new token per row (a plain decoding step)
    t_verify(D)   one target forward over D + 1 new tokens per row (a verification pass)
    t_draft       one drafter step over 1 new token per row (model drafters, EAGLE ones included); for drafters without a
                  model of their own (n-gram, Medusa heads) the sweep's measured draft time per round / D
    overhead      per round, outside the model passes (verification, bookkeeping), from the sweep's passes

Expected throughput, with E[AL](D) from the per-position acceptance measured at the largest D:

    plain (D = 0)  B / (t_plain + overhead_plain)
    D >= 1         B * E[AL](D) / (D * t_draft + t_verify(D) + overhead_spec)

The recommended D maximises it over 0 .. D_max (0 = do not speculate); positions past D_max were never
measured, so the model does not extrapolate beyond them. It is set beside the best D of the measured sweep,
and beside the adaptive row where there is one (the draft length chosen per request and round, which
`generate` and `serve` use by default: the fixed D the advice names is for a server run with it fixed).
"""

from __future__ import annotations

import statistics
import time

import torch

from draftsmith.eval.decoding import Pass
from draftsmith.eval.speed import round_overhead_s
from draftsmith.eval.stats import predicted_al
from draftsmith.speculative.kv import KVState
from draftsmith.speculative import kinds
from draftsmith.speculative.proposers import left_pad


@torch.inference_mode()
def measure_costs(target: torch.nn.Module, proposer, prompts: list[list[int]], batch_size: int, max_draft_len: int,
                  extra_context: int, reps: int) -> dict:
    contexts = [_padded(prompts[b % len(prompts)], extra_context) for b in range(batch_size)]
    target_kv = _prefilled(target, contexts)
    costs = {
        "plain_step_s": _time_step(target_kv, 1, reps),
        "verify_s": {d: _time_step(target_kv, d + 1, reps) for d in range(1, max_draft_len + 1)},
        "draft_step_s": None,
        "draft_step_source": "sweep",
    }
    model = kinds.of(proposer).draft_model(proposer) if proposer is not None else None
    if model is not None:
        # An EAGLE drafter also reads a feature per slot: zeros cost what real features cost.
        features = model.config.hidden_size * len(proposer.target_layers) if proposer.needs_target_states else None
        draft_kv = _prefilled(model, contexts, features)
        costs["draft_step_s"] = _time_step(draft_kv, 1, reps, logits_to_keep=1, features=features)
        costs["draft_step_source"] = "timed"
    return costs


def advise(costs: dict, alphas: list[float | None], spec_passes: list[Pass], plain: Pass, batch_size: int,
           adaptive: Pass | None = None) -> dict:
    """Expected tokens/s per D at one batch size and mode, the recommended D, and the measured sweep (and
    the adaptive pass, if any) beside it."""
    overhead_spec = statistics.mean(round_overhead_s(p) for p in spec_passes)
    overhead_plain = round_overhead_s(plain)
    draft_step = costs["draft_step_s"]
    if draft_step is None:  # no model to time: the sweep's draft time per drafted position
        draft_step = statistics.mean(
            sum(s.draft_s for s in p.calls) / max(p.batch_rounds, 1) / p.draft_len for p in spec_passes)
    expected = [{"draft_len": 0, "expected_al": 1.0,
                 "expected_tokens_per_s": batch_size / (costs["plain_step_s"] + overhead_plain)}]
    for d in range(1, len(alphas) + 1):
        al = predicted_al(alphas, d)
        round_s = d * draft_step + costs["verify_s"][d] + overhead_spec
        expected.append({"draft_len": d, "expected_al": al, "expected_tokens_per_s": batch_size * al / round_s})
    plain_rate = expected[0]["expected_tokens_per_s"]
    for row in expected:
        row["expected_speedup"] = row["expected_tokens_per_s"] / plain_rate
    measured = [{"draft_len": 0, "tokens_per_s": _rate(plain)}] + [
        {"draft_len": p.draft_len, "tokens_per_s": _rate(p)} for p in spec_passes]
    recommended = max(expected, key=lambda r: r["expected_tokens_per_s"])["draft_len"]
    best = max(measured, key=lambda r: r["tokens_per_s"])
    at_recommended = next((m["tokens_per_s"] for m in measured if m["draft_len"] == recommended), None)
    return {
        "mode": plain.mode,
        "batch_size": batch_size,
        "costs": {**costs, "draft_step_s": draft_step, "overhead_spec_s": overhead_spec,
                  "overhead_plain_s": overhead_plain},
        # the costs in units of one plain decoding step at this batch size
        "relative_costs": {"draft_step": draft_step / costs["plain_step_s"],
                           "verify": {d: v / costs["plain_step_s"] for d, v in costs["verify_s"].items()}},
        "expected": expected,
        "recommended_draft_len": recommended,
        "measured": measured,
        "measured_best_draft_len": best["draft_len"],
        "agrees": recommended == best["draft_len"],
        # measured tokens/s at the recommended D over the best measured (None: that D was not swept)
        "recommended_vs_best": (at_recommended / best["tokens_per_s"]
                                if at_recommended and best["tokens_per_s"] else None),
        # the adaptive draft length as measured: its most D, tokens/s, speedup over the plain pass, and its
        # tokens/s over the best of the fixed sweep (plain decoding included)
        "adaptive": None if adaptive is None else {
            "max_draft_len": adaptive.draft_len, "tokens_per_s": _rate(adaptive),
            "speedup": _rate(adaptive) / _rate(plain) if _rate(plain) else None,
            "vs_best_fixed": _rate(adaptive) / best["tokens_per_s"] if best["tokens_per_s"] else None},
    }


def _rate(p: Pass) -> float:
    return p.tokens / p.seconds if p.seconds > 0 else 0.0


def _padded(prompt: list[int], extra: int) -> list[int]:
    return prompt + [prompt[i % len(prompt)] for i in range(extra)]


def _prefilled(model: torch.nn.Module, contexts: list[list[int]], features: int | None = None) -> KVState:
    device = next(model.parameters()).device
    kv = KVState(model, len(contexts), device)
    tokens, valid = left_pad(contexts, device)
    kv.forward(tokens, valid, logits_to_keep=1, **_feature_inputs(kv, tokens, features))
    return kv


def _feature_inputs(kv: KVState, tokens: torch.Tensor, features: int | None) -> dict:
    """Zero features of width `features` per slot for a drafter that reads them (EAGLE), else nothing."""
    if features is None:
        return {}
    dtype = next(kv.model.parameters()).dtype
    return {"features": torch.zeros(*tokens.shape, features, dtype=dtype, device=kv.device)}


def _time_step(kv: KVState, width: int, reps: int, logits_to_keep: int = 0, features: int | None = None) -> float:
    """Median seconds of one forward over `width` new tokens per row; each is rolled back after timing."""
    tokens = torch.ones(kv.batch_size, width, dtype=torch.int64, device=kv.device)
    valid = torch.ones_like(tokens, dtype=torch.bool)
    drop = torch.zeros_like(valid)
    inputs = _feature_inputs(kv, tokens, features)
    times = []
    for rep in range(reps + 1):
        _sync(kv.device)
        start = time.perf_counter()
        kv.forward(tokens, valid, logits_to_keep=logits_to_keep, **inputs)
        _sync(kv.device)
        if rep:  # the first is the warm-up
            times.append(time.perf_counter() - start)
        kv.keep_last(drop)
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
