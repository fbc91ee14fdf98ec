"""The training loop, written out: micro-batches, backward, clip, step, log, evaluate, checkpoint.

    accelerate launch -m draftsmith.train RECIPE [key=value ...]
    draftsmith train RECIPE [key=value ...]

run the same `train` function. What one optimizer step does:

    for each of grad_accum micro-batches (this process's slice of the global batch):
        teacher signals   online: a no-grad target forward; offline: rows of the teacher cache
        drafter logits    only at the positions that count (answer tokens)
        loss              the recipe's divergence (Medusa: per-head weighted) / grad_accum
        backward          (DDP syncs gradients on the last micro-batch only)
    clip, optimizer step, scheduler step

Determinism and resume: the batch for (step, micro-batch, rank) is a pure function of the seed, on-policy
samples use seeds derived from the same position, and checkpoints hold weights, optimizer, scheduler,
RNG states and the trainer state. A run killed at any point and resumed from its last checkpoint ends
with the weights of an uninterrupted run.
"""

from __future__ import annotations

import functools
import math
import os
import resource
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import safetensors.torch
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, set_seed
from tqdm.auto import tqdm

from draftsmith.data.collate import pad_batch
from draftsmith.data.teacher import sparse_teacher_probs
from draftsmith.speculative import kinds
from draftsmith.speculative.calibrate import cpu_has_native_bf16, native_bf16
from draftsmith.speculative.checkpoint import DrafterInfo, save_drafter
from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.fileio import atomic_file, atomic_write_json
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.loading import load_model
from draftsmith.speculative.prompts import stop_token_ids
from draftsmith.speculative.sampling import SamplingParams
from draftsmith.train.al_eval import acceptance_length
from draftsmith.train.config import Recipe
from draftsmith.train.data_prep import TrainingData, prepare_data
from draftsmith.train.losses import distill_loss, teacher_distribution
from draftsmith.train.modules import build_drafter, freeze
from draftsmith.speculative.options import DecodeOptions


