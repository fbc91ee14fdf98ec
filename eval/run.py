"""`evaluate`: one evaluation run of a drafter against a target, as a `Report`.

The order of the work, per mode (and per D of the sweep):

    1. batch-size-1 passes: plain decoding, speculative decoding at each D and the adaptive draft length
       up to `adaptive_draft_len` (the default of `generate` and `serve`), taking turns on each prompt
       (decoding.decode_passes: a drifting machine slows them alike). Per-prompt
       acceptance, greedy exactness, quality and the batch-size-1 speed figures (overall and per prompt
       category) all come from these passes; the acceptance figures need them because DecodeStats
       aggregate over the rows of a batch, and come from the fixed-D passes only.
    2. for each batch size B > 1: the same passes in batches of B (speed, memory, and the greedy
       exactness check of batched decoding).
    3. sampling fidelity for each sampled mode, at the largest D, on contexts from plain outputs.
    4. the draft-length cost model (timed loops per batch size) and its advice.
    5. with a baseline report: the paired change in acceptance and the keep / retune verdict.

Exit code of the report: 4 when an exactness check failed (a greedy divergence beyond a near-tie, or
the fidelity test rejected); else 3 when the verdict is retune; else 0.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from hashlib import sha256
from pathlib import Path

import datasets
from tqdm import tqdm

from draftsmith import __version__
from draftsmith.eval import acceptance, advice, exactness, fidelity, memory, speed
from draftsmith.eval.decoding import Pass, System, decode_passes, warm_up
from draftsmith.eval.quality import QualityScorer
from draftsmith.eval.report import EXIT_INEXACT, EXIT_OK, Report, prepare_out_dir
from draftsmith.eval.settings import TIE_TOLERANCE, EvalSettings, is_greedy
from draftsmith.eval.verdict import SCHEMA, check_compatible, compare, load_baseline
from draftsmith.speculative import kinds
from draftsmith.speculative.drafters import DrafterSource, load_drafter
from draftsmith.speculative.dtypes import dtype_name
from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.loading import LoadedModel, tokenizer_hash
from draftsmith.speculative.prompts import encode_prompt, stop_token_ids


def evaluate(target: LoadedModel, drafter_spec: str, prompts: datasets.Dataset, settings: EvalSettings, *,
             verifier=None, out_dir: str | Path | None = None, baseline: dict | str | Path | None = None,
             allow_target_mismatch: bool = False, progress: bool = True,
             plain_passes: PlainPasses | None = None) -> Report:
    """Evaluate `drafter_spec` (see speculative/drafters.py) against `target` on `prompts` (the
    data/prompts.py shape) and return the report; with `out_dir`, also write report.json, report.md and
    the plots there (refusing a non-empty directory, as the CLI does without --overwrite).

    `verifier` replaces the runtime's own choice (the fused kernel on CUDA, verify_native elsewhere;
    tests inject lossy ones). `baseline` is an earlier report (a path,
    or a dict from verdict.load_baseline): this run is compared with it and judged keep / retune.

    `plain_passes` shares the plain-decoding passes between runs that evaluate several drafters on the
    same target, prompts and settings (plain decoding does not depend on the drafter): a fresh
    `PlainPasses()` is filled by the first run, and later runs reuse its passes instead of decoding them again
    (so their speedups rest on plain passes decoded beside the first run's drafter, not beside their own).
    """
    started = time.perf_counter()
    if len(prompts) == 0:
        raise InvalidInputError("the prompt set is empty")
    if out_dir is not None:
        out_dir = prepare_out_dir(out_dir, overwrite=False)
    if baseline is not None and not isinstance(baseline, dict):
        baseline = load_baseline(baseline)
    if not settings.drafter:
        settings = dataclasses.replace(settings, drafter=drafter_spec)
    encoded = [encode_messages(target.tokenizer, row["messages"], settings.chat) for row in prompts]
    ids = [str(i) for i in prompts["id"]] if "id" in prompts.column_names else [str(i) for i in range(len(prompts))]
    categories, references = _column(prompts, "category"), _column(prompts, "reference")
    fingerprint = prompt_fingerprint(prompts)
    if baseline is not None:
        check_compatible(baseline, settings, fingerprint, len(prompts), tokenizer_hash(target.tokenizer))
    proposer, source = load_drafter(drafter_spec, target, allow_target_mismatch=allow_target_mismatch)
    if proposer is None:
        raise InvalidInputError("eval needs a drafter (--drafter DIR, early-exit:N or ngram)")
    stops = stop_token_ids(target.model, target.tokenizer)
    # The adaptive row's costs (this machine's passes and the drafter's rounds, remembered per machine) are
    # measured by its untimed warm-up, only when there is an adaptive row.
    spec = SpeculativeDecoder(target.model, proposer, stop_token_ids=stops, verifier=verifier, measure_costs=False)
    plain = SpeculativeDecoder(target.model, None, stop_token_ids=stops)
    if plain_passes is not None:
        plain_passes.bind(target, encoded, settings)
    work = _Work(spec, plain, encoded, settings, progress, plain_passes)

    passes, adaptive = work.decode_all()
    records = [r for (mode, d, b), p in passes.items() if d and b == 1
               for r in acceptance.per_prompt_records(p, ids, categories)]
    accept = [acceptance.summarize([r for r in records if r["mode"] == m and r["draft_len"] == d], settings,
                                   settings.seed + 7)
              for m in settings.modes for d in settings.draft_lens]
    device = next(target.model.parameters()).device
    data = {
        "schema": SCHEMA,
        "draftsmith_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": settings.to_dict(),
        "target": target_identity(target, device),
        "verifier": spec.verifier.name,
        "drafter": drafter_identity(source, proposer, target),
        "prompts": {"path": settings.prompts_path, "column": settings.prompt_column, "count": len(prompts),
                    "fingerprint": fingerprint, "categories": _counts(categories),
                    "with_references": sum(bool(r.strip()) for r in references),
                    "prompt_tokens": {"min": min(map(len, encoded)), "max": max(map(len, encoded))}},
        "acceptance": accept,
        "per_prompt": records,
        "exactness": work.exactness(passes, adaptive, target, ids),
        "quality": work.quality(passes, adaptive, target, references),
        "speed": work.speed(passes, adaptive),
        "speed_by_category": work.speed_by_category(passes, adaptive, categories),
        "memory": {"ledger": memory.ledger(target.model, proposer, max(map(len, encoded)) + settings.max_new_tokens
                                           + settings.max_draft_len, settings.batch_sizes),
                   "measured": work.peak.to_dict()},
        "advice": work.advice(passes, adaptive, accept, proposer),
        "comparison": compare(baseline, records, settings) if baseline is not None else None,
    }
    work.close()
    data["exit_code"] = exit_code(data)
    data["wall_s"] = time.perf_counter() - started
    report = Report(data)
    if out_dir is not None:
        report.save(out_dir)
    return report


class PlainPasses:
    """Plain-decoding passes, keyed by (mode, batch size), shared by the evaluations of several drafters
    on one target, prompt set and decoding settings: plain decoding does not depend on the drafter."""

    def __init__(self):
        self.passes: dict[tuple[str, int], Pass] = {}
        self.owner: tuple | None = None  # (target, prompts, decoding settings) the passes were made under

    def bind(self, target: LoadedModel, prompts: list[list[int]], settings: EvalSettings) -> "PlainPasses":
        """Claim the cache for this run; one filled under another target, prompt set or decoding
        settings is refused, since its plain outputs would not be this run's."""
        key = (target.weight_hash(), sha256(json.dumps(prompts).encode()).hexdigest(), settings.max_new_tokens,
               settings.seed, settings.chat)
        if self.owner is None:
            self.owner = key
        elif self.owner != key:
            raise InvalidInputError("plain_passes was filled for another target, prompt set or decoding settings")
        return self


def exit_code(data: dict) -> int:
    if not data["exactness"]["passed"]:
        return EXIT_INEXACT
    return data["comparison"]["verdict"]["exit_code"] if data["comparison"] else EXIT_OK


class _Work:
    """The decoding and timing of one run, with its progress bar."""

    def __init__(self, spec: SpeculativeDecoder, plain: SpeculativeDecoder, prompts: list[list[int]],
                 settings: EvalSettings, progress: bool, plain_passes: PlainPasses | None = None):
        self.spec, self.plain, self.prompts, self.s = spec, plain, prompts, settings
        self.plain_passes = plain_passes
        self.peak = memory.PeakMemory(spec.device)
        sampled = [m for m in settings.modes if not is_greedy(m)]
        batches = set(settings.batch_sizes) | {1}
        shared = plain_passes.passes if plain_passes is not None else {}
        reused = sum(len(prompts) for m in settings.modes for b in batches if (m, b) in shared)
        decoders = 1 + len(settings.draft_lens) + bool(settings.adaptive_draft_len)  # plain, each D, adaptive
        per_pass = len(prompts) * len(settings.modes) * decoders
        total = per_pass * len(batches) - reused + len(sampled) * settings.fidelity_contexts
        self.bar = tqdm(total=total, desc="draftsmith eval", unit="decode", file=sys.stderr, disable=not progress,
                        dynamic_ncols=True)

    def decode_all(self) -> tuple[dict[tuple[str, int, int], Pass], dict[tuple[str, int], Pass]]:
        """The fixed-D and plain passes by (mode, D, batch size), and the adaptive ones by (mode, batch size).
        At each batch size every system (plain, each D, adaptive, per mode) takes its turn on each batch of
        prompts (decoding.decode_passes), after one untimed warm-up each."""
        passes, adaptive = {}, {}
        for batch in sorted(set(self.s.batch_sizes) | {1}):
            self.peak.start()
            shared = self.plain_passes.passes if self.plain_passes is not None else None
            reused = shared is not None and all((mode, batch) in shared for mode in self.s.modes)
            if reused:
                passes.update({(mode, 0, batch): shared[mode, batch] for mode in self.s.modes})
            lengths = [(d, False) for d in ([] if reused else [0]) + self.s.draft_lens]
            lengths += [(self.s.adaptive_draft_len, True)] if self.s.adaptive_draft_len else []
            systems = [System(self.spec if d else self.plain, mode, d, a) for d, a in lengths for mode in self.s.modes]
            for d, a in lengths:
                warm_up(self.spec if d else self.plain, self.prompts[0], d, batch, adaptive=a)
            self.bar.set_postfix_str(f"B={batch}: {len(systems)} systems in turn")
            for p in decode_passes(systems, self.prompts, self.s, batch, self.bar):
                if p.adaptive:
                    adaptive[p.mode, batch] = p
                else:
                    passes[p.mode, p.draft_len, batch] = p
                    if not p.draft_len and shared is not None:
                        shared[p.mode, batch] = p
            self.peak.record(batch)
        return passes, adaptive

    def exactness(self, passes, adaptive, target: LoadedModel, ids: list[str]) -> dict:
        greedy_modes = [m for m in self.s.modes if is_greedy(m)]
        tolerance = self.s.tie_tolerance
        if tolerance is None:
            tolerance = TIE_TOLERANCE.get(dtype_name(next(target.model.parameters()).dtype), 1e-3)
        greedy = None
        if greedy_modes:
            mode = greedy_modes[0]
            others = [p for (m, d, b), p in passes.items() if m == mode and (d or b > 1)]
            others += [p for (m, b), p in adaptive.items() if m == mode]
            greedy = exactness.greedy_exactness(target.model, self.prompts, ids, passes[mode, 0, 1], others, tolerance)
        source = passes[(greedy_modes or self.s.modes)[0], 0, 1].outputs()
        contexts = fidelity.make_contexts(self.prompts, source, self.s.fidelity_contexts, self.s.fidelity_window)
        sampling = []
        for mode in (m for m in self.s.modes if not is_greedy(m)):
            self.bar.set_postfix_str(f"fidelity {mode}")
            if contexts:
                sampling.append(fidelity.fidelity_check(self.spec, self.plain, contexts, mode, self.s.max_draft_len,
                                                        self.s, self.bar))
        passed = (greedy is None or greedy["passed"]) and all(f["passed"] for f in sampling)
        return {"greedy": greedy, "sampling": sampling, "fidelity_contexts_from": "plain outputs of "
                f"{(greedy_modes or self.s.modes)[0]}", "passed": passed}

    def quality(self, passes, adaptive, target: LoadedModel, references: list[str]) -> list[dict]:
        self.bar.set_postfix_str("quality")
        scorer = QualityScorer(target.model, target.tokenizer, self.prompts, references, self.s)
        rows = []
        for mode in self.s.modes:
            plain = passes[mode, 0, 1]
            rows.append(scorer.score(plain, None, self.s.seed + 13))
            rows += [scorer.score(passes[mode, d, 1], plain, self.s.seed + 13) for d in self.s.draft_lens]
            if (mode, 1) in adaptive:
                rows.append(scorer.score(adaptive[mode, 1], plain, self.s.seed + 13))
        return rows

    def speed(self, passes, adaptive) -> list[dict]:
        rows = []
        for batch in self.s.batch_sizes:
            for mode in self.s.modes:
                plain = passes[mode, 0, batch]
                rows.append(speed.speed_row(plain, None))
                rows += [speed.speed_row(passes[mode, d, batch], plain) for d in self.s.draft_lens]
                if (mode, batch) in adaptive:
                    rows.append(speed.speed_row(adaptive[mode, batch], plain))
        return rows

    def speed_by_category(self, passes, adaptive, categories: list[str]) -> list[dict]:
        """Every batch-size-1 speculative pass against plain decoding, overall and per prompt category."""
        rows = []
        for mode in self.s.modes:
            spec = [passes[mode, d, 1] for d in self.s.draft_lens]
            spec += [adaptive[mode, 1]] if (mode, 1) in adaptive else []
            rows += [speed.by_category(p, passes[mode, 0, 1], categories, self.s, self.s.seed + 17) for p in spec]
        return rows

    def advice(self, passes, adaptive, accept: list[dict], proposer) -> list[dict]:
        self.bar.set_postfix_str("draft-length cost model")
        rates = {a["mode"]: [p["rate"] for p in a["positions"]]
                 for a in accept if a["draft_len"] == self.s.max_draft_len}
        rows = []
        for batch in self.s.batch_sizes:
            with self.spec.fast_paths():  # time the passes as the runtime runs them
                costs = advice.measure_costs(self.spec.target, proposer, self.prompts, batch, self.s.max_draft_len,
                                             self.s.max_new_tokens // 2, self.s.timing_reps)
            for mode in self.s.modes:
                spec_passes = [passes[mode, d, batch] for d in self.s.draft_lens]
                rows.append(advice.advise(costs, rates[mode], spec_passes, passes[mode, 0, batch], batch,
                                          adaptive.get((mode, batch))))
        return rows

    def close(self) -> None:
        self.bar.close()


def encode_messages(tokenizer, messages: list[dict], chat: bool) -> list[int]:
    if chat:
        return encode_prompt(tokenizer, messages, chat=True)
    return encode_prompt(tokenizer, "\n\n".join(m["content"] for m in messages), chat=False)


def prompt_fingerprint(prompts: datasets.Dataset) -> str:
    """sha256 over the ids and messages of the prompt set, in order."""
    rows = [[str(i), m] for i, m in zip(prompts["id"], prompts["messages"])]
    return sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()


def target_identity(target: LoadedModel, device) -> dict:
    config = target.model.config
    return {
        "name": target.name,
        "path": str(target.path) if target.path else None,
        "weight_hash": target.weight_hash(),
        "tokenizer_hash": tokenizer_hash(target.tokenizer),
        "dtype": dtype_name(next(target.model.parameters()).dtype),
        "device": str(device),
        "architecture": {
            "model_type": getattr(config, "model_type", None),
            "layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size,
            "attention_heads": config.num_attention_heads,
            "kv_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            "vocab_size": config.vocab_size,
            "parameters": sum(p.numel() for p in target.model.parameters()),
        },
    }


def drafter_identity(source: DrafterSource, proposer, target: LoadedModel) -> dict:
    """What the report records of the drafter: its spec and name, its kind's identity facts (weight
    hash, shared weights), and the target it was trained for (from its checkpoint's record)."""
    record = {"spec": source.spec, "kind": proposer.name, "trained_for": None, "matches_target": None,
              **kinds.of(proposer).identity(proposer)}
    info = source.record
    if info is not None:
        record["trained_for"] = {"target_name": info.target_name, "target_hash": info.target_hash,
                                 "kind": info.kind, "created": info.created}
        record["matches_target"] = info.target_hash == target.weight_hash()
    return record


def _column(prompts: datasets.Dataset, name: str) -> list[str]:
    """A text column of the prompt set as strings; all empty when the set has no such column."""
    if name not in prompts.column_names:
        return [""] * len(prompts)
    return [str(v or "") for v in prompts[name]]


def _counts(values: list[str]) -> dict:
    out: dict = {}
    for v in values:
        out[v or "(none)"] = out.get(v or "(none)", 0) + 1
    return out
