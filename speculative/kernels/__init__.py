"""Fused GPU kernels, and the switch between them and the pure-PyTorch reference.

Triton is imported here and nowhere else in draftsmith, behind `HAS_TRITON`, so the package imports
and works on a machine without it. `select_verifier` picks the verifier the runtime calls:

    auto    the fused Triton kernel on CUDA devices when Triton is installed, else `verify_native`
    native  always `verify_native`
    triton  always the kernel: CUDA, or CPU under TRITON_INTERPRET=1 (slow; for tests)

A mode passed explicitly wins; without one, the environment variable DRAFTSMITH_VERIFIER (auto |
native | triton) chooses, else "auto". Both verifiers take the same positional arguments and return a
`VerifyOutput`; the kernel also accepts accept_u / race_exp = None plus keyword `seeds` / `offsets`
to draw its noise in-kernel.

The runtime calls every verifier one way, `RoundVerifier`: (logits, draft, sampling, noise, check),
where `noise` (`RoundNoise`) hands out either explicit per-row noise or Philox keys and each verifier
takes the kind it needs. `make_verifier` builds it from a mode, or from any callable with
`verify_native`'s signature (which is given explicit noise).

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


def select_verifier(device: torch.device | str, mode: str | None = None) -> Callable[..., VerifyOutput]:
    """The verifier for tensors on `device`: `verify_fused` or `verify_native` (same call signature).
    `mode` None: DRAFTSMITH_VERIFIER, else "auto"."""
    return verify_fused if _uses_kernel(device, mode) else verify_native


def _uses_kernel(device: torch.device | str, mode: str | None) -> bool:
    mode = mode or os.environ.get(ENV_VAR) or "auto"
    if mode not in MODES:
        raise InvalidInputError(f"verifier mode must be one of {', '.join(MODES)} (from {ENV_VAR} or mode), got {mode!r}")
    on_cuda = torch.device(device).type == "cuda"
    if mode == "native" or (mode == "auto" and not (on_cuda and HAS_TRITON)):
        return False
    if not HAS_TRITON:
        raise InvalidInputError("the triton verifier needs triton: pip install 'draftsmith[gpu]', or use mode native")
    if not on_cuda and not interpreting():
        raise InvalidInputError(
            f"the triton verifier runs on CUDA devices, not {torch.device(device)}; "
            "use mode native, or set TRITON_INTERPRET=1 before triton is imported (slow, for tests)"
        )
    return True


class RoundNoise:
    """One round's randomness for the verifier, drawn from the rows' own generators on request:
    `explicit()` (accept_u [B, D], race_exp [B, V]) or `philox()` (seeds [B], offsets [B])."""

    def __init__(self, rng, sampled: list[bool], lens: list[int], width: int, vocab: int):
        self.rng, self.sampled, self.lens, self.width, self.vocab = rng, sampled, lens, width, vocab

    def explicit(self) -> tuple[torch.Tensor, torch.Tensor]:
        # Only sampled rows draw, and only as many uniforms as they drafted: a row's stream is the same
        # in any batch.
        counts = [n if x else 0 for n, x in zip(self.lens, self.sampled)]
        return self.rng.uniform(counts, self.width), self.rng.exponential(self.sampled, self.vocab)

    def philox(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rng.philox_keys()


class RoundVerifier:
    """A verifier as the runtime calls it. `fn` has verify_native's signature and gets explicit noise;
    with `kernel_noise` it is the fused kernel and gets Philox keys instead. `check`: validate the
    inputs (shapes, ids, NaNs; host syncs) in this call."""

    def __init__(self, fn: Callable[..., VerifyOutput], *, kernel_noise: bool = False, validates: bool = True):
        self.fn, self.kernel_noise, self.validates = fn, kernel_noise, validates
        self.name = getattr(fn, "__name__", type(fn).__name__)  # for reports

    def __call__(self, logits, draft, sampling, noise: RoundNoise, check: bool) -> VerifyOutput:
        args = (logits, draft.tokens, draft.lens, draft.probs, sampling.temperature, sampling.top_k, sampling.top_p)
        extra = {"validate": check} if self.validates else {}
        if self.kernel_noise:
            seeds, offsets = noise.philox()
            return self.fn(*args, None, None, seeds=seeds, offsets=offsets, **extra)
        return self.fn(*args, *noise.explicit(), **extra)


def make_verifier(device: torch.device | str, verifier: str | Callable[..., VerifyOutput] | None = None) -> RoundVerifier:
    """The runtime's verifier: a mode (see `select_verifier`; None = the environment's, else auto) or
    a callable with verify_native's signature, used as given (it validates what it likes)."""
    if callable(verifier):
        return RoundVerifier(verifier, validates=False)
    if _uses_kernel(device, verifier):
        return RoundVerifier(verify_fused, kernel_noise=True)
    return RoundVerifier(verify_native)


__all__ = ["HAS_TRITON", "MODES", "RoundNoise", "RoundVerifier", "interpreting", "make_verifier", "select_verifier",
           "verify_fused"]
