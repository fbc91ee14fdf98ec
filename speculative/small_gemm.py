"""Linear layers over a few rows, computed as `W @ x.T` on the CPU where that is faster, measured.

A verification pass runs the target over D + 1 tokens per row, so every linear layer multiplies a weight
W [out, in] by only a handful of rows. `F.linear(x, W)` hands that to the BLAS as x @ W.T, and whether
that shape runs near the one-row cost depends on the CPU, its BLAS and the weights' dtype:

- AMD EPYC (AVX-512), float32: a SmolLM2-135M pass over 3 tokens cost 2.0x a one-token step through
  F.linear (the 49152 x 576 lm_head alone 60 ms against 20 ms for one row); as (W @ x.T).T, the weight
  the left operand, 1.3x.
- Intel Xeon with AMX, float32: the other way round. F.linear runs 2-3 rows at the one-row cost and W @ x.T
  at 2-3x it (the pass over 2 tokens: 1.05x a one-token step through F.linear, 2.2x through W @ x.T).
  In bfloat16 on the same CPU W @ x.T runs 2-16 rows at half F.linear's time.

So the path is measured, not assumed: `choice(weight)` times both for each row count 2..MAX_ROWS on this
machine (a few milliseconds per weight shape; about 3 s for SmolLM2's 49152 x 576 lm_head), keeps W @ x.T
for the row counts where it is clearly faster, and remembers the answer for later processes on the
machine (calibrate.py: keyed by CPU, torch version, threads, dtype and shape).
`DRAFTSMITH_SMALL_GEMM=auto|on|off` (or `SpeculativeDecoder(..., small_gemm=...)`) overrides.

The result is the same matrix product in another summation order: logits differ from F.linear's in the
last bits (about 5e-5 on SmolLM2's logits), as they already do between a one-row step and a multi-row
pass, so greedy equality with the target's own decoding holds up to exact near-ties (see the tie
tolerance of `draftsmith eval`). One-row calls (plain decoding steps) and large calls (prefill) keep
F.linear untouched.

`small_row_linears(*modules, mode=...)` switches every nn.Linear inside the given modules to this path for
the duration of a `with` block and restores them after, so a model used outside draftsmith's runtime (for
example by Hugging Face `generate`) is unaffected. The runtime plans its layers once per decoder (`plan`)
and enters `patched(plan)` per engine step: walking the modules and setting attributes through
nn.Module on every step cost about 5% of a plain SmolLM2 step on one core.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from typing import Iterator

import torch
from torch import nn

from draftsmith.speculative import calibrate
from draftsmith.speculative.errors import InvalidInputError

MAX_ROWS = 16  # above this many rows the BLAS's own choice is as fast or faster (measured on the lm_head)
MODE_ENV = "DRAFTSMITH_SMALL_GEMM"
MODES = ("auto", "on", "off")
ALL_ROWS = frozenset(range(2, MAX_ROWS + 1))
# W @ x.T is kept for a row count only when it takes less than this share of F.linear's time: where the two
# are within noise of each other the BLAS's own path stays.
MARGIN = 0.9
_REPS = 5  # timed calls per path and row count (after one warm-up), interleaved; the median decides
_chosen: dict[tuple, frozenset[int]] = {}


def small_row_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`module(x)`, as W @ x.T when x holds a row count in the module's `_ds_rows` (default: 2..MAX_ROWS)."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if rows not in getattr(module, "_ds_rows", ALL_ROWS):
        return nn.functional.linear(x, module.weight, module.bias)
    flat = x.reshape(rows, x.shape[-1])
    y = torch.matmul(module.weight, flat.T).T  # [rows, out]
    if module.bias is not None:
        y = y + module.bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


Plan = list[tuple[nn.Linear, frozenset[int]]]


def plan(*modules: nn.Module | None, mode: str = "on") -> Plan:
    """The nn.Linear layers inside `modules` that take the few-row path, each with its row counts: every
    count 2..MAX_ROWS ("on"), or those where this machine runs it faster ("auto", `choice`)."""
    linears = {id(m): m for root in modules if root is not None for m in root.modules()
               if type(m) is nn.Linear and "forward" not in vars(m)}  # exact type: subclasses may do more
    chosen = [(m, ALL_ROWS if mode == "on" else choice(m.weight)) for m in linears.values()]
    return [(m, rows) for m, rows in chosen if rows]


@contextlib.contextmanager
def patched(layers: Plan) -> Iterator[None]:
    """Route each planned layer through `small_row_linear` within the block (restored after). The runtime
    enters this once per engine step, so it writes the instance dicts directly (no module walk, no
    nn.Module.__setattr__)."""
    mine = [(m, rows) for m, rows in layers if "forward" not in vars(m)]  # nested: the outer block owns the rest
    try:
        for m, rows in mine:
            state = vars(m)
            state["_ds_rows"] = rows
            state["forward"] = small_row_linear.__get__(m)  # an instance attribute shadows nn.Linear.forward
        yield
    finally:
        for m, _ in mine:
            state = vars(m)
            state.pop("forward", None)
            state.pop("_ds_rows", None)


def small_row_linears(*modules: nn.Module | None, mode: str = "on") -> contextlib.AbstractContextManager:
    """Route the nn.Linear layers inside `modules` through `small_row_linear` within the block (`plan`)."""
    return patched(plan(*modules, mode=mode))


def resolve_mode(device: torch.device | str, small_gemm: bool | str | None = None) -> str:
    """"auto", "on" or "off" for a runtime on `device`: `small_gemm` if given (True/False: on/off), else
    $DRAFTSMITH_SMALL_GEMM, else "auto" on CPU devices and "off" elsewhere (GPUs keep their own kernels)."""
    if isinstance(small_gemm, bool):
        return "on" if small_gemm else "off"
    mode = small_gemm or os.environ.get(MODE_ENV, "").strip().lower() or "auto"
    if mode not in MODES:
        raise InvalidInputError(f"{MODE_ENV} must be one of {', '.join(MODES)}, got {mode!r}")
    return "off" if mode == "auto" and torch.device(device).type != "cpu" else mode


def choice(weight: torch.Tensor) -> frozenset[int]:
    """The row counts (of 2..MAX_ROWS) at which W @ x.T beats F.linear for this weight's shape and dtype on
    this machine: measured once per machine and remembered (calibrate.py). With calibration off: every
    row count for float32 (the choice measured on the CPUs this was first built on), none for 16-bit."""
    if weight.device.type != "cpu":
        return frozenset()
    if not calibrate.enabled():
        return ALL_ROWS if weight.dtype == torch.float32 else frozenset()
    quick = (weight.dtype, weight.shape, torch.get_num_threads())  # the runtime asks once per step per layer
    if quick not in _chosen:
        key = f"{str(weight.dtype).removeprefix('torch.')}|linear W @ x.T rows|{tuple(weight.shape)}"
        _chosen[quick] = frozenset(calibrate.remembered(key, lambda: sorted(measure(weight))))
    return _chosen[quick]


def measure(weight: torch.Tensor, reps: int = _REPS) -> frozenset[int]:
    """Time F.linear against W @ x.T on `weight` for 2..MAX_ROWS rows; the row counts where W @ x.T wins."""
    faster = set()
    with torch.inference_mode():
        for rows in sorted(ALL_ROWS):
            x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
            paths = (lambda: nn.functional.linear(x, weight), lambda: torch.matmul(weight, x.T).T)
            times: tuple[list[float], list[float]] = ([], [])
            for rep in range(reps + 1):
                for path, spent in zip(paths, times):
                    start = time.perf_counter()
                    path()
                    if rep:  # the first call of each path warms up
                        spent.append(time.perf_counter() - start)
            if statistics.median(times[1]) < MARGIN * statistics.median(times[0]):
                faster.add(rows)
    return frozenset(faster)
