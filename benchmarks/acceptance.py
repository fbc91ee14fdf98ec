"""Acceptance length of several drafters on the same prompts, side by side in one run.

    python benchmarks/acceptance.py --drafters runs/draft-lm-smollm2/drafter,runs/medusa-smollm2/drafter,early-exit:12,ngram \
        [--prompts 50] [--draft-len 4] [--max-new-tokens 128] [--batch-size 10] [--alternatives 0,3] [--json out.json]

Greedy decoding of chat prompts spread over vicuna_bench and arena-hard v0.1, half from each (shipped with
draftsmith: `--prompt-sets builtin:vicuna_bench,builtin:arena_hard_v0.1`, the default; files and
hf:NAME[:CONFIG][@SPLIT] sources also do). Greedy speculation is exact, so each row's tokens (and therefore
its AL) are the same in any batch; prompts are decoded in batches only to make the run affordable on a CPU. Every
drafter's output is checked against the first drafter's (all must equal plain greedy decoding). A lookup
combination (`ngram+DIR`) also reports the share of rounds its prompt lookup drafted. For speed figures
at batch 1 use benchmarks/speedup.py. With `--alternatives 0,3` each drafter runs once per value: A > 0
also verifies its A runner-up tokens per draft position as sibling leaves (speculative/tree.py); the
"leaf rounds" column is the share of rounds a leaf replaced a rejected draft token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from draftsmith.data.prompts import load_conversations
from draftsmith.speculative.drafters import build_proposer
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.loading import load_model
from draftsmith.speculative.prompts import encode_prompt, stop_token_ids
from draftsmith.speculative.options import DecodeOptions

PROMPT_SETS = "builtin:vicuna_bench,builtin:arena_hard_v0.1"


def eval_prompts(count: int, sources: str = PROMPT_SETS) -> list:
    """An equal share of `count` prompts from each source (the later ones take the remainder), spread
    over it: by default half from vicuna_bench (over its categories), half from arena-hard."""
    sources = sources.split(",")
    picks = []
    for k, source in enumerate(sources):
        share = count // len(sources) + (k >= len(sources) - count % len(sources))
        rows = load_conversations(source) if share else []
        picks += [rows[i] for i in range(0, len(rows), max(len(rows) // max(share, 1), 1))][:share]
    return picks


def measure(target, spec, prompts, args, stops, alternatives=0):
    proposer = build_proposer(spec, target)
    decoder = SpeculativeDecoder(target.model, proposer, stop_token_ids=stops, measure_costs=False)  # fixed D
    outputs, rounds, tokens, hist, leaves = [], 0, 0, None, 0
    start = time.perf_counter()
    with torch.inference_mode():
        for begin in range(0, len(prompts), args.batch_size):
            result = decoder.generate(prompts[begin:begin + args.batch_size], options=DecodeOptions(max_new_tokens=args.max_new_tokens,
                                                                                                    draft_len=args.draft_len,
                                                                                                    draft_alternatives=alternatives,
                                                                                                    leaf_min_prob=args.leaf_min_prob))
            outputs += result.tokens
            stats = result.stats
            rounds += stats.rounds
            leaves += stats.leaf_accepts
            tokens += sum(k * n for k, n in enumerate(stats.emitted_hist))
            hist = stats.emitted_hist if hist is None else [a + b for a, b in zip(hist, stats.emitted_hist)]
    seconds = time.perf_counter() - start
    name = spec if not alternatives else f"{spec} A={alternatives}" + (
        f" m={args.leaf_min_prob:g}" if args.leaf_min_prob else "")
    row = {"drafter": name, "alternatives": alternatives, "acceptance_length": tokens / max(rounds, 1),
           "rounds": rounds, "leaf_share": leaves / max(rounds, 1), "emitted_hist": hist, "seconds": seconds}
    if hasattr(proposer, "lookup_rounds"):  # a lookup combination: how often each side drafted
        row["lookup_share"] = proposer.lookup_rounds / max(proposer.lookup_rounds + proposer.model_rounds, 1)
    return outputs, row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None)
    parser.add_argument("--drafters", required=True, help="comma-separated drafter specs")
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--draft-len", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--alternatives", default="0",
                        help="comma-separated runner-up counts per draft position (0 = chain drafting)")
    parser.add_argument("--leaf-min-prob", type=float, default=0.0,
                        help="with alternatives: verify a leaf only when the drafter's estimate that it is taken is at least this")
    parser.add_argument("--prompt-sets", default=PROMPT_SETS,
                        help="comma-separated prompt sources (files, builtin:NAME, hf:NAME[:CONFIG][@SPLIT]), an "
                             "equal share of --prompts from each")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    target = load_model(args.target)
    stops = stop_token_ids(target.model, target.tokenizer)
    prompts = [encode_prompt(target.tokenizer, row["messages"], chat=True)
               for row in eval_prompts(args.prompts, args.prompt_sets)]
    rows, reference = [], None
    for spec in args.drafters.split(","):
        for alternatives in (int(a) for a in args.alternatives.split(",")):
            outputs, row = measure(target, spec, prompts, args, stops, alternatives)
            reference = reference or outputs
            row["identical_outputs"] = sum(a == b for a, b in zip(outputs, reference))
            rows.append(row)
            print(f"{row['drafter']}: AL {row['acceptance_length']:.3f} in {row['seconds']:.0f} s", file=sys.stderr,
                  flush=True)
    print(f"\ntarget {target.name}; {len(prompts)} prompts ({args.prompt_sets}), greedy, D={args.draft_len}, "
          f"{args.max_new_tokens} new tokens, batches of {args.batch_size}")
    print(f"{'drafter':45s} {'AL':>6s} {'rounds':>7s} {'seconds':>8s} {'same tokens':>12s} {'lookup rounds':>14s} "
          f"{'leaf rounds':>12s}")
    for r in rows:
        share = f"{r['lookup_share']:.0%}" if "lookup_share" in r else "-"
        leaf = f"{r['leaf_share']:.0%}" if r["alternatives"] else "-"
        print(f"{r['drafter']:45s} {r['acceptance_length']:6.3f} {r['rounds']:7d} {r['seconds']:8.0f} "
              f"{r['identical_outputs']:>5d}/{len(prompts)} {share:>14s} {leaf:>12s}")
    if args.json:
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
