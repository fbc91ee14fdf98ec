"""Medusa-1 heads (Cai et al. 2024) and their chain proposer.

K heads read the frozen target's last hidden state h_t (the final-norm output that feeds the lm_head,
`hidden_states[-1]` in transformers). The target's own lm_head predicts token t+1 from h_t; head k
(k = 1..K) predicts token t+1+k. Each head is `num_layers` residual blocks x + SiLU(W x + b) followed
by a projection to the vocabulary: the target's lm_head, shared and frozen (the default, stored
nowhere in the checkpoint), or the head's own copy of it.

The W of every block starts at zero, so an untrained head is the target's lm_head: it predicts
token t+1 again, a weak but sane starting point that training moves to t+1+k.

Drafting is a chain: each head's top token (with `min_confidence`, cut after the first head whose top
probability is below it). The proposal is deterministic (q one-hot), which is exact
under sampling too.
"""

from __future__ import annotations

import torch
from torch import nn

from draftsmith.speculative.proposers import Draft, Proposer, RoundContext
from draftsmith.speculative.tree import runner_ups


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1,
                 own_lm_head: bool = False):
        super().__init__()
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers, self.own_lm_head = num_heads, num_layers, own_lm_head
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)]) for _ in range(num_heads)
        )
        self.lm_heads = (
            nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads))
            if own_lm_head else None
        )
        self._shared_lm_head: list[nn.Module] = []  # a list, so the target's lm_head is not a submodule

    def attach_lm_head(self, lm_head: nn.Module) -> "MedusaHeads":
        """Use the target's lm_head (shared, not saved). With own heads, also initialise them from it."""
        self._shared_lm_head = [lm_head]
        return self

    def init_own_heads_from_shared(self) -> None:
        with torch.no_grad():
            for head in self.lm_heads:
                head.weight.copy_(self._shared_lm_head[0].weight)

    def config(self) -> dict:
        return {"hidden_size": self.hidden_size, "vocab_size": self.vocab_size, "num_heads": self.num_heads,
                "num_layers": self.num_layers, "own_lm_head": self.own_lm_head}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., K, V]
        features = torch.stack([block(hidden) for block in self.blocks], dim=-2)  # [..., K, H]
        if self.lm_heads is not None:
            return torch.stack([head(features[..., k, :]) for k, head in enumerate(self.lm_heads)], dim=-2)
        if not self._shared_lm_head:
            raise RuntimeError("MedusaHeads needs attach_lm_head(target lm_head) before use")
        return self._shared_lm_head[0](features)  # one matmul reads the lm_head once for all K heads


class MedusaProposer(Proposer):
    """Chain drafting from Medusa heads on the target's last hidden state."""

    name = "medusa"
    needs_target_hidden = True

    def __init__(self, heads: MedusaHeads):
        self.heads = heads

    def propose(self, ctx: RoundContext, draft_len: int) -> Draft:
        hidden = ctx.target_hidden  # [B, H]: the state that produced the newest token
        width = min(draft_len, self.heads.num_heads, max(ctx.max_lens))
        batch = hidden.shape[0]
        if width <= 0:
            return Draft.empty(batch, hidden.device)
        logits = self.heads(hidden.to(next(self.heads.parameters()).dtype))[:, :width]  # [B, width, V]
        tokens = logits.argmax(dim=-1)  # lowest index on ties, like every argmax in draftsmith
        lens = torch.tensor(ctx.max_lens, device=hidden.device).clamp(max=width)
        if ctx.min_confidence > 0:  # the chain ends after the first head below the threshold
            confident = logits.float().softmax(dim=-1).amax(dim=-1) >= ctx.min_confidence  # [B, width]
            run = confident.long().cumprod(dim=1).sum(dim=1)  # leading confident heads
            lens = torch.minimum(lens, (run + 1).clamp(max=width))
        alternatives = None
        if ctx.alternatives > 0:
            greedy, reach, columns = ctx.sampling.greedy, None, []
            for k in range(width):  # head k's estimate builds on heads 0..k-1's
                leaves, reach = runner_ups(logits[:, k], tokens[:, k], ctx.alternatives, greedy, reach,
                                           ctx.leaf_min_prob)
                columns.append(leaves)
            alternatives = torch.stack(columns, dim=1)
        return Draft(tokens, lens, None, alternatives)
