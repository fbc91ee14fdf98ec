"""Is the drafter short of data, of capacity, or of prompts like the user's? Its training objective's
top-1 agreement with the target, per draft step, on three sets side by side in one run.

    python benchmarks/drafter_gap.py --drafter runs/eagle3-smollm2/drafter [--train-rows 64]
        [--heldout 24] [--prompts 50] [--prompt-sets builtin:vicuna_bench,builtin:arena_hard_v0.1]
        [--max-new-tokens 128] [--batch-size 10] [--json out.json]

- `train`: rows the drafter was trained on (its recipe's data, read from the drafter's record; the
  regenerated answers must be in the recipe's `data.cache_dir`, else they are regenerated first);
- `held-out`: the recipe's held-out prompts (its own sources, never trained on), answered greedily by
  the target here;
- `eval`: prompts from other sources (by default the README's eval prompts: vicuna_bench and arena-hard,
  as benchmarks/acceptance.py picks them), answered greedily by the target here.

Every set is scored by the drafter kind's own objective (teacher-forced, as in training: step k reads
the drafter's own guesses of the k-1 steps before it) against the target's greedy token at the answers'
positions, so the figures are comparable across sets and kinds. How to read them: agreement high on
`train` and low on `held-out` is a drafter that memorised its rows (more data, or regularisation, is
the lever; more steps are not); low on `train` too is a drafter short of capacity or of training steps;
`held-out` well above `eval` is a training set unlike the user's prompts (data like theirs is the
lever). The first step's agreement is about the first draft position's acceptance in greedy chains.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from draftsmith.data.collate import pad_batch
from draftsmith.speculative import kinds
from draftsmith.speculative.checkpoint import check_target, read_drafter_info
from draftsmith.speculative.errors import DraftsmithError, InvalidInputError
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.loading import load_model
from draftsmith.speculative.options import DecodeOptions
from draftsmith.speculative.prompts import encode_prompt, stop_token_ids
from draftsmith.train.config import Recipe
from draftsmith.train.data_prep import TrainingData, prepare_data
from draftsmith.train.loop import Teacher

from acceptance import PROMPT_SETS, eval_prompts  # benchmarks/, the script's own folder


def answered_rows(target, prompts: list[list[int]], max_new: int, batch_size: int) -> list[dict]:
    """Rows (input_ids, loss_mask on the answer) of the target's greedy answers to `prompts`."""
    decoder = SpeculativeDecoder(target.model, None, stop_token_ids=stop_token_ids(target.model, target.tokenizer))
    rows = []
    with torch.inference_mode():
        for begin in range(0, len(prompts), batch_size):
            chunk = prompts[begin:begin + batch_size]
            result = decoder.generate(chunk, options=DecodeOptions(max_new_tokens=max_new, draft_len=0))
            for prompt, answer in zip(chunk, result.tokens):
                rows.append({"input_ids": list(prompt) + list(answer), "loss_mask": [0] * len(prompt) + [1] * len(answer)})
    return rows


def score(kind, module, drafter, rows: list[dict], teacher: Teacher, recipe: Recipe, batch_size: int) -> dict:
    """Position-weighted means of the objective's loss and agreement metrics over `rows`."""
    totals, positions = {}, 0
    with torch.no_grad():
        for begin in range(0, len(rows), batch_size):
            chunk = [dict(row, index=begin + i) for i, row in enumerate(rows[begin:begin + batch_size])]
            loss, count, metrics = kind.objective(module, drafter, pad_batch(chunk, pad_id=0), teacher, recipe)
            if not count:
                continue
            positions += count
            for key, value in {"loss": float(loss), **metrics}.items():
                totals[key] = totals.get(key, 0.0) + value * count
    return {"positions": positions, **{key: value / max(positions, 1) for key, value in totals.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True, help="a draftsmith drafter directory (its record names its recipe)")
    parser.add_argument("--train-rows", type=int, default=64, help="training rows scored (spread over the set)")
    parser.add_argument("--heldout", type=int, default=24, help="held-out prompts scored (at most the recipe's)")
    parser.add_argument("--prompts", type=int, default=50, help="eval prompts scored")
    parser.add_argument("--prompt-sets", default=PROMPT_SETS, help="comma-separated eval prompt sources")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    info = read_drafter_info(args.drafter)
    if info is None or not info.recipe:
        raise InvalidInputError(f"{args.drafter} is not a draftsmith drafter trained by a recipe (no recipe in its record)")
    raw = dict(info.recipe)
    raw["teacher"] = dict(raw.get("teacher") or {}, mode="online")  # scored from live target passes
    raw["loss"] = dict(raw.get("loss") or {}, prompt_positions=False)  # at the answers' positions only
    recipe = Recipe.model_validate(raw)
    kind = kinds.get(info.kind)
    if not kind.trainable:
        raise InvalidInputError(f"a {info.kind} drafter has no training objective to score")
    target = load_model(recipe.target)
    check_target(info, target, args.drafter)
    drafter = kind.load(Path(args.drafter), target).eval()
    module = kind.training_module(drafter).eval()

    data = prepare_data(recipe, target, is_main=True, progress=False)
    stride = max(len(data.train) // max(args.train_rows, 1), 1)
    sets = {"train": [dict(data.train[i]) for i in range(0, len(data.train), stride)][: args.train_rows]}
    sets["held-out"] = answered_rows(target, data.heldout_prompts[: args.heldout], args.max_new_tokens, args.batch_size)
    prompts = [encode_prompt(target.tokenizer, row["messages"], chat=True) for row in eval_prompts(args.prompts, args.prompt_sets)]
    sets["eval"] = answered_rows(target, prompts, args.max_new_tokens, args.batch_size)

    results = {}
    for name, rows in sets.items():
        scored = TrainingData(train=rows, heldout_prompts=[], teacher=None, source={})
        results[name] = {"rows": len(rows), **score(kind, module, drafter, rows, Teacher(target, scored, recipe), recipe,
                                                     args.batch_size)}
        print(f"{name}: {results[name]['positions']} positions scored", file=sys.stderr, flush=True)

    steps = sorted({k for r in results.values() for k in r if k.startswith("agreement/")})
    print(f"\ndrafter {args.drafter} ({info.kind}, recipe {recipe.name}); target {target.name}; greedy answers of up to "
          f"{args.max_new_tokens} tokens; eval prompts: {args.prompt_sets}")
    print(f"{'set':10s} {'rows':>5s} {'positions':>9s} {'loss':>7s} " + " ".join(f"{s.split('/')[1]:>7s}" for s in steps))
    for name, r in results.items():
        print(f"{name:10s} {r['rows']:5d} {r['positions']:9d} {r['loss']:7.3f} "
              + " ".join(f"{r.get(s, float('nan')):7.3f}" for s in steps))
    if args.json:
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except DraftsmithError as err:  # a bad drafter, recipe or prompt source: one line, as the CLI prints it
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