@dataclass
class TrainerState:
    """What a checkpoint holds beside weights, optimizer, scheduler and RNG states."""

    step: int = 0
    tokens_trained: int = 0
    train_seconds: float = 0.0
    al_before: dict | None = None
    evals: list = field(default_factory=list)  # [{"step", "acceptance_length", ...}]
    best: dict | None = None  # keep_best: the best periodic evaluation so far (its weights: BEST_WEIGHTS)
    last_loss: float | None = None
    planned_steps: int | None = None  # train.time_budget_min: the steps that fit it, once timed
    loop_seconds: float = 0.0  # wall time of the training loop so far: steps, evaluations, checkpoints
    eval_seconds: float | None = None  # one held-out evaluation (the one before training)

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def train(recipe: Recipe, *, progress: bool = True, lineage: dict | None = None,
          al_before: dict | None = None) -> dict:
    """Run the recipe to completion (resuming from its last checkpoint) and save the drafter.

    `lineage` (from `draftsmith retune`) is recorded in the drafter's config. `al_before`: the
    held-out AL of the untrained drafter when the caller has just measured it (`retune` does), so
    it is not decoded twice.
    """
    out = Path(recipe.output_dir)
    check_output_dir(out)
    accelerator = make_accelerator(recipe, out)
    is_main = accelerator.is_main_process
    set_seed(recipe.train.seed)

    target = load_model(recipe.target, device=accelerator.device)
    freeze(target.model)
    with accelerator.main_process_first():
        data = prepare_data(recipe, target, is_main=is_main, progress=progress)

    kind = kinds.get(recipe.drafter.kind)
    drafter = build_drafter(recipe, target)
    kind.prepare(drafter, data.train, recipe)
    module = kind.training_module(drafter)
    trainable = [p for p in module.parameters() if p.requires_grad]
    if not trainable:
        raise InvalidInputError("the recipe leaves no drafter parameter trainable")
    optimizer = torch.optim.AdamW(trainable, lr=recipe.train.lr, weight_decay=recipe.train.weight_decay)
    state = TrainerState()
    # Stepped by hand once per optimizer step: accelerate's wrapper would step it once per process. Its end
    # is read from the state at every step: a time budget moves it once the first steps are timed.
    warmup = recipe.train.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: cosine_with_warmup(step, warmup, total_steps(recipe, state)))
    module, optimizer = accelerator.prepare(module, optimizer)
    accelerator.register_for_checkpointing(scheduler, state)
    resumed = resume(accelerator, out)
    start_trackers(accelerator, recipe, out, resumed)

    if state.step == 0 and is_main:
        t0 = time.perf_counter()
        state.al_before = (dict(al_before, step=0) if al_before is not None
                           else evaluate(drafter, target, data, recipe, step=0, accelerator=accelerator))
        state.eval_seconds = None if al_before is not None else time.perf_counter() - t0
        state.loop_seconds += time.perf_counter() - t0
    bar = tqdm(total=total_steps(recipe, state), initial=state.step, desc=f"training {recipe.name}", file=sys.stderr,
               disable=not (progress and is_main), dynamic_ncols=True)
    probe_mark: tuple[int, float] | None = None  # (step, train seconds) after the first steps' one-off costs
    while state.step < total_steps(recipe, state):
        loop_start = t0 = time.perf_counter()
        metrics = train_step(module, drafter, optimizer, scheduler, accelerator, target, data, recipe, state.step)
        state.step += 1
        state.train_seconds += time.perf_counter() - t0
        state.tokens_trained += metrics.pop("tokens")
        state.last_loss = metrics["loss"]
        metrics["tokens_per_s"] = state.tokens_trained / max(state.train_seconds, 1e-9)
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", refresh=False)
        if state.step % recipe.train.log_every == 0 or state.step == total_steps(recipe, state):
            accelerator.log(metrics, step=state.step)
        if recipe.train.eval_every and state.step % recipe.train.eval_every == 0 and state.step < total_steps(recipe, state):
            if is_main:
                evaluate(drafter, target, data, recipe, step=state.step, accelerator=accelerator, state=state)
                if recipe.train.keep_best:
                    remember_if_best(drafter, state, out)
            accelerator.wait_for_everyone()
            if reached_goal(recipe, state, accelerator):
                break
        state.loop_seconds += time.perf_counter() - loop_start
        if recipe.train.time_budget_min is not None and state.planned_steps is None:
            if state.step == BUDGET_WARMUP_STEPS:
                probe_mark = (state.step, state.train_seconds)
            if state.step >= BUDGET_PROBE_STEPS:
                state.planned_steps = steps_within_budget(recipe, state, probe_mark, accelerator)
                bar.total = state.planned_steps
                bar.refresh()
                if is_main:
                    print(f"time budget {recipe.train.time_budget_min:g} min: {state.planned_steps:,} of "
                          f"{recipe.train.steps:,} steps fit", file=sys.stderr, flush=True)
        if recipe.train.checkpoint_every and state.step % recipe.train.checkpoint_every == 0:
            saving = time.perf_counter()
            save_checkpoint(accelerator, out, state.step, recipe.train.keep_checkpoints)
            state.loop_seconds += time.perf_counter() - saving
    bar.close()

    summary = None
    if is_main:
        t0 = time.perf_counter()
        al_after = evaluate(drafter, target, data, recipe, step=state.step, accelerator=accelerator, state=state)
        state.loop_seconds += time.perf_counter() - t0  # the summary's loop_seconds: what the time budget counts
        if recipe.train.keep_best:
            al_after = restore_if_better(drafter, state, al_after, out)
        summary = training_summary(recipe, state, al_after, data, resumed, accelerator.mixed_precision)
        save_final(drafter, target, recipe, summary, out, lineage)
        atomic_write_json(out / "summary.json", summary)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return summary


# --- the schedule and the time budget ---------------------------------------------------------------

BUDGET_WARMUP_STEPS = 2  # steps left out of the time per step: the first ones pay one-off costs
BUDGET_PROBE_STEPS = 10  # steps timed before the time budget fixes the step count


def total_steps(recipe: Recipe, state: TrainerState) -> int:
    """The steps this run takes: `train.steps`, or fewer where `train.time_budget_min` allows fewer."""
    return state.planned_steps if state.planned_steps is not None else recipe.train.steps


def cosine_with_warmup(step: int, warmup: int, total: int) -> float:
    """The learning rate's factor at `step`: linear warmup over `warmup` steps, then a cosine to zero at `total`."""
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))


