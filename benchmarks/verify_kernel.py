"""The fused Triton verifier against `verify_native` on one GPU: time, bandwidth, speedup.

    python benchmarks/verify_kernel.py [--quick] [--json out.json] [--one-hot] [--reps 20]
    python benchmarks/verify_kernel.py --interpret-smoke     # CPU: a tiny config on Triton's interpreter

Grid: B in {1, 8, 64, 256}, D in {1, 4, 8}, V in {32000, 49152, 128256, 151936}, fp32 and bf16 logits;
every row sampled at temperature 1 (no top-k / top-p: the fast path), a full draft of D tokens from a
dense q (`--one-hot`: deterministic drafts, draft_probs=None). Random drafts are nearly always rejected
at the first position, so the recovered-token path (residual race, one q row read) is what runs.

Columns, medians over --reps timed calls (CUDA events) after --warmup calls:
- native_ms: `verify_native` with pre-drawn noise (drawing it is not timed);
- fused_ms: `verify_fused` as the runtime calls it, noise drawn in-kernel (seeds, offsets);
- kernel_ms: the same without `validate_verify_inputs` (its NaN scan reads the logits once more);
- GB/s and %copy: kernel_ms against the bytes the verifier cannot avoid moving once: all logits,
  one q row per row (the residual at the rejected position) plus the D gathered q entries, and the small
  tensors in and out. Counting all of draft_probs [B, D, V] instead would flatter the kernel, which
  never reads most of it. %copy compares with a timed 1 GiB device-to-device copy (read + write bytes);
- speedup: native_ms / fused_ms.
The goal line covers configs with B * (D + 1) * V >= 1e8: %copy >= 80 and speedup >= 5.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

if "--interpret-smoke" in sys.argv:  # Triton reads this when it is first imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from draftsmith.speculative import kernels  # noqa: E402
from draftsmith.speculative.verify import verify_native  # noqa: E402

GOAL_ELEMENTS, GOAL_COPY_PCT, GOAL_SPEEDUP = 1e8, 80.0, 5.0
FULL_GRID = dict(batch=[1, 8, 64, 256], draft=[1, 4, 8], vocab=[32000, 49152, 128256, 151936],
                 dtype=[torch.float32, torch.bfloat16])
QUICK_GRID = dict(batch=[1, 64, 256], draft=[4], vocab=[32000, 128256], dtype=[torch.float32, torch.bfloat16])
SMOKE_GRID = dict(batch=[1, 3], draft=[2], vocab=[50], dtype=[torch.float32, torch.bfloat16])


def time_ms(fn, device: torch.device, reps: int, warmup: int) -> float:
    """Median milliseconds of fn(): CUDA events on a GPU, perf_counter elsewhere."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_gbps(device: torch.device, reps: int, nbytes: int) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, reps, warmup=3)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def make_inputs(batch, draft, vocab, dtype, one_hot, device):
    g = torch.Generator(device=device).manual_seed(0)
    width = draft + 1
    logits = (torch.randn(batch, width, vocab, generator=g, device=device) * 2).to(dtype)
    probs = None
    if not one_hot:
        probs = torch.rand(batch, draft, vocab, generator=g, device=device)
        probs /= probs.sum(-1, keepdim=True)
    args = dict(
        target_logits=logits,
        draft_tokens=torch.randint(0, vocab, (batch, draft), generator=g, device=device),
        draft_lens=torch.full((batch,), draft, device=device),
        draft_probs=probs,
        temperature=torch.ones(batch, device=device),
        top_k=torch.zeros(batch, dtype=torch.long, device=device),
        top_p=torch.ones(batch, device=device),
    )
    noise = dict(
        accept_u=torch.rand(batch, draft, generator=g, device=device),
        race_exp=torch.empty(batch, vocab, device=device).exponential_(generator=g).clamp_(min=1e-30),
    )
    philox = dict(seeds=torch.arange(batch, device=device), offsets=torch.zeros(batch, dtype=torch.long, device=device))
    return args, noise, philox


def min_bytes(batch, draft, vocab, dtype, one_hot) -> int:
    """Bytes moved at least once: logits, the q entries used, small tensors in and out."""
    width = draft + 1
    logits = batch * width * vocab * torch.empty((), dtype=dtype).element_size()
    q = 0 if one_hot else batch * (vocab + draft) * 4
    small_in = batch * (draft * 8 + 8 + 4 + 8 + 4 + 16)  # tokens, lens, temperature, top_k, top_p, seeds+offsets
    small_out = batch * (width * 8 + 16)  # tokens, num_accepted, num_emitted
    return logits + q + small_in + small_out


def fits(batch, draft, vocab, dtype, one_hot, device) -> bool:
    """Rough peak of the reference (float logits, scaled copy, p, masks) plus the inputs."""
    if device.type != "cuda":
        return True
    cells = batch * (draft + 1) * vocab
    need = cells * (torch.empty((), dtype=dtype).element_size() + 4 * 4) + (0 if one_hot else batch * draft * vocab * 4)
    return need < 0.8 * torch.cuda.mem_get_info(device)[0]


