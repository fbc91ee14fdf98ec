"""Floating-point dtypes by name: the one table behind `--dtype` and the teacher cache's setting."""

from __future__ import annotations

import torch

# In the order `--dtype` offers them.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """The name of `dtype` as reports and manifests record it: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")
