"""From a drafter spec on the command line to a `Proposer`.

    ngram | ngram:MAX[:MIN]      prompt lookup (training-free)
    early-exit:N                 the target's first N layers + final norm + lm_head (training-free)
    DIR                          a drafter trained by draftsmith (draft LM or Medusa heads; checked
                                 against the target it was trained for), or any HF causal LM directory
    HUB_ID | FILE.gguf           an independent draft LM with the target's tokenizer
    ngram[:MAX[:MIN]]+DRAFTER    prompt lookup where the context repeats an n-gram of MIN..MAX tokens
                                 (default 3:2), DRAFTER (any of the above) everywhere else
"""

from __future__ import annotations

from pathlib import Path

from draftsmith.speculative.checkpoint import load_drafter
from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.loading import LoadedModel, check_same_tokenizer, load_model
from draftsmith.speculative.proposers import (DraftModelProposer, EarlyExitProposer, LookupFirstProposer, NGramProposer,
                                               Proposer)


def build_proposer(spec: str | None, target: LoadedModel, *, device=None, dtype=None,
                   allow_target_mismatch: bool = False) -> Proposer | None:
    if spec is None or spec in ("", "none"):
        return None
    combined = split_combined(spec)
    if combined is not None:
        lookup_spec, drafter_spec = combined
        # A single-token match says little; in a combination it is the drafter's turn (MIN defaults to 2).
        lookup = _ngram(lookup_spec.partition(":")[2], spec, default_min=2)
        drafter = build_proposer(drafter_spec, target, device=device, dtype=dtype,
                                 allow_target_mismatch=allow_target_mismatch)
        if drafter is None or isinstance(drafter, (NGramProposer, LookupFirstProposer)):
            raise InvalidInputError(f"bad drafter spec '{spec}': after '+' comes a model drafter, not '{drafter_spec}'")
        return LookupFirstProposer(lookup, drafter)
    kind, _, arg = spec.partition(":")
    if kind == "ngram":
        return _ngram(arg, spec, default_min=1)
    if kind == "early-exit":
        if not arg:
            raise InvalidInputError("early-exit needs a layer count, e.g. --drafter early-exit:8")
        return EarlyExitProposer(target.model, _positive_int(arg, spec))
    if Path(spec).expanduser().is_dir():
        return load_drafter(Path(spec).expanduser(), target, allow_target_mismatch=allow_target_mismatch,
                            device=device, dtype=dtype)[0]
    drafter = load_model(spec, device=device or target.model.device, dtype=dtype or target.model.dtype)
    check_same_tokenizer(target.tokenizer, drafter.tokenizer, target.name, drafter.name)
    return DraftModelProposer(drafter.model)


def split_combined(spec: str) -> tuple[str, str] | None:
    """("ngram[:MAX[:MIN]]", "DRAFTER") for a combined spec, else None (a directory named with '+' is
    a directory)."""
    head, plus, rest = spec.partition("+")
    if not plus or Path(spec).expanduser().exists() or head.partition(":")[0] != "ngram":
        return None
    return head, rest


def _ngram(sizes_text: str, spec: str, default_min: int) -> NGramProposer:
    """NGramProposer from "MAX[:MIN]" (empty: MAX = 3); MIN defaults to min(default_min, MAX)."""
    sizes = [_positive_int(x, spec) for x in sizes_text.split(":")] if sizes_text else [3]
    return NGramProposer(max_ngram=sizes[0], min_ngram=sizes[1] if len(sizes) > 1 else min(default_min, sizes[0]))


def _positive_int(text: str, spec: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise InvalidInputError(f"bad drafter spec '{spec}': '{text}' is not an integer") from None
    if value < 1:
        raise InvalidInputError(f"bad drafter spec '{spec}': {value} must be >= 1")
    return value
