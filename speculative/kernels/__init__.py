"""Fused GPU kernels, and the switch between them and the pure-PyTorch reference.

Triton is imported here and nowhere else in draftsmith, behind `HAS_TRITON`, so the package imports
and works on a machine without it. `select_verifier` picks the verifier the runtime calls:

    auto    the fused Triton kernel on CUDA devices when Triton is installed, else `verify_native`
    native  always `verify_native`
    triton  always the kernel: CUDA, or CPU under TRITON_INTERPRET=1 (slow; for tests)

The environment variable DRAFTSMITH_VERIFIER (auto | native | triton), when set, overrides the mode.
Both verifiers take the same positional arguments and return a `VerifyOutput`; the kernel also
accepts accept_u / race_exp = None plus keyword `seeds` / `offsets` to draw its noise in-kernel.

TRITON_INTERPRET must be set before triton is first imported (Triton reads it when its own library
functions are defined), which in practice means at the top of a test conftest or in the environment.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Callable

import torch

from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.verify import VerifyOutput, verify_native

# Found, not imported: importing triton costs start-up time, and on a CPU machine it must happen only
# after TRITON_INTERPRET is set. The kernel module is imported on first use.
HAS_TRITON = importlib.util.find_spec("triton") is not None

MODES = ("auto", "native", "triton")
ENV_VAR = "DRAFTSMITH_VERIFIER"

def verify_fused(*args, **kwargs) -> VerifyOutput:
    """The fused Triton verifier (`verify_triton.verify_fused`), imported on first call."""
    if not HAS_TRITON:
        raise InvalidInputError("the fused verifier needs triton: pip install 'draftsmith[gpu]' (or use verify_native)")
    from draftsmith.speculative.kernels.verify_triton import verify_fused as fused

    return fused(*args, **kwargs)


def interpreting() -> bool:
    """True when Triton kernels run on the CPU interpreter: TRITON_INTERPRET=1 was set before triton
    was imported (set later, Triton's own library functions are already compiled-mode only)."""
    if not HAS_TRITON:
        return False
    import triton

    if not triton.knobs.runtime.interpret:
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.philox, InterpretedFunction)


def select_verifier(device: torch.device | str, mode: str = "auto") -> Callable[..., VerifyOutput]:
    """The verifier for tensors on `device`: `verify_fused` or `verify_native` (same call signature)."""
    mode = os.environ.get(ENV_VAR) or mode
    if mode not in MODES:
        raise InvalidInputError(f"verifier mode must be one of {', '.join(MODES)} (from {ENV_VAR} or mode), got {mode!r}")
    on_cuda = torch.device(device).type == "cuda"
    if mode == "native" or (mode == "auto" and not (on_cuda and HAS_TRITON)):
        return verify_native
    if not HAS_TRITON:
        raise InvalidInputError("the triton verifier needs triton: pip install 'draftsmith[gpu]', or use mode native")
    if not on_cuda and not interpreting():
        raise InvalidInputError(
            f"the triton verifier runs on CUDA devices, not {torch.device(device)}; "
            "use mode native, or set TRITON_INTERPRET=1 before triton is imported (slow, for tests)"
        )
    return verify_fused


__all__ = ["HAS_TRITON", "MODES", "interpreting", "select_verifier", "verify_fused"]
