"""A step-level engine: a running batch that requests join and leave between speculative rounds.

    engine = Engine(decoder, DecodeOptions(draft_len=4), max_batch=8, kv_budget=4096)
    rid = engine.add(Request(prompt_ids, SamplingParams(0.7, seed=1), max_new_tokens=64))
    while engine.busy:
        for e in engine.step():      # Emission(request_id, tokens, finish_reason)
            ...

`add` queues a request. `step` lets waiting requests join (prefilled in caches of their own, then
appended to the running batch's: `_Run.join` in generate.py), runs one round (propose -> score ->
verify -> accept -> rollback) for every running row and reports what each row emitted; rows that
finish leave the batch at once and their cache rows are freed. `cancel` takes a request out between
steps. `SpeculativeDecoder.generate` is a loop over an engine that holds every prompt at once.

Exactness is the runtime's own: every row's computation and random stream are its own (a row draws
only from its request's generator, in an order that depends only on the row), so a greedy request
emits the target's greedy decoding of it alone, and a seeded sampled request repeats exactly whatever
joins or leaves around it (as for any batch, up to the floating-point reduction order of batch shapes).

Per request: its sampling and seed, its token budget, its own stop ids besides the decoder's, and how it
drafts: its draft length within the engine's D, its confidence stop, its sibling leaves within the
engine's A (the engine sizes the batch's verification pass) and their minimum probability (`Request`;
unset, the engine's `DecodeOptions`). A row's drafts depend on its own settings only, so its tokens do
not depend on what the other rows ask for.

Memory: with `kv_budget` (tokens), a running request holds a reservation of prompt + max_new_tokens + D
cache slots (the most its row can fill: its context, plus one round's verification slots) from the
step it joins until it leaves; waiting requests join in arrival order while the budget and `max_batch`
allow (the first that does not fit waits, and those behind it too). A request that could never fit is
refused by `add`. Holes left by ragged rounds are bounded by the cache's compaction (kv.py).
`ledger()` prices the reservations in bytes, for the target and (from its kind's footprint) the drafter.

The engine is not thread-safe: one thread owns it (the server's engine thread, server.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from draftsmith.speculative import kinds
from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.generate import DecodeStats, SpeculativeDecoder, _Run
from draftsmith.speculative.options import DecodeOptions, Request


@dataclass
class Emission:
    """What one request emitted in one step."""

    request_id: int
    tokens: list[int]  # new token ids (a stop token, if hit, is the last one)
    finish_reason: str | None = None  # "stop" or "length" when the request is done, else None


class Engine:
    """A running batch of requests over one `SpeculativeDecoder` (see the module docstring)."""

    def __init__(self, decoder: SpeculativeDecoder, options: DecodeOptions = DecodeOptions(), *,
                 max_batch: int | None = None, kv_budget: int | None = None, min_join: int = 1):
        """`options`: how the batch drafts (D = `draft_len`, the most any request drafts; its
        `max_new_tokens` is unused, each request brings its own). `max_batch`: most running rows.
        `kv_budget`: most cache slots (tokens) reserved by running requests. None = no limit.
        `min_join`: while rows run, waiting requests join only once at least this many of them can (or
        all that wait): each join copies the running cache, so a throughput job (regeneration) joins
        rows in groups; a server joins each request at once (1)."""
        if max_batch is not None and max_batch < 1:
            raise InvalidInputError(f"max_batch must be >= 1, got {max_batch}")
        if min_join < 1:
            raise InvalidInputError(f"min_join must be >= 1, got {min_join}")
        if kv_budget is not None and kv_budget < 1:
            raise InvalidInputError(f"the KV budget must be >= 1 token, got {kv_budget}")
        self.decoder, self.options = decoder, options
        self.max_batch, self.kv_budget, self.min_join = max_batch, kv_budget, min_join
        self.run = _Run(decoder, options, self._collect)
        self.waiting: deque[tuple[int, Request]] = deque()
        self.reserved: dict[int, int] = {}  # running request id -> the cache slots it holds in reserve
        self._next_id = 0
        self._emitted: dict[int, list[int]] = {}  # this step's tokens per request id
        self._kv_per_token: tuple[int, int] | None = None  # (target, drafter) bytes, computed on first use

    # --- requests in and out ----------------------------------------------------------------------

    def add(self, request: Request) -> int:
        """Queue a request; its id. Refused (InvalidInputError) when it could never run here."""
        vocab = self.decoder.vocab_size
        if min(request.prompt) < 0 or max(request.prompt) >= vocab:
            raise InvalidInputError(f"the prompt has token ids outside 0..{vocab - 1}")
        need = self.need(request)
        if self.kv_budget is not None and need > self.kv_budget:
            raise InvalidInputError(f"the request needs {need} KV tokens (prompt {len(request.prompt)} + "
                                    f"max_new_tokens {request.max_new_tokens} + D {self.run.options.draft_len}); "
                                    f"the budget is {self.kv_budget}")
        rid = self._next_id
        self._next_id += 1
        self.waiting.append((rid, request))
        return rid

    def need(self, request: Request) -> int:
        """The cache slots a request reserves while it runs."""
        return len(request.prompt) + request.max_new_tokens + self.run.options.draft_len

    def cancel(self, request_id: int) -> bool:
        """Take a request out, waiting or running (its row leaves, as a finished row would). False
        when the engine does not hold it (finished, cancelled or unknown)."""
        for i, (rid, _) in enumerate(self.waiting):
            if rid == request_id:
                del self.waiting[i]
                return True
        if request_id not in self.reserved:
            return False
        with torch.inference_mode():
            self.run.leave([rid == request_id for rid in self.run.rows])
        self._forget(request_id)
        return True

    def abort(self) -> list[int]:
        """Drop the running batch (after an error inside a step: its state cannot be trusted); the ids of
        the requests it held. Waiting requests stay queued; the next step starts a fresh batch."""
        dropped = list(self.reserved)
        stats = self.run.stats
        self.run = _Run(self.decoder, self.options, self._collect)
        self.run.stats = stats
        self.reserved.clear()
        return dropped

    # --- the step -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Emission]:
        """Admit what fits, run one round for every running row; each running row's emission."""
        with self.decoder.fast_paths():
            self._admit()
            if not self.run.rows:
                return []
            before = list(self.run.rows)
            self._emitted = {}
            self.run.round()
        running = set(self.run.rows)
        out = []
        for rid in before:
            reason = None
            if rid not in running:
                reason = self.run.finish_reasons[rid]
                self._forget(rid)
            out.append(Emission(rid, self._emitted.get(rid, []), reason))
        return out

    def _admit(self) -> None:
        joining: list[tuple[int, Request]] = []
        while self.waiting:
            rid, request = self.waiting[0]
            if self.max_batch is not None and len(self.run.rows) + len(joining) >= self.max_batch:
                break
            if self.kv_budget is not None and self.reserved_tokens + self.need(request) > self.kv_budget:
                break
            self.waiting.popleft()
            joining.append((rid, request))
            self.reserved[rid] = self.need(request)
        if joining and self.run.rows and len(joining) < self.min_join and self.waiting:
            for rid, request in reversed(joining):  # too few to be worth a join: wait for more room
                self.waiting.appendleft((rid, request))
                del self.reserved[rid]
            return
        if joining:
            self.run.join([rid for rid, _ in joining], [request for _, request in joining])

    def _collect(self, request_id: int, tokens: list[int]) -> None:
        self._emitted.setdefault(request_id, []).extend(tokens)

    def _forget(self, request_id: int) -> None:
        self.reserved.pop(request_id, None)
        self.run.outputs.pop(request_id, None)
        self.run.finish_reasons.pop(request_id, None)

    # --- state ----------------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Requests are waiting or running."""
        return bool(self.waiting or self.run.rows)

    @property
    def running(self) -> int:
        return len(self.run.rows)

    @property
    def queued(self) -> int:
        return len(self.waiting)

    @property
    def reserved_tokens(self) -> int:
        return sum(self.reserved.values())

    @property
    def draft_len(self) -> int:
        """The batch's D (0 without a drafter)."""
        return self.run.options.draft_len

    def finish(self) -> DecodeStats:
        """The statistics of every round so far."""
        return self.run.finish()

    def ledger(self) -> dict:
        """The running requests' KV reservations in tokens and bytes (target, drafter), and the budget."""
        target_per_token, drafter_per_token = self._bytes_per_token()
        tokens = self.reserved_tokens
        return {
            "running": self.running,
            "queued": self.queued,
            "kv_budget_tokens": self.kv_budget,
            "reserved_tokens": tokens,
            "per_request_tokens": dict(self.reserved),
            "target_kv_bytes": tokens * target_per_token,
            "drafter_kv_bytes": tokens * drafter_per_token,
        }

    def _bytes_per_token(self) -> tuple[int, int]:
        if self._kv_per_token is None:
            target, proposer = self.decoder.target, self.decoder.proposer
            element = next(target.parameters()).element_size()
            drafter = kinds.of(proposer).footprint(proposer, target).kv_bytes_per_token if proposer is not None else 0
            self._kv_per_token = (kinds.kv_bytes_per_token(target.config, element_size=element), drafter)
        return self._kv_per_token
