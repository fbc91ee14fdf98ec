"""`draftsmith generate`: decode one prompt speculatively, streaming the text to stdout."""

from __future__ import annotations

import argparse
import sys

from draftsmith.common import add_adaptive_arg, add_target_args, resolve_device, resolve_dtype
from draftsmith.speculative.drafters import load_drafter
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.loading import load_model
from draftsmith.speculative.options import DecodeOptions
from draftsmith.speculative.prompts import encode_prompt, stop_token_ids
from draftsmith.speculative.sampling import SamplingParams


def register(sub) -> None:
    p = sub.add_parser("generate", help="decode a prompt with a drafter (or plainly)",
                       description="Stream the generated text to stdout; statistics go to stderr.")
    add_target_args(p)
    p.add_argument("--drafter", default=None,
                   help="a draft model (directory, .gguf, hub id), early-exit:N, or ngram; omit to decode plainly")
    p.add_argument("--allow-target-mismatch", action="store_true",
                   help="use a drafter trained for another target anyway (exact, but likely slow)")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the target's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--draft-len", type=int, default=4, help="draft tokens per round (D); the most, with --draft-confidence")
    p.add_argument("--draft-confidence", type=float, default=0.0,
                   help="stop a draft after a token the drafter gives less than this probability "
                        "(dynamic draft length; 0 = always D tokens; still exact)")
    p.add_argument("--draft-alternatives", type=int, default=0,
                   help="greedy: also verify the drafter's A runner-up tokens per draft position as sibling "
                        "leaves in the same target pass (a small draft tree; 0 = a chain; still exact)")
    p.add_argument("--leaf-min-prob", type=float, default=0.0,
                   help="with --draft-alternatives: verify a leaf only when the drafter's estimate that it is "
                        "taken (its probability times the chain's before it) is at least this")
    add_adaptive_arg(p, default=True)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    options = DecodeOptions(max_new_tokens=args.max_new_tokens, draft_len=args.draft_len,
                            draft_confidence=args.draft_confidence, draft_alternatives=args.draft_alternatives,
                            leaf_min_prob=args.leaf_min_prob, adaptive=args.adaptive_draft,
                            verify_cost=args.verify_cost,
                            round_cost=args.round_cost)
    target = load_model(args.target, device=device, dtype=dtype)
    proposer, _ = load_drafter(args.drafter, target, device=device, dtype=dtype,
                              allow_target_mismatch=args.allow_target_mismatch)
    prompt = encode_prompt(target.tokenizer, args.prompt, chat=args.chat)
    decoder = SpeculativeDecoder(target.model, proposer, stop_token_ids=stop_token_ids(target.model, target.tokenizer))
    stream = TextStream(target.tokenizer)
    result = decoder.generate([prompt], sampling, options, on_emit=lambda row, ids: stream.push(ids))
    stream.close()
    print(format_stats(result.stats, proposer is not None), file=sys.stderr)
    return 0


class TextStream:
    """Prints decoded text as tokens arrive, holding back an incomplete multi-byte character."""

    def __init__(self, tokenizer, out=None):
        self.tokenizer, self.out = tokenizer, out or sys.stdout
        self.ids: list[int] = []
        self.printed = 0

    def push(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)

    def close(self) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        self.out.write(text[self.printed:] + "\n")
        self.out.flush()


def format_stats(stats, speculative: bool) -> str:
    t = stats.to_dict()["time_s"]
    line = f"{stats.new_tokens} tokens in {stats.total_s:.2f} s ({stats.tokens_per_s:.1f} tok/s)"
    if speculative:
        accept = ", ".join("-" if a is None else f"{a:.2f}" for a in stats.position_acceptance)
        line = (f"AL {stats.acceptance_length:.2f} (D={stats.draft_len}, {stats.mean_draft_len:.2f} drafted per round)"
                f" | {line} | per-position acceptance [{accept}]"
                f" | time: draft {t['draft']:.2f} s, target {t['target']:.2f} s, verify {t['verify']:.2f} s")
        if stats.leaf_accepts:
            line += f" | a sibling leaf was taken in {stats.leaf_accepts} of {stats.rounds} rounds"
    return line
