"""Decoding options: how one `generate` call drafts, as one frozen object validated where it is made.

Per-request sampling (temperature, top-k, top-p, seed) is `SamplingParams`, and a request to an engine
(its prompt, sampling and limits) is a `Request`; everything about the speculation itself travels
here, from the command line through `generate()` to the proposer (`RoundContext.options`), so a new
option is one field, not one more keyword in five layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.sampling import SamplingParams


@dataclass(frozen=True)
class DecodeOptions:
    max_new_tokens: int = 128
    """Most tokens generated per prompt (a stop token ends a row earlier)."""
    draft_len: int = 4
    """D: most tokens drafted per round (0 = plain decoding through the same loop)."""
    draft_confidence: float = 0.0
    """Dynamic draft length: a drafter with probabilities stops a row's draft after the first token it
    gives less than this probability (0 = always D)."""
    draft_alternatives: int = 0
    """A: runner-up tokens per draft position that greedy rows also verify as sibling leaves (tree.py)."""
    leaf_min_prob: float = 0.0
    """Keep only sibling leaves the drafter gives at least this estimated chance of being taken."""
    adaptive: bool = False
    """Adaptive draft length: each row drafts, up to D, as many tokens as its own observed acceptance
    pays for, and backs off to plain decoding where its drafts are rejected (adaptive.py)."""
    verify_cost: float | None = None
    """(adaptive) What one more verified position costs the target's pass, relative to a one-token step.
    None = the pass costs measured on this machine (calibrate.py), or where
    calibration is off the device's (adaptive.VERIFY_COST: by device type and, on CPU, weight width)."""
    round_cost: float | None = None
    """(adaptive) What a round that drafts at all costs beyond its per-token costs, relative to a one-token
    step; None = measured with the drafter beside measured passes (calibrate.draft_costs; for prompt lookup the
    device's adaptive.ROUND_OVERHEAD), else adaptive.ROUND_COST."""

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise InvalidInputError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.draft_len < 0:
            raise InvalidInputError(f"draft length must be >= 0, got {self.draft_len}")
        _check_drafting(self.draft_confidence, self.draft_alternatives, self.leaf_min_prob)
        if self.verify_cost is not None and not 0.0 <= self.verify_cost:
            raise InvalidInputError(f"verify cost must be >= 0, got {self.verify_cost}")
        if self.round_cost is not None and not 0.0 <= self.round_cost:
            raise InvalidInputError(f"round cost must be >= 0, got {self.round_cost}")


@dataclass(frozen=True)
class Request:
    """One request for an engine (engine.py): its prompt, sampling and limits, what `DecodeOptions` sets
    for a whole `generate` call, and how it drafts where it differs from the engine's `DecodeOptions`
    (each None = the engine's value)."""

    prompt: tuple[int, ...]
    """Token ids, at least one."""
    sampling: SamplingParams = SamplingParams()
    """Temperature, top-k, top-p and seed of this request."""
    max_new_tokens: int = 128
    """Most tokens generated (a stop token ends it earlier)."""
    draft_len: int | None = None
    """Most draft tokens per round for this request; None = the engine's D, 0 = plain decoding."""
    draft_confidence: float | None = None
    """This request's confidence stop (`DecodeOptions.draft_confidence`); 0 = a fixed length."""
    draft_alternatives: int | None = None
    """This request's sibling leaves per draft position, within the engine's A (they widen the batch's
    verification pass, which the engine sizes)."""
    leaf_min_prob: float | None = None
    """This request's `DecodeOptions.leaf_min_prob`."""
    stop_token_ids: frozenset[int] = frozenset()
    """Stop tokens besides the decoder's own (its EOS)."""
    ignore_eos: bool = False
    """Do not stop at the decoder's own stop tokens (fixed-length runs for benchmarks)."""

    def __post_init__(self):
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        object.__setattr__(self, "stop_token_ids", frozenset(int(t) for t in self.stop_token_ids))
        if not self.prompt:
            raise InvalidInputError("the prompt is empty; a request needs at least one token")
        if self.max_new_tokens < 1:
            raise InvalidInputError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.draft_len is not None and self.draft_len < 0:
            raise InvalidInputError(f"draft length must be >= 0, got {self.draft_len}")
        _check_drafting(self.draft_confidence, self.draft_alternatives, self.leaf_min_prob)


def _check_drafting(confidence: float | None, alternatives: int | None, min_prob: float | None) -> None:
    """The ranges `DecodeOptions` and `Request` share (None = not given)."""
    if confidence is not None and not 0.0 <= confidence < 1.0:
        raise InvalidInputError(f"draft confidence must lie in [0, 1), got {confidence}")
    if alternatives is not None and alternatives < 0:
        raise InvalidInputError(f"draft alternatives must be >= 0, got {alternatives}")
    if min_prob is not None and not 0.0 <= min_prob < 1.0:
        raise InvalidInputError(f"leaf min prob must lie in [0, 1), got {min_prob}")
