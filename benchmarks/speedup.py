"""Speculative decoding speed on the embedded target, side by side in one run.

    python benchmarks/speedup.py [--drafter early-exit:10 | DIR | ngram] [--prompts N] [--reps 3]
                                 [--draft-lens 2,4] [--confidences 0,0.4] [--alternatives 0,3]
                                 [--leaf-min-probs 0,0.1] [--adaptive off|on|both] [--json out.json]

Batch 1, greedy, 128 new tokens, chat prompts spread over the categories of vicuna_bench (shipped with
draftsmith: `--prompts-file builtin:vicuna_bench`, the default; a file or hf:NAME[:CONFIG][@SPLIT] also
does). Each system decodes every prompt; a repetition is one pass over all prompts, and the table reports
the median over repetitions of total tokens / total seconds:

- `hf generate`: the target's own `generate`, no drafter (the baseline);
- `hf assisted D=k`: Hugging Face assisted generation with the same drafter as `assistant_model`, a
  constant k draft tokens per round (confidence-based early stopping off); `hf assisted D=k c=x`: the
  same with its `assistant_confidence_threshold` x (a draft stops after a token the drafter gives less
  than x); and `hf assisted heuristic`, its default schedule (k from 20, +2 after a fully accepted
  draft, -1 otherwise, threshold 0.4);
- `draftsmith D=k [c=x]`: draftsmith's runtime with the same drafter, D and confidence stop
  (`draft_confidence=x`), hence the same drafts and the same acceptance: the ratio of the two is the
  runtimes' own overhead;
- `draftsmith D=k [c=x] A=a [m=p]`: with `--alternatives`, draftsmith also verifying the drafter's a
  runner-up tokens per draft position as sibling leaves in the same target pass (speculative/tree.py),
  with `--leaf-min-probs` only those the drafter gives an estimated chance >= p of being taken; Hugging
  Face has no counterpart, so these rows have no hf twin;
- `draftsmith ... adaptive` (`--adaptive on|both`): under the adaptive draft length, as `draftsmith
  generate` and `serve` decode by default (D the most a round drafts).

Each draftsmith row decodes a few tokens untimed first: the first decode on a machine also measures its
passes (speculative/calibrate.py).

Hugging Face assisted generation needs a draft *model*; for Medusa heads, EAGLE drafters or n-gram lookup its rows are
left out and the table compares draftsmith with plain decoding only.

AL is tokens per target pass; for HF it comes from the number of target forward passes, counted with a
hook. The outputs of every system are checked token for token against the baseline's greedy output.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from draftsmith.speculative import kinds
from draftsmith.data.prompts import load_conversations
from draftsmith.speculative.drafters import build_proposer
from draftsmith.speculative.dtypes import DTYPES
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.loading import load_model
from draftsmith.speculative.prompts import encode_prompt, stop_token_ids
from draftsmith.speculative.options import DecodeOptions


def load_prompts(source: str, count: int) -> list[list[dict]]:
    """`count` prompts (their messages; a turns source gives its first turn) spread over `source`."""
    rows = load_conversations(source)
    step = max(len(rows) // count, 1)  # spread over the file, which is grouped by category
    return [rows[i]["messages"] for i in range(0, len(rows), step)][:count]


class PassCounter:
    """Counts the target's forward passes (prefill included) through a pre-forward hook."""

    def __init__(self, model):
        self.count = 0
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.count += 1


