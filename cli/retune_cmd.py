"""`draftsmith retune`: re-tune a drafter for a changed target (see draftsmith.train.retune)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftsmith.train.retune import RetuneOptions, retune


def register(sub) -> None:
    p = sub.add_parser("retune", help="re-tune a drafter after its target changed",
                       description="Warm-start from DRAFTER, regenerate answers with the new target, and train "
                                   "until the held-out AL is back at its old level or the budget is spent.")
    p.add_argument("--drafter", required=True, type=Path, help="the drafter directory trained for the old target")
    p.add_argument("--target", required=True, help="the new target (directory, .gguf, hub id, ...)")
    p.add_argument("--prompts", action="append", default=None,
                   help="training prompts (repeatable): a file, builtin:NAME or hf:NAME[:CONFIG][@SPLIT]; "
                        "default: the prompts the drafter was trained on")
    p.add_argument("--limit", type=int, default=None, help="use at most N records per prompt source")
    p.add_argument("--budget-steps", type=int, default=200, help="most optimizer steps to spend")
    p.add_argument("--eval-every", type=int, default=25, help="steps between held-out AL checks")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (merged into the result)")
    p.add_argument("--out", type=Path, default=None, help="run directory (default: <drafter>-retuned)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    out = args.out or args.drafter.with_name(args.drafter.name + "-retuned")
    result = retune(RetuneOptions(drafter=args.drafter, target=args.target, out=out, prompts=args.prompts,
                                  limit=args.limit, budget_steps=args.budget_steps, lora=args.lora,
                                  eval_every=args.eval_every, progress=not args.no_progress))
    (out / "retune.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0
