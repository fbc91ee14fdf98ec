"""User-facing errors.

Every error a user can cause (bad input, a missing file, mismatched models, a corrupt checkpoint, NaN
logits) is raised as a `DraftsmithError` subclass whose message is one line that says what is wrong and,
where it helps, what to do. The CLI prints `error: <message>` and exits with `exit_code` (2 by default);
anything else is a bug and keeps its traceback.
"""


class DraftsmithError(Exception):
    """An error caused by the user's input or environment, reported as one line."""

    exit_code = 2


class ModelLoadError(DraftsmithError):
    """A model, tokenizer or checkpoint could not be loaded."""


class TokenizerMismatchError(DraftsmithError):
    """Target and drafter do not share a tokenizer."""


class InvalidInputError(DraftsmithError):
    """Arguments or tensors that violate a documented contract (shapes, ids, ranges)."""


class NumericalError(DraftsmithError):
    """A model produced NaN or infinite logits."""


def first_line(exc: BaseException) -> str:
    """What a one-line error quotes of another exception: the first line of its message, stripped,
    or the exception's type name when the message is empty (library errors often span many lines)."""
    lines = str(exc).strip().splitlines()
    return lines[0].strip() if lines else type(exc).__name__