def time_hf(model, prompts, max_new, assistant=None, draft_len=None, schedule="constant", confidence=0.0):
    outputs, tokens, passes = [], 0, 0
    counter = PassCounter(model)
    kwargs = {}
    if assistant is not None:
        assistant.generation_config.num_assistant_tokens = draft_len or 20
        assistant.generation_config.num_assistant_tokens_schedule = schedule
        assistant.generation_config.assistant_confidence_threshold = confidence if schedule == "constant" else 0.4
        kwargs["assistant_model"] = assistant
    start = time.perf_counter()
    for ids in prompts:
        x = torch.tensor([ids], device=model.device)
        before = counter.count
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                             pad_token_id=model.generation_config.pad_token_id, **kwargs)
        new = out[0, len(ids):].tolist()
        outputs.append(new)
        tokens += len(new)
        passes += counter.count - before - 1  # minus the prefill
    elapsed = time.perf_counter() - start
    counter.handle.remove()
    return outputs, tokens / elapsed, tokens / max(passes, 1)


def time_draftsmith(decoder, prompts, max_new, draft_len, confidence=0.0, alternatives=0, min_prob=0.0,
                    adaptive=False):
    outputs, tokens, rounds = [], 0, 0
    options = DecodeOptions(max_new_tokens=max_new, draft_len=draft_len, draft_confidence=confidence,
                            draft_alternatives=alternatives, leaf_min_prob=min_prob, adaptive=adaptive)
    decoder.generate([prompts[0]], options=dataclasses.replace(options, max_new_tokens=4))  # untimed warm-up
    start = time.perf_counter()
    for ids in prompts:
        result = decoder.generate([ids], options=options)
        outputs.append(result.tokens[0])
        tokens += result.stats.new_tokens
        rounds += result.stats.rounds
    elapsed = time.perf_counter() - start
    return outputs, tokens / elapsed, tokens / max(rounds, 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None)
    parser.add_argument("--drafter", default="early-exit:10", help="a draft LM directory or early-exit:N")
    parser.add_argument("--prompts-file", default="builtin:vicuna_bench",
                        help="the prompts: a file, builtin:NAME or hf:NAME[:CONFIG][@SPLIT]")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-lens", default="2,4")
    parser.add_argument("--confidences", default="0",
                        help="comma list of confidence stops per D (0 = a fixed D); each gives an hf and a draftsmith row")
    parser.add_argument("--alternatives", default="0",
                        help="comma list of runner-up counts per draft position (0 = chain); draftsmith rows only")
    parser.add_argument("--leaf-min-probs", default="0",
                        help="comma list of leaf_min_prob values for the rows with alternatives")
    parser.add_argument("--adaptive", choices=["off", "on", "both"], default="off",
                        help="draftsmith rows with the adaptive draft length (the default of generate and serve: "
                             "D the most drafted; rows labelled 'adaptive'), without it, or both")
    parser.add_argument("--no-heuristic", action="store_true", help="leave out HF's heuristic schedule")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES),
                        help="target and drafter weights (every row, the baseline included, runs in it)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)

    target = load_model(args.target, dtype=DTYPES[args.dtype])
    proposer = build_proposer(args.drafter, target, dtype=DTYPES[args.dtype])
    # Hugging Face assisted generation takes a causal LM as assistant_model: a draft LM or early exit, not
    # an EAGLE drafter (which reads the target's features) nor heads or lookup.
    assistant = kinds.of(proposer).assistant_model(proposer)
    texts = load_prompts(args.prompts_file, args.prompts)
    prompts = [encode_prompt(target.tokenizer, t, chat=True) for t in texts]
    stops = stop_token_ids(target.model, target.tokenizer)
    target.model.generation_config.eos_token_id = stops
    decoder = SpeculativeDecoder(target.model, proposer, stop_token_ids=stops)
    plain_decoder = SpeculativeDecoder(target.model, None, stop_token_ids=stops)
    settings = [(int(d), float(c)) for d in args.draft_lens.split(",") for c in args.confidences.split(",")]
    alternatives = [int(a) for a in args.alternatives.split(",")]
    min_probs = [float(m) for m in args.leaf_min_probs.split(",")]

    adaptives = {"off": [False], "on": [True], "both": [False, True]}[args.adaptive]

    def label(d, c, a=0, m=0.0, adaptive=False):
        return (f"D={d}" + (f" c={c:g}" if c else "") + (f" A={a}" if a else "") + (f" m={m:g}" if a and m else "")
                + (" adaptive" if adaptive else ""))

    systems = {"hf generate": lambda: time_hf(target.model, prompts, args.max_new_tokens),
               "draftsmith plain": lambda: time_draftsmith(plain_decoder, prompts, args.max_new_tokens, 0)}
    for d, c in settings:
        if assistant is not None:
            systems[f"hf assisted {label(d, c)}"] = lambda d=d, c=c: time_hf(
                target.model, prompts, args.max_new_tokens, assistant, d, confidence=c)
        for a in alternatives:
            for m in min_probs if a else [0.0]:
                for ad in adaptives:
                    systems[f"draftsmith {label(d, c, a, m, ad)}"] = lambda d=d, c=c, a=a, m=m, ad=ad: time_draftsmith(
                        decoder, prompts, args.max_new_tokens, d, c, a, m, ad)
    if assistant is not None and not args.no_heuristic:
        systems["hf assisted heuristic"] = lambda: time_hf(target.model, prompts, args.max_new_tokens, assistant,
                                                           schedule="heuristic")
    if assistant is None:
        print(f"{args.drafter} is not a draft model: no Hugging Face assisted generation rows", file=sys.stderr)

    results = {name: [] for name in systems}
    reference = None
    with torch.inference_mode():
        for rep in range(args.reps):
            for name, fn in systems.items():
                outputs, tps, al = fn()
                if reference is None:
                    reference = outputs
                exact = sum(o == r for o, r in zip(outputs, reference))
                results[name].append((tps, al, exact))
                print(f"rep {rep + 1}/{args.reps} {name:24s} {tps:7.2f} tok/s  AL {al:.2f}  exact {exact}/{len(prompts)}",
                      file=sys.stderr, flush=True)

    base = statistics.median(r[0] for r in results["hf generate"])
    rows = []
    for name, runs in results.items():
        tps = statistics.median(r[0] for r in runs)
        rows.append({"system": name, "tokens_per_s": tps, "acceptance_length": runs[0][1],
                     "speedup_vs_hf_generate": tps / base, "exact_outputs": f"{min(r[2] for r in runs)}/{len(prompts)}"})
    print(f"\ntarget {target.name}, drafter {args.drafter}, {len(prompts)} prompts, batch 1, greedy, "
          f"{args.max_new_tokens} new tokens, {args.dtype}, median of {args.reps}, {torch.get_num_threads()} threads")
    print(f"{'system':26s} {'tok/s':>8s} {'AL':>6s} {'speedup':>8s} {'exact':>7s}")
    for r in rows:
        print(f"{r['system']:26s} {r['tokens_per_s']:8.2f} {r['acceptance_length']:6.2f} "
              f"{r['speedup_vs_hf_generate']:7.2f}x {r['exact_outputs']:>7s}")
    for d, c in settings if assistant is not None and 0 in alternatives and False in adaptives else []:
        ours = next(r for r in rows if r["system"] == f"draftsmith {label(d, c)}")
        hf = next(r for r in rows if r["system"] == f"hf assisted {label(d, c)}")
        print(f"draftsmith / hf assisted at {label(d, c)}: {ours['tokens_per_s'] / hf['tokens_per_s']:.2f}x")
    if assistant is not None and not args.no_heuristic:
        best = max((r for r in rows if r["system"].startswith("draftsmith D=")), key=lambda r: r["tokens_per_s"])
        hf = max((r for r in rows if r["system"].startswith("hf assisted")), key=lambda r: r["tokens_per_s"])
        print(f"best draftsmith ({best['system']}) / best hf assisted ({hf['system']}): "
              f"{best['tokens_per_s'] / hf['tokens_per_s']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(args) | {"prompts_file": str(args.prompts_file),
                                                                    "json": str(args.json)}, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
