"""The n-gram kind: prompt-lookup decoding (training-free, deterministic).

    --drafter ngram[:MAX[:MIN]]
"""

from __future__ import annotations

import torch

from draftsmith.speculative import kinds
from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.kinds import DrafterKind, Footprint
from draftsmith.speculative.proposers import Draft, Proposer, RoundContext


class NGramProposer(Proposer):
    """Prompt-lookup decoding: find the latest earlier occurrence of the context's last n tokens
    (n from max_ngram down to min_ngram) and propose the tokens that followed it. Training-free,
    deterministic (q is one-hot)."""

    kind = name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise InvalidInputError(f"ngram sizes need 1 <= min <= max, got min={min_ngram} max={max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, ctx: RoundContext) -> Draft:
        device, draft_len = ctx.sampling.temperature.device, ctx.options.draft_len
        rows = [self.lookup(h, min(draft_len, m)) for h, m in zip(ctx.history, ctx.max_lens)]
        width = max((len(r) for r in rows), default=0)
        if width == 0:
            return Draft.empty(len(rows), device)
        tokens = torch.zeros(len(rows), width, dtype=torch.int64)
        for b, r in enumerate(rows):
            tokens[b, : len(r)] = torch.tensor(r, dtype=torch.int64)
        lens = torch.tensor([len(r) for r in rows], dtype=torch.int64)
        return Draft(tokens.to(device), lens.to(device), None)

    def lookup(self, history: list[int], count: int) -> list[int]:
        if count <= 0:
            return []
        for n in range(min(self.max_ngram, len(history) - 1), self.min_ngram - 1, -1):
            suffix = history[-n:]
            # Latest earlier match first: recent context predicts the continuation best.
            for start in range(len(history) - n - 1, -1, -1):
                if history[start : start + n] == suffix:
                    return history[start + n : start + n + count]
        return []


def ngram_from_sizes(sizes_text: str, spec: str, default_min: int) -> NGramProposer:
    """NGramProposer from "MAX[:MIN]" (empty: MAX = 3); MIN defaults to min(default_min, MAX)."""
    sizes = [kinds.positive_int(x, spec) for x in sizes_text.split(":")] if sizes_text else [3]
    return NGramProposer(max_ngram=sizes[0], min_ngram=sizes[1] if len(sizes) > 1 else min(default_min, sizes[0]))


@kinds.register
class NGramKind(DrafterKind):
    name = "ngram"
    from_spec_name = True
    behind_lookup = False

    def from_spec(self, arg, spec, target):
        return ngram_from_sizes(arg, spec, default_min=1)

    def footprint(self, proposer, target):
        return Footprint(0, 0, "none (prompt lookup)")
