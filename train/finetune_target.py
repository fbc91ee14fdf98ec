"""A reproducible target update: supervised fine-tuning of the target with LoRA, adapter merged.

This is not how drafters are trained; it makes "target v2" for the re-tune workflow: a recipe with
`task: finetune-target` fine-tunes a base model on prompt/answer pairs that shift its style or domain
(GSM8K's step-by-step arithmetic with calculator annotations, for the shipped one), merges the adapter
and writes a plain Hugging Face directory, `<output_dir>/model`. Loss covers the answer tokens only.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Literal

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from pydantic import Field
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from draftsmith.data.collate import pad_batch
from draftsmith.data.prompts import ColumnMap, load_conversations
from draftsmith.data.render import render_conversation
from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.fileio import atomic_directory
from draftsmith.speculative.loading import load_model
from draftsmith.train.config import LoraConfig, Section


class FinetuneData(Section):
    prompts: list[str]
    """Sources of prompt / answer records: files, builtin:NAME or hf:NAME[:CONFIG][@SPLIT]."""
    prompt_column: str | None = None
    answer_column: str = "answer"
    """The column holding the answer the target learns to give."""
    limit: int | None = Field(None, ge=1)
    max_length: int = Field(320, ge=16)


class FinetuneTrain(Section):
    steps: int = Field(60, ge=1)
    batch_size: int = Field(4, ge=1)
    lr: float = Field(3e-4, gt=0)
    warmup_steps: int = Field(5, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    seed: int = 0


class FinetuneRecipe(Section):
    task: Literal["finetune-target"]
    name: str
    base: str | None = None
    """The target to update; None = the embedded default."""
    output_dir: str
    data: FinetuneData
    lora: LoraConfig = Field(default_factory=lambda: LoraConfig(enabled=True, r=16, alpha=32))
    train: FinetuneTrain = Field(default_factory=FinetuneTrain)


def finetune_target(recipe: FinetuneRecipe, *, progress: bool = True) -> Path:
    out = Path(recipe.output_dir)
    if (out / "model").exists():
        raise InvalidInputError(f"{out / 'model'} already exists; choose another output_dir")
    accelerator = Accelerator()
    set_seed(recipe.train.seed)
    base = load_model(recipe.base, device=accelerator.device)
    rows = sft_rows(recipe, base.tokenizer)
    from peft import LoraConfig as PeftLoraConfig, get_peft_model

    model = get_peft_model(base.model.train(), PeftLoraConfig(
        r=recipe.lora.r, lora_alpha=recipe.lora.alpha, lora_dropout=recipe.lora.dropout,
        target_modules=recipe.lora.target_modules, task_type="CAUSAL_LM"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=recipe.train.lr)
    scheduler = get_cosine_schedule_with_warmup(optimizer, recipe.train.warmup_steps, recipe.train.steps)
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(recipe.train.seed)
    start, losses = time.perf_counter(), []
    for _ in tqdm(range(recipe.train.steps), desc=f"fine-tuning {recipe.name}", disable=not progress, file=sys.stderr):
        picks = torch.randint(len(rows), (recipe.train.batch_size,), generator=g).tolist()
        batch = {k: v.to(accelerator.device) for k, v in pad_batch([rows[i] for i in picks], pad_id=0).items()}
        labels = batch["input_ids"].masked_fill(batch["loss_mask"] == 0, -100)
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), recipe.train.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    merged = accelerator.unwrap_model(model).merge_and_unload().eval()
    summary = {"recipe": recipe.model_dump(), "base": base.name, "base_weight_hash": base.weight_hash(),
               "steps": recipe.train.steps, "seconds": time.perf_counter() - start,
               "first_loss": losses[0], "last_loss": sum(losses[-5:]) / len(losses[-5:])}
    save_model_dir(out / "model", merged, base.tokenizer, summary)
    print(f"fine-tuned {base.name} in {summary['seconds']:.0f} s (loss {summary['first_loss']:.3f} -> "
          f"{summary['last_loss']:.3f}); updated target in {out / 'model'}", file=sys.stderr)
    return out / "model"


def sft_rows(recipe: FinetuneRecipe, tokenizer) -> list[dict]:
    cfg = recipe.data
    rows = []
    for spec in cfg.prompts:
        records = load_conversations(spec, ColumnMap(prompt=cfg.prompt_column, reference=cfg.answer_column),
                                     limit=cfg.limit)
        for record in records:
            if not record["reference"].strip():
                continue
            messages = record["messages"] + [{"role": "assistant", "content": record["reference"]}]
            ids, mask = render_conversation(tokenizer, messages)
            if sum(mask[: cfg.max_length]):
                rows.append({"input_ids": ids[: cfg.max_length], "loss_mask": mask[: cfg.max_length]})
    if not rows:
        raise InvalidInputError(f"no prompt/answer pairs with a non-empty '{cfg.answer_column}' in {cfg.prompts}")
    return rows


def save_model_dir(path: Path, model, tokenizer, summary: dict) -> None:
    with atomic_directory(path) as scratch:
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        (scratch / "draftsmith_finetune.json").write_text(json.dumps(summary, indent=2) + "\n")
