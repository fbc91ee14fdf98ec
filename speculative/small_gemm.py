"""Linear layers over a few rows, computed as `W @ x.T` on the CPU where that is faster, measured.

A verification pass runs the target over D + 1 tokens per row, so every linear layer multiplies a weight
W [out, in] by only a handful of rows. `F.linear(x, W)` hands that to the BLAS as x @ W.T, and whether
that shape runs near the one-row cost depends on the CPU, its BLAS and the weights' dtype:

- AMD EPYC (AVX-512), float32, MKL: F.linear runs two rows at about twice one row's time (the 49152 x 576
  lm_head 14.5 ms against 7.0 ms), while W @ x.T over two rows streams the weight faster than the
  one-row product itself does (4.5 ms). So one row is computed as two (a zero row added), three as four:
  SmolLM2-135M's one-token step went from 37.7 to 34.8 ms and its passes over 2 / 4 tokens from 58.4 /
  57.1 ms to 36.0 / 39.9 ms.
- Intel Xeon with AMX, float32: the other way round. F.linear runs 2-3 rows at the one-row cost and W @ x.T
  at 2-3x it (the pass over 2 tokens: 1.05x a one-token step through F.linear, 2.2x through W @ x.T).
  In bfloat16 on the same CPU W @ x.T runs 2-16 rows at half F.linear's time.

So the path is measured, not assumed: `choice(weight)` times both for each row count 1..MAX_ROWS on this
machine and keeps, per count, W @ x.T over that many rows or a few more (zeros added) where that is
clearly faster, else F.linear (its "route"). It times a weight as a pass meets it, read from memory
after every other weight of the model, not hot in cache: copies of the weight fill as much memory as the
planned modules' weights (up to COLD_CAP). Timed hot, a 1536 x 576 weight favoured F.linear at every row
count on the EPYC; in the pass W @ x.T was 30% faster. The answer is remembered for later processes
on the machine (calibrate.py: keyed by CPU, torch version, threads, dtype, shape and working set), and
the pass costs measured in a plan's context are keyed by its `signature`.
`DRAFTSMITH_SMALL_GEMM=auto|on|off` (or `SpeculativeDecoder(..., small_gemm=...)`) overrides.

The result is the same matrix product in another summation order: logits differ from F.linear's in the
last bits (about 5e-5 on SmolLM2's logits), as they already do between a one-row step and a multi-row
pass, so greedy equality with the target's own decoding holds up to exact near-ties (see the tie
tolerance of `draftsmith eval`). The result is returned row-major, as F.linear's: a transposed one made
attention's query strided and sent every multi-token pass to the unfused attention kernel (a 2-token
pass of SmolLM2 spent 11 ms there against 1.2 ms fused). Large calls (prefill) keep F.linear untouched.

`small_row_linears(*modules, mode=...)` switches every nn.Linear inside the given modules to this path for
the duration of a `with` block and restores them after, so a model used outside draftsmith's runtime (for
example by Hugging Face `generate`) is unaffected. The runtime plans its layers once per decoder (`plan`)
and enters `patched(plan)` per engine step: walking the modules and setting attributes through
nn.Module on every step cost about 5% of a plain SmolLM2 step on one core.
"""

from __future__ import annotations

import contextlib
import hashlib
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
# A route maps a row count to the row count the product is computed over (>= it: the rest zero rows), for the
# counts that take W @ x.T; the others keep F.linear. ALL_ROWS: every count 2..MAX_ROWS as it is.
Route = dict[int, int]
ALL_ROWS: Route = {rows: rows for rows in range(2, MAX_ROWS + 1)}
# W @ x.T is kept for a row count only when it takes less than this share of F.linear's time: where the two
# are within noise of each other the BLAS's own path stays.
MARGIN = 0.9
PAD_SLACK = 1.03  # a wider product is chosen only when it beats every narrower one by more than this
COLD_CAP = 128 << 20  # weight bytes a timing cycles through at most: beyond any CPU's last-level cache
_REPS = 3  # timed sweeps per path and row count (after one warm-up), interleaved; the median decides
_chosen: dict[tuple, Route] = {}


def small_row_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`module(x)`, as W @ x.T (over `route[rows]` rows, the rest zeros) when the module's route
    (`_ds_route`, default ALL_ROWS) holds x's row count, else F.linear. Row-major like F.linear's result:
    a transposed one would take attention off its fused kernel (a query whose last dim is strided)."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    width = getattr(module, "_ds_route", ALL_ROWS).get(rows)
    if width is None:
        return nn.functional.linear(x, module.weight, module.bias)
    flat = x.reshape(rows, x.shape[-1])
    if width > rows:
        flat = torch.cat([flat, flat.new_zeros(width - rows, flat.shape[1])])
    y = torch.matmul(module.weight, flat.T)[:, :rows].T.contiguous()  # [rows, out]
    if module.bias is not None:
        y = y + module.bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


Plan = list[tuple[nn.Linear, Route]]


def plan(*modules: nn.Module | None, mode: str = "on") -> Plan:
    """The nn.Linear layers inside `modules` that take the few-row path, each with its route: every count
    2..MAX_ROWS as it is ("on"), or what this machine runs fastest ("auto", `choice`), timed with the
    weights cycling through as much memory as these modules' linear weights fill (up to COLD_CAP): in a
    pass every weight comes back after all the others, out of cache when they outgrow it."""
    linears = {id(m): m for root in modules if root is not None for m in root.modules()
               if type(m) is nn.Linear and "forward" not in vars(m)}  # exact type: subclasses may do more
    weights = {id(m.weight): m.weight for m in linears.values()}  # tied weights count once
    working_set = working_set_bytes(sum(w.numel() * w.element_size() for w in weights.values()))
    chosen = [(m, ALL_ROWS if mode == "on" else choice(m.weight, working_set)) for m in linears.values()]
    return [(m, route) for m, route in chosen if route]


