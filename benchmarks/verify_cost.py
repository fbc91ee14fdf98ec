"""What one more verified position costs the target's pass: the adaptive draft length's `verify_cost`.

    python benchmarks/verify_cost.py [--target SPEC] [--context 256] [--max-positions 9] [--batch-sizes 1,4]
                                     [--reps 30] [--device cpu|cuda] [--dtype float32|bfloat16|float16]
                                     [--json out.json]

A verification pass feeds the last token and D draft tokens: D + 1 positions over a cache of `--context`
tokens. For n = 1 .. `--max-positions` it times that pass through the runtime's own cache (KVState: the
n slots are appended, then rolled back, as a round with every draft rejected does; in the runtime's
context for few-row linear layers), the n's interleaved
and repeated, and reports the median seconds per pass relative to n = 1 (a plain decoding step), and the
least-squares slope over n: the cost of one more position, which is the `verify_cost` the adaptive
policy adds to the drafter's own cost per drafted token (speculative/adaptive.py, VERIFY_COST).
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
    parser.add_argument("--small-gemm", choices=["auto", "on", "off"], default=None,
                        help="the few-row linear path (small_gemm.py); default: the runtime's ($DRAFTSMITH_SMALL_GEMM, else auto)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    target = load_model(args.target, device=device, dtype=DTYPES[args.dtype])
    positions = list(range(1, args.max_positions + 1))
    rows = []
    # In the runtime's own context for few-row linear layers (small_gemm.py), as its rounds run.
    with torch.inference_mode(), SpeculativeDecoder(target.model, None, small_gemm=args.small_gemm).fast_linears():
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            seconds = time_passes(target.model, batch, args.context, positions, args.reps, device)
            base = seconds[1]
            relative = [seconds[n] / base for n in positions]
            rows.append({"batch": batch, "seconds": seconds, "relative": dict(zip(positions, relative)),
                         "verify_cost": slope(positions, relative)})
    print(f"target {target.name} on {device} in {args.dtype} ({torch.get_num_threads()} threads), context {args.context}, "
          f"median of {args.reps}")
    print(f"{'batch':>5s} " + " ".join(f"{'n=' + str(n):>6s}" for n in positions) + f" {'per position':>12s}")
    for r in rows:
        print(f"{r['batch']:5d} " + " ".join(f"{r['relative'][n]:6.2f}" for n in positions)
              + f" {r['verify_cost']:12.3f}")
    print("(seconds per pass relative to n=1, a plain decoding step; the last column is the slope: verify_cost)")
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
