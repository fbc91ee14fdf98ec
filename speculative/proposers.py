"""Drafters ("proposers"): what the runtime asks each round for up to D draft tokens.

A proposer sees the runtime through four calls:

    begin(prompts, sampling, rng)      once per batch, before its first round (prefill its own state)
    add_rows(prompts, sampling, rng,   between rounds, when requests join a running batch: their rows
             states)                   come after the batch's, with state as `begin` would make it
    propose(ctx) -> Draft              each round: tokens [B, D], per-row lengths, and q (or None)
    rollback(num_accepted, emitted)    each round, after verification: drop the rejected drafts' state
                                       and take in the emitted tokens
    select_rows(rows)                  when finished rows leave the batch

Each proposer names its kind (`kind`, a name in the registry of kinds.py), which knows its checkpoint
I/O, footprint and training objective. `ChainProposer` is the chain machinery shared by drafters that
draft autoregressively with a KV-cached module (draft LM, early exit, EAGLE).

The decoding options reach a proposer as `RoundContext.options` (a `DecodeOptions`); the three that a
request may set for itself (confidence, alternatives, leaf_min_prob) come resolved per row in the
context (`RoundContext.confidence`, `.alternatives`, `.leaf_min_prob`), which proposers read instead.
`options.draft_confidence` asks for dynamic draft lengths: a model drafter stops drafting a row
after the first token whose draft probability is below it (that token is still proposed), so
confident stretches get long drafts and uncertain ones short drafts (Hugging Face assisted
generation's `assistant_confidence_threshold`, SpecDec++'s stopping rule in its simplest form). The
rule reads only the drafter's own outputs, never the target's, so verification stays exact: every
position is verified with the same min(1, p/q) test whatever the number of positions after it.
Proposers without probabilities (prompt lookup) ignore it.

`options.draft_alternatives` = A asks a drafter with logits for its A runner-up tokens at every draft
position of greedy rows (`Draft.alternatives`), which the runtime verifies as sibling leaves of the
chain in the same target pass (tree.py); with `options.leaf_min_prob` only those the drafter's own
probabilities give at least that chance of being taken. Prompt lookup has no runner-ups and ignores it.

`RoundContext.target_hidden` carries the target's last hidden state at the position that produced the
newest token, for drafters that read it (Medusa-style heads); a proposer that wants it sets
`needs_target_hidden = True`. A proposer that sets `needs_target_states = True` (EAGLE-style drafters)
is handed the target's hidden states (those of `target_layers`, concatenated: by default the last,
`hidden_states[-1]`) at every position the target has processed and kept:
through `target_states` once after the prefill (the prompt but its last token) and once per round
before `rollback` (the positions of the emitted tokens). A proposer that drafts deterministically (prompt lookup, heads taking
their top token) returns `probs=None`, which the verifier treats as a one-hot q: that is exact under
sampling too, since a deterministic draft is accepted with probability p(token).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from draftsmith.speculative.errors import NumericalError
from draftsmith.speculative.kv import KVState
from draftsmith.speculative.options import DecodeOptions
from draftsmith.speculative.rng import RowGenerators
from draftsmith.speculative.sampling import BatchSampling, processed_probs, race_sample
from draftsmith.speculative.tree import runner_ups


@dataclass
class Draft:
    tokens: torch.Tensor  # [B, D] int64; entries at or past `lens` are padding (any valid id)
    lens: torch.Tensor  # [B] int64 in 0..D
    probs: torch.Tensor | None  # [B, D, V] draft distribution q after the shared processing; None = one-hot
    alternatives: torch.Tensor | None = None  # [B, D, A] int64 sibling leaves per position (tree.py); -1 = none

    @classmethod
    def empty(cls, batch: int, device) -> "Draft":
        zeros = torch.zeros(batch, dtype=torch.int64, device=device)
        return cls(torch.zeros(batch, 0, dtype=torch.int64, device=device), zeros, None)


@dataclass
class RoundContext:
    history: list[list[int]]  # per row: prompt + emitted tokens; the last one is not yet in the target's cache
    max_lens: list[int]  # per row: most tokens it may draft this round (<= options.draft_len)
    sampling: BatchSampling
    rng: RowGenerators
    options: DecodeOptions = DecodeOptions()
    target_hidden: torch.Tensor | None = None  # [B, H] hidden state that produced history[b][-1]
    check: bool = False  # validate the drafter's outputs this round (costs host syncs; see generate.py)
    # Per row: how it drafts (a request's own settings, engine.py). None = the options' value for every row.
    confidence: list[float] | None = None  # its confidence stop (0 = none)
    alternatives: list[int] | None = None  # its sibling leaves per position (0 = none)
    leaf_min_prob: list[float] | None = None

    def __post_init__(self):
        rows = len(self.max_lens)
        if self.confidence is None:
            self.confidence = [self.options.draft_confidence] * rows
        if self.alternatives is None:
            self.alternatives = [self.options.draft_alternatives] * rows
        if self.leaf_min_prob is None:
            self.leaf_min_prob = [self.options.leaf_min_prob] * rows

    def stop_thresholds(self, device) -> torch.Tensor | None:
        """[B] each row's confidence stop, or None when no row stops early."""
        return torch.tensor(self.confidence, device=device) if max(self.confidence) > 0 else None

    @property
    def leaf_count(self) -> int:
        """The most sibling leaves any row takes per draft position (0 = a chain for every row)."""
        return max(self.alternatives)

    def leaves(self, logits: torch.Tensor, drafted: torch.Tensor, rows: torch.Tensor,
               reach: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`tree.runner_ups` at one draft position ([B, V] logits, [B] drafted tokens, [B] rows that get
        leaves) with each row's own count and minimum probability: [B, leaf_count] leaves, next reach."""
        count = self.leaf_count
        min_prob = torch.tensor(self.leaf_min_prob, device=logits.device)
        leaves, reach = runner_ups(logits, drafted, count, rows, reach, min_prob)
        if min(self.alternatives) < count:  # rows asking fewer leaves than the widest row
            own = torch.tensor(self.alternatives, device=logits.device)
            leaves = leaves.masked_fill(torch.arange(count, device=logits.device)[None, :] >= own[:, None], -1)
        return leaves, reach


class Proposer(ABC):
    kind: str = ""  # its kind's name in the registry (kinds.py)
    name: str = "proposer"  # for reports; a combination names its parts
    needs_target_hidden: bool = False
    needs_target_states: bool = False
    target_layers: tuple[int, ...] = (-1,)  # indices into the target's `hidden_states` it reads

    def begin(self, prompts: list[list[int]], sampling: BatchSampling, rng: RowGenerators) -> None:
        """Called once per batch (a `generate` call, or an engine's batch starting empty) before its first round."""

    def add_rows(self, prompts: list[list[int]], sampling: BatchSampling, rng: RowGenerators,
                 states: list[torch.Tensor] | None = None) -> None:
        """Rows join the running batch between rounds, after its rows and in order: `prompts` as for
        `begin`, `sampling` and `rng` the new rows' own; `states` (`needs_target_states` only) the
        target's states at their prompts' positions but the last, as `target_states` gets them after
        `begin`. A proposer without per-row state needs nothing here; one that overrides `begin` must
        override this too."""
        if type(self).begin is not Proposer.begin:
            raise NotImplementedError(f"{type(self).__name__} keeps per-row state (it defines begin) but not "
                                      "add_rows, so no request can join its running batch")

    @abstractmethod
    def propose(self, ctx: RoundContext) -> Draft: ...

    def rollback(self, num_accepted: list[int], emitted: list[list[int]]) -> None:
        """Keep the state of the accepted drafts only, and take in the emitted tokens: emitted[b] is
        what row b emitted this round (accepted drafts + recovered/bonus)."""

    def target_states(self, states: list[torch.Tensor]) -> None:
        """(`needs_target_states` only) states[b]: [n_b, H'], the target's hidden states at each
        position it has just processed and kept for row b, in order. After the prefill these are
        the prompt's positions but the last; after a round, the n_b = len(emitted[b]) positions whose
        outputs were the emitted tokens (position j's state produced emitted[b][j]). H' is H times the
        number of `target_layers`."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these rows (indices into the current batch)."""

    def skip_round(self) -> None:
        """This round's draft came from elsewhere (LookupFirstProposer): `propose` was not called
        before the next `rollback`."""


class ChainProposer(Proposer):
    """Autoregressive chain drafting with a module that has its own KV cache (`model`): greedy or
    sampled (q is the drafter's processed distribution), with the confidence stop and sibling leaves.

    As written it drafts with a causal LM that reads tokens (a draft LM, the target's first layers);
    EAGLE overrides the inputs of the first draft step, the forward and the rollback."""

    def __init__(self, model: nn.Module, device: torch.device | str | None = None):
        self.model = model
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.kv: KVState | None = None
        self.pending: list[list[int]] = []  # per row: emitted tokens not yet in the draft cache
        self._fed_drafts = 0  # draft tokens appended to the cache by the last propose
        self._fed_tokens: list[list[int]] = []  # per row: those tokens

    def begin(self, prompts, sampling, rng):
        self.kv = KVState(self.model, len(prompts), self.device)
        context = [p[:-1] for p in prompts]
        if max(len(c) for c in context) > 0:
            tokens, valid = left_pad(context, self.device)
            self.kv.forward(tokens, valid, logits_to_keep=1)
        self.pending = [[p[-1]] for p in prompts]
        self._fed_drafts = -1  # nothing proposed yet

    def add_rows(self, prompts, sampling, rng, states=None):
        """The new rows' state is what `begin` (then `target_states`) makes for them alone, made on a copy
        of this proposer and appended: the cache's rows (`KVState.append_rows`) and every per-row list
        the copy's `begin` or `target_states` made anew (`pending`; EAGLE's features too). A subclass
        keeping per-row state of another form overrides this."""
        joining = copy.copy(self)
        joining.begin(prompts, sampling, rng)
        if states is not None:
            joining.target_states(states)
        self.kv.append_rows(joining.kv)
        for name, value in vars(joining).items():
            if isinstance(value, list) and value is not getattr(self, name, None) and len(value) == len(prompts):
                setattr(self, name, getattr(self, name) + value)

    def propose(self, ctx: RoundContext) -> Draft:
        batch = len(self.pending)
        options = ctx.options
        draft_len = min(options.draft_len, max(ctx.max_lens))
        if draft_len == 0:
            self._fed_drafts = -1
            return Draft.empty(batch, self.device)
        sampled = ~ctx.sampling.greedy
        any_sampled = bool(sampled.any())
        tokens, valid = self._draft_inputs()
        lens = torch.tensor(ctx.max_lens, device=self.device).clamp(max=draft_len)
        drafts, probs, alternatives, reach = [], [], [], None
        thresholds = ctx.stop_thresholds(self.device)  # [B] or None
        for step in range(draft_len):
            logits = self._draft_forward(tokens, valid)  # [B, 1, V]
            if ctx.check and bool(torch.isnan(logits).any()):
                raise NumericalError("the drafter produced NaN logits; check its weights and dtype")
            token = logits[:, 0].argmax(dim=-1)  # greedy rows; lowest index on ties
            q = None
            if any_sampled:
                q = processed_probs(logits, ctx.sampling)[:, 0]  # [B, V]
                # Only rows still drafting draw noise, so a row's random stream (and its output) is the
                # same in any batch as alone, also when other rows stop early.
                draw = [bool(s) and step < m for s, m in zip(sampled.tolist(), lens.tolist())]
                token = torch.where(sampled, race_sample(q, ctx.rng.exponential(draw, q.shape[-1])), token)
                probs.append(q)
            drafts.append(token)
            if ctx.leaf_count > 0:
                leaves, reach = ctx.leaves(logits[:, 0], token, ~sampled, reach)
                alternatives.append(leaves)
            if thresholds is not None:
                lens = self._stop_unconfident(lens, step, logits[:, 0], q, token, sampled, thresholds)
                if int(lens.max()) <= step + 1:  # every row has stopped: no further draft step
                    break
            if step < draft_len - 1:  # the last draft token is never fed: the target verifies it
                tokens, valid = token[:, None], torch.ones(batch, 1, dtype=torch.bool, device=self.device)
        self._fed_drafts = len(drafts) - 1
        self._fed_tokens = torch.stack(drafts[: self._fed_drafts], 1).tolist() if self._fed_drafts > 0 else []
        return Draft(torch.stack(drafts, 1), lens, torch.stack(probs, 1) if any_sampled else None,
                     torch.stack(alternatives, 1) if alternatives else None)

    def _draft_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The first draft step's inputs: every row's pending tokens, left-padded."""
        return left_pad(self.pending, self.device)

    def _draft_forward(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Append one draft step's slots to the cache; the logits after the last one, [B, 1, V]."""
        return self.kv.forward(tokens, valid, logits_to_keep=1).logits[:, -1:]

    @staticmethod
    def _stop_unconfident(lens, step, logits, q, token, sampled, threshold) -> torch.Tensor:
        """Cap at step + 1 the length of every row whose token at `step` has draft probability below
        its `threshold` ([B]; 0 never stops): q for sampled rows, the softmax of the raw logits for greedy rows."""
        confidence = logits.softmax(dim=-1).gather(1, token[:, None])[:, 0]
        if q is not None:
            confidence = torch.where(sampled, q.gather(1, token[:, None])[:, 0], confidence)
        return torch.where(confidence < threshold, lens.clamp(max=step + 1), lens)

    def skip_round(self) -> None:
        self._fed_drafts = -1

    def rollback(self, num_accepted, emitted):
        if self._fed_drafts < 0:  # no draft this round: the pending tokens were not fed either
            self.pending = [p + e for p, e in zip(self.pending, emitted)]
            return
        fed = self._fed_drafts
        # A fed draft token stays in the cache while it equals the token emitted at its position: for a
        # row drafted by this model that is its accepted prefix (a rejected draft token is never the
        # one emitted in its place); for a row drafted by someone else this round (lookup.py's LookupFirstProposer)
        # it is whatever prefix the model happened to guess. At least the last emitted token stays
        # pending, so every row has an input for the next draft step.
        kept = [_common_prefix(f, e[: len(e) - 1]) for f, e in zip(self._fed_tokens, emitted)] if fed > 0 else [0] * len(emitted)
        if fed > 0:
            keep = torch.arange(fed, device=self.device)[None, :] < torch.tensor(kept, device=self.device)[:, None]
            self.kv.keep_last(keep)
        # Emitted tokens beyond the kept draft slots (the recovered/bonus token, and the last draft
        # token when all were accepted) are fed at the start of the next round.
        self.pending = [e[k:] for k, e in zip(kept, emitted)]
        self._fed_drafts = -1  # until the next propose: a round the runtime drafts nothing in feeds nothing

    def select_rows(self, rows):
        self.kv.select_rows(rows)
        self.pending = [self.pending[i] for i in rows.tolist()]
        self._fed_tokens = [self._fed_tokens[i] for i in rows.tolist()] if self._fed_tokens else []


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def left_pad(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] token ids and validity mask, rows aligned to the right (holes on the left)."""
    width = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.int64)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, r in enumerate(rows):
        if r:
            tokens[b, width - len(r) :] = torch.tensor(r, dtype=torch.int64)
            valid[b, width - len(r) :] = True
    return tokens.to(device), valid.to(device)
