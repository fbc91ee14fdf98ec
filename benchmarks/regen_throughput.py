"""Regeneration throughput: the same prompts answered under two schedules, side by side in one process.

    python benchmarks/regen_throughput.py [--target SPEC] [--prompts builtin:seed_tasks] [--count 128]
                                          [--max-new-tokens 64] [--batch-sizes 8,32,64] [--shard-size 64]
                                          [--schedules static,engine] [--dtypes float32,bfloat16]
                                          [--json out.json]

Greedy, plain decoding (no drafter), the embedded SmolLM2 by default. For each batch size B, in turn:

- `static` (before): each shard's prompts sorted by length and cut into batches of B, each batch decoded
  to its end by `SpeculativeDecoder.generate` before the next begins (data/regenerate.py up to commit
  983a1f7). Finished rows leave, so the batch drains to its longest row, and every shard end drains it;
- `engine` (after): `regenerate`'s schedule (`_generate_shards`): one engine of at most B rows, prompts
  queued shard by shard in order of length, a finished row replaced at once by a waiting one.

With several `--dtypes` (data.regen_dtype: the target cast as `regenerate` gets it), each runs every
schedule, and the table adds each dtype's rate against the first's: whether bf16 pays depends on the
CPU (bf16 arithmetic in hardware or emulated).

Tokens/s is generated tokens over wall time (rendering, prefill and decoding; no files written). The two
schedules' answers are compared token for token. Both run in this process, one after the other, so that
a shared machine's load drifts over both alike; `--repeats` alternates their order.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import datasets
from tqdm.auto import tqdm

from draftsmith.data import regenerate as regen
from draftsmith.data.manifest import shard_range
from draftsmith.data.prompts import load_conversations
from draftsmith.data.render import render_prompt
from draftsmith.speculative.dtypes import DTYPES
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.loading import load_model
from draftsmith.speculative.options import DecodeOptions
from draftsmith.speculative.prompts import stop_token_ids
from draftsmith.speculative.sampling import SamplingParams
from draftsmith.train.data_prep import regen_target


def static_schedule(decoder, tokenizer, conversations, settings: dict, batch_size: int) -> list[list[int]]:
    """Answers under the earlier schedule: per shard, length-sorted batches decoded one after another."""
    answers = []
    for shard in range(-(-settings["num_records"] // settings["shard_size"])):
        records = shard_range(shard, settings["shard_size"], settings["num_records"])
        prompts = [render_prompt(tokenizer, regen._prompt_row(conversations[r], r, True)["messages"]) for r in records]
        order = sorted(range(len(prompts)), key=lambda k: len(prompts[k]))
        out = [None] * len(prompts)
        for begin in range(0, len(order), batch_size):
            chunk = order[begin: begin + batch_size]
            params = [SamplingParams(temperature=0.0, seed=regen.row_seed(settings["seed"], records[k])) for k in chunk]
            result = decoder.generate([prompts[k] for k in chunk], params,
                                      DecodeOptions(max_new_tokens=settings["max_new_tokens"], draft_len=0))
            for k, tokens in zip(chunk, result.tokens):
                out[k] = tokens
        answers += out
    return answers


def engine_schedule(decoder, tokenizer, conversations, settings: dict, batch_size: int) -> list[list[int]]:
    """Answers under regenerate's schedule."""
    shards = list(range(-(-settings["num_records"] // settings["shard_size"])))
    done = {}
    with tqdm(disable=True) as bar:
        for shard, rows in regen._generate_shards(decoder, tokenizer, conversations, shards, settings, batch_size,
                                                  0, bar, "assistant"):
            done[shard] = [row["input_ids"][row["prompt_len"]:] for row in rows]
    return [tokens for shard in shards for tokens in done[shard]]


SCHEDULES = {"static": static_schedule, "engine": engine_schedule}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=None, help="a model spec (default: the embedded SmolLM2)")
    parser.add_argument("--prompts", default="builtin:seed_tasks")
    parser.add_argument("--count", type=int, default=128, help="prompts (the first ones of the set)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="8,32,64")
    parser.add_argument("--shard-size", type=int, default=64, help="regenerate's default")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each schedule, alternating their order")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="which schedules to run")
    parser.add_argument("--dtypes", default="float32", help="the dtypes the target answers in (data.regen_dtype)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    schedules = args.schedules.split(",")
    dtypes = args.dtypes.split(",")
    if not set(schedules) <= set(SCHEDULES) or not set(dtypes) <= set(DTYPES):
        print(f"error: --schedules takes {', '.join(SCHEDULES)}; --dtypes {', '.join(DTYPES)}", file=sys.stderr)
        return 2

    target = load_model(args.target)
    conversations = load_conversations(args.prompts)
    conversations = conversations.select(range(min(args.count, len(conversations))))
    conversations = datasets.Dataset.from_list(conversations.to_list())
    settings = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0, "top_p": 1.0, "seed": 0,
                "shard_size": args.shard_size, "num_records": len(conversations)}
    print(f"{target.name}: {len(conversations)} prompts of {args.prompts}, {args.max_new_tokens} new tokens, "
          f"shards of {args.shard_size}, greedy, plain decoding", file=sys.stderr)
    results = []
    for dtype in dtypes:
        model = regen_target(target, dtype).model
        decoder = SpeculativeDecoder(model, None, stop_token_ids=stop_token_ids(model, target.tokenizer))
        for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
            answers = {}
            for repeat in range(args.repeats):
                for name in (schedules if repeat % 2 == 0 else schedules[::-1]):
                    t0 = time.perf_counter()
                    out = SCHEDULES[name](decoder, target.tokenizer, conversations, settings, batch_size)
                    seconds = time.perf_counter() - t0
                    tokens = sum(len(a) for a in out)
                    answers.setdefault(name, out)
                    results.append({"dtype": dtype, "batch_size": batch_size, "schedule": name, "repeat": repeat,
                                    "tokens": tokens, "seconds": round(seconds, 3),
                                    "tokens_per_s": round(tokens / seconds, 2)})
                    print(f"{dtype:8s} B={batch_size:3d} {name:7s} {tokens:6d} tokens {seconds:7.1f} s "
                          f"{tokens / seconds:7.2f} tok/s", file=sys.stderr, flush=True)
            if len(answers) == 2:
                same = answers["static"] == answers["engine"]
                differ = sum(a != b for a, b in zip(answers["static"], answers["engine"]))
                print(f"{dtype:8s} B={batch_size:3d} answers identical: {same}" + ("" if same else f" ({differ} differ)"),
                      file=sys.stderr, flush=True)
                for row in results:
                    if row["batch_size"] == batch_size and row["dtype"] == dtype:
                        row["identical"] = same

    def rate(dtype: str, batch_size: int, name: str) -> float | None:
        rows = [r for r in results if (r["dtype"], r["batch_size"], r["schedule"]) == (dtype, batch_size, name)]
        return sum(r["tokens"] for r in rows) / max(sum(r["seconds"] for r in rows), 1e-3) if rows else None

    print("| dtype | B | " + " | ".join(f"{name} tok/s" for name in schedules)
          + (" | engine / static" if len(schedules) == 2 else "")
          + (f" | {schedules[-1]} against {dtypes[0]}" if len(dtypes) > 1 else "") + " |")
    print("|---" * (2 + len(schedules) + (len(schedules) == 2) + (len(dtypes) > 1)) + "|")
    for dtype in dtypes:
        for batch_size in sorted({r["batch_size"] for r in results}):
            rates = [rate(dtype, batch_size, name) for name in schedules]
            cells = [f"{r:.2f}" for r in rates]
            if len(schedules) == 2:
                cells.append(f"{rates[1] / rates[0]:.2f}x")
            if len(dtypes) > 1:
                cells.append(f"{rates[-1] / rate(dtypes[0], batch_size, schedules[-1]):.2f}x")
            print(f"| {dtype} | {batch_size} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"target": target.name, "prompts": args.prompts, "count": len(conversations),
                       "max_new_tokens": args.max_new_tokens, "shard_size": args.shard_size, "runs": results},
                      handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
