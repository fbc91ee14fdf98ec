"""Drafters ("proposers"): what the runtime asks each round for up to D draft tokens.

A proposer sees the runtime through four calls:

    begin(prompts, sampling, rng)      once, before the first round (prefill its own state)
    propose(ctx, draft_len) -> Draft   each round: tokens [B, D], per-row lengths, and q (or None)
    commit(num_accepted, emitted)      each round, after verification: roll back to the accepted prefix
    select_rows(rows)                  when finished rows leave the batch

`RoundContext.min_confidence` asks for dynamic draft lengths: a model drafter stops drafting a row
after the first token whose draft probability is below it (that token is still proposed), so
confident stretches get long drafts and uncertain ones short drafts (Hugging Face assisted
generation's `assistant_confidence_threshold`, SpecDec++'s stopping rule in its simplest form). The
rule reads only the drafter's own outputs, never the target's, so verification stays exact: every
position is verified with the same min(1, p/q) test whatever the number of positions after it.
Proposers without probabilities (prompt lookup) ignore it.

`RoundContext.alternatives` = A asks a drafter with logits for its A runner-up tokens at every draft
position of greedy rows (`Draft.alternatives`), which the runtime verifies as sibling leaves of the
chain in the same target pass (tree.py); with `leaf_min_prob` only those the drafter's own
probabilities give at least that chance of being taken. Prompt lookup has no runner-ups and ignores it.

`RoundContext.target_hidden` carries the target's last hidden state at the position that produced the
newest token, for drafters that read it (Medusa-style heads); a proposer that wants it sets
`needs_target_hidden = True`. A proposer that sets `needs_target_states = True` (EAGLE-style drafters)
is handed the target's last hidden state at every position the target has processed and kept:
through `target_states` once after the prefill (the prompt but its last token) and once per round
before `commit` (the positions of the emitted tokens). A proposer that drafts deterministically (prompt lookup, heads taking
their top token) returns `probs=None`, which the verifier treats as a one-hot q: that is exact under
sampling too, since a deterministic draft is accepted with probability p(token).
"""

from __future__ import annotations

import copy
import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from draftsmith.speculative.errors import InvalidInputError, NumericalError
from draftsmith.speculative.kv import KVState
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
    max_lens: list[int]  # per row: most tokens it may draft this round (<= draft_len)
    sampling: BatchSampling
    rng: RowGenerators
    target_hidden: torch.Tensor | None = None  # [B, H] hidden state that produced history[b][-1]
    min_confidence: float = 0.0  # stop drafting a row after a token with draft probability below this
    alternatives: int = 0  # A: runner-up tokens per draft position for greedy rows (tree.py); 0 = a chain
    leaf_min_prob: float = 0.0  # ... each only when the drafter's estimate that it is taken is at least this


class Proposer(ABC):
    name: str = "proposer"
    needs_target_hidden: bool = False
    needs_target_states: bool = False

    def begin(self, prompts: list[list[int]], sampling: BatchSampling, rng: RowGenerators) -> None:
        """Called once per `generate` call before the first round."""

    @abstractmethod
    def propose(self, ctx: RoundContext, draft_len: int) -> Draft: ...

    def commit(self, num_accepted: list[int], emitted: list[list[int]]) -> None:
        """emitted[b]: the tokens row b emitted this round (accepted drafts + recovered/bonus)."""

    def target_states(self, states: list[torch.Tensor]) -> None:
        """(`needs_target_states` only) states[b]: [n_b, H], the target's last hidden state at each
        position it has just processed and kept for row b, in order. After the prefill these are
        the prompt's positions but the last; after a round, the n_b = len(emitted[b]) positions whose
        outputs were the emitted tokens (position j's state produced emitted[b][j])."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these rows (indices into the current batch)."""

    def skip_round(self) -> None:
        """This round's draft came from elsewhere (LookupFirstProposer): `propose` was not called
        before the next `commit`."""


