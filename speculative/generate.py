"""The decoding loop: prefill, then rounds of propose -> score -> verify -> accept -> rollback.

One round for every row still decoding:

    propose   the drafter proposes up to D tokens d_1..d_D (and q), given the context
    score     one target pass over [last, d_1, .., d_D] gives p at D+1 positions
    verify    the verifier keeps the longest acceptable prefix and adds the recovered or bonus token
    accept    the emitted tokens are appended, stopping at a stop token or max_new_tokens
    rollback  target and drafter caches drop the slots of rejected tokens and take in the emitted
              ones; nothing is re-encoded

The target's cache always holds the context except its newest token (`last`), which is the first
input of the next verification pass. With no drafter every round has D = 0 and this is plain
decoding through the same code. With `draft_alternatives` > 0, greedy rows also verify the drafter's
runner-up tokens as sibling leaves of the chain in the same pass (tree.py). Greedy rows reproduce the
target's greedy decoding token for token; sampled rows emit exactly the target's (processed)
distribution.

The batch (`_Run`) changes between rounds: requests join (prefilled apart, then appended to the
caches) and finished rows leave at once. engine.py drives it step by step for a server; `generate` is
a loop over an engine that holds all of its prompts from the first step.

Checks that cost host syncs (the verifier's input validation, a NaN scan of the target's and the
drafter's logits) run in the first round of each call, and in every round with `debug=True` (or
DRAFTSMITH_DEBUG=1); the inputs themselves are validated once where they enter (`generate`,
`DecodeOptions`). Timing wraps the steps (`_timed`), outside their lines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from draftsmith.speculative import calibrate, kinds
from draftsmith.speculative.adaptive import adaptive_lengths
from draftsmith.speculative.errors import InvalidInputError, NumericalError
from draftsmith.speculative.kernels import RoundNoise, make_verifier
from draftsmith.speculative.kv import KVState
from draftsmith.speculative.options import DecodeOptions, Request
from draftsmith.speculative.proposers import Draft, Proposer, RoundContext, left_pad
from draftsmith.speculative.rng import RowGenerators
from draftsmith.speculative.sampling import BatchSampling, SamplingParams
from draftsmith.speculative.attention import grouped_attention, switchable
from draftsmith.speculative.small_gemm import Plan, patched, plan, resolve_mode, signature
from draftsmith.speculative.tree import Leaves, take_leaves
from draftsmith.speculative.verify import VerifyOutput, validate_verify_inputs

Verifier = Callable[..., VerifyOutput]
DEBUG_ENV = "DRAFTSMITH_DEBUG"


@dataclass
class DecodeStats:
    """What one `generate` call measured. Rounds are counted per row: a batch round of B rows is B rounds."""

    draft_len: int
    rounds: int = 0
    new_tokens: int = 0
    emitted_hist: list[int] = field(default_factory=list)  # [D + 2]: rounds that emitted k tokens (k >= 1)
    offered: list[int] = field(default_factory=list)  # [D]: rounds whose draft reached position i
    accepted: list[int] = field(default_factory=list)  # [D]: ... and accepted it
    drafted: int = 0  # draft tokens proposed, over all rounds (fewer than D per round with a confidence stop)
    leaf_accepts: int = 0  # rounds in which a sibling leaf replaced a rejected draft token (tree.py)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    target_s: float = 0.0  # target forward passes of the rounds
    verify_s: float = 0.0  # the verifier itself
    other_s: float = 0.0
    total_s: float = 0.0
    first_token_s: float | None = None  # from the start of the call to the first emitted token
    round_s: list[float] = field(default_factory=list)  # wall time of each batch round
    round_tokens: list[int] = field(default_factory=list)  # tokens emitted in each batch round

    def __post_init__(self):
        self.emitted_hist = self.emitted_hist or [0] * (self.draft_len + 2)
        self.offered = self.offered or [0] * self.draft_len
        self.accepted = self.accepted or [0] * self.draft_len

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per target pass (the AL), bonus/recovered token included."""
        return sum(k * n for k, n in enumerate(self.emitted_hist)) / max(self.rounds, 1)

    @property
    def position_acceptance(self) -> list[float | None]:
        """P(draft token i accepted | tokens before it accepted), per position i = 1..D."""
        return [a / o if o else None for a, o in zip(self.accepted, self.offered)]

    @property
    def mean_draft_len(self) -> float:
        """Draft tokens proposed per round (D with a fixed length, less with `draft_confidence`)."""
        return self.drafted / max(self.rounds, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def record(self, num_accepted: list[int], lens: list[int]) -> None:
        for n, m in zip(num_accepted, lens):
            self.rounds += 1
            self.drafted += m
            self.emitted_hist[n + 1] += 1
            for i in range(min(n + 1, m)):
                self.offered[i] += 1
                self.accepted[i] += int(i < n)

    def to_dict(self) -> dict:
        return {
            "draft_len": self.draft_len,
            "rounds": self.rounds,
            "new_tokens": self.new_tokens,
            "acceptance_length": self.acceptance_length,
            "emitted_hist": self.emitted_hist,
            "position_acceptance": self.position_acceptance,
            "mean_draft_len": self.mean_draft_len,
            "offered": self.offered,
            "accepted": self.accepted,
            "leaf_accepts": self.leaf_accepts,
            "tokens_per_s": self.tokens_per_s,
            "time_s": {
                "prefill": self.prefill_s,
                "draft": self.draft_s,
                "target": self.target_s,
                "verify": self.verify_s,
                "other": self.other_s,
                "total": self.total_s,
                "first_token": self.first_token_s,
            },
        }


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # per prompt: the generated ids (a stop token, if hit, is the last one)
    finish_reasons: list[str]  # per prompt: "stop" or "length"
    stats: DecodeStats


class SpeculativeDecoder:
    """Exact speculative decoding of a Hugging Face causal LM with any `Proposer` (or none)."""

    def __init__(
        self,
        target: torch.nn.Module,
        proposer: Proposer | None = None,
        *,
        stop_token_ids: list[int] | tuple[int, ...] = (),
        verifier: Verifier | str | None = None,
        small_gemm: bool | str | None = None,
        grouped_attention: bool = True,
        debug: bool | None = None,
        measure_costs: bool = True,
    ):
        """`verifier`: a callable with verify_native's signature (given explicit noise from the
        per-request generators), or a mode for `kernels.select_verifier`: "auto" (the fused Triton
        kernel on CUDA, the reference elsewhere), "native" or "triton". A mode given here wins over
        the DRAFTSMITH_VERIFIER environment variable, which chooses when none is given. A kernel
        draws its random numbers in the kernel (Philox, keyed by each request's seed).

        `small_gemm`: compute linear layers over a few rows (verification passes) as W @ x.T where this
        CPU runs that faster (see small_gemm.py): "auto" (measured per weight shape and row count), True
        or "on" (always), False or "off"; None = $DRAFTSMITH_SMALL_GEMM, else auto on CPU, off elsewhere.
        `grouped_attention`: masked passes on the CPU attend over grouped key/value heads without copying
        them (attention.py); False keeps Transformers' own sdpa (for comparison).
        `debug`: run the per-round checks in every round, not only the first of a call (None: the
        DRAFTSMITH_DEBUG environment variable).
        `measure_costs`: what this machine's passes and the drafter's rounds cost, which the adaptive draft
        length prices rounds with, is measured (on a new machine: minutes) or read now, not inside a
        timed request. False for decoders that decode at fixed draft lengths only (evaluations, training's
        held-out AL): an adaptive request then measures them first (`measure_costs()`)."""
        self.target = target
        self.proposer = proposer
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.device = next(target.parameters()).device
        self.verifier = make_verifier(self.device, verifier)
        self.vocab_size = target.get_output_embeddings().weight.shape[0]
        self.small_gemm = resolve_mode(self.device, small_gemm)
        self._linear_plan: Plan | None = None
        self.grouped_attention = grouped_attention
        self._attention: list | None = None  # the model configs switched to grouped attention (attention.py)
        # which fast paths the passes take (small_gemm.signature of the plan, and grouped attention or not):
        # the measured costs below are keyed by it
        self.path_signature = "off"
        # The adaptive draft length's pass costs and the drafter's round costs (None where calibration is
        # off or there is no drafter), measured once per decoder (remembered per machine), read by every run.
        self.pass_costs: dict[int, list[float]] | None = None
        self.draft_costs: dict | None = None
        self._costs_measured = False
        self.debug = os.environ.get(DEBUG_ENV, "") not in ("", "0") if debug is None else debug
        self.fast_paths()  # plans the paths (measuring the linear routes on a new machine)
        if measure_costs:
            self.measure_costs()

    def measure_costs(self) -> None:
        """Measure (on a new machine) or read the costs the adaptive draft length prices rounds with:
        the target's passes, then the drafter's rounds timed at fixed draft lengths (these passes and the
        drafter's steps, as the runtime runs them). Once per decoder."""
        if self._costs_measured or self.proposer is None:
            return
        self._costs_measured = True
        with self.fast_paths():
            self.pass_costs = calibrate.batch_pass_costs(self.target, self.path_signature)
        if self.pass_costs is not None:
            debug, self.debug = self.debug, False  # the rounds are timed without the per-round checks
            try:
                self.draft_costs = calibrate.draft_costs(self)
            finally:
                self.debug = debug

    def fast_paths(self) -> contextlib.AbstractContextManager:
        """The context the runtime's forward passes run in: the few-row linear path (small_gemm.py) and
        masked grouped-query attention without copied heads (attention.py). Which layers take the
        few-row path is planned once per decoder (the first time), not on every engine step."""
        if self._attention is None:
            kind = kinds.find(self.proposer.kind) if self.proposer is not None else None
            modules = [self.target, *(kind.modules(self.proposer) if kind is not None else [])]
            self._attention = switchable(*modules) if self.grouped_attention else []
            if self.small_gemm != "off":
                self._linear_plan = plan(*modules, mode=self.small_gemm)
            self.path_signature = signature(self._linear_plan) + ("+gqa" if self._attention else "")
        return _both(self._linear_plan, self._attention)

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams | list[SamplingParams] = SamplingParams(),
        options: DecodeOptions = DecodeOptions(),
        *,
        on_emit: Callable[[int, list[int]], None] | None = None,
    ) -> GenerationResult:
        """Decode every prompt; `on_emit(prompt_index, new_ids)` streams tokens as they are accepted.

        `sampling`: one `SamplingParams` for all prompts or one per prompt. `options` (a
        `DecodeOptions`): the token budget and how to draft; without a proposer D is 0. Output is
        exact whatever the options."""
        from draftsmith.speculative.engine import Engine  # the engine drives this module's _Run

        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        self._validate(prompts, params)
        engine = Engine(self, options)
        index = {engine.add(Request(p, s, options.max_new_tokens)): i for i, (p, s) in enumerate(zip(prompts, params))}
        outputs: list[list[int]] = [[] for _ in prompts]
        finish_reasons = ["length"] * len(prompts)
        while engine.busy:
            for e in engine.step():
                i = index[e.request_id]
                outputs[i].extend(e.tokens)
                if on_emit is not None and e.tokens:
                    on_emit(i, e.tokens)
                if e.finish_reason is not None:
                    finish_reasons[i] = e.finish_reason
        return GenerationResult(outputs, finish_reasons, engine.finish())

    def _validate(self, prompts, params) -> None:
        if not prompts:
            raise InvalidInputError("no prompts to decode")
        if len(params) != len(prompts):
            raise InvalidInputError(f"{len(params)} sampling settings for {len(prompts)} prompts")
        for i, p in enumerate(prompts):
            if not p:
                raise InvalidInputError(f"prompt {i} is empty; every prompt needs at least one token")
            if min(p) < 0 or max(p) >= self.vocab_size:
                raise InvalidInputError(f"prompt {i} has token ids outside 0..{self.vocab_size - 1}")


