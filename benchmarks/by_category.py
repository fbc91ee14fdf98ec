"""Never slower than plain decoding? Speed per prompt category, plain vs fixed D vs adaptive draft length.

    python benchmarks/by_category.py --drafter DIR|early-exit:N|ngram|ngram+DIR
        [--prompts-file builtin:vicuna_bench,builtin:unlike_training] [--per-category 4]
        [--draft-len 4] [--max-new-tokens 128] [--reps 2] [--verify-cost X] [--round-cost R] [--json out.json]

Batch 1, greedy, the embedded SmolLM2 by default. For every category of the prompt sources (vicuna_bench's
writing, coding, math, ...; unlike_training's translation, summarization of a long passage and questions
over a long context, the kind of prompts a new user tries first) `--per-category` prompts, each decoded by:

- `plain`: draftsmith's runtime without a drafter (the baseline);
- `fixed D=k`: the drafter drafting k tokens every round;
- `adaptive D=k`: the drafter under the adaptive draft length (speculative/adaptive.py), the default of
  `draftsmith generate` and `draftsmith serve`.

Within a repetition the systems take turns prompt by prompt (the order rotating), so that a shared
machine's load drifts over all of them alike; a category's tokens/s is its tokens over its seconds, the
median over repetitions. Every output is checked token for token against plain greedy decoding. The table
gives per category tokens/s, AL (tokens per target pass), the mean draft length and the speedup over plain
(its tokens over its seconds against plain's, pooled over prompts and repetitions) with a 95% CI from
resampling the (prompt, repetition) pairs, each decoded by every system in the same turn: two threads on
a two-core machine move a 128-token decode by several percent from one repetition to the next, as much as
the losses this looks for. The last lines name, per system, the categories where it is slower than plain
(the whole CI below 1) and those where the two cannot be told apart at these repetitions (the CI holds 1
and the estimate is below it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from draftsmith.data.prompts import load_conversations
from draftsmith.eval.stats import paired_ratio_change
from draftsmith.speculative.drafters import build_proposer
from draftsmith.speculative.dtypes import DTYPES
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.loading import load_model
from draftsmith.speculative.options import DecodeOptions
from draftsmith.speculative.prompts import encode_prompt, stop_token_ids


def prompts_by_category(sources: list[str], per_category: int) -> dict[str, list[list[dict]]]:
    """Up to `per_category` prompts (their messages up to the first user turn) of each category."""
    out: dict[str, list[list[dict]]] = defaultdict(list)
    for source in sources:
        for row in load_conversations(source):
            category = row.get("category") or "uncategorized"
            if len(out[category]) < per_category:
                out[category].append(row["messages"][:1])
    return dict(out)


def behind_plain(rows: list[dict]) -> tuple[list[str], list[str]]:
    """A system's categories slower than plain (the whole 95% CI of the speedup below 1), and those whose
    estimate is below 1 but whose CI holds it (not told apart from plain at these repetitions)."""
    slower = [r["category"] for r in rows if r["speedup_ci"][1] < 1.0]
    unresolved = [r["category"] for r in rows if r["speedup_vs_plain"] < 1.0 <= r["speedup_ci"][1]]
    return slower, unresolved


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--prompts-file", default="builtin:vicuna_bench,builtin:unlike_training",
                        help="comma list of prompt sources (files, builtin:NAME, hf:NAME) with a category column")
    parser.add_argument("--per-category", type=int, default=4)
    parser.add_argument("--draft-len", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--verify-cost", type=float, default=None, help="the adaptive policy's (default: the device's)")
    parser.add_argument("--round-cost", type=float, default=None, help="the adaptive policy's (default: the device's)")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES), help="target and drafter weights")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    target = load_model(args.target, dtype=DTYPES[args.dtype])
    stops = stop_token_ids(target.model, target.tokenizer)
    decoder = SpeculativeDecoder(target.model, build_proposer(args.drafter, target, dtype=DTYPES[args.dtype]), stop_token_ids=stops)
    plain = SpeculativeDecoder(target.model, None, stop_token_ids=stops)
    categories = prompts_by_category(args.prompts_file.split(","), args.per_category)
    d, max_new = args.draft_len, args.max_new_tokens
    systems = {
        "plain": (plain, DecodeOptions(max_new_tokens=max_new, draft_len=0)),
        f"fixed D={d}": (decoder, DecodeOptions(max_new_tokens=max_new, draft_len=d)),
        f"adaptive D={d}": (decoder, DecodeOptions(max_new_tokens=max_new, draft_len=d, adaptive=True,
                                                    verify_cost=args.verify_cost, round_cost=args.round_cost)),
    }
    names = list(systems)
    # per (system, category): each (rep, prompt)'s tokens, seconds, rounds and offered draft tokens
    units: dict[tuple[str, str], dict[tuple[int, int], tuple[int, float, int, int]]] = defaultdict(dict)
    outputs: dict[tuple[str, str, int, int], list[int]] = {}  # (system, category, rep, prompt): the tokens
    with torch.inference_mode():
        # Warm up every system once, untimed: the first decode on a machine also measures its passes
        # (speculative/calibrate.py: the linear path and the adaptive policy's pass costs, a few seconds).
        first = encode_prompt(target.tokenizer, next(iter(categories.values()))[0], chat=True)
        for dec, options in systems.values():
            dec.generate([first], options=dataclasses.replace(options, max_new_tokens=8))
        for rep in range(args.reps):
            turn = 0
            for category, prompts in categories.items():
                for i, messages in enumerate(prompts):
                    ids = encode_prompt(target.tokenizer, messages, chat=True)
                    order = names[turn % len(names):] + names[: turn % len(names)]
                    turn += 1
                    for name in order:
                        dec, options = systems[name]
                        t0 = time.perf_counter()
                        result = dec.generate([ids], options=options)
                        elapsed = time.perf_counter() - t0
                        tokens = result.tokens[0]
                        outputs[name, category, rep, i] = tokens
                        units[name, category][rep, i] = (len(tokens), elapsed, result.stats.rounds,
                                                         sum(result.stats.offered))
            print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    # Every decode against plain's first of the same prompt (also those decoded before plain's in their turn).
    mismatches = {name: sum(tokens != outputs["plain", category, 0, i]
                            for (system, category, _, i), tokens in outputs.items() if system == name)
                  for name in names[1:]}
    rows = []
    for category in categories:
        for name in names:
            # per repetition: the category's tokens, seconds, rounds and offered draft tokens
            runs = [[sum(column) for column in zip(*(u for (r, _), u in units[name, category].items() if r == rep))]
                    for rep in range(args.reps)]
            tps = statistics.median(t[0] / t[1] for t in runs)
            keys = sorted(units["plain", category])
            plain_units, mine = [units["plain", category][k] for k in keys], [units[name, category][k] for k in keys]
            change = paired_ratio_change([u[0] for u in plain_units], [u[1] for u in plain_units],
                                         [u[0] for u in mine], [u[1] for u in mine],
                                         resamples=2000, confidence=0.95, seed=0)
            rows.append({"category": category, "system": name, "prompts": len(categories[category]),
                         "tokens_per_s": tps, "speedup_vs_plain": 1 + change["relative"],
                         "speedup_ci": [1 + c for c in change["relative_ci"]],
                         "acceptance_length": runs[0][0] / max(runs[0][2], 1),
                         "mean_draft_len": runs[0][3] / max(runs[0][2], 1)})
    print(f"\ntarget {target.name}, drafter {args.drafter}, batch 1, greedy, {max_new} new tokens, "
          f"{args.per_category} prompts per category, median of {args.reps}, {torch.get_num_threads()} threads")
    print(f"{'category':18s} {'system':14s} {'tok/s':>7s} {'AL':>5s} {'drafted':>7s} {'vs plain [95% CI]':>22s}")
    for r in rows:
        ci = "" if r["system"] == "plain" else f" [{r['speedup_ci'][0]:.2f}, {r['speedup_ci'][1]:.2f}]"
        print(f"{r['category']:18s} {r['system']:14s} {r['tokens_per_s']:7.2f} {r['acceptance_length']:5.2f} "
              f"{r['mean_draft_len']:7.2f} {r['speedup_vs_plain']:7.2f}x{ci}")
    for name in names[1:]:
        mine = [r for r in rows if r["system"] == name]
        slower, unresolved = behind_plain(mine)
        overall = statistics.geometric_mean(r["speedup_vs_plain"] for r in mine)
        print(f"{name}: geometric mean {overall:.2f}x plain; slower than plain in: {', '.join(slower) or 'none'}; "
              f"below plain within the CI: {', '.join(unresolved) or 'none'}; "
              f"outputs differing from plain greedy: {mismatches[name]}")
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "rows": rows,
                                         "mismatches": dict(mismatches)}, indent=2))
    return 0 if not any(mismatches.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
