"""From a drafter spec on the command line to a `Proposer`, and what is known about it.

    ngram | ngram:MAX[:MIN]      prompt lookup (training-free)
    early-exit:N                 the target's first N layers + final norm + lm_head (training-free)
    DIR                          a drafter trained by draftsmith (any kind with checkpoints; checked
                                 against the target it was trained for), or any HF causal LM directory
    HUB_ID | FILE.gguf           an independent draft LM with the target's tokenizer
    ngram[:MAX[:MIN]]+DRAFTER    prompt lookup where the context repeats an n-gram of MIN..MAX tokens
                                 (default 3:2), DRAFTER (any of the above) everywhere else

`NAME[:ARG]` specs are the training-free kinds of the registry (kinds.py) that parse a spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from draftsmith.speculative import kinds
from draftsmith.speculative.checkpoint import DrafterInfo, load_drafter_dir
from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.loading import LoadedModel, check_same_tokenizer, load_model
from draftsmith.speculative.lookup import LookupFirstProposer, split_combined
from draftsmith.speculative.ngram import ngram_from_sizes
from draftsmith.speculative.proposers import Proposer

@dataclass(frozen=True)
class DrafterSource:
    """What loading a drafter learned, so nobody parses the spec or reads config.json again."""

    spec: str
    kind: str  # the proposer's kind (kinds.py); "lookup" for a combination
    record: DrafterInfo | None = None  # the checkpoint's record (a combination's drafter's), if any
    path: Path | None = None  # the drafter's directory, if it came from one


def load_drafter(spec: str | None, target: LoadedModel, *, device=None, dtype=None,
                 allow_target_mismatch: bool = False) -> tuple[Proposer | None, DrafterSource | None]:
    """(proposer, what is known about it) for a spec; (None, None) for no drafter."""
    if spec is None or spec in ("", "none"):
        return None, None
    combined = split_combined(spec)
    if combined is not None:
        lookup_spec, drafter_spec = combined
        # A single-token match says little; in a combination it is the drafter's turn (MIN defaults to 2).
        lookup = ngram_from_sizes(lookup_spec.partition(":")[2], spec, default_min=2)
        drafter, inner = load_drafter(drafter_spec, target, device=device, dtype=dtype,
                                      allow_target_mismatch=allow_target_mismatch)
        if drafter is None or not kinds.of(drafter).behind_lookup:
            raise InvalidInputError(f"bad drafter spec '{spec}': after '+' comes a model drafter, not '{drafter_spec}'")
        return LookupFirstProposer(lookup, drafter), DrafterSource(spec, "lookup", inner.record, inner.path)
    name, _, arg = spec.partition(":")
    if name in kinds.names(from_spec=True):
        proposer = kinds.get(name).from_spec(arg, spec, target)
        return proposer, DrafterSource(spec, proposer.kind)
    path = Path(spec).expanduser()
    if path.is_dir():
        proposer, record = load_drafter_dir(path, target, allow_target_mismatch=allow_target_mismatch,
                                            device=device, dtype=dtype)
        return proposer, DrafterSource(spec, proposer.kind, record, path)
    drafter = load_model(spec, device=device or target.model.device, dtype=dtype or target.model.dtype)
    check_same_tokenizer(target.tokenizer, drafter.tokenizer, target.name, drafter.name)
    proposer = kinds.get("draft-lm").proposer(drafter.model)
    return proposer, DrafterSource(spec, proposer.kind)


def build_proposer(spec: str | None, target: LoadedModel, **options) -> Proposer | None:
    """The proposer alone (see `load_drafter`)."""
    return load_drafter(spec, target, **options)[0]
