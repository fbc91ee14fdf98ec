"""The medusa kind: Medusa-1 heads (Cai et al. 2024), their chain proposer, checkpoint and objective.

K heads read the frozen target's last hidden state h_t (the final-norm output that feeds the lm_head,
`hidden_states[-1]` in transformers). The target's own lm_head predicts token t+1 from h_t; head k
(k = 1..K) predicts token t+1+k. Each head is `num_layers` residual blocks x + SiLU(W x + b) followed
by a projection to the vocabulary: the target's lm_head, shared and frozen (the default, stored
nowhere in the checkpoint), or the head's own copy of it.

The W of every block starts at zero, so an untrained head is the target's lm_head: it predicts
token t+1 again, a weak but sane starting point that training moves to t+1+k.

Drafting is a chain: each head's top token (with `draft_confidence`, cut after the first head whose top
probability is below it). The proposal is deterministic (q one-hot), which is exact
under sampling too.

Checkpoint: config.json {"draftsmith": record, "medusa": head config}, heads.safetensors (the heads
only; a shared lm_head is the target's and is not stored), tokenizer files. Objective: head k's
divergence from the target's distribution for token t+2+k (read at position t+1+k), weighted per head
(`loss.head_weights`, default `loss.head_decay`**k).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from draftsmith.speculative import kinds
from draftsmith.speculative.errors import ModelLoadError
from draftsmith.speculative.kinds import DrafterKind, Footprint, top1_agreement, weight_bytes
from draftsmith.speculative.proposers import Draft, Proposer, RoundContext

WEIGHTS = "heads.safetensors"


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
        return self.lm_head(0)(features)  # one matmul reads the shared lm_head once for all K heads

    def head_logits(self, k: int, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V]
        """Head k alone (training feeds each head its own positions)."""
        return self.lm_head(k)(self.blocks[k](hidden))

    def lm_head(self, k: int) -> nn.Module:
        """Head k's projection to the vocabulary: its own, or the target's shared one."""
        if self.lm_heads is not None:
            return self.lm_heads[k]
        if not self._shared_lm_head:
            raise RuntimeError("MedusaHeads needs attach_lm_head(target lm_head) before use")
        return self._shared_lm_head[0]


class MedusaProposer(Proposer):
    """Chain drafting from Medusa heads on the target's last hidden state."""

    kind = name = "medusa"
    needs_target_hidden = True

    def __init__(self, heads: MedusaHeads):
        self.heads = heads

    def propose(self, ctx: RoundContext) -> Draft:
        hidden = ctx.target_hidden  # [B, H]: the state that produced the newest token
        options = ctx.options
        width = min(options.draft_len, self.heads.num_heads, max(ctx.max_lens))
        batch = hidden.shape[0]
        if width <= 0:
            return Draft.empty(batch, hidden.device)
        logits = self.heads(hidden.to(next(self.heads.parameters()).dtype))[:, :width]  # [B, width, V]
        tokens = logits.argmax(dim=-1)  # lowest index on ties, like every argmax in draftsmith
        lens = torch.tensor(ctx.max_lens, device=hidden.device).clamp(max=width)
        thresholds = ctx.stop_thresholds(hidden.device)  # [B] or None
        if thresholds is not None:  # the chain ends after the first head below the row's threshold
            confident = logits.float().softmax(dim=-1).amax(dim=-1) >= thresholds[:, None]  # [B, width]
            run = confident.long().cumprod(dim=1).sum(dim=1)  # leading confident heads
            lens = torch.minimum(lens, (run + 1).clamp(max=width))
        alternatives = None
        if ctx.leaf_count > 0:
            greedy, reach, columns = ctx.sampling.greedy, None, []
            for k in range(width):  # head k's estimate builds on heads 0..k-1's
                leaves, reach = ctx.leaves(logits[:, k], tokens[:, k], greedy, reach)
                columns.append(leaves)
            alternatives = torch.stack(columns, dim=1)
        return Draft(tokens, lens, None, alternatives)


