"""`draftsmith quickstart`: the whole story on the embedded default target, in one command.

1. fetch the embedded target (SmolLM2-135M-Instruct; `--tiny`: the tiny byte-level LM);
2. build a training set from the prompts that ship with draftsmith (`data/prompts/quickstart.jsonl`:
   chat, explanations, reasoning, code, writing) and regenerate the answers with the target;
3. train a small drafter: an EAGLE-style drafter, which gives the best AL per minute of CPU training
   (one decoder layer reading the target's hidden states, trained from a cached teacher, two draft
   steps unrolled; it drafts among the answers' most frequent tokens, so a draft step costs one small
   layer and a small lm_head product, not a model pass);
4. evaluate it beside the training-free baselines (early exit, n-gram) at a fixed draft length, and the
   trained drafter also as `generate` and `serve` decode by default (the adaptive draft length), and
   write the reports, plots and a summary table;
5. end with a speculative generation demo and its measured speedup over plain decoding.

Everything lands in `--out` (default `runs/quickstart`, or `runs/quickstart-tiny`); a second run reuses
the regenerated data, the trained drafter and finished reports.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from draftsmith.common import resolve_device
from draftsmith.data.prompts import load_conversations
from draftsmith.eval.run import PlainPasses, evaluate
from draftsmith.eval.settings import EvalSettings
from draftsmith.speculative.drafters import build_proposer
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.loading import load_model
from draftsmith.speculative.prompts import encode_prompt, stop_token_ids
from draftsmith.train.config import load_recipe
from draftsmith.train.data_prep import BUILTIN_PROMPTS
from draftsmith.train.loop import train
from draftsmith.speculative.options import DecodeOptions

DEMO_PROMPT = "Explain in a few sentences why the sky is blue."
# The drafter kinds the quickstart can train: the tiny recipe it starts from, and overrides of the full plan
# (EAGLE-3 reads EAGLE-3's default layers [2, L//2, L-3] of the real target, not the tiny recipe's).
KINDS = {
    "eagle": ("tiny-eagle", []),
    "eagle3": ("tiny-eagle3", ["drafter.target_layers=null"]),
}
DEFAULT_KIND = "eagle"

PLANS = {
    # name: (target spec, recipe overrides, early-exit layers, eval prompts, eval tokens)
    # The full plan is sized to finish in under 12 minutes on 2 CPU cores (docs/commands.md, "quickstart"):
    # 300 steps at lr 2e-3 (held-out AL at D=3 over 20 prompts 1.583; 150 steps at 1e-3: 1.472; 450 steps: 1.590,
    # the answers' few tokens are the limit; docs/results.md, "the quickstart's drafter: steps, learning rate, kind,
    # answer length").
    "full": ("smollm2-135m-instruct",
             ["data.limit=null", "data.heldout=20", "data.max_new_tokens=64", "data.max_length=256",
              "data.regen_batch_size=32", "drafter.draft_vocab=4096", "train.steps=300", "train.lr=2e-3",
              "train.eval_every=0",
              "train.eval_prompts=8", "train.eval_max_new_tokens=64", "teacher.mode=offline", "teacher.top_k=8"],
             12, 8, 64),
    "tiny": ("tiny-lm:0:4",
             ["data.limit=null", "data.heldout=16", "data.max_new_tokens=48", "data.max_length=160",
              "train.steps=60", "train.eval_every=0", "train.eval_prompts=8", "train.eval_max_new_tokens=32"],
             1, 8, 32),
}


def register(sub) -> None:
    p = sub.add_parser("quickstart", help="train, evaluate and demo a drafter for the embedded default target",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny target and reduced budget (about a minute)")
    p.add_argument("--out", type=Path, default=None, help="run directory (default runs/quickstart[-tiny])")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 300, --tiny 60)")
    p.add_argument("--kind", choices=sorted(KINDS), default=DEFAULT_KIND,
                   help=f"the drafter kind to train (default {DEFAULT_KIND}: the most AL per minute of CPU training, "
                        "README 'Results')")
    p.add_argument("--report-to", default="none", choices=["none", "wandb", "tensorboard"])
    p.add_argument("--device", default="auto",
                   help="auto (CUDA when available), cpu, or cuda: where the target answers, trains and is evaluated")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    plan = "tiny" if args.tiny else "full"
    target_spec, overrides, exit_layers, eval_prompts, eval_tokens = PLANS[plan]
    out = args.out or Path("runs") / ("quickstart-tiny" if args.tiny else "quickstart")
    progress = not args.no_progress
    started = time.perf_counter()
    device = resolve_device(args.device)

    step(1, f"target {target_spec} on {device}")
    target = load_model(target_spec, device=device)

    step(2, "training data: the builtin prompts, answered by the target (cached after the first run)")
    recipe_name, kind_overrides = KINDS[args.kind]
    # Each kind trains in its own folder (the default kind in `train`), so one --out compares kinds on
    # the same regenerated data and reuses the baselines' reports.
    train_dir = out / ("train" if args.kind == DEFAULT_KIND else f"train-{args.kind}")
    recipe = load_recipe(recipe_name, [f"target={target_spec}", f"output_dir={train_dir}",
                                         f"name=quickstart-{plan}", f"tracking.report_to={args.report_to}",
                                         f"data.cache_dir={out / 'data'}", *overrides,
                                         *(kind_overrides if plan == "full" else []),
                                         *([f"train.steps={args.steps}"] if args.steps else [])])
    drafter_dir = train_dir / "drafter"
    if drafter_dir.is_dir():
        step(3, f"drafter: reusing {drafter_dir}")
    else:
        step(3, f"drafter: {recipe.drafter.kind}, {recipe.drafter.num_layers} layer, {recipe.train.steps} steps")
        with training_device(device):
            train(recipe, progress=progress)

    step(4, "evaluation against the training-free baselines")
    prompts = load_conversations(BUILTIN_PROMPTS / "quickstart.jsonl").shuffle(seed=recipe.train.seed)
    heldout = prompts.select(range(recipe.data.heldout))  # the prompts the drafter never trained on
    # One draft length (the one training evaluated) and one plain pass shared by the three drafters:
    # plain decoding does not depend on the drafter, and each extra pass costs minutes on a CPU.
    # The trained drafter is also decoded as `generate` and `serve` decode by default (the adaptive draft
    # length up to the same D); the baselines only at the fixed D, to keep the quickstart's minutes.
    draft_len = recipe.train.eval_draft_len
    settings = EvalSettings(modes=["greedy"], draft_lens=[draft_len], adaptive_draft_len=0, batch_sizes=[1],
                            max_new_tokens=eval_tokens, limit=eval_prompts,
                            prompts_path="builtin:quickstart (held out)")
    rows, plain_passes = [], PlainPasses()
    for name, spec, adaptive in [(f"{recipe.drafter.kind} (trained)", str(drafter_dir), draft_len),
                                 (f"early-exit:{exit_layers}", f"early-exit:{exit_layers}", 0), ("ngram", "ngram", 0)]:
        report_dir = out / "eval" / name.split(" ")[0].replace(":", "-")
        report = load_or_evaluate(target, spec, heldout.select(range(min(eval_prompts, len(heldout)))),
                                  dataclasses.replace(settings, adaptive_draft_len=adaptive), report_dir, progress,
                                  plain_passes)
        rows.append((name, report, report_dir))
    write_summary(out, rows, started)

    step(5, "speculative generation demo")
    demo(target, str(drafter_dir), draft_len)
    print(f"\nquickstart finished in {time.perf_counter() - started:.0f} s; reports in {out / 'eval'}, "
          f"summary in {out / 'quickstart.md'}", file=sys.stderr)
    return 0


def load_or_evaluate(target, spec, prompts, settings, report_dir: Path, progress: bool,
                     plain_passes: PlainPasses) -> dict:
    cached = report_dir / "report.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    return evaluate(target, spec, prompts, settings, out_dir=report_dir, progress=progress,
                    plain_passes=plain_passes).data


def best_row(report: dict) -> dict:
    """The fixed draft length with the highest speculative tokens/s, the plain baseline of the same run
    (shared by the drafters of one quickstart), and the adaptive row where the report has one."""
    speed = report["speed"]
    plain = next(r for r in speed if r["decoder"] == "plain")
    best = max((r for r in speed if r["decoder"] == "speculative"), key=lambda r: r["tokens_per_s"])
    adaptive = next((r for r in speed if r["decoder"] == "adaptive"), None)
    accept = next(a for a in report["acceptance"] if a["draft_len"] == best["draft_len"])
    return {"draft_len": best["draft_len"], "al": accept["al"], "al_ci": accept["al_ci"],
            "tokens_per_s": best["tokens_per_s"], "plain_tokens_per_s": plain["tokens_per_s"],
            "speedup": best["tokens_per_s"] / plain["tokens_per_s"],
            "adaptive": None if adaptive is None else {"tokens_per_s": adaptive["tokens_per_s"],
                                                       "speedup": adaptive["tokens_per_s"] / plain["tokens_per_s"],
                                                       "mean_draft_len": adaptive["mean_draft_len"]}}


def write_summary(out: Path, rows, started: float) -> None:
    lines = ["# draftsmith quickstart", "",
             "Greedy decoding of held-out builtin prompts, batch 1; one plain pass is the baseline of all rows. "
             "`fixed D` drafts D tokens every round (what the drafter is accepted at, and what always drafting D "
             "costs); `adaptive` decodes as `draftsmith generate` and `serve` do by default, each request drafting "
             "up to D as its own acceptance pays for on this machine.",
             "",
             "| drafter | D | AL [95% CI] | fixed D tokens/s | speedup | adaptive tokens/s | speedup | plain tokens/s "
             "| report |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, report, report_dir in rows:
        b = best_row(report)
        a = b["adaptive"]
        adaptive = f"{a['tokens_per_s']:.1f} | **{a['speedup']:.2f}x**" if a else "- | -"
        lines.append(f"| {name} | {b['draft_len']} | {b['al']:.2f} [{b['al_ci'][0]:.2f}, {b['al_ci'][1]:.2f}] | "
                     f"{b['tokens_per_s']:.1f} | {b['speedup']:.2f}x | {adaptive} | {b['plain_tokens_per_s']:.1f} | "
                     f"[report]({report_dir.relative_to(out)}/report.md) |")
        shown = f"; adaptive {a['tokens_per_s']:.1f} tok/s ({a['speedup']:.2f}x plain)" if a else ""
        print(f"  {name:20s} D={b['draft_len']}  AL {b['al']:.2f}  {b['tokens_per_s']:.1f} tok/s  "
              f"({b['speedup']:.2f}x plain){shown}", file=sys.stderr)
    lines += ["", f"Total time so far: {time.perf_counter() - started:.0f} s.", ""]
    (out / "quickstart.md").write_text("\n".join(lines))


def demo(target, drafter: str, draft_len: int) -> None:
    stops = stop_token_ids(target.model, target.tokenizer)
    prompt = encode_prompt(target.tokenizer, DEMO_PROMPT, chat=True)
    plain = SpeculativeDecoder(target.model, None, stop_token_ids=stops).generate([prompt], options=DecodeOptions(max_new_tokens=64))
    decoder = SpeculativeDecoder(target.model, build_proposer(drafter, target), stop_token_ids=stops)
    # As `draftsmith generate` decodes by default: up to D, the adaptive draft length.
    result = decoder.generate([prompt], options=DecodeOptions(max_new_tokens=64, draft_len=draft_len, adaptive=True))
    # The text goes to stdout, its statistics to stderr, as in `draftsmith generate`.
    print(f"\n> {DEMO_PROMPT}\n{target.tokenizer.decode(result.tokens[0], skip_special_tokens=True)}\n", flush=True)
    same = "identical to" if result.tokens == plain.tokens else "DIFFERENT FROM"
    print(f"speculative: {result.stats.tokens_per_s:.1f} tok/s, AL {result.stats.acceptance_length:.2f}; "
          f"plain: {plain.stats.tokens_per_s:.1f} tok/s; speedup {result.stats.tokens_per_s / plain.stats.tokens_per_s:.2f}x; "
          f"output {same} plain greedy decoding", file=sys.stderr)


@contextlib.contextmanager
def training_device(device):
    """Training runs under accelerate, which takes a GPU whenever it sees one: on `--device cpu` it is told
    not to (ACCELERATE_USE_CPU, for the training only)."""
    saved = os.environ.get("ACCELERATE_USE_CPU")
    if device.type == "cpu":
        os.environ["ACCELERATE_USE_CPU"] = "true"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("ACCELERATE_USE_CPU", None)
        else:
            os.environ["ACCELERATE_USE_CPU"] = saved


def step(number: int, text: str) -> None:
    print(f"[{number}/5] {text}", file=sys.stderr, flush=True)
