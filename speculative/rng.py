"""Per-request random streams.

Each request (batch row) owns a `torch.Generator` seeded with its own seed, and every random number a
row consumes comes from its own stream, in an order that depends only on that row. So a seeded request
gives the same output whether it runs alone or inside any batch, and a rerun repeats it exactly. Rows
that need no randomness (greedy rows, empty drafts) draw nothing.

The fused verifier draws its noise in the kernel (Philox) instead, keyed by the row's seed and a
counter offset; `philox_keys` hands out a fresh offset per row and verification round, so those draws
are per row and batch-independent too.
"""

from __future__ import annotations

import torch


class RowGenerators:
    """One generator per batch row; `select` keeps the streams of the rows still decoding."""

    def __init__(self, seeds: list[int], device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.seeds = [int(seed) % 2**63 for seed in seeds]  # the in-kernel Philox key is an int64
        self.rounds = [0] * len(seeds)  # verification rounds each row has drawn Philox keys for
        self.generators = []
        for seed in seeds:
            g = torch.Generator(device=self.device)
            g.manual_seed(int(seed))
            self.generators.append(g)

    def __len__(self) -> int:
        return len(self.generators)

    def select(self, rows: list[int]) -> None:
        self.generators = [self.generators[i] for i in rows]
        self.seeds = [self.seeds[i] for i in rows]
        self.rounds = [self.rounds[i] for i in rows]

    def extend(self, other: "RowGenerators") -> None:
        """Append the rows of `other` (requests joining the batch), their streams as they are."""
        self.generators += other.generators
        self.seeds += other.seeds
        self.rounds += other.rounds

    def philox_keys(self) -> tuple[torch.Tensor, torch.Tensor]:  # ([B] int64 seeds, [B] int64 offsets)
        """Each row's seed and a counter offset it has never used, for one round of in-kernel draws."""
        offsets = torch.tensor(self.rounds, dtype=torch.int64, device=self.device)
        self.rounds = [r + 1 for r in self.rounds]
        return torch.tensor(self.seeds, dtype=torch.int64, device=self.device), offsets

    def uniform(self, counts: list[int], width: int) -> torch.Tensor:  # [B, width] float32 in [0, 1)
        """Row b draws counts[b] uniforms (left-aligned); the rest of its row is 0."""
        out = torch.zeros(len(self.generators), width, device=self.device)
        for b, (g, n) in enumerate(zip(self.generators, counts)):
            if n > 0:
                out[b, :n] = torch.rand(n, generator=g, device=self.device)
        return out

    def exponential(self, rows: list[bool], vocab: int) -> torch.Tensor:  # [B, vocab] float32, > 0
        """Exp(1) noise for the rows marked True; other rows get ones (and draw nothing)."""
        out = torch.ones(len(self.generators), vocab, device=self.device)
        for b, (g, draw) in enumerate(zip(self.generators, rows)):
            if draw:
                out[b].exponential_(generator=g)
        # exponential_ can return exactly 0 (from u = 0); a zero would turn w / E into inf or nan.
        return out.clamp_(min=torch.finfo(torch.float32).tiny)