def steps_within_budget(recipe: Recipe, state: TrainerState, mark: tuple[int, float] | None, accelerator) -> int:
    """min(train.steps, the steps that fit train.time_budget_min): the time spent so far (the evaluation
    before training included), then per step the optimizer steps' time after `mark` (the first ones left
    out), each `eval_every`-th step also a held-out evaluation as long as the one before training took, and
    one more at the end. Decided on the main process and shared, so every process stops at the same step."""
    cfg = recipe.train
    step0, seconds0 = mark if mark is not None and mark[0] < state.step else (0, 0.0)
    per_step = (state.train_seconds - seconds0) / max(1, state.step - step0)
    evaluation = state.eval_seconds or 0.0
    per_step += evaluation / cfg.eval_every if cfg.eval_every else 0.0
    left = cfg.time_budget_min * 60 - state.loop_seconds - evaluation
    planned = [max(state.step, min(cfg.steps, state.step + int(left / max(per_step, 1e-9))))]
    if accelerator.num_processes > 1:
        broadcast_object_list(planned, from_process=0)
    return int(planned[0])


# --- one optimizer step ---------------------------------------------------------------------------


def train_step(module, drafter, optimizer, scheduler, accelerator, target, data, recipe, step) -> dict:
    accum = recipe.train.grad_accum
    kind, teacher = kinds.get(recipe.drafter.kind), Teacher(target, data, recipe)
    totals = {"loss": 0.0, "tokens": 0}
    agreement: dict[str, list[float]] = {}
    for micro in range(accum):
        batch = micro_batch(data, recipe, step, micro, accelerator)
        if recipe.on_policy.fraction > 0:
            batch = with_on_policy_answers(batch, drafter, accelerator, target, recipe, step, micro)
        sync = micro == accum - 1
        with accelerator.no_sync(module) if not sync else nullcontext():
            loss, tokens, agree = kind.objective(module, drafter, batch, teacher, recipe)
            accelerator.backward(loss / accum)
        totals["loss"] += loss.item() / accum
        totals["tokens"] += tokens
        for key, value in agree.items():
            agreement.setdefault(key, []).append(value)
    grad_norm = accelerator.clip_grad_norm_(module.parameters(), recipe.train.max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    metrics = {"loss": totals["loss"], "lr": scheduler.get_last_lr()[0], "grad_norm": float(grad_norm),
               "tokens": totals["tokens"]}
    metrics.update({key: sum(v) / len(v) for key, v in agreement.items()})
    return metrics


def micro_batch(data: TrainingData, recipe: Recipe, step: int, micro: int, accelerator) -> dict:
    """Rows for (step, micro-batch, rank): a slice of an endless stream of per-epoch permutations."""
    size, world, rank = recipe.train.batch_size, accelerator.num_processes, accelerator.process_index
    count = len(data.train)
    start = ((step * recipe.train.grad_accum + micro) * world + rank) * size
    indices = []
    for position in range(start, start + size):
        epoch, offset = divmod(position, count)
        indices.append(epoch_order(recipe.train.seed, epoch, count)[offset])
    rows = [dict(data.train[i], index=i) for i in indices]
    batch = pad_batch(rows, pad_id=0)
    return {k: v.to(accelerator.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@functools.lru_cache(maxsize=4)
def epoch_order(seed: int, epoch: int, count: int) -> list[int]:
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()


class Teacher:
    """The target's signals for a kind's objective (kinds.Teacher): online from a no-grad target pass,
    or offline from the teacher cache's rows; and the recipe's divergence."""

    def __init__(self, target, data: TrainingData, recipe: Recipe):
        self.target, self.data, self.recipe = target, data, recipe
        self._teacher = None  # (teacher logits, their distribution) of the last loss: held, so `is` is safe

    def hidden(self, batch) -> torch.Tensor:
        return target_hidden(batch, self.target, self.data)

    def at(self, positions, batch, hidden=None):
        return teacher_at(positions, batch, self.target, self.data, self.recipe, hidden=hidden)

    @torch.no_grad()
    def states(self, batch, layers) -> torch.Tensor:
        """[B, L, len(layers) * H]: the target's `hidden_states[i]` for i in `layers` (the states entering
        those layers; -1 is the last, final-norm state), concatenated: from one online pass, or read from the
        teacher cache (cached with the kind's `teacher_layers`), in the target's dtype."""
        cache = self.data.teacher
        if cache is not None:
            stored = padded_cache_field(batch, self.data, "states") if any(i != -1 for i in layers) else None
            hidden = padded_cache_field(batch, self.data, "hidden") if -1 in layers else None
            parts = [hidden if i == -1 else stored[..., cache.state_columns(i)] for i in layers]
            return torch.cat(parts, dim=-1).to(self.target.model.dtype)
        decoder = self.target.model.get_decoder()
        out = decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                      output_hidden_states=list(layers))  # those states only, not every layer's
        return torch.cat([out.hidden_states[i] for i in layers], dim=-1)

    @torch.no_grad()
    def logits(self, hidden, vocab=None) -> torch.Tensor:
        """[N, V] the target's logits from its last hidden states [N, H] (its lm_head), no grad; given
        target ids `vocab` [V'], [N, V'] from only those rows of the lm_head (a drafter's vocabulary)."""
        head = self.target.model.get_output_embeddings()
        if vocab is None:
            return head(hidden)
        bias = head.bias[vocab] if getattr(head, "bias", None) is not None else None
        return F.linear(hidden, head.weight[vocab], bias)

    @torch.no_grad()
    def top(self, positions, batch, hidden) -> torch.Tensor:
        """[N] the target's greedy token after positions [N, 2] (row, t): the teacher cache's top-1 (taken
        from the target's full-precision states when the cache was built), else the lm_head over `hidden`."""
        rows, t = positions[:, 0], positions[:, 1]
        if self.data.teacher is not None:
            return padded_cache_field(batch, self.data, "topk_ids")[rows, t, 0].long()
        return self.logits(hidden[rows, t]).argmax(-1)

    def loss(self, student, labels, *, teacher_logits=None, teacher_probs=None) -> torch.Tensor:
        cfg = self.recipe.loss
        dist = None
        if teacher_logits is not None and cfg.kind != "ce":
            # An objective scores several draft steps against the same teacher logits: their softmax once.
            if self._teacher is None or self._teacher[0] is not teacher_logits:
                self._teacher = (teacher_logits, teacher_distribution(teacher_logits, cfg.temperature))
            dist = self._teacher[1]
        return distill_loss(cfg.kind, student, labels=labels, teacher_logits=teacher_logits,
                            teacher_probs=teacher_probs, teacher=dist, temperature=cfg.temperature, beta=cfg.beta)


@torch.no_grad()
def target_hidden(batch, target, data) -> torch.Tensor:
    if data.teacher is not None:
        return padded_cache_field(batch, data, "hidden").to(target.model.dtype)
    decoder = target.model.get_decoder()
    return decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state


@torch.no_grad()
def teacher_at(positions, batch, target, data, recipe, hidden=None):
    """(teacher logits, None) online, or (None, teacher probabilities) from the offline cache, at positions."""
    if data.teacher is None:
        hidden = hidden if hidden is not None else target_hidden(batch, target, data)
        logits = target.model.get_output_embeddings()(hidden[positions[:, 0], positions[:, 1]])
        return logits, None
    vocab = target.model.get_output_embeddings().weight.shape[0]
    values = padded_cache_field(batch, data, "topk_logprobs")[positions[:, 0], positions[:, 1]]
    ids = padded_cache_field(batch, data, "topk_ids")[positions[:, 0], positions[:, 1]].long()
    return None, sparse_teacher_probs(values, ids, vocab)


def padded_cache_field(batch, data, name) -> torch.Tensor:  # [B, L, width] from the offline cache rows
    # In the cache's dtype (float16 by default); callers convert what they use.
    out = data.teacher.padded(batch["index"].tolist(), name, batch["input_ids"].shape[1])
    return out.to(batch["input_ids"].device)


# --- on-policy answers (DistillSpec) --------------------------------------------------------------


@torch.no_grad()
def with_on_policy_answers(batch, drafter, accelerator, target, recipe, step, micro) -> dict:
    """Replace the answers of a deterministic share of rows by the drafter's own samples."""
    cfg = recipe.on_policy
    g = torch.Generator().manual_seed(recipe.train.seed * 7919 + step * 131 + micro)
    chosen = (torch.rand(batch["input_ids"].shape[0], generator=g) < cfg.fraction).tolist()
    if not any(chosen):
        return batch
    drafter = kinds.get(recipe.drafter.kind).inference_module(drafter)
    was_training = drafter.training
    drafter.eval()
    rows = []
    for b, (ids, loss_mask) in enumerate(zip(batch["input_ids"].tolist(), batch["loss_mask"].tolist())):
        length = int(batch["attention_mask"][b].sum())
        prompt_len = loss_mask.index(1) if 1 in loss_mask else length
        row = {"input_ids": ids[:length], "loss_mask": loss_mask[:length], "index": int(batch["index"][b])}
        if chosen[b]:
            prompt = ids[:prompt_len]
            seed = recipe.train.seed * 1_000_003 + (step * recipe.train.grad_accum + micro) * 1009 + b
            decoder = SpeculativeDecoder(drafter, None, stop_token_ids=stop_token_ids(target.model, target.tokenizer))
            answer = decoder.generate([prompt], SamplingParams(cfg.temperature, seed=seed),
                                      DecodeOptions(max_new_tokens=cfg.max_new_tokens)).tokens[0]
            row = {"input_ids": prompt + answer, "loss_mask": [0] * len(prompt) + [1] * len(answer), "index": -1}
        rows.append(row)
    drafter.train(was_training)
    padded = pad_batch(rows, pad_id=0)
    return {k: v.to(accelerator.device) if isinstance(v, torch.Tensor) else v for k, v in padded.items()}


# --- evaluation, checkpoints, output --------------------------------------------------------------


def evaluate(drafter, target, data, recipe, *, step, accelerator, state=None) -> dict:
    result = acceptance_length(drafter, recipe.drafter.kind, target, data.heldout_prompts[: recipe.train.eval_prompts],
                               draft_len=recipe.train.eval_draft_len, max_new_tokens=recipe.train.eval_max_new_tokens)
    result["step"] = step
    if state is not None:
        state.evals.append(result)
    log = {"eval/acceptance_length": result["acceptance_length"]}
    log.update({f"eval/acceptance_pos{i + 1}": a for i, a in enumerate(result["position_acceptance"]) if a is not None})
    accelerator.log(log, step=step)
    tqdm.write(f"step {step}: held-out AL {result['acceptance_length']:.3f} (D={recipe.train.eval_draft_len})",
               file=sys.stderr)
    return result


BEST_WEIGHTS = "best-drafter.safetensors"


def remember_if_best(drafter, state: TrainerState, out: Path) -> None:
    """keep_best: snapshot the drafter's weights when the newest evaluation beats every earlier one.
    Written before the checkpoint of the same step; a resumed run replays the same steps, so the
    snapshot always belongs to `state.best` once the run has caught up."""
    latest = state.evals[-1]
    if state.best is not None and latest["acceptance_length"] <= state.best["acceptance_length"]:
        return
    with atomic_file(out / BEST_WEIGHTS) as scratch:
        safetensors.torch.save_model(drafter, str(scratch))  # handles tied weights
    state.best = latest


def restore_if_better(drafter, state: TrainerState, final: dict, out: Path) -> dict:
    """keep_best: load the best periodic snapshot into the drafter when it beat the final evaluation;
    returns the evaluation of the weights that will be written."""
    if state.best is None or state.best["acceptance_length"] <= final["acceptance_length"]:
        return final
    safetensors.torch.load_model(drafter, str(out / BEST_WEIGHTS), device=str(next(drafter.parameters()).device))
    tqdm.write(f"keeping the weights of step {state.best['step']} (held-out AL {state.best['acceptance_length']:.3f}"
               f" against {final['acceptance_length']:.3f} at the end)", file=sys.stderr)
    return dict(state.best)


def save_checkpoint(accelerator, out: Path, step: int, keep: int) -> None:
    root = out / "checkpoints"
    final, scratch = root / f"step-{step:07d}", root / f".partial-step-{step:07d}"
    if accelerator.is_main_process:
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(scratch), safe_serialization=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        os.rename(scratch, final)  # a checkpoint directory without the prefix is complete
        for old in completed_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def completed_checkpoints(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step-*") if p.is_dir()) if root.is_dir() else []


def resume(accelerator, out: Path) -> bool:
    checkpoints = completed_checkpoints(out / "checkpoints")
    if not checkpoints:
        return False
    accelerator.load_state(str(checkpoints[-1]))
    if accelerator.is_main_process:
        tqdm.write(f"resuming from {checkpoints[-1]}", file=sys.stderr)
    return True


def check_output_dir(out: Path) -> None:
    if (out / "drafter").exists():
        raise InvalidInputError(f"{out} already holds a finished run ({out / 'drafter'}); choose another output_dir")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise InvalidInputError(f"cannot write to output_dir {out}: {exc.strerror or exc}") from None


def resolve_precision(setting: str) -> str:
    """train.mixed_precision as accelerate takes it. auto: bf16 on a GPU that supports it, else no (on a CPU
    bf16 autocast is a recipe's own choice: it cost the quickstart's EAGLE drafter 0.06 AL at equal steps,
    docs/results.md "`train.mixed_precision: auto` stays float32 on a CPU"). bf16-if-native: bf16 where the device
    does bf16 arithmetic (auto's GPU, or a CPU with AVX512-BF16, AMX or Arm BF16), else no: emulated bf16
    autocast trained an EAGLE-3 drafter at 0.34x float32's rate on a Xeon with AVX-512 alone."""
    if setting not in ("auto", "bf16-if-native"):
        return setting
    gpu = torch.cuda.is_available()
    if setting == "auto" and not gpu:
        return "no"
    return "bf16" if native_bf16("cuda" if gpu else "cpu") else "no"


def make_accelerator(recipe: Recipe, out: Path) -> Accelerator:
    precision = resolve_precision(recipe.train.mixed_precision)
    warn_if_bf16_is_emulated(precision)
    log_with = None if recipe.tracking.report_to == "none" else recipe.tracking.report_to
    return Accelerator(mixed_precision=precision, log_with=log_with, project_dir=str(out / "logs"))


def warn_if_bf16_is_emulated(precision: str) -> None:
    if precision == "bf16" and not torch.cuda.is_available() and not cpu_has_native_bf16():
        print("draftsmith: warning: train.mixed_precision=bf16, and this CPU shows no bf16 arithmetic (AVX512-BF16, "
              "AMX, Arm BF16): emulated bf16 can train slower than float32 (train.mixed_precision=no)", file=sys.stderr)


def start_trackers(accelerator, recipe: Recipe, out: Path, resumed: bool) -> None:
    if recipe.tracking.report_to == "none":
        return
    init_kwargs = {}
    if recipe.tracking.report_to == "wandb":
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        name = recipe.tracking.run_name or recipe.name
        init_kwargs["wandb"] = {"dir": str(out), "mode": mode, "name": f"{name}-resumed" if resumed else name}
    accelerator.init_trackers(recipe.tracking.project, config=flat_config(recipe), init_kwargs=init_kwargs)


def flat_config(recipe: Recipe) -> dict:
    """The resolved recipe as flat scalar keys (TensorBoard's hparams take no nested values)."""
    flat = {}
    for section, values in recipe.model_dump().items():
        if isinstance(values, dict):
            for key, value in values.items():
                flat[f"{section}.{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
        else:
            flat[section] = values if isinstance(values, (int, float, str, bool)) else str(values)
    return flat


def training_summary(recipe, state: TrainerState, al_after: dict, data: TrainingData, resumed: bool,
                     mixed_precision: str) -> dict:
    return {
        "recipe": recipe.name,
        "steps": state.step,
        "planned_steps": total_steps(recipe, state),  # train.steps, or what train.time_budget_min allowed
        "loop_seconds": state.loop_seconds,
        "train_seconds": state.train_seconds,
        "tokens_trained": state.tokens_trained,
        "tokens_per_s": state.tokens_trained / max(state.train_seconds, 1e-9),
        "final_loss": state.last_loss,
        "al_before": state.al_before,
        "al_after": al_after,
        "kept_step": al_after.get("step", state.step),  # keep_best: the step whose weights were written
        "evals": state.evals,
        "data": data.source,
        "resumed": resumed,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "eval_draft_len": recipe.train.eval_draft_len,
        "mixed_precision": mixed_precision,  # as accelerate ran it
    }


def reached_goal(recipe: Recipe, state: TrainerState, accelerator) -> bool:
    """Early stop for re-tuning: the last held-out AL reached `train.stop_at_al` (decided on the main
    process, which ran the evaluation, and shared so every process stops at the same step)."""
    if recipe.train.stop_at_al is None:
        return False
    reached = bool(state.evals) and state.evals[-1]["acceptance_length"] >= recipe.train.stop_at_al
    flag = torch.tensor([float(reached and accelerator.is_main_process)], device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="sum").item() > 0)


def save_final(drafter, target, recipe: Recipe, summary: dict, out: Path, lineage: dict | None = None) -> Path:
    info = DrafterInfo.for_target(recipe.drafter.kind, target, recipe=recipe.model_dump(), training=summary,
                                  lineage=lineage)
    return save_drafter(out / "drafter", drafter, target.tokenizer, info)
