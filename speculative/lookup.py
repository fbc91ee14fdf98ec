"""The lookup+drafter kind: prompt lookup where the context repeats itself, a model drafter elsewhere.

    --drafter ngram[:MAX[:MIN]]+DRAFTER

What it costs and is, is its drafter's: the lookup holds neither weights nor a cache. A round's draft
cost is a mix (lookup rows cost nothing), so it offers no single draft step to time.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from draftsmith.speculative import kinds
from draftsmith.speculative.kinds import DrafterKind
from draftsmith.speculative.ngram import NGramProposer
from draftsmith.speculative.proposers import Draft, Proposer, RoundContext


class LookupFirstProposer(Proposer):
    """Prompt lookup where the context repeats itself, a model drafter everywhere else.

    Each round, a row whose context ends in an n-gram seen earlier (n >= the lookup's min_ngram) drafts
    the tokens that followed it; every other row is drafted by `drafter` (a draft LM, early exit or
    Medusa heads). Copy-heavy stretches (code edits, quoted text, lists) get long free drafts, the rest
    gets the trained drafter's. Lookup rows are hidden from the drafter by a zero draft budget, so it
    draws no random numbers for them: a row's output stays the same in any batch. A lookup draft is
    deterministic (one-hot q), so verification stays exact under sampling too.
    """

    kind = "lookup"

    def __init__(self, lookup: NGramProposer, drafter: Proposer):
        self.lookup, self.drafter = lookup, drafter
        self.name = f"{lookup.name}+{drafter.name}"
        self.needs_target_hidden = drafter.needs_target_hidden
        self.needs_target_states = drafter.needs_target_states
        self.target_layers = drafter.target_layers
        self.lookup_rounds = 0  # rows x rounds drafted by lookup, for statistics
        self.model_rounds = 0

    def begin(self, prompts, sampling, rng):
        self.drafter.begin(prompts, sampling, rng)

    def add_rows(self, prompts, sampling, rng, states=None):
        self.drafter.add_rows(prompts, sampling, rng, states)

    def propose(self, ctx: RoundContext) -> Draft:
        device, draft_len = ctx.sampling.temperature.device, ctx.options.draft_len
        found = [self.lookup.lookup(h, min(draft_len, m)) for h, m in zip(ctx.history, ctx.max_lens)]
        model_lens = [0 if f else m for f, m in zip(found, ctx.max_lens)]
        self.lookup_rounds += sum(1 for f in found if f)
        self.model_rounds += sum(1 for m in model_lens if m > 0)
        if max(model_lens, default=0) > 0:
            draft = self.drafter.propose(dataclasses.replace(ctx, max_lens=model_lens))
        else:  # nothing for the model this round; its rollback sees that it fed no draft
            draft = Draft.empty(len(found), device)
            self.drafter.skip_round()
        width = max([draft.tokens.shape[1]] + [len(f) for f in found])
        if width == 0:
            return draft
        tokens = torch.zeros(len(found), width, dtype=torch.int64, device=device)
        tokens[:, : draft.tokens.shape[1]] = draft.tokens
        lens = draft.lens.clone()
        for b, f in enumerate(found):
            if f:
                tokens[b, : len(f)] = torch.tensor(f, dtype=torch.int64, device=device)
                lens[b] = len(f)
        probs = None
        if draft.probs is not None:  # lookup rows get a one-hot q: their draft is deterministic
            probs = torch.zeros(len(found), width, draft.probs.shape[-1], dtype=draft.probs.dtype, device=device)
            probs[:, : draft.probs.shape[1]] = draft.probs
            rows = [b for b, f in enumerate(found) if f]
            if rows:
                index = torch.tensor(rows, device=device)
                probs[index] = torch.nn.functional.one_hot(tokens[index], probs.shape[-1]).to(probs.dtype)
        alternatives = None
        if draft.alternatives is not None:  # lookup rows have no runner-ups
            alternatives = draft.alternatives.new_full((len(found), width, draft.alternatives.shape[-1]), -1)
            alternatives[:, : draft.alternatives.shape[1]] = draft.alternatives
            alternatives[torch.tensor([bool(f) for f in found], device=device)] = -1
        return Draft(tokens, lens, probs, alternatives)

    def rollback(self, num_accepted, emitted):
        self.drafter.rollback(num_accepted, emitted)

    def target_states(self, states):
        self.drafter.target_states(states)

    def select_rows(self, rows):
        self.drafter.select_rows(rows)


@kinds.register
class LookupKind(DrafterKind):
    name = "lookup"
    behind_lookup = False

    def footprint(self, proposer, target):
        return kinds.of(proposer.drafter).footprint(proposer.drafter, target)

    def identity(self, proposer):
        return kinds.of(proposer.drafter).identity(proposer.drafter)

    def modules(self, proposer):
        return kinds.of(proposer.drafter).modules(proposer.drafter)


def split_combined(spec: str) -> tuple[str, str] | None:
    """("ngram[:MAX[:MIN]]", "DRAFTER") for a combined spec, else None (a directory named with '+' is
    a directory)."""
    head, plus, rest = spec.partition("+")
    if not plus or Path(spec).expanduser().exists() or head.partition(":")[0] != "ngram":
        return None
    return head, rest
