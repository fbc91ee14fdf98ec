"""The evaluation report: one JSON document (schema "draftsmith.eval/1"), its Markdown summary and plots.

report.json, top-level keys:

    schema, draftsmith_version, created, wall_s
    settings          EvalSettings as a dict (the sweep, budgets, seeds, statistics settings)
    target            name, weight_hash, tokenizer_hash, dtype, device, architecture numbers
    drafter           spec, kind, weight_hash, trained_for (from a draftsmith checkpoint), matches_target
    prompts           path, column, count, fingerprint (sha256 of ids + messages), categories, references
    acceptance        per (mode, D): AL with CI, predicted AL, emitted_hist, positions[], by_category{}
    per_prompt        per (prompt, mode, D): the raw counts (rounds, emitted, emitted_hist, offered, accepted)
    exactness         greedy {checks[], divergences[], passed}, sampling [per sampled mode], passed
    quality           per (mode, decoder, D): nll_per_token with CI, reference_metric (ROUGE-L) or null
    speed             per (mode, batch size, decoder, D): tokens/s, TTFT, latency p50/p95/p99, speedup, ...
    memory            ledger[] per batch size (weights and KV, bytes), measured {kind, per_batch_size[]}
    advice            per (mode, batch size): costs, expected[] per D, recommended vs measured best
    comparison        null, or the baseline comparison with its verdict (see verdict.py)
    exit_code         0 done (keep), 3 retune, 4 an exactness check failed

Numbers are plain JSON: NaN and infinities are written as null.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass
from pathlib import Path

from draftsmith.eval.verdict import SCHEMA
from draftsmith.speculative.fileio import atomic_write_text, check_destination

EXIT_OK, EXIT_INEXACT = 0, 4
REPORT_FILE, SUMMARY_FILE = "report.json", "report.md"


@dataclass
class Report:
    data: dict

    @property
    def exit_code(self) -> int:
        return self.data["exit_code"]

    @property
    def verdict(self) -> dict | None:
        comparison = self.data.get("comparison")
        return comparison["verdict"] if comparison else None

    def to_json(self) -> str:
        return json.dumps(clean(self.data), indent=2, allow_nan=False) + "\n"

    def save(self, out_dir: str | Path, *, plots: bool = True) -> dict[str, Path]:
        """Write report.json, report.md and the PNG plots into `out_dir`; returns what was written."""
        from draftsmith.eval import markdown, plots as plotting

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        written = {"report": atomic_write_text(out_dir / REPORT_FILE, self.to_json())}
        figures = plotting.write_plots(self.data, out_dir) if plots else {}
        written["summary"] = atomic_write_text(out_dir / SUMMARY_FILE, markdown.render(self.data, figures))
        written.update(figures)
        return written


def prepare_out_dir(out_dir: str | Path, *, overwrite: bool) -> Path:
    """Refuse an existing non-empty directory (or a file) unless overwrite; checked before any decoding."""
    out_dir = Path(out_dir).expanduser()
    return check_destination(out_dir, overwrite=overwrite, label=f"--out {out_dir}",
                             advice="choose another directory or pass --overwrite")


def clean(value):
    """JSON-safe copy: NaN/inf -> None, tuples -> lists, dict keys -> str."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items() if not str(k).startswith("_")}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


__all__ = ["Report", "SCHEMA", "EXIT_OK", "EXIT_INEXACT", "prepare_out_dir", "clean"]
