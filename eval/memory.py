"""Memory: a ledger computed from the configs, beside the measured peak.

KV cache bytes = 2 (keys and values) * layers * kv_heads * head_dim * context * batch * bytes per element,
at context = the longest prompt + max_new_tokens + D_max (the verification slots of the last round): the
slots the serving engine reserves for one running request (`Engine.need`, priced by `Engine.ledger()` with
the same per-token figures), so each row also gives the target's and the drafter's KV per active request.
Weights are counted once per tensor (tied embeddings once); an early-exit drafter shares the target's
weights, so it adds none; n-gram lookup holds neither weights nor a cache.

Measured: on CUDA, torch.cuda.max_memory_allocated (reset before each batch size's passes); on CPU the
process's peak resident set (getrusage ru_maxrss), which only grows, so the figure after each batch size
is the peak so far, including the Python runtime and libraries.
"""

from __future__ import annotations

import resource
import sys

import torch

from draftsmith.speculative import kinds
from draftsmith.speculative.kinds import kv_bytes_per_token, weight_bytes
from draftsmith.speculative.proposers import Proposer


def ledger(target: torch.nn.Module, proposer: Proposer | None, context_len: int, batch_sizes: list[int]) -> list[dict]:
    element = next(target.parameters()).element_size()
    target_weights = weight_bytes(target)
    drafter_weights, drafter_kv_per_token, sharing = _drafter_footprint(target, proposer)
    rows = []
    target_per_request = kv_bytes_per_token(target.config, element_size=element) * context_len
    drafter_per_request = drafter_kv_per_token * context_len
    for batch in batch_sizes:
        target_kv, drafter_kv = target_per_request * batch, drafter_per_request * batch
        rows.append({
            "batch_size": batch,
            "context_len": context_len,
            "target_weights": target_weights,
            "drafter_weights": drafter_weights,
            "drafter_weights_note": sharing,
            "target_kv": target_kv,
            "drafter_kv": drafter_kv,
            "target_kv_per_request": target_per_request,
            "drafter_kv_per_request": drafter_per_request,
            "total": target_weights + drafter_weights + target_kv + drafter_kv,
        })
    return rows


def _drafter_footprint(target, proposer) -> tuple[int, int, str]:
    """(extra weight bytes, KV bytes per token, a note on sharing) of a drafter, from its kind."""
    if proposer is None:
        return 0, 0, "none (plain decoding)"
    footprint = kinds.of(proposer).footprint(proposer, target)
    return footprint.weight_bytes, footprint.kv_bytes_per_token, footprint.note


class PeakMemory:
    """The peak memory of the decoding, per batch size (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.rows: list[dict] = []

    @property
    def kind(self) -> str:
        return "cuda_max_memory_allocated" if self.device.type == "cuda" else "process_peak_rss"

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def record(self, batch_size: int) -> None:
        self.rows.append({"batch_size": batch_size, "peak_bytes": self.peak_bytes()})

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux

    def to_dict(self) -> dict:
        record = {"kind": self.kind, "per_batch_size": self.rows}
        try:  # the current resident set too, where psutil is installed
            import psutil

            record["rss_bytes_at_end"] = psutil.Process().memory_info().rss
        except ImportError:
            pass
        return record
