"""Per-request random streams.

Each request (batch row) owns a `torch.Generator` seeded with its own seed, and every random number a
row consumes comes from its own stream, in an order that depends only on that row. So a seeded request
gives the same output whether it runs alone or inside any batch, and a rerun repeats it exactly. Rows
that need no randomness (greedy rows, empty drafts) draw nothing.
"""

from __future__ import annotations

import torch


class RowGenerators:
    """One generator per batch row; `select` keeps the streams of the rows still decoding."""

    def __init__(self, seeds: list[int], device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.generators = []
        for seed in seeds:
            g = torch.Generator(device=self.device)
            g.manual_seed(int(seed))
            self.generators.append(g)

    def __len__(self) -> int:
        return len(self.generators)

    def select(self, rows: list[int]) -> None:
        self.generators = [self.generators[i] for i in rows]

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
