"""The trainable drafter, wrapped so that one `forward` computes the logits a loss needs.

Distributed wrappers (DDP, FSDP) only synchronise gradients correctly when the model is called through
its own `forward`; these wrappers make that call compute exactly the logits at the positions that
count, so the [batch, length, vocab] tensor is never built for positions the loss ignores.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from draftsmith.speculative.checkpoint import load_eagle, load_medusa_heads
from draftsmith.speculative.draft_lm import build_draft_lm
from draftsmith.speculative.eagle import EagleDrafter
from draftsmith.speculative.loading import LoadedModel, check_same_tokenizer, load_model
from draftsmith.speculative.medusa import MedusaHeads
from draftsmith.train.config import Recipe


class DraftLMForTraining(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, positions):  # positions: [N, 2] (row, index) -> [N, V]
        decoder = self.model.get_decoder()
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, L, H]
        return self.model.get_output_embeddings()(hidden[positions[:, 0], positions[:, 1]])


class MedusaForTraining(nn.Module):
    def __init__(self, heads: MedusaHeads):
        super().__init__()
        self.heads = heads

    def forward(self, hidden: list[torch.Tensor]) -> list[torch.Tensor]:  # per head k: [N_k, H] -> [N_k, V]
        """All heads in one call (a DDP module must be called once per backward)."""
        logits = []
        for k, h in enumerate(hidden):
            features = self.heads.blocks[k](h)
            head = self.heads.lm_heads[k] if self.heads.lm_heads is not None else self.heads._shared_lm_head[0]
            logits.append(head(features))
        return logits


class EagleForTraining(nn.Module):
    def __init__(self, drafter: EagleDrafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, input_ids, features, attention_mask, positions, steps: int = 1):
        """Pairs (features[b, t], input_ids[b, t]) -> per draft step k = 1..steps, (logits [N, V],
        predicted features [N, H]) at positions [N, 2] (row, t). With a draft vocabulary the logits are
        its K tokens' only ([N, K]): the loss is over what the drafter can propose, and the lm_head
        product is K/V as large."""
        if steps == 1:
            predicted = [self.drafter.predict_features(input_ids, features, attention_mask)]
        else:
            predicted = self.drafter.predict_unrolled(input_ids, features, attention_mask, steps)
        out = []
        for step in predicted:
            guess = step[positions[:, 0], positions[:, 1]]
            if self.drafter.draft_vocab is not None:
                out.append((self.drafter.draft_vocab_logits(guess), guess))
            else:
                out.append((self.drafter.lm_head(guess), guess))
        return out


def build_drafter(recipe: Recipe, target: LoadedModel) -> nn.Module:
    """The untrained drafter the recipe asks for (requires_grad set on what trains)."""
    cfg = recipe.drafter
    if cfg.kind == "eagle":
        if cfg.init_from:
            drafter = load_eagle(Path(cfg.init_from), target)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(recipe.train.seed)
                drafter = EagleDrafter(target.model.config, cfg.num_layers)
            drafter.attach_target(target.model, init_norm=True)
        lm_head = target.model.get_output_embeddings()
        return drafter.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype).train()
    if cfg.kind == "medusa" and cfg.init_from:
        heads = load_medusa_heads(Path(cfg.init_from), target)
        return heads.train()
    if cfg.kind == "medusa":
        lm_head = target.model.get_output_embeddings()
        heads = MedusaHeads(target.model.config.hidden_size, lm_head.weight.shape[0], cfg.num_heads,
                            cfg.head_layers, own_lm_head=cfg.own_lm_head)
        heads.attach_lm_head(lm_head)
        if cfg.own_lm_head:
            heads.init_own_heads_from_shared()
        return heads.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)
    if cfg.init_from:
        loaded = load_model(cfg.init_from, device=target.model.device, dtype=target.model.dtype)
        check_same_tokenizer(target.tokenizer, loaded.tokenizer, target.name, cfg.init_from)
        model = loaded.model
    else:
        model = build_draft_lm(target.model, cfg.num_layers, hidden_size=cfg.hidden_size,
                               init_from_target=cfg.init_from_target, seed=recipe.train.seed)
    model.train()
    if cfg.freeze_embeddings:
        for module in (model.get_input_embeddings(), model.get_output_embeddings()):
            module.weight.requires_grad_(False)
    if recipe.lora.enabled:
        model = add_lora(model, recipe)
    return model


def add_lora(model: nn.Module, recipe: Recipe) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=recipe.lora.r, lora_alpha=recipe.lora.alpha, lora_dropout=recipe.lora.dropout,
                        target_modules=recipe.lora.target_modules, task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def inference_model(drafter: nn.Module) -> nn.Module:
    """The drafter as the runtime uses it: peft adapters stay active inside the base model's layers."""
    base = getattr(drafter, "base_model", None)
    if base is not None and hasattr(base, "model") and hasattr(drafter, "peft_config"):
        return base.model
    return drafter


def final_drafter(drafter: nn.Module) -> nn.Module:
    """What is saved: LoRA adapters merged into the weights, so the drafter is a plain model."""
    if hasattr(drafter, "merge_and_unload"):
        return drafter.merge_and_unload()
    return drafter


def freeze(model: nn.Module) -> nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model
