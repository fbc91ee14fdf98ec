"""Linear layers over a few rows, computed as `W @ x.T` on the CPU.

A verification pass runs the target over D + 1 tokens per row, so every linear layer multiplies a weight
W [out, in] by only a handful of rows. `F.linear(x, W)` hands that to the BLAS as x @ W.T with x the
small operand, and on CPU BLAS libraries (MKL, OpenBLAS) that shape is slow for a weight streamed from
memory: measured on 2 cores with SmolLM2-135M, a target pass over 3 tokens cost 2.0x a one-token step,
and the 49152 x 576 lm_head alone 60 ms against 20 ms for one row. The same product written as
(W @ x.T).T, where the weight is the left operand, runs at close to the one-row cost: the pass over 3
tokens drops to 1.3x a one-token step (benchmarks/speedup.py shows the effect end to end).

The result is the same matrix product in another summation order: logits differ from F.linear's in the
last bits (about 5e-5 on SmolLM2's logits), as they already do between a one-row step and a multi-row
pass, so greedy equality with the target's own decoding holds up to exact near-ties (see the tie
tolerance of `draftsmith eval`). One-row calls (plain decoding steps) and large calls (prefill) keep
F.linear untouched.

`small_row_linears(*modules)` switches every nn.Linear inside the given modules to this path for the
duration of a `with` block and restores them after, so a model used outside draftsmith's runtime (for
example by Hugging Face `generate`) is unaffected.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

MAX_ROWS = 16  # above this many rows the BLAS's own choice is as fast or faster (measured on the lm_head)


def small_row_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`module(x)`, as W @ x.T when x holds 2..MAX_ROWS rows."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if not 1 < rows <= MAX_ROWS:
        return nn.functional.linear(x, module.weight, module.bias)
    flat = x.reshape(rows, x.shape[-1])
    y = torch.matmul(module.weight, flat.T).T  # [rows, out]
    if module.bias is not None:
        y = y + module.bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


@contextlib.contextmanager
def small_row_linears(*modules: nn.Module | None) -> Iterator[None]:
    """Route the nn.Linear layers inside `modules` through `small_row_linear` within the block."""
    linears = {id(m): m for root in modules if root is not None for m in root.modules()
               if type(m) is nn.Linear and "forward" not in vars(m)}  # exact type: subclasses may do more
    patched = list(linears.values())
    try:
        for m in patched:
            m.forward = small_row_linear.__get__(m)  # an instance attribute shadows nn.Linear.forward
        yield
    finally:
        for m in patched:
            vars(m).pop("forward", None)


def wanted(device: torch.device, dtype: torch.dtype = torch.float32) -> bool:
    """The default: on for float32 weights on CPU devices, where the BLAS shape problem occurs. GPUs keep
    their own kernels, and so do 16-bit weights on CPU: oneDNN's bfloat16 path already runs a 5-token
    pass at about 1.1x a one-token step (SmolLM2-135M, one AVX-512 BF16 core), and W @ x.T would slow it."""
    return torch.device(device).type == "cpu" and dtype == torch.float32
