"""After a target update: the change in acceptance against a baseline report, and keep or retune.

The baseline is an earlier `report.json` of the same prompts and settings (usually the drafter against
the target it was trained for). Every prompt is paired with itself across the two runs: the change of
the AL (a ratio estimator over prompts) and of each position's acceptance rate gets a CI from resampling
prompt indices jointly on both sides, overall and per prompt category.

The decision, per (mode, D), and `retune` if any of them says so:

    retune  the relative AL change is <= -retune_threshold (default 5%) AND its CI lies wholly below 0
    keep    otherwise

Why this rule: at a fixed cost per round, throughput is proportional to AL, so a 5% AL loss is about a
5% loss of the speedup, which is what a re-tune is worth paying for; requiring the CI to exclude 0 keeps
prompt-sampling noise on a small prompt set from triggering a training run.

Refused (BaselineError, exit 2): a report that is not JSON, has another schema, lacks fields, or was
run with other decoding settings (COMPARED_SETTINGS), on another prompt set, or with another tokenizer.
The drafter may differ (a re-tuned drafter judged against the old report); both are recorded.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from draftsmith.eval.settings import COMPARED_SETTINGS, EvalSettings
from draftsmith.eval.stats import paired_ratio_change
from draftsmith.speculative.errors import InvalidInputError, first_line

SCHEMA = "draftsmith.eval/1"
EXIT_KEEP, EXIT_RETUNE = 0, 3
_REQUIRED = ("settings", "target", "drafter", "prompts", "per_prompt", "acceptance")


class BaselineError(InvalidInputError):
    """A baseline report that cannot be read or compared."""


def load_baseline(path: str | Path) -> dict:
    """The baseline report at `path`, checked for the schema and the fields a comparison reads."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / "report.json"
    if not path.is_file():
        raise BaselineError(f"no baseline report at {path}")
    try:
        report = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BaselineError(f"corrupt baseline report {path}: {exc}") from None
    if not isinstance(report, dict):
        raise BaselineError(f"corrupt baseline report {path}: not a JSON object")
    if report.get("schema") != SCHEMA:
        raise BaselineError(f"baseline {path} has schema {report.get('schema')!r}; this draftsmith reads {SCHEMA!r}")
    missing = [key for key in _REQUIRED if key not in report]
    if missing:
        raise BaselineError(f"corrupt baseline report {path}: no '{missing[0]}' field")
    try:
        EvalSettings.from_dict(report["settings"])
        for record in report["per_prompt"]:
            for key in ("id", "category", "mode", "draft_len", "rounds", "emitted", "offered", "accepted"):
                record[key]
        report["prompts"]["fingerprint"], report["target"]["tokenizer_hash"]
    except (InvalidInputError, KeyError, TypeError) as exc:
        raise BaselineError(f"corrupt baseline report {path}: {_reason(exc)}") from None
    report["_path"] = str(path)
    return report


def check_compatible(baseline: dict, settings: EvalSettings, fingerprint: str, count: int, tokenizer_hash: str) -> None:
    """Refuse a comparison whose decoded tokens would not be comparable."""
    path, old = baseline.get("_path", "the baseline"), baseline["settings"]
    defaults = EvalSettings()
    for key in COMPARED_SETTINGS:  # a setting newer than the baseline's report has its default there
        if old.get(key, getattr(defaults, key)) != getattr(settings, key):
            raise BaselineError(f"{key} is {getattr(settings, key)!r} here but {old.get(key)!r} in baseline {path}")
    if baseline["prompts"]["fingerprint"] != fingerprint:
        raise BaselineError(f"the prompt set ({count} prompts) differs from baseline {path}'s "
                            f"({baseline['prompts'].get('count')} prompts); compare runs on the same prompts")
    if baseline["target"]["tokenizer_hash"] != tokenizer_hash:
        raise BaselineError(f"the target's tokenizer differs from the baseline target's ({path}); "
                            "acceptance lengths over different tokens are not comparable")


def compare_reports(report, baseline) -> dict:
    """The comparison of a finished report (a `Report` or its dict) with a baseline report (a path, or a
    dict from `load_baseline`): the paired AL changes and the verdict, as `evaluate(..., baseline=)` makes it."""
    data = getattr(report, "data", report)
    if not isinstance(baseline, dict):
        baseline = load_baseline(baseline)
    settings = EvalSettings.from_dict(data["settings"])
    check_compatible(baseline, settings, data["prompts"]["fingerprint"], data["prompts"]["count"],
                     data["target"]["tokenizer_hash"])
    return compare(baseline, data["per_prompt"], settings)


