"""Quiet third-party libraries, for the command lines (`draftsmith ...` and `python -m draftsmith.train`)."""

from __future__ import annotations


def quiet_libraries() -> None:
    """Keep stdout/stderr for draftsmith's own output: no per-load progress bars or advisory warnings."""
    import datasets
    import transformers

    datasets.disable_progress_bars()  # draftsmith shows its own bars for the long steps
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