class MedusaForTraining(nn.Module):
    def __init__(self, heads: MedusaHeads):
        super().__init__()
        self.heads = heads

    def forward(self, hidden: list[torch.Tensor]) -> list[torch.Tensor]:  # per head k: [N_k, H] -> [N_k, V]
        """All heads in one call (a DDP module must be called once per backward)."""
        return [self.heads.head_logits(k, h) for k, h in enumerate(hidden)]


@kinds.register
class MedusaKind(DrafterKind):
    name = "medusa"
    has_checkpoint = True
    trainable = True
    needs_teacher_hidden = True

    def save(self, drafter, out_dir, tokenizer, info):
        from draftsmith.speculative.checkpoint import save_module

        return save_module(out_dir, drafter, WEIGHTS, {"medusa": drafter.config()}, tokenizer, info)

    def load(self, path, target, *, device=None, dtype=None):
        from draftsmith.speculative.checkpoint import load_weights, read_spec

        try:
            heads = MedusaHeads(**read_spec(path, "medusa"))
        except TypeError as exc:
            raise ModelLoadError(f"corrupt medusa config in {path}/config.json: {exc}") from None
        lm_head = target.model.get_output_embeddings()
        if (heads.hidden_size, heads.vocab_size) != (lm_head.weight.shape[1], lm_head.weight.shape[0]):
            raise ModelLoadError(f"medusa heads in {path} are {heads.hidden_size}x{heads.vocab_size}, the target is "
                                 f"{lm_head.weight.shape[1]}x{lm_head.weight.shape[0]}")
        load_weights(heads, Path(path) / WEIGHTS, "medusa")
        heads.attach_lm_head(lm_head)
        return heads.to(device=device or lm_head.weight.device, dtype=dtype or lm_head.weight.dtype).eval()

    def proposer(self, drafter):
        return MedusaProposer(drafter)

    def footprint(self, proposer, target):
        return Footprint(weight_bytes(proposer.heads, exclude=target), 0, "own heads; lm_head shared when not owned")

    def identity(self, proposer):
        from draftsmith.speculative.loading import state_dict_hash

        return {"weight_hash": state_dict_hash(proposer.heads), "shares_target_weights": False}

    def modules(self, proposer):
        return [proposer.heads]

    def build(self, recipe, target):
        cfg = recipe.drafter
        if cfg.init_from:
            return self.load(Path(cfg.init_from), target).train()
        lm_head = target.model.get_output_embeddings()
        heads = MedusaHeads(target.model.config.hidden_size, lm_head.weight.shape[0], cfg.num_heads,
                            cfg.head_layers, own_lm_head=cfg.own_lm_head)
        heads.attach_lm_head(lm_head)
        if cfg.own_lm_head:
            heads.init_own_heads_from_shared()
        return heads.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)

    def training_module(self, drafter):
        return MedusaForTraining(drafter)

    def objective(self, module, drafter, batch, teacher, recipe):
        ids = batch["input_ids"]
        hidden = teacher.hidden(batch)  # [B, L, H], no grad
        dtype = next(module.parameters()).dtype
        weights = recipe.head_weights()
        # Head k reads h_t and predicts token t + 2 + k, an answer token; positions: (row, t).
        positions = [batch["loss_mask"][:, k + 2:].bool().nonzero() for k in range(len(weights))]
        students = module([hidden[p[:, 0], p[:, 1]].to(dtype) for p in positions])
        total, tokens, agree = 0.0, 0, {}
        for k, (weight, pos, student) in enumerate(zip(weights, positions, students)):
            rows, t = pos[:, 0], pos[:, 1]
            # The target's own distribution for that token comes from position t + 1 + k.
            teacher_logits, teacher_probs = teacher.at(torch.stack([rows, t + k + 1], dim=1), batch, hidden=hidden)
            loss = teacher.loss(student, ids[rows, t + k + 2], teacher_logits=teacher_logits,
                                teacher_probs=teacher_probs)
            total = total + weight * loss
            tokens += int(pos.shape[0])
            teacher_top = (teacher_logits if teacher_logits is not None else teacher_probs).argmax(-1)
            agree[f"agreement/head{k + 1}"] = float(top1_agreement(student.detach(), teacher_top))
        return total / sum(weights), tokens, agree