def working_set_bytes(total: int) -> int:
    """`total` bytes rounded up to a power of two MiB (at least 1), at most COLD_CAP: the memory a timing
    cycles weights through (and a key of the stored choice, so close model sizes share one)."""
    mib = 1
    while mib << 20 < min(total, COLD_CAP):
        mib *= 2
    return mib << 20


def signature(layers: Plan | None) -> str:
    """A short digest of a plan's routes per weight shape (\"off\" for none): what the passes timed in its
    context depend on, so their stored costs are keyed by it."""
    if not layers:
        return "off"
    routes = sorted({(tuple(m.weight.shape), str(m.weight.dtype), tuple(sorted(r.items()))) for m, r in layers})
    return hashlib.sha256(repr(routes).encode()).hexdigest()[:12]


@contextlib.contextmanager
def patched(layers: Plan) -> Iterator[None]:
    """Route each planned layer through `small_row_linear` within the block (restored after). The runtime
    enters this once per engine step, so it writes the instance dicts directly (no module walk, no
    nn.Module.__setattr__)."""
    mine = [(m, route) for m, route in layers if "forward" not in vars(m)]  # nested: the outer block owns the rest
    try:
        for m, route in mine:
            state = vars(m)
            state["_ds_route"] = route
            state["forward"] = small_row_linear.__get__(m)  # an instance attribute shadows nn.Linear.forward
        yield
    finally:
        for m, _ in mine:
            state = vars(m)
            state.pop("forward", None)
            state.pop("_ds_route", None)


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


def choice(weight: torch.Tensor, working_set: int = 0) -> Route:
    """The route (row count -> row count computed, 1..MAX_ROWS) on which W @ x.T beats F.linear for this
    weight's shape and dtype on this machine, with `working_set` bytes of weights between two uses of it
    (`plan`): measured once per machine and remembered (calibrate.py). With calibration off: every count
    2..MAX_ROWS as it is for float32 (the choice measured on the CPUs this was first built on), none for
    16-bit."""
    if weight.device.type != "cpu":
        return {}
    if not calibrate.enabled():
        return dict(ALL_ROWS) if weight.dtype == torch.float32 else {}
    working_set = working_set_bytes(working_set)
    quick = (weight.dtype, weight.shape, working_set, torch.get_num_threads())  # asked once per layer per plan
    if quick not in _chosen:
        key = (f"{str(weight.dtype).removeprefix('torch.')}|linear route|{tuple(weight.shape)}"
               f"|{working_set >> 20} MiB")
        stored = calibrate.remembered(key, lambda: {str(r): w for r, w in measure(weight, working_set).items()})
        _chosen[quick] = {int(r): int(w) for r, w in stored.items()}
    return _chosen[quick]


def measure(weight: torch.Tensor, working_set: int = 0, reps: int = _REPS) -> Route:
    """Time F.linear against W @ x.T on `weight` for 1..MAX_ROWS rows, cycling through copies of it that
    fill `working_set` bytes (a weight read from memory, as in a pass over a model larger than the cache,
    not the cache-hot repeat of one call); the route that is fastest per row count: W @ x.T over the count
    itself or over more rows (zeros added) where that is faster still, and only where it beats F.linear.

    On an AMD EPYC core in float32, SmolLM2's 49152 x 576 lm_head (7.0 ms through F.linear for one row,
    14.5 ms for two) takes 4.5 ms through W @ x.T over two rows: one row is computed as two, and three as
    four. Timed hot, one 1536 x 576 weight favoured F.linear at every count; cold, W @ x.T over two rows
    took 150 us against 215 us for F.linear's one row."""
    copies = [weight] + [weight.clone() for _ in range(min(512, -(-working_set // _bytes(weight))) - 1)]
    counts = range(1, MAX_ROWS + 1)
    xs = {rows: torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device) for rows in counts}
    paths = {("linear", rows): (lambda w, x=xs[rows]: nn.functional.linear(x, w)) for rows in counts}
    paths.update({("wxt", rows): (lambda w, x=xs[rows]: torch.matmul(w, x.T)) for rows in counts if rows > 1})
    times: dict[tuple, list[float]] = {p: [] for p in paths}
    with torch.inference_mode():
        for rep in range(reps + 1):
            for p, path in paths.items():
                start = time.perf_counter()
                for w in copies:
                    path(w)
                if rep:  # the first sweep warms up
                    times[p].append((time.perf_counter() - start) / len(copies))
    spent = {p: statistics.median(t) for p, t in times.items()}
    route: Route = {}
    for rows in counts:
        wider = [w for w in counts if w >= max(rows, 2)]
        fastest = min(spent["wxt", w] for w in wider)
        width = min(w for w in wider if spent["wxt", w] <= PAD_SLACK * fastest)  # the narrowest near the best
        if spent["wxt", width] < MARGIN * spent["linear", rows]:
            route[rows] = width
    return route


def _bytes(weight: torch.Tensor) -> int:
    return max(1, weight.numel() * weight.element_size())
