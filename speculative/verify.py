"""Verification: which draft tokens the target keeps, and the token it adds.

Terms, used the same way everywhere in draftsmith:
- draft tokens: the D_b <= D tokens the drafter proposed for row b this round (D_b may be 0).
- accepted tokens: the longest prefix of the draft that the target keeps (n_b of them).
- recovered token: when draft token n_b + 1 is rejected, the target's replacement for it, sampled from
  norm(max(0, p - q)) at that position (greedy: the target's argmax).
- bonus token: when all D_b draft tokens are accepted, one more token sampled from the target at the
  position after the draft.
- acceptance length (AL): tokens emitted per target pass, n_b + 1, counting the recovered/bonus token;
  it lies in 1 .. D_b + 1.

Sampled rows follow Leviathan et al. 2023 / Chen et al. 2023: token i is accepted when u_i * q_i < p_i
and q_i > 0 (no division; q_i = 0 never accepts, p_i = 0 always rejects). Greedy rows (temperature 0) accept
while the draft token equals the target's argmax (lowest index on ties). When the residual
max(0, p - q) sums to zero (p == q up to rounding) the recovered token is sampled from p instead, which
keeps it a valid id < V.

`verify_native` is the pure-PyTorch reference: short and obviously correct, the path used on CPU, and
the oracle the fused kernel in `speculative/kernels/` is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.speculative.errors import InvalidInputError, NumericalError
from draftsmith.speculative.sampling import filter_logits, race_sample


@dataclass
class VerifyOutput:
    tokens: torch.Tensor  # [B, D + 1] int64: accepted tokens, then the recovered/bonus token, then -1
    num_emitted: torch.Tensor  # [B] int64 in 1 .. draft_lens + 1
    num_accepted: torch.Tensor  # [B] int64 = num_emitted - 1


def validate_verify_inputs(
    target_logits: torch.Tensor,  # [B, D + 1, V]
    draft_tokens: torch.Tensor,  # [B, D]
    draft_lens: torch.Tensor,  # [B]
    draft_probs: torch.Tensor | None,  # [B, D, V]
) -> None:
    """Raise InvalidInputError / NumericalError for inputs that break the verifier's contract."""
    if target_logits.dim() != 3:
        raise InvalidInputError(f"target_logits must be [B, D+1, V], got shape {tuple(target_logits.shape)}")
    batch, width, vocab = target_logits.shape
    if draft_tokens.shape != (batch, width - 1):
        raise InvalidInputError(
            f"draft_tokens must be [B, D] = [{batch}, {width - 1}] to match target_logits, "
            f"got {tuple(draft_tokens.shape)}"
        )
    if draft_lens.shape != (batch,):
        raise InvalidInputError(f"draft_lens must be [B] = [{batch}], got {tuple(draft_lens.shape)}")
    if bool(((draft_lens < 0) | (draft_lens > width - 1)).any()):
        raise InvalidInputError(f"draft_lens must lie in 0..{width - 1}, got {draft_lens.tolist()}")
    live = torch.arange(width - 1, device=draft_tokens.device)[None, :] < draft_lens[:, None]
    if bool((((draft_tokens < 0) | (draft_tokens >= vocab)) & live).any()):
        raise InvalidInputError(f"draft token ids must lie in 0..{vocab - 1}")
    if draft_probs is not None and draft_probs.shape != (batch, width - 1, vocab):
        raise InvalidInputError(
            f"draft_probs must be [B, D, V] = [{batch}, {width - 1}, {vocab}] (pad it like draft_tokens), "
            f"got {tuple(draft_probs.shape)}"
        )
    if bool(torch.isnan(target_logits).any()):
        raise NumericalError("the target produced NaN logits; check the model weights and dtype")


def verify_native(
    target_logits: torch.Tensor,  # [B, D + 1, V] float32 / bf16 / fp16, raw logits
    draft_tokens: torch.Tensor,  # [B, D] int64; entries at or past draft_lens are ignored
    draft_lens: torch.Tensor,  # [B] int64 in 0..D
    draft_probs: torch.Tensor | None,  # [B, D, V] processed draft distribution q; None = one-hot at the draft token
    temperature: torch.Tensor,  # [B] float32; 0 = greedy row
    top_k: torch.Tensor,  # [B] int64; 0 = off
    top_p: torch.Tensor,  # [B] float32; 1 = off
    accept_u: torch.Tensor,  # [B, D] uniforms in [0, 1) for the acceptance tests
    race_exp: torch.Tensor,  # [B, V] Exp(1) noise for the one recovered/bonus token of each row
    *,
    validate: bool = True,  # check shapes, ids and NaNs first (host syncs; the runtime does it once per call)
) -> VerifyOutput:
    if validate:
        validate_verify_inputs(target_logits, draft_tokens, draft_lens, draft_probs)
    batch, width, vocab = target_logits.shape
    positions = torch.arange(width - 1, device=target_logits.device)
    live = positions[None, :] < draft_lens[:, None]  # [B, D]
    greedy = temperature == 0  # [B]
    safe_tokens = torch.where(live, draft_tokens, torch.zeros_like(draft_tokens))

    # Target distribution p at every position (softmax of the filtered logits).
    p = torch.softmax(filter_logits(target_logits, temperature, top_k, top_p), dim=-1)  # [B, D+1, V]
    p_draft = p[:, :-1].gather(-1, safe_tokens[..., None]).squeeze(-1)  # [B, D]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.float().gather(-1, safe_tokens[..., None]).squeeze(-1)  # [B, D]

    target_argmax = target_logits.argmax(dim=-1)  # [B, D+1]
    # q > 0 as well: a token with q = 0 cannot have been drawn from q (padding, a corrupt draw), and
    # refusing it changes no distribution.
    sampled_accept = (accept_u * q_draft < p_draft) & (q_draft > 0)
    accept = torch.where(greedy[:, None], safe_tokens == target_argmax[:, :-1], sampled_accept)
    accept &= live
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B] length of the accepted prefix

    # The one extra token each row emits, at position n = num_accepted.
    rows = torch.arange(batch, device=target_logits.device)
    p_n = p[rows, num_accepted]  # [B, V]
    rejected = num_accepted < draft_lens  # [B]: recovered token, else bonus token
    weights = p_n
    if bool(rejected.any()):
        if draft_probs is None:
            q_n = torch.zeros_like(p_n)
            q_n[rows, safe_tokens[rows, num_accepted.clamp(max=width - 2)]] = 1.0
        else:
            q_n = draft_probs[rows, num_accepted.clamp(max=width - 2)].float()
        residual = (p_n - q_n).clamp(min=0)
        usable = rejected & (residual.sum(dim=-1) > 0)  # zero residual: fall back to p itself
        weights = torch.where(usable[:, None], residual, p_n)
    extra_sampled = race_sample(weights, race_exp)  # [B]
    extra = torch.where(greedy, target_argmax[rows, num_accepted], extra_sampled)

    tokens = torch.full((batch, width), -1, dtype=torch.int64, device=target_logits.device)
    keep = positions[None, :] < num_accepted[:, None]
    tokens[:, :-1] = torch.where(keep, draft_tokens, tokens[:, :-1])
    tokens[rows, num_accepted] = extra
    return VerifyOutput(tokens=tokens, num_emitted=num_accepted + 1, num_accepted=num_accepted)
