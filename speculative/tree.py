"""Sibling leaves: a small draft tree verified in the same target pass as the chain (greedy rows).

A model drafter's logits at draft position i rank more than the token it drafts there. With
`alternatives = A`, position i also offers the drafter's next A candidates as leaves beside d_i: the
tree's trunk is the chain d_1..d_D and every trunk node has A sibling leaves (Medusa's and EAGLE-2's
top-k trees in their simplest shape: no extra draft steps, only extra slots in the target's pass). A
leaf at depth i sits at the position d_i would have and attends to the context, d_1..d_{i-1} and
itself. When the target rejects d_i, a leaf equal to the target's own token there is accepted in its
place and the target's logits at that leaf give the bonus token: the round emits i + 1 tokens instead
of i.

Only greedy rows get leaves. A greedy row's output stays the target's greedy output whatever the
leaves, since every token it emits is the target's argmax after the tokens before it. A sampled row
verifies its chain with the usual min(1, p/q) test: several candidates per position would need
multi-draft rejection sampling (SpecInfer), which draftsmith does not do.

A round's target pass holds, per row, the slots

    [last, d_1 .. d_D, the leaves of depth 1, .., the leaves of depth D]

(up to A per depth; a leaf no row of the batch has takes no slot)
and `path` (per row, D + 1 slot indices) names the slots whose outputs produced the emitted tokens:
the trunk up to the accepted prefix, then the accepted leaf, if any.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.speculative.verify import VerifyOutput


def runner_ups(
    logits: torch.Tensor,  # [..., V] a drafter's logits at one draft position
    drafted: torch.Tensor,  # [...] the token it drafted there
    count: int,  # A
    rows: torch.Tensor,  # [...] bool: positions that get leaves (greedy rows)
    reach: torch.Tensor | None = None,  # [...] the drafter's estimate that the chain gets this far
    min_prob: float | torch.Tensor = 0.0,  # or [...] per position
) -> tuple[torch.Tensor, torch.Tensor]:
    """The leaves of one draft position: [..., A] the best-ranked tokens other than the drafted one
    (ties: lowest index first, like the drafter's argmax), -1 where a row gets no leaves, a candidate
    has -inf logit (outside a draft vocabulary) or its estimated acceptance, reach * q(candidate), is
    below `min_prob`; and the reach of the next position, reach * q(drafted token).

    The estimate is the drafter's own (EAGLE-2 ranks its tree's nodes the same way): with a trained
    drafter q roughly tracks the target, so `min_prob` spends verification slots only on leaves likely
    to be taken, which matters where each slot costs (a CPU); on a GPU a pass over a few more slots is
    nearly free and 0 keeps them all."""
    logits = logits.float()
    probs = logits.softmax(dim=-1)
    reach = torch.ones_like(probs[..., 0]) if reach is None else reach
    top = logits.topk(count + 1, dim=-1, sorted=True)
    # Stable sort by (value desc, index asc), so equal logits rank like argmax ranks them.
    order = torch.argsort(top.indices, dim=-1, stable=True)
    values, indices = top.values.gather(-1, order), top.indices.gather(-1, order)
    order = torch.argsort(-values, dim=-1, stable=True)
    values, indices = values.gather(-1, order), indices.gather(-1, order)
    if torch.is_tensor(min_prob):
        min_prob = min_prob[..., None]
    likely = reach[..., None] * probs.gather(-1, indices) >= min_prob
    usable = (indices != drafted[..., None]) & torch.isfinite(values) & rows[..., None] & likely
    # The first `count` usable candidates, in rank order.
    pick = torch.argsort((~usable).to(torch.int8), dim=-1, stable=True)[..., :count]
    leaves = torch.where(usable.gather(-1, pick), indices.gather(-1, pick), torch.full_like(pick, -1))
    return leaves, reach * probs.gather(-1, drafted[..., None])[..., 0]


@dataclass
class Leaves:
    tokens: torch.Tensor  # [B, L] int64, ordered by depth; 0 where a row has no leaf
    valid: torch.Tensor  # [B, L] bool
    depth: torch.Tensor  # [L] int64 in 1..D: the draft position each leaf stands beside

    @classmethod
    def from_draft(cls, alternatives: torch.Tensor | None,  # [B, D, A] int64, -1 = none
                   lens: torch.Tensor,  # [B] draft lengths
                   greedy: torch.Tensor,  # [B] bool
                   ) -> "Leaves | None":
        """The leaves of a round's draft, or None when no row has any. A (depth, rank) that no row uses
        gets no slot: every slot of the target's pass costs time (on a CPU, about as much as 7% of a
        plain step)."""
        if alternatives is None or alternatives.shape[-1] == 0:
            return None
        batch, width, count = alternatives.shape
        drafted = torch.arange(width, device=lens.device)[None, :] < lens[:, None]  # [B, D]
        valid = ((alternatives >= 0) & drafted[..., None] & greedy[:, None, None]).reshape(batch, width * count)
        used = valid.any(dim=0)  # [D * A]
        if not bool(used.any()):
            return None
        tokens = torch.where(valid, alternatives.reshape(batch, width * count), 0)
        depth = torch.arange(1, width + 1, device=lens.device).repeat_interleave(count)
        return cls(tokens[:, used], valid[:, used], depth[used])

    def attach(self, tokens: torch.Tensor,  # [B, 1 + D] the chain's slots: last, d_1 .. d_D
               valid: torch.Tensor,  # [B, 1 + D] bool
               ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The pass's slots with the leaves after the chain's, and the tree structure of the pass."""
        return (torch.cat([tokens, self.tokens], dim=1), torch.cat([valid, self.valid], dim=1),
                self.structure(tokens.shape[1] - 1))

    def kept_slots(self, path: torch.Tensor,  # [B, D + 1] from take_leaves
                   on_path: torch.Tensor,  # [B, D + 1] bool: path entries that were emitted
                   ) -> torch.Tensor:
        """[B, 1 + D + L] bool: the pass's slots a cache keeps, the emitted path's."""
        keep = torch.zeros(on_path.shape[0], on_path.shape[1] + self.tokens.shape[1], dtype=torch.bool,
                           device=on_path.device)
        return keep.scatter_(1, path, on_path)

    def structure(self, draft_width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Depth of each of the pass's T = 1 + D + L slots ([T] int64: position offset from `last`)
        and which slots each slot attends to among them ([T, T] bool)."""
        trunk = torch.arange(draft_width + 1, device=self.depth.device)
        depth = torch.cat([trunk, self.depth])
        total = depth.shape[0]
        sees = torch.zeros(total, total, dtype=torch.bool, device=depth.device)
        sees[: draft_width + 1, : draft_width + 1] = trunk[None, :] <= trunk[:, None]  # causal trunk
        leaves = slice(draft_width + 1, total)
        sees[leaves, : draft_width + 1] = trunk[None, :] < self.depth[:, None]  # last, d_1 .. d_{i-1}
        sees[leaves, leaves] = torch.eye(len(self.depth), dtype=torch.bool, device=depth.device)
        return depth, sees


def take_leaves(
    out: VerifyOutput,  # the chain's verification
    logits: torch.Tensor,  # [B, T, V] the target's logits at all slots of the pass
    lens: torch.Tensor,  # [B] draft lengths
    leaves: Leaves,
) -> tuple[VerifyOutput, torch.Tensor, torch.Tensor]:
    """Accept, in each greedy row whose chain was cut at depth n + 1, the leaf of that depth equal to the
    target's token there, and take the bonus token from the target's logits at the leaf.

    Returns the new verification, `path` ([B, D + 1] slot indices: entry j produced emitted token j)
    and which rows took a leaf ([B] bool)."""
    batch, width = out.tokens.shape  # width = D + 1
    rows = torch.arange(batch, device=logits.device)
    n = out.num_accepted
    wanted = out.tokens[rows, n]  # greedy rows: the target's argmax after the accepted prefix
    match = leaves.valid & (leaves.depth[None, :] == n[:, None] + 1) & (leaves.tokens == wanted[:, None])  # [B, L]
    hit = match.any(dim=1) & (n < lens)
    slot = width + match.long().argmax(dim=1)  # [B] the matching leaf's slot (leaves follow the trunk)
    path = torch.arange(width, device=logits.device).repeat(batch, 1)
    tokens = out.tokens.clone()
    if bool(hit.any()):
        h = rows[hit]
        path[h, n[h] + 1] = slot[h]
        tokens[h, n[h] + 1] = logits[h, slot[h]].argmax(dim=-1)
    accepted = n + hit.long()
    return VerifyOutput(tokens=tokens, num_emitted=accepted + 1, num_accepted=accepted), path, hit
