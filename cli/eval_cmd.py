"""`draftsmith eval`: acceptance, exactness, quality, speed, memory and draft-length advice for one
drafter, and with --baseline the keep / retune verdict after a target update.

Exit codes: 0 done (with --baseline: keep); 3 with --baseline: retune; 4 an exactness check failed;
2 bad input (one `error:` line).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from draftsmith.common import add_target_args, resolve_device, resolve_dtype
from draftsmith.speculative.errors import InvalidInputError

# Flags whose value, when not given, comes from the baseline report (or the EvalSettings default).
_SETTING_FLAGS = {
    "modes": "modes", "draft_lens": "draft_lens", "adaptive_draft_len": "adaptive_draft_len",
    "batch_sizes": "batch_sizes", "max_new_tokens": "max_new_tokens",
    "limit": "limit", "chat": "chat", "seed": "seed", "bootstrap": "bootstrap",
    "fidelity_contexts": "fidelity_contexts", "fidelity_samples": "fidelity_samples",
    "fidelity_window": "fidelity_window", "retune_threshold": "retune_threshold",
    "draft_confidence": "draft_confidence", "draft_alternatives": "draft_alternatives",
    "leaf_min_prob": "leaf_min_prob",
    "prompts": "prompts_path", "prompt_column": "prompt_column", "drafter": "drafter",
}
_LISTS = {"modes": str, "draft_lens": int, "batch_sizes": int}


def register(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a drafter: acceptance, exactness, quality, speed, memory, advice",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(p)
    p.add_argument("--drafter", help="the drafter: a drafter directory, a draft model, early-exit:N or ngram "
                                     "(with --baseline: the baseline's, when omitted)")
    p.add_argument("--allow-target-mismatch", action="store_true",
                   help="evaluate a drafter trained for another target (implied by --baseline)")
    p.add_argument("--prompts", help="prompt file (.jsonl/.json/.parquet/.csv), saved dataset directory, "
                                     "builtin:NAME (a set shipped with draftsmith, e.g. builtin:vicuna_bench) "
                                     "or hf:NAME[:CONFIG][@SPLIT] (datasets.load_dataset: a hub id or local dataset); "
                                     "a comma list of them is read as one set (e.g. "
                                     "builtin:vicuna_bench,builtin:unlike_training)")
    p.add_argument("--prompt-column", help="the column holding the prompt text (default: inferred)")
    p.add_argument("--modes", help="comma list of greedy, sample:T[:P[:K]] (default greedy)")
    p.add_argument("--draft-lens", help="comma list of draft lengths D (default 1,2,4,8)")
    p.add_argument("--adaptive-draft-len", type=int,
                   help="also decode with the adaptive draft length up to N, as `generate` and `serve` do by "
                        "default, and set its speed beside plain decoding per prompt category (default 4; 0 = "
                        "the fixed-D sweep only)")
    p.add_argument("--draft-confidence", type=float,
                   help="dynamic draft length: stop a draft after a token the drafter gives less than this "
                        "probability; each D is then the most per round (default 0 = fixed D)")
    p.add_argument("--draft-alternatives", type=int,
                   help="greedy modes: also verify the drafter's A runner-up tokens per draft position, as "
                        "sibling leaves in the same target pass (default 0 = chain drafting; still exact)")
    p.add_argument("--leaf-min-prob", type=float,
                   help="with --draft-alternatives: verify a leaf only when the drafter's estimate that it is "
                        "taken (its probability times the chain's before it) is at least this (default 0)")
    p.add_argument("--batch-sizes", help="comma list of batch sizes for the speed figures (default 1)")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--limit", type=int, help="evaluate the first N prompts only (of each source, with several)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="render prompts with the chat template (default: on)")
    p.add_argument("--seed", type=int)
    p.add_argument("--bootstrap", type=int, help="bootstrap resamples for the CIs (default 1000)")
    p.add_argument("--fidelity-contexts", type=int, help="contexts of the sampling fidelity check (default 8)")
    p.add_argument("--fidelity-samples", type=int, help="samples per context and side (default 400)")
    p.add_argument("--fidelity-window", type=int, help="tokens kept of each fidelity context (default 64, 0 = all)")
    p.add_argument("--baseline", help="an earlier report.json (or its directory) to compare against: keep or retune")
    p.add_argument("--retune-threshold", type=float,
                   help="relative AL drop that calls for a re-tune when its CI excludes 0 (default 0.05)")
    p.add_argument("--out", help="report directory (default runs/eval-<timestamp>)")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out directory")
    p.add_argument("--report-to", choices=["none", "wandb"], default="none",
                   help="also log to Weights & Biases (offline unless WANDB_API_KEY is set)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from draftsmith.data.prompts import ColumnMap, load_prompt_sets, prompt_sources
    from draftsmith.eval.report import prepare_out_dir
    from draftsmith.eval.verdict import load_baseline
    from draftsmith.speculative.loading import load_model

    baseline = load_baseline(args.baseline) if args.baseline else None
    settings = resolve_settings(args, baseline)
    if not settings.drafter:
        raise InvalidInputError("eval needs --drafter (a drafter directory, a draft model, early-exit:N or ngram)")
    if not settings.prompts_path:
        raise InvalidInputError("eval needs --prompts FILE")
    out_dir = prepare_out_dir(args.out or Path("runs") / f"eval-{time.strftime('%Y%m%d-%H%M%S')}",
                              overwrite=args.overwrite)
    for source in prompt_sources(settings.prompts_path):
        check_not_empty(Path(source).expanduser())
    prompts = load_prompt_sets(settings.prompts_path, ColumnMap(prompt=settings.prompt_column), limit=settings.limit)
    device = resolve_device(args.device)
    target = load_model(args.target, device=device, dtype=resolve_dtype(args.dtype, device))

    from draftsmith.eval.run import evaluate

    report = evaluate(target, settings.drafter, prompts, settings, baseline=baseline,
                      allow_target_mismatch=args.allow_target_mismatch or baseline is not None,
                      progress=not args.no_progress)
    written = report.save(out_dir)
    if args.report_to == "wandb":
        from draftsmith.eval.tracking import log_to_wandb

        figures = {k: v for k, v in written.items() if k not in ("report", "summary")}
        print(f"wandb: {log_to_wandb(report.data, out_dir, figures)}", file=sys.stderr)
    print(summary(report.data, written["report"]))
    return report.exit_code


def check_not_empty(path: Path) -> None:
    # datasets fails on a zero-byte file with an unhelpful message (StopIteration); say what is wrong.
    if path.is_file() and path.stat().st_size == 0:
        raise InvalidInputError(f"prompt file {path} is empty")


def resolve_settings(args: argparse.Namespace, baseline: dict | None):
    """EvalSettings from the flags given, the rest from the baseline's settings (or the defaults)."""
    from draftsmith.eval.settings import EvalSettings

    values = dict(baseline["settings"]) if baseline else {}
    for flag, key in _SETTING_FLAGS.items():
        given = getattr(args, flag)
        if given is not None:
            values[key] = parse_list(flag, given, _LISTS[flag]) if flag in _LISTS else given
    return EvalSettings.from_dict(values)


