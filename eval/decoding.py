"""Decoding passes with per-prompt bookkeeping: what every figure of the evaluation is computed from.

A *pass* decodes every prompt once with one decoder (speculative at draft length D, or plain: D = 0;
an adaptive pass drafts up to D, as its acceptance pays for), one mode and one batch size. Per-prompt
acceptance figures come only from batch-size-1 passes, where each `generate` call's DecodeStats belong to
one prompt; batched passes feed the speed figures (and the greedy exactness check), because DecodeStats
aggregate the rows of a batch.

Emission times: `on_emit` stamps each call with time.perf_counter(). The tokens of one call (one
round of one row) arrive together; `Trace.token_gaps` spreads the wait since the previous emission
evenly over them, which is the per-token latency a streaming reader sees on average.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from hashlib import sha256

from draftsmith.eval.settings import EvalSettings
from draftsmith.speculative.generate import DecodeStats, SpeculativeDecoder
from draftsmith.speculative.options import DecodeOptions


@dataclass
class Trace:
    """One prompt's decode within a pass."""

    index: int  # prompt index in the prompt set
    tokens: list[int]  # generated ids
    finish: str  # "stop" | "length"
    emissions: list[tuple[float, int]] = field(default_factory=list)  # (seconds since call start, tokens)
    stats: DecodeStats | None = None  # this prompt's own stats (batch size 1 only)

    @property
    def first_token_s(self) -> float | None:
        return self.emissions[0][0] if self.emissions else None

    def token_gaps(self) -> list[float]:
        """Seconds per token after the first emission (which is the time to first token), spread evenly
        over the tokens of each emission."""
        gaps = []
        for (before, _), (now, count) in zip(self.emissions, self.emissions[1:]):
            gaps.extend([(now - before) / count] * count)
        return gaps

    def output_sha(self) -> str:
        return sha256(",".join(map(str, self.tokens)).encode()).hexdigest()[:16]


@dataclass
class Pass:
    mode: str
    draft_len: int  # 0 = plain decoding
    batch_size: int
    traces: list[Trace]
    calls: list[DecodeStats]  # one per generate call (per batch)
    adaptive: bool = False  # the adaptive draft length, up to draft_len (generate's and serve's default)

    @property
    def decoder(self) -> str:
        """How the report names the pass's decoder: plain, speculative (fixed D) or adaptive (up to D)."""
        return "plain" if not self.draft_len else "adaptive" if self.adaptive else "speculative"

    @property
    def tokens(self) -> int:
        return sum(s.new_tokens for s in self.calls)

    @property
    def seconds(self) -> float:
        return sum(s.total_s for s in self.calls)

    @property
    def batch_rounds(self) -> int:
        return sum(len(s.round_s) for s in self.calls)

    def outputs(self) -> list[list[int]]:
        return [t.tokens for t in self.traces]


@dataclass(frozen=True)
class System:
    """One way of decoding a pass: a decoder, a mode and a draft length (0 = plain; `adaptive`: up to it)."""

    decoder: SpeculativeDecoder
    mode: str
    draft_len: int
    adaptive: bool = False


def decode_passes(systems: list[System], prompts: list[list[int]], settings: EvalSettings, batch_size: int,
                  progress=None) -> list[Pass]:
    """One pass per system over every prompt, in batches of `batch_size` (in prompt order), the systems taking
    turns on each batch of prompts, their order rotating from batch to batch: a machine whose speed drifts
    during the run (a shared CPU, a GPU's clocks) slows every system alike, instead of whichever pass ran in a
    slow minute, so the speedups and per-prompt timings compare like with like."""
    traces: list[list[Trace]] = [[] for _ in systems]
    calls: list[list[DecodeStats]] = [[] for _ in systems]
    for turn, start in enumerate(range(0, len(prompts), batch_size)):
        indices = list(range(start, min(start + batch_size, len(prompts))))
        for k in range(len(systems)):
            j = (turn + k) % len(systems)
            system = systems[j]
            batch_traces, stats = decode_batch(system.decoder, [prompts[i] for i in indices], indices, settings,
                                               system.mode, system.draft_len, system.adaptive)
            traces[j].extend(batch_traces)
            calls[j].append(stats)
            if progress is not None:
                progress.update(len(indices))
    return [Pass(s.mode, s.draft_len, batch_size, t, c, s.adaptive) for s, t, c in zip(systems, traces, calls)]


def decode_batch(decoder: SpeculativeDecoder, prompts: list[list[int]], indices: list[int],
                 settings: EvalSettings, mode: str, draft_len: int,
                 adaptive: bool = False) -> tuple[list[Trace], DecodeStats]:
    emissions: list[list[tuple[float, int]]] = [[] for _ in prompts]
    start = time.perf_counter()

    def on_emit(row: int, ids: list[int]) -> None:
        emissions[row].append((time.perf_counter() - start, len(ids)))

    result = decoder.generate(prompts, [settings.sampling(mode, i) for i in indices],
                              settings.options(draft_len, adaptive), on_emit=on_emit)
    own = result.stats if len(prompts) == 1 else None
    traces = [Trace(i, tokens, finish, emitted, own)
              for i, tokens, finish, emitted in zip(indices, result.tokens, result.finish_reasons, emissions)]
    return traces, result.stats


def warm_up(decoder: SpeculativeDecoder, prompt: list[int], draft_len: int, batch_size: int,
            adaptive: bool = False) -> None:
    """A short untimed decode, so one-off costs (allocator growth, kernel selection; for an adaptive pass,
    measuring the machine's pass and round costs the first time) stay out of timings."""
    decoder.generate([prompt] * batch_size, options=DecodeOptions(max_new_tokens=min(8, 2 * draft_len + 2),
                                                                  draft_len=draft_len, adaptive=adaptive))