def compare(baseline: dict, records: list[dict], settings: EvalSettings) -> dict:
    """The paired change per (mode, D) and the verdict (see the module docstring)."""
    seed = settings.seed + 11  # the bootstrap's own stream, fixed by the run's seed
    old_by_key = _by_key(baseline["per_prompt"])
    new_by_key = _by_key(records)
    rows = []
    for (mode, draft_len), new in sorted(new_by_key.items()):
        old = old_by_key.get((mode, draft_len))
        if old is None:
            raise BaselineError(f"baseline {baseline.get('_path', 'report')} has no records for {mode} "
                                f"at D={draft_len}")
        rows.append(compare_one(mode, draft_len, old, new, settings, seed))
    verdict = decide(rows, settings.retune_threshold, settings.confidence)
    return {
        "baseline": baseline.get("_path"),
        "baseline_target": {k: baseline["target"].get(k) for k in ("name", "weight_hash")},
        "baseline_drafter": {k: baseline["drafter"].get(k) for k in ("spec", "weight_hash")},
        "rule": f"retune when the relative AL change <= -{settings.retune_threshold:g} and its "
                f"{settings.confidence:.0%} CI lies below 0, for any mode and draft length",
        "rows": rows,
        "verdict": verdict,
    }


def compare_one(mode: str, draft_len: int, old: dict, new: dict, settings: EvalSettings, seed: int) -> dict:
    ids = sorted(new)
    if set(ids) != set(old):
        raise BaselineError(f"the baseline's prompts for {mode} at D={draft_len} are not this run's prompts")
    boot = dict(resamples=settings.bootstrap, confidence=settings.confidence)

    def change(num_key, den_key, subset, position=None, salt=0):
        pick = (lambda r, k: r[k][position]) if position is not None else (lambda r, k: r[k])
        return paired_ratio_change([pick(old[i], num_key) for i in subset], [pick(old[i], den_key) for i in subset],
                                   [pick(new[i], num_key) for i in subset], [pick(new[i], den_key) for i in subset],
                                   seed=seed + salt, **boot)

    categories = defaultdict(list)
    for i in ids:
        categories[new[i]["category"]].append(i)
    row = {"mode": mode, "draft_len": draft_len, "prompts": len(ids), "al": change("emitted", "rounds", ids)}
    row["positions"] = [{"position": p + 1, **change("accepted", "offered", ids, p, p + 1)} for p in range(draft_len)]
    row["by_category"] = ({(c or "(none)"): change("emitted", "rounds", members) for c, members in
                           sorted(categories.items())} if set(categories) != {""} else {})
    rel, (_, hi) = row["al"]["relative"], row["al"]["relative_ci"]
    row["decision"] = "retune" if rel <= -settings.retune_threshold and hi < 0 else "keep"
    return row


def decide(rows: list[dict], threshold: float, confidence: float) -> dict:
    retune = [r for r in rows if r["decision"] == "retune"]
    worst = min(rows, key=lambda r: r["al"]["relative"])
    focus = min(retune, key=lambda r: r["al"]["relative"]) if retune else worst
    al = focus["al"]
    lo, hi = al["relative_ci"]
    where = f"{focus['mode']} at D={focus['draft_len']}"
    figures = (f"{al['old']:.2f} to {al['new']:.2f} ({al['relative']:+.1%}, {confidence:.0%} CI "
               f"{lo:+.1%} to {hi:+.1%})")
    if retune:
        reason = (f"retune: with {where} the AL fell from {figures}, a drop beyond the {threshold:.0%} "
                  "threshold whose CI excludes 0.")
    else:
        reason = (f"keep: no mode or draft length lost {threshold:.0%} or more of its AL with a CI excluding 0 "
                  f"(largest change: {where}, AL {figures}).")
    return {"decision": "retune" if retune else "keep", "exit_code": EXIT_RETUNE if retune else EXIT_KEEP,
            "reason": reason, "threshold": threshold}


def _by_key(records: list[dict]) -> dict:
    out: dict = defaultdict(dict)
    for r in records:
        out[(r["mode"], r["draft_len"])][r["id"]] = r
    return out


def _reason(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return f"a record lacks '{exc.args[0]}'"
    return first_line(exc)
