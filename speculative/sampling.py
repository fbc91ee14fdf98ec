"""Logits processing shared by the drafter and the target.

Exact speculative sampling preserves the target's *processed* distribution only if the drafter's
distribution q and the target's distribution p go through the very same processing. Everything that
turns logits into a distribution lives here, and both sides call it:

    temperature -> top-k -> top-p      (the order Hugging Face `generate` applies them)

Conventions, fixed once for the whole package:
- temperature 0 means greedy: the distribution is one-hot at the argmax.
- argmax ties go to the lowest token index (`torch.argmax` returns the first maximum).
- top-k keeps every token whose logit is >= the k-th largest logit (ties at the boundary are kept).
- top-p keeps the smallest prefix of tokens, sorted by probability descending (ties: lower index first),
  whose mass reaches top_p; the most likely token is always kept.
- sampling from a (possibly unnormalised) non-negative weight vector w is an exponential race:
  argmax_v w_v / E_v with E_v ~ Exp(1) i.i.d.; this picks v with probability w_v / sum(w) and needs no
  normalisation, which is also how the fused kernel samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.speculative.errors import InvalidInputError


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1 = no nucleus filter
    seed: int = 0  # per-request seed; the same seed repeats the same output

    def __post_init__(self):
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise InvalidInputError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidInputError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidInputError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class BatchSampling:
    """Per-row sampling parameters as tensors, so greedy and sampled rows mix in one batch."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32, 1 = off

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device | str = "cpu") -> "BatchSampling":
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        )

    @property
    def greedy(self) -> torch.Tensor:  # [B] bool
        return self.temperature == 0

    def select(self, rows: torch.Tensor) -> "BatchSampling":
        return BatchSampling(self.temperature[rows], self.top_k[rows], self.top_p[rows])

    def extend(self, other: "BatchSampling") -> "BatchSampling":
        """These rows, then the rows of `other` (requests joining the batch)."""
        return BatchSampling(torch.cat([self.temperature, other.temperature]), torch.cat([self.top_k, other.top_k]),
                             torch.cat([self.top_p, other.top_p]))

    def to(self, device) -> "BatchSampling":
        return BatchSampling(self.temperature.to(device), self.top_k.to(device), self.top_p.to(device))


def filter_logits(
    logits: torch.Tensor,  # [B, T, V] any float dtype
    temperature: torch.Tensor,  # [B]
    top_k: torch.Tensor,  # [B]
    top_p: torch.Tensor,  # [B]
) -> torch.Tensor:  # [B, T, V] float32: logits / temperature, -inf outside the allowed set
    """Temperature, then top-k, then top-p; greedy rows (temperature 0) come back unscaled."""
    x = logits.float()
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    x = x / t[:, None, None]
    vocab = x.shape[-1]
    if bool(((top_k > 0) & (top_k < vocab)).any()):
        x = _mask_top_k(x, top_k)
    if bool((top_p < 1.0).any()):
        x = _mask_top_p(x, top_p)
    return x


def _mask_top_k(x: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    vocab = x.shape[-1]
    active = (top_k > 0) & (top_k < vocab)  # [B]
    k = torch.where(active, top_k, torch.ones_like(top_k)).clamp(max=vocab)
    kmax = int(k.max())
    top_values = torch.topk(x, kmax, dim=-1).values  # [B, T, kmax]; values are unique whatever the tie order
    kth = top_values.gather(-1, (k - 1)[:, None, None].expand(-1, x.shape[1], 1))  # [B, T, 1]
    drop = (x < kth) & active[:, None, None]
    return x.masked_fill(drop, float("-inf"))


def _mask_top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    active = top_p < 1.0  # [B]
    probs = torch.softmax(x, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p[:, None, None]  # the first token has mass_before 0 and stays
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    drop &= active[:, None, None]
    return x.masked_fill(drop, float("-inf"))


def processed_probs(
    logits: torch.Tensor,  # [B, T, V]
    sampling: BatchSampling,
) -> torch.Tensor:  # [B, T, V] float32
    """The distribution a row samples from: softmax of the filtered logits; one-hot argmax for greedy rows."""
    filtered = filter_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    probs = torch.softmax(filtered, dim=-1)
    greedy = sampling.greedy
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None, None], one_hot, probs)
    return probs


def race_sample(
    weights: torch.Tensor,  # [..., V] non-negative, need not be normalised
    exp_noise: torch.Tensor,  # [..., V] Exp(1) samples, > 0
) -> torch.Tensor:  # [...] int64
    """Sample v with probability weights_v / sum(weights) (exponential race; lowest index wins ties)."""
    return (weights / exp_noise).argmax(dim=-1)
