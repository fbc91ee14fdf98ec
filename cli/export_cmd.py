"""`draftsmith export DRAFTER --format speculators|sglang --out DIR`: an EAGLE-3 drafter for a serving
engine (see draftsmith.speculative.formats)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from draftsmith.speculative.formats import FORMATS, export


def register(sub) -> None:
    p = sub.add_parser("export", help="write an EAGLE-3 drafter in the layout vLLM or SGLang serves",
                       description="speculators: the directory `vllm serve` loads (speculators' eagle3 format); "
                                   "sglang: SGLang's LlamaForCausalLMEagle3 layout (also SpecForge's and the "
                                   "EAGLE-3 repository's). The target's embeddings are not written.")
    p.add_argument("drafter", type=Path, help="a draftsmith eagle3 drafter directory")
    p.add_argument("--format", required=True, choices=FORMATS, dest="fmt")
    p.add_argument("--out", required=True, type=Path, help="a new directory to write")
    p.add_argument("--verifier", default=None,
                   help="the target's hub id or path as the engine should load it (default: the drafter's "
                        "recorded target; the embedded default is written as its hub id)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    out = export(args.drafter, args.fmt, args.out, verifier=args.verifier)
    print(f"wrote {args.fmt} drafter to {out}", file=sys.stderr)
    return 0