class DraftModelProposer(Proposer):
    """An independent causal LM with the target's tokenizer and its own KV cache, drafting autoregressively."""

    name = "draft-lm"

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

    def propose(self, ctx: RoundContext, draft_len: int) -> Draft:
        batch = len(self.pending)
        draft_len = min(draft_len, max(ctx.max_lens))
        if draft_len == 0:
            self._fed_drafts = -1
            return Draft.empty(batch, self.device)
        sampled = ~ctx.sampling.greedy
        any_sampled = bool(sampled.any())
        tokens, valid = self._draft_inputs()
        lens = torch.tensor(ctx.max_lens, device=self.device).clamp(max=draft_len)
        drafts, probs, alternatives, reach = [], [], [], None
        for step in range(draft_len):
            logits = self._draft_forward(tokens, valid)  # [B, 1, V]
            if bool(torch.isnan(logits).any()):
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
            if ctx.alternatives > 0:
                leaves, reach = runner_ups(logits[:, 0], token, ctx.alternatives, ~sampled, reach, ctx.leaf_min_prob)
                alternatives.append(leaves)
            if ctx.min_confidence > 0:
                lens = self._stop_unconfident(lens, step, logits[:, 0], q, token, sampled, ctx.min_confidence)
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
        `threshold`: q for sampled rows, the softmax of the raw logits for greedy rows."""
        confidence = logits.softmax(dim=-1).gather(1, token[:, None])[:, 0]
        if q is not None:
            confidence = torch.where(sampled, q.gather(1, token[:, None])[:, 0], confidence)
        return torch.where(confidence < threshold, lens.clamp(max=step + 1), lens)

    def skip_round(self) -> None:
        self._fed_drafts = -1

    def commit(self, num_accepted, emitted):
        if self._fed_drafts < 0:  # no draft this round: the pending tokens were not fed either
            self.pending = [p + e for p, e in zip(self.pending, emitted)]
            return
        fed = self._fed_drafts
        # A fed draft token stays in the cache while it equals the token emitted at its position: for a
        # row drafted by this model that is its accepted prefix (a rejected draft token is never the
        # one emitted in its place); for a row drafted by someone else this round (LookupFirstProposer)
        # it is whatever prefix the model happened to guess. At least the last emitted token stays
        # pending, so every row has an input for the next draft step.
        kept = [_common_prefix(f, e[: len(e) - 1]) for f, e in zip(self._fed_tokens, emitted)] if fed > 0 else [0] * len(emitted)
        if fed > 0:
            keep = torch.arange(fed, device=self.device)[None, :] < torch.tensor(kept, device=self.device)[:, None]
            self.kv.keep_last(keep)
        # Emitted tokens beyond the kept draft slots (the recovered/bonus token, and the last draft
        # token when all were accepted) are fed at the start of the next round.
        self.pending = [e[k:] for k, e in zip(kept, emitted)]

    def select_rows(self, rows):
        self.kv.select_rows(rows)
        self.pending = [self.pending[i] for i in rows.tolist()]
        self._fed_tokens = [self._fed_tokens[i] for i in rows.tolist()] if self._fed_tokens else []


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


class EarlyExitProposer(DraftModelProposer):
    """Training-free self-speculative drafter: the target's first N layers, its final norm and lm_head.

    The layers share the target's weights (no copy); the drafter keeps its own KV cache.
    """

    name = "early-exit"

    def __init__(self, target: nn.Module, num_layers: int):
        super().__init__(truncated_model(target, num_layers))
        self.num_layers = num_layers


def truncated_model(model: nn.Module, num_layers: int) -> nn.Module:
    """A view of a decoder-only HF model keeping its first `num_layers` layers (weights shared)."""
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise InvalidInputError(f"early-exit needs a decoder with a `.layers` list; {type(model).__name__} has none")
    total = len(layers)
    if not 1 <= num_layers < total:
        raise InvalidInputError(f"early-exit:N needs 1 <= N < {total} (the target's layer count), got {num_layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types)[:num_layers]
    short_decoder = _shallow_module_copy(decoder)
    short_decoder.layers = nn.ModuleList(list(layers)[:num_layers])
    short_decoder.config = config
    shell = _shallow_module_copy(model)
    setattr(shell, _decoder_attribute(model, decoder), short_decoder)
    shell.config = config
    return shell


def _decoder_attribute(model: nn.Module, decoder: nn.Module) -> str:
    for name, child in model.named_children():
        if child is decoder:
            return name
    raise InvalidInputError(f"cannot locate the decoder module of {type(model).__name__}")


def _shallow_module_copy(module: nn.Module) -> nn.Module:
    """A new module object sharing parameters and submodules, whose own submodule table can change."""
    new = copy.copy(module)
    new._modules = dict(module._modules)
    new._parameters = dict(module._parameters)
    new._buffers = dict(module._buffers)
    for name, value in vars(module).items():  # hooks registered on the original must not fire on the view
        if name.endswith("hooks") and isinstance(value, dict):
            setattr(new, name, type(value)(value))
    return new


class NGramProposer(Proposer):
    """Prompt-lookup decoding: find the latest earlier occurrence of the context's last n tokens
    (n from max_ngram down to min_ngram) and propose the tokens that followed it. Training-free,
    deterministic (q is one-hot)."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise InvalidInputError(f"ngram sizes need 1 <= min <= max, got min={min_ngram} max={max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, ctx: RoundContext, draft_len: int) -> Draft:
        device = ctx.sampling.temperature.device
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


class LookupFirstProposer(Proposer):
    """Prompt lookup where the context repeats itself, a model drafter everywhere else.

    Each round, a row whose context ends in an n-gram seen earlier (n >= the lookup's min_ngram) drafts
    the tokens that followed it; every other row is drafted by `drafter` (a draft LM, early exit or
    Medusa heads). Copy-heavy stretches (code edits, quoted text, lists) get long free drafts, the rest
    gets the trained drafter's. Lookup rows are hidden from the drafter by a zero draft budget, so it
    draws no random numbers for them: a row's output stays the same in any batch. A lookup draft is
    deterministic (one-hot q), so verification stays exact under sampling too.
    """

    def __init__(self, lookup: NGramProposer, drafter: Proposer):
        self.lookup, self.drafter = lookup, drafter
        self.name = f"{lookup.name}+{drafter.name}"
        self.needs_target_hidden = drafter.needs_target_hidden
        self.needs_target_states = drafter.needs_target_states
        self.lookup_rounds = 0  # rows x rounds drafted by lookup, for statistics
        self.model_rounds = 0

    def begin(self, prompts, sampling, rng):
        self.drafter.begin(prompts, sampling, rng)

    def propose(self, ctx: RoundContext, draft_len: int) -> Draft:
        device = ctx.sampling.temperature.device
        found = [self.lookup.lookup(h, min(draft_len, m)) for h, m in zip(ctx.history, ctx.max_lens)]
        model_lens = [0 if f else m for f, m in zip(found, ctx.max_lens)]
        self.lookup_rounds += sum(1 for f in found if f)
        self.model_rounds += sum(1 for m in model_lens if m > 0)
        if max(model_lens, default=0) > 0:
            draft = self.drafter.propose(dataclasses.replace(ctx, max_lens=model_lens), draft_len)
        else:  # nothing for the model this round; its commit sees that it fed no draft
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

    def commit(self, num_accepted, emitted):
        self.drafter.commit(num_accepted, emitted)

    def target_states(self, states):
        self.drafter.target_states(states)

    def select_rows(self, rows):
        self.drafter.select_rows(rows)


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
