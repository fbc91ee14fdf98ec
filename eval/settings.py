"""What one evaluation run measures, as a typed, validated config.

A mode names how requests sample:

    greedy            temperature 0
    sample:T          temperature T (no top-k / top-p)
    sample:T:P        temperature T, top-p P
    sample:T:P:K      temperature T, top-p P, top-k K

Every sampled request of prompt i uses seed `seed + i`, so a rerun (or a baseline comparison)
decodes each prompt with the same random stream.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.options import DecodeOptions
from draftsmith.speculative.sampling import SamplingParams

# A greedy divergence whose target logit margin (top-1 minus top-2 at the first differing position) is
# at most this is a near-tie that batched floating-point arithmetic can flip, not a verification error.
TIE_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.05}

# Fewer resamples leave the 2.5% / 97.5% percentiles of a 95% CI resting on a handful of draws.
MIN_BOOTSTRAP = 1000

# The settings a baseline comparison needs to be equal: they decide which tokens are decoded and how.
COMPARED_SETTINGS = ("modes", "draft_lens", "draft_confidence", "draft_alternatives", "leaf_min_prob", "max_new_tokens",
                     "chat", "seed", "limit")


@dataclass
class EvalSettings:
    """One evaluation run. Lists are swept: every mode x draft length x batch size is measured."""

    modes: list[str] = field(default_factory=lambda: ["greedy"])  # "greedy", "sample:T[:P[:K]]"
    draft_lens: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # D values of the sweep, each >= 1
    # N > 0: one more speculative row decoded as `draftsmith generate` and `serve` decode by default, the
    # adaptive draft length (each request drafts up to N tokens, as many as its own acceptance pays for on
    # this machine's measured costs); its speed is reported beside plain decoding per prompt category.
    # 0 = the fixed-D sweep only.
    adaptive_draft_len: int = 4
    draft_confidence: float = 0.0  # > 0: dynamic draft length (see speculative/proposers.py); D is the most
    draft_alternatives: int = 0  # A > 0: greedy rows also verify the drafter's A runner-ups per position (tree.py)
    leaf_min_prob: float = 0.0  # ... each only when the drafter's estimate that it is taken is at least this
    batch_sizes: list[int] = field(default_factory=lambda: [1])  # batch sizes of the speed figures, each >= 1
    max_new_tokens: int = 128  # generation budget per prompt
    limit: int | None = None  # first N prompts only; None = all
    chat: bool = True  # render prompts with the target's chat template
    seed: int = 0  # base seed: prompt i samples with seed + i; bootstrap and fidelity seeds derive from it
    bootstrap: int = 1000  # bootstrap resamples (prompts drawn with replacement) for every CI
    confidence: float = 0.95  # CI level
    fidelity_contexts: int = 8  # contexts of the sampling fidelity check, cut from plain greedy outputs
    fidelity_samples: int = 400  # samples per context and side (speculative, plain)
    fidelity_tokens: int = 2  # the first this many emitted tokens form one sample (their joint value)
    fidelity_window: int = 64  # each context keeps its last this many tokens (0 = all); bounds the cost
    fidelity_alpha: float = 0.01  # the check fails when the pooled chi-square p-value is below this
    tie_tolerance: float | None = None  # greedy near-tie margin in logits; None = by dtype (TIE_TOLERANCE)
    retune_threshold: float = 0.05  # verdict: retune when the relative AL drop is >= this and its CI excludes 0
    timing_reps: int = 5  # repetitions of each timed step of the draft-length cost model (median kept)
    prompts_path: str | None = None  # where the prompts came from (recorded; a baseline run re-reads it)
    prompt_column: str | None = None  # the --prompt-column given, if any
    drafter: str = ""  # the drafter spec as given

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        for mode in self.modes:
            parse_mode(mode)
        if not self.modes:
            raise InvalidInputError("--modes needs at least one mode (e.g. greedy,sample:0.7)")
        _check_positive_list("--draft-lens", self.draft_lens)
        _check_positive_list("--batch-sizes", self.batch_sizes)
        self.draft_lens = sorted(set(self.draft_lens))
        self.batch_sizes = sorted(set(self.batch_sizes))
        checks = [
            (0 <= self.draft_confidence < 1, f"--draft-confidence must lie in [0, 1), got {self.draft_confidence}"),
            (self.draft_alternatives >= 0, f"--draft-alternatives must be >= 0, got {self.draft_alternatives}"),
            (0 <= self.leaf_min_prob < 1, f"--leaf-min-prob must lie in [0, 1), got {self.leaf_min_prob}"),
            (isinstance(self.adaptive_draft_len, int) and self.adaptive_draft_len >= 0,
             f"--adaptive-draft-len must be an integer >= 0 (0 = no adaptive row), got {self.adaptive_draft_len}"),
            (self.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {self.max_new_tokens}"),
            (self.limit is None or self.limit >= 1, f"--limit must be >= 1, got {self.limit}"),
            (self.bootstrap >= MIN_BOOTSTRAP, f"--bootstrap needs >= {MIN_BOOTSTRAP} resamples, got {self.bootstrap}"),
            (0.5 < self.confidence < 1, f"confidence must lie in (0.5, 1), got {self.confidence}"),
            (self.fidelity_contexts >= 0, "--fidelity-contexts must be >= 0"),
            (self.fidelity_samples >= 20, f"--fidelity-samples must be >= 20, got {self.fidelity_samples}"),
            (self.fidelity_tokens >= 1, "fidelity_tokens must be >= 1"),
            (self.fidelity_window >= 0, "--fidelity-window must be >= 0"),
            (0 < self.fidelity_alpha < 0.5, f"fidelity_alpha must lie in (0, 0.5), got {self.fidelity_alpha}"),
            (self.retune_threshold >= 0, f"--retune-threshold must be >= 0, got {self.retune_threshold}"),
            (self.timing_reps >= 1, "timing_reps must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidInputError(message)

    @property
    def max_draft_len(self) -> int:
        return max(self.draft_lens)

    def options(self, draft_len: int, adaptive: bool = False) -> DecodeOptions:
        """The decoding options of the sweep's point at draft length D (with `adaptive`: the most D of the
        adaptive row)."""
        return DecodeOptions(max_new_tokens=self.max_new_tokens, draft_len=draft_len,
                             draft_confidence=self.draft_confidence, draft_alternatives=self.draft_alternatives,
                             leaf_min_prob=self.leaf_min_prob, adaptive=adaptive)

    def sampling(self, mode: str, prompt_index: int) -> SamplingParams:
        return parse_mode(mode, seed=self.seed + prompt_index)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, record: dict) -> "EvalSettings":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(record) - known)
        if unknown:
            raise InvalidInputError(f"unknown eval setting '{unknown[0]}'")
        return cls(**record)


def parse_mode(mode: str, seed: int = 0) -> SamplingParams:
    """SamplingParams for a mode string (see the module docstring); InvalidInputError if malformed."""
    kind, *args = mode.strip().split(":")
    if kind == "greedy" and not args:
        return SamplingParams(seed=seed)
    if kind == "sample" and 1 <= len(args) <= 3:
        try:
            temperature = float(args[0])
            top_p = float(args[1]) if len(args) > 1 else 1.0
            top_k = int(args[2]) if len(args) > 2 else 0
        except ValueError:
            raise InvalidInputError(f"bad mode '{mode}': use sample:T, sample:T:P or sample:T:P:K") from None
        if temperature <= 0:
            raise InvalidInputError(f"bad mode '{mode}': a sampled mode needs T > 0 (use greedy for T = 0)")
        return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    raise InvalidInputError(f"unknown mode '{mode}'; use greedy, sample:T, sample:T:P or sample:T:P:K")


def is_greedy(mode: str) -> bool:
    return parse_mode(mode).greedy


def _check_positive_list(flag: str, values: list[int]) -> None:
    if not values:
        raise InvalidInputError(f"{flag} needs at least one value")
    bad = [v for v in values if not isinstance(v, int) or v < 1]
    if bad:
        raise InvalidInputError(f"{flag} values must be integers >= 1, got {bad[0]}")
