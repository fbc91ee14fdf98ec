"""From a drafter spec on the command line to a `Proposer`.

    ngram | ngram:MAX[:MIN]      prompt lookup (training-free)
    early-exit:N                 the target's first N layers + final norm + lm_head (training-free)
    DIR                          a drafter trained by draftsmith (draft LM or Medusa heads; checked
                                 against the target it was trained for), or any HF causal LM directory
    HUB_ID | FILE.gguf           an independent draft LM with the target's tokenizer
"""

from __future__ import annotations

from pathlib import Path

from draftsmith.speculative.checkpoint import load_drafter
from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.loading import LoadedModel, check_same_tokenizer, load_model
from draftsmith.speculative.proposers import DraftModelProposer, EarlyExitProposer, NGramProposer, Proposer


def build_proposer(spec: str | None, target: LoadedModel, *, device=None, dtype=None,
                   allow_target_mismatch: bool = False) -> Proposer | None:
    if spec is None or spec in ("", "none"):
        return None
    kind, _, arg = spec.partition(":")
    if kind == "ngram":
        sizes = [_positive_int(x, spec) for x in arg.split(":")] if arg else [3]
        return NGramProposer(max_ngram=sizes[0], min_ngram=sizes[1] if len(sizes) > 1 else 1)
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


def _positive_int(text: str, spec: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise InvalidInputError(f"bad drafter spec '{spec}': '{text}' is not an integer") from None
    if value < 1:
        raise InvalidInputError(f"bad drafter spec '{spec}': {value} must be >= 1")
    return value
