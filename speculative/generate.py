"""The decoding loop: prefill, then rounds of propose -> verify -> accept -> rollback.

One round for every row still decoding:

    propose   the drafter proposes up to D tokens d_1..d_D (and q), given the context
    verify    one target pass over [last, d_1, .., d_D] gives p at D+1 positions; the verifier keeps
              the longest acceptable prefix and adds the recovered or bonus token
    accept    the emitted tokens are appended, stopping at a stop token or max_new_tokens
    rollback  target and drafter caches drop the slots of rejected tokens; nothing is re-encoded

The target's cache always holds the context except its newest token (`last`), which is the first
input of the next verification pass. With no drafter every round has D = 0 and this is plain
decoding through the same code. With `draft_alternatives` > 0, greedy rows also verify the drafter's
runner-up tokens as sibling leaves of the chain in the same pass (tree.py). Greedy rows reproduce the target's greedy decoding token for token;
sampled rows emit exactly the target's (processed) distribution.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.kv import KVState
from draftsmith.speculative.proposers import Draft, Proposer, RoundContext, left_pad
from draftsmith.speculative.rng import RowGenerators
from draftsmith.speculative.sampling import BatchSampling, SamplingParams
from draftsmith.speculative.small_gemm import small_row_linears, wanted
from draftsmith.speculative.tree import Leaves, take_leaves
from draftsmith.speculative.verify import VerifyOutput

Verifier = Callable[..., VerifyOutput]


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
        verifier: Verifier | str = "auto",
        small_gemm: bool | None = None,
    ):
        """`verifier`: a callable with verify_native's signature, or a mode for
        `kernels.select_verifier`: "auto" (the fused Triton kernel on CUDA, the reference elsewhere),
        "native" or "triton"; the DRAFTSMITH_VERIFIER environment variable overrides a mode.
        A kernel chosen by mode draws its random numbers in the kernel (Philox, keyed by each
        request's seed); a callable is always given explicit noise from the per-request generators.

        `small_gemm`: compute linear layers over a few rows (verification passes) as W @ x.T, which
        CPU BLAS libraries run far faster (see small_gemm.py); None = on for CPU devices."""
        self.target = target
        self.proposer = proposer
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.device = next(target.parameters()).device
        self.noise_in_kernel = False
        if isinstance(verifier, str):
            from draftsmith.speculative.kernels import select_verifier, verify_fused

            verifier = select_verifier(self.device, verifier)
            self.noise_in_kernel = verifier is verify_fused
        self.verifier = verifier
        self.vocab_size = target.get_output_embeddings().weight.shape[0]
        self.small_gemm = wanted(self.device) if small_gemm is None else small_gemm

    def fast_linears(self) -> contextlib.AbstractContextManager:
        """The context the runtime's forward passes run in (small_gemm.py), or a no-op."""
        if not self.small_gemm:
            return contextlib.nullcontext()
        return small_row_linears(self.target, *proposer_modules(self.proposer))

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams | list[SamplingParams] = SamplingParams(),
        *,
        max_new_tokens: int = 128,
        draft_len: int = 4,
        draft_confidence: float = 0.0,
        draft_alternatives: int = 0,
        leaf_min_prob: float = 0.0,
        on_emit: Callable[[int, list[int]], None] | None = None,
    ) -> GenerationResult:
        """Decode every prompt; `on_emit(prompt_index, new_ids)` streams tokens as they are accepted.

        `draft_len` is the most tokens drafted per round; with `draft_confidence` > 0 a drafter with
        probabilities stops a row's draft early, after the first token it gives less than that
        probability (see proposers.py). With `draft_alternatives` = A > 0 a drafter with logits also
        offers its A runner-ups at each draft position of greedy rows, verified as a tree in the same
        target pass (tree.py); with `leaf_min_prob` > 0 only those its own probabilities give at
        least that chance of being taken. Output is exact either way."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        self._validate(prompts, params, max_new_tokens, draft_len, draft_confidence)
        if draft_alternatives < 0:
            raise InvalidInputError(f"draft alternatives must be >= 0, got {draft_alternatives}")
        if not 0.0 <= leaf_min_prob < 1.0:
            raise InvalidInputError(f"leaf min prob must lie in [0, 1), got {leaf_min_prob}")
        draft_len = draft_len if self.proposer is not None else 0
        run = _Run(self, prompts, params, max_new_tokens, draft_len, on_emit, draft_confidence, draft_alternatives,
                   leaf_min_prob)
        with self.fast_linears():
            run.prefill()
            while run.active:
                run.round()
        run.stats.total_s = time.perf_counter() - run.start
        run.stats.other_s = max(
            run.stats.total_s - run.stats.prefill_s - run.stats.draft_s - run.stats.target_s - run.stats.verify_s, 0.0
        )
        return GenerationResult(run.outputs, run.finish, run.stats)

    def _validate(self, prompts, params, max_new_tokens, draft_len, draft_confidence) -> None:
        if not prompts:
            raise InvalidInputError("no prompts to decode")
        if len(params) != len(prompts):
            raise InvalidInputError(f"{len(params)} sampling settings for {len(prompts)} prompts")
        for i, p in enumerate(prompts):
            if not p:
                raise InvalidInputError(f"prompt {i} is empty; every prompt needs at least one token")
            if min(p) < 0 or max(p) >= self.vocab_size:
                raise InvalidInputError(f"prompt {i} has token ids outside 0..{self.vocab_size - 1}")
        if max_new_tokens < 1:
            raise InvalidInputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if draft_len < 0:
            raise InvalidInputError(f"draft length must be >= 0, got {draft_len}")
        if not 0.0 <= draft_confidence < 1.0:
            raise InvalidInputError(f"draft confidence must lie in [0, 1), got {draft_confidence}")


def proposer_modules(proposer) -> list[torch.nn.Module]:
    """The modules a proposer runs (its draft model, or its heads, or those of a combination's
    drafter), for small_gemm."""
    inner = getattr(proposer, "drafter", None)
    if inner is not None:
        return proposer_modules(inner)
    found = [getattr(proposer, name, None) for name in ("model", "heads")]
    return [m for m in found if isinstance(m, torch.nn.Module)]


class _Run:
    """The state of one `generate` call: active rows, their caches, outputs and statistics."""

    def __init__(self, decoder: SpeculativeDecoder, prompts, params, max_new_tokens, draft_len, on_emit,
                 draft_confidence: float, draft_alternatives: int = 0, leaf_min_prob: float = 0.0):
        self.d = decoder
        self.draft_confidence = draft_confidence
        self.draft_alternatives = draft_alternatives
        self.leaf_min_prob = leaf_min_prob
        self.leaves: Leaves | None = None  # this round's sibling leaves (tree.py)
        self.start = time.perf_counter()
        self.max_new_tokens = max_new_tokens
        self.draft_len = draft_len
        self.on_emit = on_emit
        self.stats = DecodeStats(draft_len=draft_len)
        device = decoder.device
        self.rows = list(range(len(prompts)))  # original index of each active row
        self.history = [list(p) for p in prompts]
        self.outputs: list[list[int]] = [[] for _ in prompts]
        self.finish = ["length"] * len(prompts)
        self.sampling = BatchSampling.from_params(params, device)
        self.rng = RowGenerators([p.seed for p in params], device)
        self.target_kv = KVState(decoder.target, len(prompts), device)
        self.target_hidden: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return bool(self.rows)

    def prefill(self) -> None:
        t0 = time.perf_counter()
        context = [h[:-1] for h in self.history]
        proposer = self.d.proposer
        wants_states = proposer is not None and proposer.needs_target_states
        states = [torch.zeros(0, 0, device=self.d.device) for _ in context]
        if max(len(c) for c in context) > 0:
            tokens, valid = left_pad(context, self.d.device)
            out = self.target_kv.forward(tokens, valid, logits_to_keep=1, output_hidden_states=wants_states)
            if wants_states:
                states = [h[v] for h, v in zip(out.hidden_states[-1], valid)]
        if proposer is not None:
            proposer.begin(self.history, self.sampling, self.rng)
            if wants_states:
                proposer.target_states(states)
        self.stats.prefill_s = time.perf_counter() - t0

    def round(self) -> None:
        t0 = time.perf_counter()
        draft = self.propose()
        t1 = time.perf_counter()
        logits, hidden = self.score(draft)
        t2 = time.perf_counter()
        out, path = self.verify(logits, draft)
        t3 = time.perf_counter()
        self.accept(out, draft, hidden, path)
        self.stats.draft_s += t1 - t0
        self.stats.target_s += t2 - t1
        self.stats.verify_s += t3 - t2
        self.stats.round_s.append(time.perf_counter() - t0)

    def propose(self) -> Draft:
        proposer, batch = self.d.proposer, len(self.rows)
        # Never draft past the token budget: a round emits at most draft length + 1 tokens.
        max_lens = [min(self.draft_len, self.max_new_tokens - len(self.outputs[r]) - 1) for r in self.rows]
        wants_hidden = proposer is not None and proposer.needs_target_hidden
        if proposer is None or max(max_lens) <= 0 or (wants_hidden and self.target_hidden is None):
            return Draft.empty(batch, self.d.device)
        ctx = RoundContext(self.history, max_lens, self.sampling, self.rng, self.target_hidden, self.draft_confidence,
                           self.draft_alternatives, self.leaf_min_prob)
        return proposer.propose(ctx, self.draft_len)

    def score(self, draft: Draft) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target pass over [last, d_1 .. d_D] and any sibling leaves: logits [B, T, V], T = D+1
        plus the leaves' slots (and hidden states if wanted)."""
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
            tokens = torch.cat([tokens, self.leaves.tokens], dim=1)
            valid = torch.cat([valid, self.leaves.valid], dim=1)
            tree = self.leaves.structure(width)
        proposer = self.d.proposer
        wants_hidden = proposer is not None and (proposer.needs_target_hidden or proposer.needs_target_states)
        out = self.target_kv.forward(tokens, valid, output_hidden_states=wants_hidden, tree=tree)
        return out.logits, (out.hidden_states[-1] if wants_hidden else None)

    def verify(self, logits: torch.Tensor, draft: Draft) -> tuple[VerifyOutput, torch.Tensor | None]:
        """The chain's verification, then (with leaves) a leaf in place of a rejected greedy token; also
        the slots whose outputs were the emitted tokens ([B, D+1], None = the chain's own)."""
        s = self.sampling
        chain = logits[:, : draft.tokens.shape[1] + 1]
        args = (chain, draft.tokens, draft.lens, draft.probs, s.temperature, s.top_k, s.top_p)
        if self.d.noise_in_kernel:
            seeds, offsets = self.rng.philox_keys()
            out = self.d.verifier(*args, None, None, seeds=seeds, offsets=offsets)
        else:
            sampled = (~s.greedy).tolist()
            lens = draft.lens.tolist()
            accept_u = self.rng.uniform([n if x else 0 for n, x in zip(lens, sampled)], draft.tokens.shape[1])
            race_exp = self.rng.exponential(sampled, logits.shape[-1])
            out = self.d.verifier(*args, accept_u, race_exp)
        if self.leaves is None:
            return out, None
        out, path, hit = take_leaves(out, logits, draft.lens, self.leaves)
        self.stats.leaf_accepts += int(hit.sum())
        return out, path

    def accept(self, out: VerifyOutput, draft: Draft, hidden: torch.Tensor | None,
               path: torch.Tensor | None = None) -> None:
        num_accepted = out.num_accepted.tolist()
        tokens = out.tokens.tolist()
        lens = draft.lens.tolist()
        self.stats.record(num_accepted, lens)
        emitted = [row[: n + 1] for row, n in zip(tokens, num_accepted)]
        before = self.stats.new_tokens
        finished = [self.emit(b, e) for b, e in enumerate(emitted)]
        self.stats.round_tokens.append(self.stats.new_tokens - before)

        width = draft.tokens.shape[1] + 1
        on_path = torch.arange(width, device=self.d.device)[None, :] <= out.num_accepted[:, None]  # [B, D+1]
        if path is None:
            keep = on_path
        else:  # keep the path's slots among all of the pass's; its hidden states in emitted order
            keep = torch.zeros(len(lens), width + self.leaves.tokens.shape[1], dtype=torch.bool, device=self.d.device)
            keep.scatter_(1, path, on_path)
            if hidden is not None:
                hidden = hidden.gather(1, path[..., None].expand(-1, -1, hidden.shape[-1]))
        self.target_kv.keep_last(keep)
        if self.d.proposer is not None:
            if self.d.proposer.needs_target_states:
                self.d.proposer.target_states([h[: n + 1] for h, n in zip(hidden, num_accepted)])
            self.d.proposer.commit(num_accepted, emitted)
        if hidden is not None and self.d.proposer.needs_target_hidden:
            self.target_hidden = hidden[torch.arange(len(self.rows), device=hidden.device), out.num_accepted]
        if any(finished):
            self.drop([b for b, f in enumerate(finished) if not f])

    def emit(self, b: int, tokens: list[int]) -> bool:
        """Append row b's tokens up to a stop token or the budget; True when the row is finished."""
        row = self.rows[b]
        room = self.max_new_tokens - len(self.outputs[row])
        tokens = tokens[:room]
        stop_at = next((i for i, t in enumerate(tokens) if t in self.d.stop_token_ids), None)
        if stop_at is not None:
            tokens = tokens[: stop_at + 1]
            self.finish[row] = "stop"
        self.outputs[row].extend(tokens)
        self.history[b].extend(tokens)
        self.stats.new_tokens += len(tokens)
        if self.stats.first_token_s is None and tokens:
            self.stats.first_token_s = time.perf_counter() - self.start
        if self.on_emit is not None and tokens:
            self.on_emit(row, tokens)
        return stop_at is not None or len(self.outputs[row]) >= self.max_new_tokens

    def drop(self, keep_rows: list[int]) -> None:
        index = torch.tensor(keep_rows, dtype=torch.int64, device=self.d.device)
        self.rows = [self.rows[b] for b in keep_rows]
        self.history = [self.history[b] for b in keep_rows]
        self.sampling = self.sampling.select(index)
        self.rng.select(keep_rows)
        if self.target_hidden is not None:
            self.target_hidden = self.target_hidden[index]
        if not self.rows:
            return
        self.target_kv.select_rows(index)
        if self.d.proposer is not None:
            self.d.proposer.select_rows(index)