def bench_one(batch, draft, vocab, dtype, one_hot, device, reps, warmup) -> dict:
    from draftsmith.speculative.kernels.verify_triton import _verify_fused_unchecked

    args, noise, philox = make_inputs(batch, draft, vocab, dtype, one_hot, device)
    unchecked = [args[k] for k in ("target_logits", "draft_tokens", "draft_lens", "draft_probs", "temperature",
                                   "top_k", "top_p")] + [None, None, philox["seeds"], philox["offsets"]]
    native_ms = time_ms(lambda: verify_native(**args, **noise), device, reps, warmup)
    fused_ms = time_ms(lambda: kernels.verify_fused(**args, **philox), device, reps, warmup)
    kernel_ms = time_ms(lambda: _verify_fused_unchecked(*unchecked), device, reps, warmup)
    # Same noise, same tokens: a guard that the timed kernel computes the right thing (a difference is
    # possible only where u * q or two race entries lie within a few ulps, see verify_triton).
    same = torch.equal(kernels.verify_fused(**args, **noise).tokens, verify_native(**args, **noise).tokens)
    nbytes = min_bytes(batch, draft, vocab, dtype, one_hot)
    return dict(batch=batch, draft=draft, vocab=vocab, dtype=str(dtype).removeprefix("torch."),
                elements=batch * (draft + 1) * vocab, native_ms=native_ms, fused_ms=fused_ms, kernel_ms=kernel_ms,
                gbps=nbytes / (kernel_ms * 1e-3) / 1e9, speedup=native_ms / fused_ms, bytes=nbytes,
                matches_native=same)


def print_table(rows: list[dict], copy: float, copy_bytes: int) -> None:
    print(f"copy bandwidth: {copy:.1f} GB/s ({copy_bytes / 2**20:.0f} MiB device-to-device, read + write)")
    head = f"{'B':>4} {'D':>2} {'V':>7} {'dtype':>8} {'native_ms':>10} {'fused_ms':>9} {'kernel_ms':>10} " \
           f"{'GB/s':>7} {'%copy':>6} {'speedup':>8}"
    print(head)
    for r in rows:
        if "skipped" in r:
            print(f"{r['batch']:>4} {r['draft']:>2} {r['vocab']:>7} {r['dtype']:>8}  skipped: {r['skipped']}")
            continue
        print(f"{r['batch']:>4} {r['draft']:>2} {r['vocab']:>7} {r['dtype']:>8} {r['native_ms']:>10.3f} "
              f"{r['fused_ms']:>9.3f} {r['kernel_ms']:>10.3f} {r['gbps']:>7.0f} {r['copy_pct']:>6.1f} "
              f"{r['speedup']:>7.1f}x" + ("" if r["matches_native"] else "  MISMATCH"))


def goal(rows: list[dict]) -> dict:
    big = [r for r in rows if "skipped" not in r and r["elements"] >= GOAL_ELEMENTS]
    bw_ok = [r for r in big if r["copy_pct"] >= GOAL_COPY_PCT]
    fast = [r for r in big if r["speedup"] >= GOAL_SPEEDUP]
    return dict(configs=len(big), copy_pct_ok=len(bw_ok), speedup_ok=len(fast),
                met=bool(big) and len(bw_ok) == len(big) and len(fast) == len(big))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small subset of the grid")
    parser.add_argument("--json", help="write the table as JSON to this path")
    parser.add_argument("--one-hot", action="store_true", help="deterministic drafts (draft_probs=None)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--interpret-smoke", action="store_true", help="tiny configs on the CPU interpreter")
    args = parser.parse_args()

    if args.interpret_smoke:
        device, grid, copy_bytes, args.reps, args.warmup = torch.device("cpu"), SMOKE_GRID, 1 << 24, 2, 1
        if not kernels.interpreting():
            print("the Triton interpreter did not start (is triton installed?)")
            return 1
    elif not torch.cuda.is_available():
        print("no CUDA device: this benchmark measures the GPU kernel (use --interpret-smoke to test the script)")
        return 0
    else:
        device, grid, copy_bytes = torch.device("cuda"), QUICK_GRID if args.quick else FULL_GRID, 1 << 30
    if not kernels.HAS_TRITON:
        print("triton is not installed: pip install 'draftsmith[gpu]'")
        return 0

    copy = copy_gbps(device, args.reps, copy_bytes)
    rows = []
    for batch, draft, vocab, dtype in itertools.product(grid["batch"], grid["draft"], grid["vocab"], grid["dtype"]):
        row = dict(batch=batch, draft=draft, vocab=vocab, dtype=str(dtype).removeprefix("torch."))
        if not fits(batch, draft, vocab, dtype, args.one_hot, device):
            rows.append({**row, "skipped": "does not fit in free device memory"})
            continue
        try:
            row = bench_one(batch, draft, vocab, dtype, args.one_hot, device, args.reps, args.warmup)
            row["copy_pct"] = 100 * row["gbps"] / copy
        except torch.cuda.OutOfMemoryError:
            row["skipped"] = "out of memory"
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print_table(rows, copy, copy_bytes)
    summary = goal(rows)
    verdict = "no config in range" if not summary["configs"] else "met" if summary["met"] else "NOT met"
    print(f"goal (B*(D+1)*V >= {GOAL_ELEMENTS:.0e}: >= {GOAL_COPY_PCT:.0f}% of copy bandwidth, >= {GOAL_SPEEDUP:.0f}x "
          f"native): {summary['copy_pct_ok']}/{summary['configs']} bandwidth, {summary['speedup_ok']}/"
          f"{summary['configs']} speedup -> {verdict}")
    if args.json:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
        report = dict(device=name, copy_gbps=copy, draft_probs="one-hot" if args.one_hot else "dense",
                      reps=args.reps, warmup=args.warmup, configs=rows, goal=summary)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if all(r.get("matches_native", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