@contextlib.contextmanager
def _both(layers: Plan | None, configs: list):
    with patched(layers or []), grouped_attention(configs):
        yield


def _timed(stat: str):
    """Add a step's wall time to `DecodeStats.<stat>` (kept out of the step's own lines)."""
    def wrap(step):
        @functools.wraps(step)
        def timed(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return step(self, *args, **kwargs)
            finally:
                setattr(self.stats, stat, getattr(self.stats, stat) + time.perf_counter() - t0)
        return timed
    return wrap


class _Run:
    """The running batch: its rows' caches, histories, generators, outputs and statistics. Rows join
    between rounds (`join`) and leave as soon as they finish (`leave`); engine.py drives it."""

    def __init__(self, decoder: SpeculativeDecoder, options: DecodeOptions,
                 on_emit: Callable[[int, list[int]], None] | None = None):
        self.d = decoder
        self.proposer = decoder.proposer
        self.options = options if decoder.proposer is not None else dataclasses.replace(options, draft_len=0)
        self.start = time.perf_counter()
        self.on_emit = on_emit  # on_emit(request_id, new_ids)
        self.stats = DecodeStats(draft_len=self.options.draft_len)
        self.rows: list[int] = []  # request id of each active row
        self.requests: list[Request] = []  # per row: its request (budget, draft length, stop ids)
        self.history: list[list[int]] = []  # per row: prompt + emitted tokens
        self.outputs: dict[int, list[int]] = {}  # per request id: its emitted tokens
        self.finish_reasons: dict[int, str] = {}  # per request id: "stop" or "length"
        self.sampling: BatchSampling | None = None  # None while the batch is empty
        self.rng: RowGenerators | None = None
        self.target_kv: KVState | None = None
        self.target_hidden: torch.Tensor | None = None  # [B, H] for proposers that read it
        self.hidden_ready: list[bool] = []  # per row: target_hidden holds its state (not a row that just joined)
        self.leaves: Leaves | None = None  # this round's sibling leaves (tree.py)
        self.rounds_run = 0
        self.adaptive = adaptive_lengths(self.options, decoder) if self.options.draft_len > 0 else None

    @property
    def active(self) -> bool:
        return bool(self.rows)

    @property
    def check(self) -> bool:
        """Run the checks that cost host syncs in this round (see the module docstring)."""
        return self.d.debug or self.rounds_run == 0

    def wants_states(self) -> bool:
        p = self.proposer
        return p is not None and (p.needs_target_hidden or p.needs_target_states)

    def captured(self, wanted: bool) -> list[int] | bool:
        """What a target pass asks Transformers to keep of its hidden states: the proposer's layers only
        (the rest come back as None), not every layer's: keeping all of them alive cost SmolLM2's prefill
        over a 672-token prompt about 7% on an AMD EPYC (fresh memory for 31 states instead of reused).
        Indices count as in the full tuple from transformers 5.25 on (pyproject pins it; 5.20 counted a
        selection from the first layer's output, one lower: tests/speculative/test_kv.py checks it)."""
        return list(self.proposer.target_layers) if wanted else False

    def states(self, hidden_states) -> torch.Tensor:
        """The proposer's target states from a pass's `hidden_states`: its layers, concatenated."""
        layers = self.proposer.target_layers
        if len(layers) == 1:
            return hidden_states[layers[0]]
        return torch.cat([hidden_states[i] for i in layers], dim=-1)

    @_timed("prefill_s")
    def join(self, ids: list[int], requests: list[Request]) -> None:
        """Requests join the batch (between rounds): their prompts are prefilled in a cache of their own,
        which is appended to the running one; the proposer takes them in the same way (`add_rows`), or
        starts afresh (`begin`) when the batch is empty."""
        device, proposer = self.d.device, self.proposer
        history = [list(r.prompt) for r in requests]
        sampling = BatchSampling.from_params([r.sampling for r in requests], device)
        rng = RowGenerators([r.sampling.seed for r in requests], device)
        kv = KVState(self.d.target, len(requests), device)
        states = self.prefill(kv, history)
        if not self.rows:  # an empty batch starts afresh
            self.target_kv, self.sampling, self.rng, self.target_hidden = kv, sampling, rng, None
            if proposer is not None:
                proposer.begin(history, sampling, rng)
                if states is not None:
                    proposer.target_states(states)
        else:
            self.target_kv.append_rows(kv)
            self.sampling = self.sampling.extend(sampling)
            self.rng.extend(rng)
            if self.target_hidden is not None:  # the new rows have none until their first round
                self.target_hidden = torch.cat([self.target_hidden, self.target_hidden.new_zeros(
                    len(requests), self.target_hidden.shape[1])])
            if proposer is not None:
                proposer.add_rows(history, sampling, rng, states)
        self.rows += ids
        self.requests += requests
        self.history += history
        self.hidden_ready += [False] * len(requests)
        if self.adaptive is not None:
            self.adaptive.add_rows(len(requests), alone=[not r.sampling.greedy for r in requests])
        for i in ids:
            self.outputs[i], self.finish_reasons[i] = [], "length"

    def prefill(self, kv: KVState, prompts: list[list[int]]) -> list[torch.Tensor] | None:
        """Fill `kv` with the prompts but their last tokens; the proposer's target states at those
        positions when it reads them (else None)."""
        context = [p[:-1] for p in prompts]
        proposer = self.proposer
        wants_states = proposer is not None and proposer.needs_target_states
        states = [torch.zeros(0, 0, device=self.d.device) for _ in context]
        if max(len(c) for c in context) > 0:
            tokens, valid = left_pad(context, self.d.device)
            out = kv.forward(tokens, valid, logits_to_keep=1, output_hidden_states=self.captured(wants_states))
            if bool(torch.isnan(out.logits).any()):  # once per prefill: a broken target shows here
                raise NumericalError("the target produced NaN logits; check the model weights and dtype")
            if wants_states:
                states = [h[v] for h, v in zip(self.states(out.hidden_states), valid)]
        return states if wants_states else None

    def round(self) -> None:
        t0 = time.perf_counter()
        draft = self.propose()
        logits, hidden = self.score(draft)
        out, path = self.verify(logits, draft)
        emitted, finished = self.accept(out, draft)
        self.rollback(out, draft, emitted, hidden, path)
        self.leave(finished)
        self.rounds_run += 1
        self.stats.round_s.append(time.perf_counter() - t0)

    @_timed("draft_s")
    def propose(self) -> Draft:
        """Up to D draft tokens per row (never past the row's token budget: a round emits at most D + 1)."""
        max_lens = [min(self.draft_len(q), q.max_new_tokens - len(self.outputs[r]) - 1)
                    for r, q in zip(self.rows, self.requests)]
        proposer, batch = self.proposer, len(self.rows)
        if proposer is not None and proposer.needs_target_hidden:  # rows that just joined have no state yet
            max_lens = [m if ready else 0 for m, ready in zip(max_lens, self.hidden_ready)]
        if self.adaptive is not None:  # each row's own length, from its acceptance so far
            max_lens = self.adaptive.lengths(max_lens)
        if proposer is None or max(max_lens) <= 0 or (proposer.needs_target_hidden and self.target_hidden is None):
            return Draft.empty(batch, self.d.device)
        ctx = RoundContext(self.history, max_lens, self.sampling, self.rng, self.options, self.target_hidden,
                           check=self.check, **self.row_drafting())
        return proposer.propose(ctx)

    def row_drafting(self) -> dict[str, list]:
        """Each row's confidence stop, sibling leaves (within the batch's A: the engine sizes the pass)
        and leaf minimum probability, its request's where it sets them, else the options'."""
        o = self.options
        return {
            "confidence": [o.draft_confidence if q.draft_confidence is None else q.draft_confidence
                           for q in self.requests],
            "alternatives": [o.draft_alternatives if q.draft_alternatives is None
                             else min(q.draft_alternatives, o.draft_alternatives) for q in self.requests],
            "leaf_min_prob": [o.leaf_min_prob if q.leaf_min_prob is None else q.leaf_min_prob for q in self.requests],
        }

    @_timed("target_s")
    def score(self, draft: Draft) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target pass over [last, d_1 .. d_D] and any sibling leaves: logits [B, T, V], T = D+1
        plus the leaves' slots (and the proposer's target states there, if it reads them)."""
        batch, width = draft.tokens.shape
        device = self.d.device
        last = torch.tensor([h[-1] for h in self.history], dtype=torch.int64, device=device)
        tokens = torch.cat([last[:, None], draft.tokens], dim=1)
        valid = torch.cat(
            [torch.ones(batch, 1, dtype=torch.bool, device=device),
             torch.arange(width, device=device)[None, :] < draft.lens[:, None]],
            dim=1,
        )
        tree = None
        self.leaves = Leaves.from_draft(draft.alternatives, draft.lens, self.sampling.greedy)
        if self.leaves is not None:
            tokens, valid, tree = self.leaves.attach(tokens, valid)
        wants = self.wants_states()
        out = self.target_kv.forward(tokens, valid, output_hidden_states=self.captured(wants), tree=tree)
        return out.logits, (self.states(out.hidden_states) if wants else None)

    @_timed("verify_s")
    def verify(self, logits: torch.Tensor, draft: Draft) -> tuple[VerifyOutput, torch.Tensor | None]:
        """The chain's verification, then (with leaves) a leaf in place of a rejected greedy token; also
        the slots whose outputs were the emitted tokens ([B, D+1], None = the chain's own)."""
        chain = logits[:, : draft.tokens.shape[1] + 1]
        if self.check:
            validate_verify_inputs(chain, draft.tokens, draft.lens, draft.probs)
        noise = RoundNoise(self.rng, (~self.sampling.greedy).tolist(), draft.lens.tolist(), draft.tokens.shape[1],
                           logits.shape[-1])
        out = self.d.verifier(chain, draft, self.sampling, noise, self.check)
        if self.leaves is None:
            return out, None
        out, path, hit = take_leaves(out, logits, draft.lens, self.leaves)
        self.stats.leaf_accepts += int(hit.sum())
        return out, path

    def accept(self, out: VerifyOutput, draft: Draft) -> tuple[list[list[int]], list[bool]]:
        """Append each row's accepted tokens and its recovered/bonus token (up to a stop token or the
        budget); the emitted tokens per row and which rows are finished."""
        num_accepted, drafted = out.num_accepted.tolist(), draft.lens.tolist()
        self.stats.record(num_accepted, drafted)
        if self.adaptive is not None:
            self.adaptive.observe(drafted, num_accepted)
        emitted = [row[: n + 1] for row, n in zip(out.tokens.tolist(), num_accepted)]
        before = self.stats.new_tokens
        finished = [self.emit(b, e) for b, e in enumerate(emitted)]
        self.stats.round_tokens.append(self.stats.new_tokens - before)
        return emitted, finished

    def rollback(self, out: VerifyOutput, draft: Draft, emitted: list[list[int]], hidden: torch.Tensor | None,
                 path: torch.Tensor | None) -> None:
        """Target and drafter keep the state of the emitted path only: the target's cache its slots
        (the last emitted token is fed next round), the drafter whatever its kind keeps."""
        width = draft.tokens.shape[1] + 1
        on_path = torch.arange(width, device=self.d.device)[None, :] <= out.num_accepted[:, None]  # [B, D+1]
        keep = on_path if path is None else self.leaves.kept_slots(path, on_path)
        if path is not None and hidden is not None:  # the path's states, in emitted order
            hidden = hidden.gather(1, path[..., None].expand(-1, -1, hidden.shape[-1]))
        self.target_kv.keep_last(keep)
        proposer = self.proposer
        if proposer is None:
            return
        if proposer.needs_target_states:
            proposer.target_states([h[: len(e)] for h, e in zip(hidden, emitted)])
        proposer.rollback(out.num_accepted.tolist(), emitted)
        if proposer.needs_target_hidden:
            self.target_hidden = hidden[torch.arange(len(emitted), device=hidden.device), out.num_accepted]
            self.hidden_ready = [True] * len(emitted)

    def emit(self, b: int, tokens: list[int]) -> bool:
        """Append row b's tokens up to a stop token or the budget; True when the row is finished."""
        row, request = self.rows[b], self.requests[b]
        room = request.max_new_tokens - len(self.outputs[row])
        tokens = tokens[:room]
        stops = frozenset() if request.ignore_eos else self.d.stop_token_ids
        stop_at = next((i for i, t in enumerate(tokens) if t in stops or t in request.stop_token_ids), None)
        if stop_at is not None:
            tokens = tokens[: stop_at + 1]
            self.finish_reasons[row] = "stop"
        self.outputs[row].extend(tokens)
        self.history[b].extend(tokens)
        self.stats.new_tokens += len(tokens)
        if self.stats.first_token_s is None and tokens:
            self.stats.first_token_s = time.perf_counter() - self.start
        if self.on_emit is not None and tokens:
            self.on_emit(row, tokens)
        return stop_at is not None or len(self.outputs[row]) >= request.max_new_tokens

    def draft_len(self, request: Request) -> int:
        """The most tokens a request's row drafts per round: its own D, within the batch's."""
        d = self.options.draft_len
        return d if request.draft_len is None else min(request.draft_len, d)

    def leave(self, finished: list[bool]) -> None:
        """Finished rows leave the batch (their caches' rows and generators with them); an empty batch
        frees its caches."""
        if not any(finished):
            return
        keep_rows = [b for b, f in enumerate(finished) if not f]
        index = torch.tensor(keep_rows, dtype=torch.int64, device=self.d.device)
        self.rows = [self.rows[b] for b in keep_rows]
        self.requests = [self.requests[b] for b in keep_rows]
        self.history = [self.history[b] for b in keep_rows]
        self.hidden_ready = [self.hidden_ready[b] for b in keep_rows]
        if self.adaptive is not None:
            self.adaptive.select(keep_rows)
        self.sampling = self.sampling.select(index)
        self.rng.select(keep_rows)
        if self.target_hidden is not None:
            self.target_hidden = self.target_hidden[index]
        if self.rows:
            self.target_kv.select_rows(index)
        else:
            self.target_kv = self.target_hidden = None
        if self.proposer is not None:
            self.proposer.select_rows(index)

    def finish(self) -> DecodeStats:
        """The statistics so far, with the total time and what the steps do not account for."""
        s = self.stats
        s.total_s = time.perf_counter() - self.start
        s.other_s = max(s.total_s - s.prefill_s - s.draft_s - s.target_s - s.verify_s, 0.0)
        return s
