"""Distillation losses between the drafter's distribution q and the target's p (DistillSpec, Zhou et al. 2023).

All functions take logits over the vocabulary at the positions that count and return the mean over
those positions:

    ce    cross-entropy on hard labels (the target's tokens)                 -log q(y)
    fkl   forward KL(p || q) = sum p (log p - log q)      mass-covering
    rkl   reverse KL(q || p) = sum q (log q - log p)      mode-seeking
    jsd   JSD_beta = beta KL(p || m) + (1 - beta) KL(q || m),  m = beta p + (1 - beta) q
    tv    total variation 0.5 sum |p - q|, the quantity speculative acceptance depends on directly:
          P(accept) = 1 - TV(p, q) for one drafted token

Both sides are softened by the same temperature. A teacher given as probabilities (an offline cache of
renormalised top-k log-probs) works for every divergence; tokens outside the top-k have p = 0, and the
terms that take log p use a floor so that q's mass there is penalised rather than undefined.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from draftsmith.speculative.kinds import top1_agreement  # noqa: F401  (the metric the kinds report)

LOG_FLOOR = 1e-8


def distill_loss(
    kind: str,
    student_logits: torch.Tensor,  # [N, V]
    *,
    labels: torch.Tensor | None = None,  # [N] int64 hard labels, for "ce"
    teacher_logits: torch.Tensor | None = None,  # [N, V]
    teacher_probs: torch.Tensor | None = None,  # [N, V], instead of teacher_logits
    teacher: TeacherDistribution | None = None,  # `teacher_distribution(teacher_logits)`, instead of both
    temperature: float = 1.0,
    beta: float = 0.5,
) -> torch.Tensor:
    if student_logits.shape[0] == 0:
        return student_logits.sum() * 0.0  # keeps the graph (and DDP) happy on an empty batch
    if kind == "ce":
        if not bool((labels != -100).any()):  # every label ignored (outside a draft vocabulary)
            return student_logits.sum() * 0.0
        return F.cross_entropy(student_logits.float(), labels)
    if kind not in ("fkl", "rkl", "jsd", "tv"):
        raise ValueError(f"unknown loss kind {kind!r}")
    log_q = F.log_softmax(_scaled(student_logits.float(), temperature), dim=-1)
    if teacher_probs is None:
        log_p, p = teacher if teacher is not None else teacher_distribution(teacher_logits, temperature)
    else:
        p = soften(teacher_probs.float(), temperature)
        log_p = p.clamp(min=LOG_FLOOR).log()
    if kind == "fkl":
        per_token = (p * (log_p - log_q)).sum(-1)
    else:
        q = log_q.exp()
        if kind == "rkl":
            per_token = (q * (log_q - log_p)).sum(-1)
        elif kind == "jsd":
            m = beta * p + (1 - beta) * q
            log_m = m.clamp(min=LOG_FLOOR).log()
            per_token = beta * (p * (log_p - log_m)).sum(-1) + (1 - beta) * (q * (log_q - log_m)).sum(-1)
        else:
            per_token = 0.5 * (p - q).abs().sum(-1)
    # Hinton et al.: scale by T^2 so gradients keep their size across temperatures (not for TV).
    scale = temperature ** 2 if kind in ("fkl", "rkl", "jsd") else 1.0
    return per_token.mean() * scale


class TeacherDistribution(NamedTuple):
    log_p: torch.Tensor  # [N, V] float32
    p: torch.Tensor  # [N, V] float32


@torch.no_grad()
def teacher_distribution(teacher_logits: torch.Tensor, temperature: float = 1.0) -> TeacherDistribution:
    """The teacher's log-probabilities and probabilities at `temperature`, float32: computed once, they
    serve every divergence against the same teacher (an objective's several draft steps)."""
    log_p = F.log_softmax(_scaled(teacher_logits.float(), temperature), dim=-1)
    return TeacherDistribution(log_p, log_p.exp())


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits if temperature == 1.0 else logits / temperature


def soften(probs: torch.Tensor, temperature: float) -> torch.Tensor:
    """p^(1/T), renormalised: the temperature-T version of a distribution given as probabilities."""
    if temperature == 1.0:
        return probs
    powered = probs.clamp(min=0) ** (1.0 / temperature)
    return powered / powered.sum(-1, keepdim=True).clamp(min=LOG_FLOOR)