def parse_list(flag: str, text: str, kind: type) -> list:
    items = [t.strip() for t in text.split(",") if t.strip()]
    try:
        return [kind(t) for t in items]
    except ValueError:
        bad = next(t for t in items if not _parses(t, kind))
        raise InvalidInputError(f"--{flag.replace('_', '-')}: '{bad}' is not an integer") from None


def summary(r: dict, report_path: Path) -> str:
    from draftsmith.eval.markdown import draft_label, slower_line

    lines = [f"report: {report_path}"]
    for a in r["acceptance"]:
        lines.append(f"{a['mode']} D={a['draft_len']}: AL {a['al']:.2f} "
                     f"[{a['al_ci'][0]:.2f}, {a['al_ci'][1]:.2f}] (predicted {a['predicted_al']:.2f})")
    for v in r["speed"]:
        if v["decoder"] != "plain":
            lines.append(f"{v['mode']} B={v['batch_size']} {draft_label(v)}: {v['tokens_per_s']:.1f} tok/s, "
                         f"speedup {v.get('speedup', float('nan')):.2f}x")
    for c in r.get("speed_by_category") or []:
        if c["decoder"] == "adaptive" and c["categories"]:
            lines.append(f"{c['mode']} {draft_label(c)} per category "
                         f"({r['settings']['confidence']:.0%} CI): {slower_line(c)}")
    e = r["exactness"]
    if e["greedy"] is not None:
        lines.append(f"greedy exactness: {e['greedy']['share_identical']:.1%} identical, "
                     f"{'pass' if e['greedy']['passed'] else 'FAIL'}")
    for f in e["sampling"]:
        lines.append(f"sampling fidelity {f['mode']}: p = {f['p_value']:.3g}, {'pass' if f['passed'] else 'FAIL'}")
    for a in r["advice"]:
        lines.append(f"advice {a['mode']} B={a['batch_size']}: D={a['recommended_draft_len']} "
                     f"(measured best D={a['measured_best_draft_len']})")
    if r.get("comparison"):
        lines.append(r["comparison"]["verdict"]["reason"])
    return "\n".join(lines)


def _parses(text: str, kind: type) -> bool:
    try:
        kind(text)
        return True
    except ValueError:
        return False
