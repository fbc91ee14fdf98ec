"""The command line shared by `draftsmith train` and `accelerate launch -m draftsmith.train`."""

from __future__ import annotations

import argparse
import sys

from draftsmith.speculative.errors import DraftsmithError
from draftsmith.speculative.quiet import quiet_libraries


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="a recipe YAML file, or the name of a shipped recipe (e.g. tiny-medusa)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="override recipe keys, e.g. train.steps=50 loss.kind=jsd")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from draftsmith.train.config import load_raw_recipe, validate_recipe
    from draftsmith.train.loop import train

    raw, path = load_raw_recipe(args.recipe, args.overrides)
    if raw.get("task") == "finetune-target":  # a target update (see finetune_target.py), not a drafter
        from draftsmith.train.finetune_target import FinetuneRecipe, finetune_target

        finetune_target(validate_recipe(raw, str(path), FinetuneRecipe), progress=not args.no_progress)
        return 0
    recipe = validate_recipe(raw, str(path))
    summary = train(recipe, progress=not args.no_progress)
    if summary is not None:  # the main process
        before, after = summary["al_before"], summary["al_after"]
        print(f"trained {recipe.name} in {summary['train_seconds']:.0f} s "
              f"({summary['tokens_trained']} tokens, {summary['tokens_per_s']:.0f} tok/s); held-out AL "
              f"{before['acceptance_length'] if before else float('nan'):.3f} -> {after['acceptance_length']:.3f} "
              f"(D={summary['eval_draft_len']}); drafter in {recipe.output_dir}/drafter", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="draftsmith.train", description="Train a drafter from a recipe.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    quiet_libraries()
    try:
        return run(args)
    except DraftsmithError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to resume from the last checkpoint", file=sys.stderr)
        return 130
