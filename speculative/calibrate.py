"""What this machine's passes cost, measured once and remembered: the runtime's speed choices rest on it.

Two choices depend on the hardware so much that no table fits every machine (see small_gemm.py and
adaptive.py): which matmul path a few-row linear layer takes, and what a target pass over n positions
costs relative to a one-token step (the adaptive draft length's cost model), for each running batch
size (BATCH_SIZES) since a round covers every row's drafts; and with it what the decoder's drafter adds
to a round (`draft_costs`: its steps are few-row matmuls and bookkeeping that no weight count prices).
On an AMD EPYC core in float32, SmolLM2-135M's pass over 3 tokens cost 2.0x a one-token step through
F.linear; on an Intel Xeon with AMX, 1.1x at batch 1 and 1.5x at batch 2 (2 rows of 3 positions against
2 one-token rows), and 1.6x over 5 tokens at batch 1. So they are measured on the machine that decodes,
the first time they are needed, and kept in `<cache>/machine.json` under a key naming the processor (or
GPU), torch version, thread count, dtype and what was measured. Later processes read the stored value instead of
measuring, under a file lock, so every process on the machine makes the same choices: a seeded sampled
request repeats exactly across processes, since its draft lengths depend only on its acceptance and these
stored numbers. Delete the file to measure again; `DRAFTSMITH_CALIBRATE=0` uses the built-in tables
instead of measuring (adaptive.py's VERIFY_COST and ROUND_COST; small_gemm's fixed choice).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from draftsmith.speculative.fileio import atomic_write_json
from draftsmith.speculative.kv import KVState

CALIBRATE_ENV = "DRAFTSMITH_CALIBRATE"
CONTEXT = 128  # tokens in the cache a timed pass attends over
MAX_POSITIONS = 9  # passes of 1..9 positions (D up to 8); longer ones are extrapolated
BATCH_SIZES = (1, 2, 4, 8, 16)  # running batches whose passes are measured; others are interpolated
# Timings keep the fastest of their repetitions, not the median: another process's burst only ever
# slows a pass, and on a shared 2-core machine a median of 5 once stored SmolLM2's 2-position pass at
# 1.09 one-token steps where undisturbed runs give 1.3-1.45 (so the policy drafted where it did not pay).
REPS = 7  # timed passes per length (after two warm-up sweeps); the fastest counts
DRAFT_LENS = (1, 2, 3, 4)  # fixed draft lengths whose rounds time the drafter (draft_costs): D = 1..4
ROUND_BATCHES = (1, 2, 4)  # running batches whose rounds are timed; larger ones are priced by the pass model
DRAFT_CONTEXT = 64  # prompt tokens before the timed rounds
DRAFT_ROUNDS = 8  # rounds timed per run
REPS_ROUNDS = 3  # timed runs per draft length (after a warm-up sweep); the fastest counts

_memory: dict[str, object] = {}


def enabled() -> bool:
    return os.environ.get(CALIBRATE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def remembered(key: str, measure: Callable[[], object], device: torch.device | str = "cpu") -> object:
    """The value stored for `key` on this machine's `device`, else `measure()`'s (stored for the next
    process)."""
    full = f"{device_name(device)}|torch {torch.__version__}|{torch.get_num_threads()} threads|{key}"
    if full in _memory:
        return _memory[full]
    path = _path()
    try:
        from filelock import FileLock

        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(path) + ".lock", timeout=600)
    except OSError:  # a read-only home: measure for this process only
        lock = None
    with lock if lock is not None else contextlib.nullcontext():
        stored = _read(path)
        if full not in stored:
            _announce(path)
            stored[full] = measure()
            _write(path, stored)
    _memory[full] = stored[full]
    return stored[full]


def pass_costs(model: torch.nn.Module, batch: int = 1, path: str = "off") -> list[float] | None:
    """Seconds of a target pass over n = 1..MAX_POSITIONS positions per row of a `batch`-row batch (over a
    CONTEXT-token cache), relative to the same batch's one-token step: entry n - 1, made non-decreasing
    (`monotone`). None where calibration is off. The caller (the decoder, once when it is built) measures
    in the runtime's own context (its few-row linear path and attention), as its rounds run, and names it
    by `path` (the decoder's `path_signature`): passes timed on other paths are not these passes."""
    if not enabled():
        return None
    param = next(model.parameters())
    fingerprint = _config_fingerprint(model)
    rows = "" if batch == 1 else f"|batch {batch}"
    # "fastest": the costs stored before timings kept their fastest repetition (medians) are measured again
    key = (f"{str(param.dtype).removeprefix('torch.')}|pass costs fastest{rows}|{type(model).__name__} {fingerprint}"
           f"|paths {path}")

    def measure() -> list[float]:
        seconds = time_passes(model, batch, CONTEXT, list(range(1, MAX_POSITIONS + 1)), REPS, param.device)
        return [round(seconds[n] / seconds[1], 3) for n in range(1, MAX_POSITIONS + 1)]

    return monotone(list(remembered(key, measure, param.device)))


def draft_costs(decoder) -> dict | None:
    """What the decoder's drafter costs on this machine, relative to one round that drafts nothing (a plain
    step of the same runtime, drafter attached), fitted to rounds timed at fixed draft lengths DRAFT_LENS
    as C(d) - P(d + 1) = r + d * c: `per_token` (c, one more draft step) and `per_round` (r, the round's
    first draft step over the accepted tokens and the bookkeeping of a drafting round), both >= 0; and
    `rounds`, {B: C_B(d) for d in DRAFT_LENS} for each running batch B in ROUND_BATCHES, as timed (B rows
    drafting d tokens each, against B rows drafting nothing; made non-decreasing in d): the policy prices
    rounds of those batches with them as they are, with no model between. None where calibration is off,
    the pass costs are not measured, or the proposer runs no module (prompt lookup: its cost is the pass's).
    Remembered per drafter architecture (kind and the shapes of the weights it runs), target model and
    dtype, as the pass costs are."""
    from draftsmith.speculative import kinds

    proposer = decoder.proposer
    kind = kinds.find(proposer.kind) if proposer is not None else None
    modules = kind.modules(proposer) if kind is not None else []
    if not enabled() or decoder.pass_costs is None or not modules:
        return None
    target = decoder.target
    param = next(target.parameters())
    shapes = [(name, tuple(p.shape), str(p.dtype)) for m in modules for name, p in m.named_parameters()]
    drafter = hashlib.sha256(f"{kind.name}|{shapes}".encode()).hexdigest()[:16]
    # "by batch": the costs stored before rounds were timed per running batch (batch 1 only) are measured again
    key = (f"{str(param.dtype).removeprefix('torch.')}|draft costs by batch|{type(target).__name__} "
           f"{_config_fingerprint(target)}|{kind.name} {drafter}|paths {decoder.path_signature}")

    def measure() -> dict:
        timed = {batch: time_rounds(decoder, (0, *DRAFT_LENS), DRAFT_ROUNDS, REPS_ROUNDS, batch)
                 for batch in ROUND_BATCHES}
        # the drafter's c and r, from one row's rounds
        (plain, plain_pass), alone = timed[1][0], timed[1]
        if param.device.type == "cuda":  # passes run asynchronously: a round's wall against the measured P
            extra = [alone[d][0] / plain - decoder.pass_costs[1][d] for d in DRAFT_LENS]
        else:  # what a round adds beyond its own target pass, over what the plain step adds beyond its pass
            extra = [((alone[d][0] - alone[d][1]) - (plain - plain_pass)) / plain for d in DRAFT_LENS]
        # and the rounds themselves per batch (adaptive.round_price): no model between them and the policy
        rounds = {str(batch): monotone([t[d][0] / t[0][0] for d in DRAFT_LENS]) for batch, t in timed.items()}
        return {**fit_draft_costs(list(DRAFT_LENS), extra), "rounds": rounds}

    measured = dict(remembered(key, measure, param.device))
    measured["rounds"] = {int(batch): list(costs) for batch, costs in measured["rounds"].items()}
    return measured


def fit_draft_costs(lens: list[int], extra: list[float]) -> dict[str, float]:
    """r + d * c fitted to `extra` over draft lengths `lens` (least squares, with r and c kept >= 0)."""
    n = len(lens)
    mean_d, mean_e = sum(lens) / n, sum(extra) / n
    spread = sum((d - mean_d) ** 2 for d in lens)
    c = max(sum((d - mean_d) * (e - mean_e) for d, e in zip(lens, extra)) / spread, 0.0) if spread else 0.0
    r = mean_e - c * mean_d
    if r < 0:  # a line through the origin instead
        r, c = 0.0, max(sum(d * e for d, e in zip(lens, extra)) / sum(d * d for d in lens), 0.0)
    return {"per_token": round(c, 4), "per_round": round(r, 4)}


def time_rounds(decoder, draft_lens, rounds: int, reps: int, batch: int = 1) -> dict[int, tuple[float, float]]:
    """Per fixed draft length (0: rounds that draft nothing), the fewest seconds (over `reps` runs) of one
    of the decoder's greedy rounds and of the target's pass in it: `batch` rows, each after its own
    DRAFT_CONTEXT-token random prompt, over `rounds` rounds after their first (where a drafter that reads
    the target's states takes in the prompts'). Random text is rarely drafted right, so nearly every round
    drafts its full length."""
    from draftsmith.speculative.engine import Engine
    from draftsmith.speculative.options import DecodeOptions, Request

    g = torch.Generator().manual_seed(0)
    prompts = [tuple(torch.randint(0, decoder.vocab_size, (DRAFT_CONTEXT,), generator=g).tolist())
               for _ in range(batch)]
    budget = (max(draft_lens) + 1) * (rounds + 2)
    times: dict[int, list[tuple[float, float]]] = {d: [] for d in draft_lens}
    for rep in range(reps + 1):  # the first sweep warms up
        for d in draft_lens[rep % len(draft_lens):] + draft_lens[: rep % len(draft_lens)]:
            engine = Engine(decoder, DecodeOptions(draft_len=d))
            for prompt in prompts:
                engine.add(Request(prompt, max_new_tokens=budget, ignore_eos=True))
            engine.step()  # the prefill and the first round
            stats = engine.run.stats
            target_before, t0 = stats.target_s, time.perf_counter()
            for _ in range(rounds):
                engine.step()
            if rep > 0:
                times[d].append(((time.perf_counter() - t0) / rounds, (stats.target_s - target_before) / rounds))
    return {d: min(t) for d, t in times.items()}  # the fastest run: the one least disturbed


def _config_fingerprint(model: torch.nn.Module) -> str:
    return hashlib.sha256(model.config.to_json_string(use_diff=False).encode()).hexdigest()[:16]


def monotone(costs: list[float]) -> list[float]:
    """The closest non-decreasing sequence (least squares: pooled adjacent violators), at least 1: a pass over
    more positions never costs less, so a dip (or a spike before a flat run) in the timings is noise."""
    blocks: list[list[float]] = []  # [mean, count] of pooled runs
    for c in costs:
        blocks.append([max(c, 1.0), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return [round(m, 3) for m, n in blocks for _ in range(n)]


def batch_pass_costs(model: torch.nn.Module, path: str = "off") -> dict[int, list[float]] | None:
    """`pass_costs` for each of BATCH_SIZES (a running batch's round is priced at its own size: a pass
    over 4 rows of 3 positions costs more, against 4 one-token rows, than one row's does), or None."""
    if not enabled():
        return None
    return {batch: pass_costs(model, batch, path) for batch in BATCH_SIZES}


@torch.inference_mode()
def time_passes(model, batch: int, context: int, positions: list[int], reps: int, device) -> dict[int, float]:
    """The fewest seconds (over `reps` passes) of one pass of n positions over a `context`-token cache, per
    n (the n's interleaved; each pass is rolled back, as a round whose drafts are all rejected)."""
    device = torch.device(device)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    kv = KVState(model, batch, device)
    prompt = torch.randint(0, vocab, (batch, context), generator=g).to(device)
    kv.forward(prompt, torch.ones_like(prompt, dtype=torch.bool))
    times: dict[int, list[float]] = {n: [] for n in positions}
    for rep in range(reps + 2):  # the first two sweeps warm up
        for n in positions[rep % len(positions):] + positions[: rep % len(positions)]:
            tokens = torch.randint(0, vocab, (batch, n), generator=g).to(device)
            valid = torch.ones(batch, n, dtype=torch.bool, device=device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            kv.forward(tokens, valid)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if rep >= 2:
                times[n].append(time.perf_counter() - t0)
            kv.keep_last(torch.zeros(batch, n, dtype=torch.bool, device=device))
    return {n: min(t) for n, t in times.items()}


def device_name(device: torch.device | str = "cpu") -> str:
    """The GPU's name for a CUDA device, else the processor's model name."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return _cpu_name()


@functools.cache
def _cpu_name() -> str:  # read once per process: every lookup of a stored value names the machine
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpuinfo_field(*keys: str, path: str = "/proc/cpuinfo") -> str | None:
    """The value on the first line of /proc/cpuinfo (Linux) whose key is one of `keys` (any case); None where
    there is no such line or no such file."""
    wanted = {key.lower() for key in keys}
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in wanted:
            return value.strip()
    return None


# CPU feature flags (Linux /proc/cpuinfo) for bf16 arithmetic in hardware: x86's AVX512-BF16 and AMX-BF16,
# Arm's BF16 extension. Elsewhere bf16 products are emulated, slower than float32 (on an Intel Xeon with
# AVX-512 but neither, regeneration ran at 0.57-0.69x float32's rate; docs/results.md).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


@functools.cache
def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    flags = cpuinfo_field("flags", "features", path=cpuinfo)  # x86 says flags, Arm features; not Linux: no
    return flags is not None and not NATIVE_BF16_FLAGS.isdisjoint(flags.split())


def native_bf16(device: torch.device | str = "cpu") -> bool:
    """Whether `device` does bf16 arithmetic in hardware: a CUDA GPU that supports bf16, or a CPU with the
    flags above."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_has_native_bf16()


@functools.cache
def _announce(path: Path) -> None:  # once per process: the first measurement on a machine takes minutes
    print(f"draftsmith: timing this machine's passes for its speed choices (first use; up to a few minutes; "
          f"stored in {path})", file=sys.stderr, flush=True)


def _path() -> Path:
    from draftsmith.speculative.loading import default_cache_dir

    return default_cache_dir() / "machine.json"


def _read(path: Path) -> dict:
    try:
        stored = json.loads(path.read_text())
        return stored if isinstance(stored, dict) else {}
    except (OSError, ValueError):
        return {}  # absent or unreadable: measure again (and rewrite it)


def _write(path: Path, stored: dict) -> None:
    try:
        atomic_write_json(path, stored, sort_keys=True)
    except OSError:
        pass  # the values still hold for this process
