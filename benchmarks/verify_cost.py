"""What one more verified position costs the target's pass: the adaptive draft length's `verify_cost`.

    python benchmarks/verify_cost.py [--target SPEC] [--context 256] [--max-positions 9] [--batch-sizes 1,4]
                                     [--reps 30] [--device cpu|cuda] [--dtype float32|bfloat16|float16]
                                     [--small-gemm off,auto] [--attention grouped,copied] [--json out.json]

A verification pass feeds the last token and D draft tokens: D + 1 positions over a cache of `--context`
tokens. For n = 1 .. `--max-positions` it times that pass through the runtime's own cache (KVState: the
n slots are appended, then rolled back, as a round with every draft rejected does; in the runtime's
context for few-row linear layers), the n's interleaved
and repeated, and reports the fastest seconds per pass relative to n = 1 (a plain decoding step), and the
least-squares slope over n: the cost of one more position, which is the `verify_cost` the adaptive
policy adds to the drafter's own cost per drafted token (speculative/adaptive.py, VERIFY_COST).

`--small-gemm` takes a comma list of linear paths (small_gemm.py: off = F.linear everywhere, on = W @ x.T
for 2..16 rows, auto = the routes measured on this machine) and times each in the same run, so the table
also gives each path's one-token step in milliseconds: what plain decoding costs on it. `--attention`
does the same for masked grouped-query attention (attention.py): `grouped` (the runtime's) or `copied`
(Transformers' sdpa, which copies the key/value heads under a mask).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from draftsmith.speculative.calibrate import time_passes
from draftsmith.speculative.dtypes import DTYPES
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.loading import load_model


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--max-positions", type=int, default=9)
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES), help="the target's weights")
    parser.add_argument("--small-gemm", default=None,
                        help="comma list of few-row linear paths to time side by side (auto, on, off; small_gemm.py); "
                             "default: the runtime's ($DRAFTSMITH_SMALL_GEMM, else auto)")
    parser.add_argument("--attention", default="grouped",
                        help="comma list: grouped (attention.py, the runtime's) and/or copied (Transformers' sdpa)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    paths = args.small_gemm.split(",") if args.small_gemm else [None]
    if any(p not in (None, "auto", "on", "off") for p in paths):
        parser.error(f"--small-gemm takes auto, on or off (comma separated), got {args.small_gemm!r}")
    attentions = args.attention.split(",")
    if any(a not in ("grouped", "copied") for a in attentions):
        parser.error(f"--attention takes grouped or copied (comma separated), got {args.attention!r}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    target = load_model(args.target, device=device, dtype=DTYPES[args.dtype])
    positions = list(range(1, args.max_positions + 1))
    rows = []
    for path, attention in [(p, a) for p in paths for a in attentions]:
        decoder = SpeculativeDecoder(target.model, None, small_gemm=path, grouped_attention=attention == "grouped")
        # In the runtime's own context for few-row linear layers (small_gemm.py), as its rounds run.
        with torch.inference_mode(), decoder.fast_paths():
            for batch in [int(b) for b in args.batch_sizes.split(",")]:
                seconds = time_passes(target.model, batch, args.context, positions, args.reps, device)
                base = seconds[1]
                relative = [seconds[n] / base for n in positions]
                rows.append({"path": decoder.small_gemm, "attention": attention, "batch": batch, "seconds": seconds,
                             "relative": dict(zip(positions, relative)), "verify_cost": slope(positions, relative)})
    print(f"target {target.name} on {device} in {args.dtype} ({torch.get_num_threads()} threads), context {args.context}, "
          f"fastest of {args.reps} passes per length")
    print(f"{'path':>5s} {'attention':>9s} {'batch':>5s} {'step ms':>7s} " + " ".join(f"{'n=' + str(n):>6s}" for n in positions)
          + f" {'per position':>12s}")
    for r in rows:
        print(f"{r['path']:>5s} {r['attention']:>9s} {r['batch']:5d} {r['seconds'][1] * 1e3:7.1f} "
              + " ".join(f"{r['relative'][n]:6.2f}" for n in positions) + f" {r['verify_cost']:12.3f}")
    print("(step ms: one plain decoding step; n=k: seconds per pass over k positions relative to it, on the same path;"
          " the last column is the slope: verify_cost)")
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
