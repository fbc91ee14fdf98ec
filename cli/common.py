"""Options and helpers shared by the subcommands."""

from __future__ import annotations

import argparse

import torch

from draftsmith.speculative.dtypes import DTYPES
from draftsmith.speculative.errors import InvalidInputError


def add_target_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=None,
                        help="target model: a local HF directory, a .gguf file, a hub id, or "
                             "smollm2-135m-instruct (the embedded default, used when omitted)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when available)")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                        help="weights dtype; auto = float32 on CPU, bfloat16 on CUDA")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise InvalidInputError(f"unknown device '{name}'") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError(f"device '{name}' asked for, but CUDA is not available here")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def add_adaptive_arg(p: argparse.ArgumentParser, default: bool) -> None:
    """--adaptive-draft / --no-adaptive-draft: each request drafts what its own acceptance pays for."""
    p.add_argument("--adaptive-draft", action=argparse.BooleanOptionalAction, default=default,
                   help="each request drafts, up to D, as many tokens as its observed acceptance pays for and "
                        "backs off to plain decoding where drafts are rejected (still exact)"
                        + (" (on by default)" if default else ""))
    p.add_argument("--verify-cost", type=float, default=None,
                   help="with --adaptive-draft: what one more verified position costs the target's pass relative "
                        "to a one-token step (default: the target's passes measured on this machine, once; "
                        "with DRAFTSMITH_CALIBRATE=0, 0.1 on CPU in float32, 0.02 in 16-bit or on CUDA)")
    p.add_argument("--round-cost", type=float, default=None,
                   help="with --adaptive-draft: what a round that drafts at all costs beyond its per-token costs, "
                        "relative to a one-token step (default: 0.1 beside measured passes, 0.05 on CUDA; with "
                        "DRAFTSMITH_CALIBRATE=0, 0.4 on CPU in float32, 0.1 in 16-bit)")
