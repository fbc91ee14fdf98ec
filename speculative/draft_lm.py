"""The draft-LM kind: an independent causal LM with the target's tokenizer, drafting autoregressively.

Its model is any Hugging Face causal LM (a small model of the target's family, or one built here from
the target's own architecture); its proposer is the shared chain machinery (proposers.py) over its
own KV cache; its checkpoint a `save_pretrained` directory with a draftsmith record in config.json
(so it also loads with `AutoModelForCausalLM` and serves as Hugging Face's `assistant_model`); its
objective the recipe's divergence at every answer position.

Building one from the target:

The draft LM is the target's config with fewer layers (and optionally a narrower width). When the
width matches, it starts from the target: embeddings, final norm and lm_head copied, and the first N
decoder layers copied, so an untrained draft LM is already the early-exit drafter. A narrower draft
starts random. Which parameters train (the copied embeddings and lm_head are frozen by default) is
the trainer's business.
"""

from __future__ import annotations

import copy
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from draftsmith.speculative import kinds
from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.kinds import Footprint, ModelKind, kv_bytes_per_token, top1_agreement, weight_bytes
from draftsmith.speculative.proposers import ChainProposer


def draft_lm_config(target_config, num_layers: int, hidden_size: int | None = None,
                    intermediate_size: int | None = None):
    config = copy.deepcopy(target_config)
    if not 1 <= num_layers <= target_config.num_hidden_layers:
        raise InvalidInputError(
            f"a draft LM needs 1..{target_config.num_hidden_layers} layers (the target's count), got {num_layers}"
        )
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types)[:num_layers]
    if hidden_size is not None and hidden_size != target_config.hidden_size:
        head_dim = getattr(target_config, "head_dim", None) or target_config.hidden_size // target_config.num_attention_heads
        if hidden_size % head_dim:
            raise InvalidInputError(f"draft hidden_size {hidden_size} must be a multiple of the head size {head_dim}")
        heads = hidden_size // head_dim
        ratio = target_config.num_attention_heads // target_config.num_key_value_heads
        if heads % ratio:
            raise InvalidInputError(f"draft hidden_size {hidden_size} gives {heads} heads, not a multiple of {ratio}")
        config.hidden_size, config.num_attention_heads, config.num_key_value_heads = hidden_size, heads, heads // ratio
        config.head_dim = head_dim
        config.intermediate_size = intermediate_size or round(
            target_config.intermediate_size * hidden_size / target_config.hidden_size)
    elif intermediate_size is not None:
        config.intermediate_size = intermediate_size
    for key in ("quantization_config", "draftsmith"):
        if hasattr(config, key):
            delattr(config, key)
    return config


def build_draft_lm(target: PreTrainedModel, num_layers: int, *, hidden_size: int | None = None,
                   intermediate_size: int | None = None, init_from_target: bool = True,
                   seed: int = 0) -> PreTrainedModel:
    config = draft_lm_config(target.config, num_layers, hidden_size, intermediate_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        draft = AutoModelForCausalLM.from_config(config, dtype=target.dtype)
    same_width = config.hidden_size == target.config.hidden_size and \
        config.intermediate_size == target.config.intermediate_size
    if init_from_target and same_width:
        copy_from_target(draft, target)
    return draft.to(target.device)


def copy_from_target(draft: PreTrainedModel, target: PreTrainedModel) -> None:
    """Copy every draft parameter from the target parameter of the same name (the first N layers
    share their names with the target's first N layers)."""
    source = target.state_dict()
    with torch.no_grad():
        for name, tensor in draft.state_dict().items():
            tensor.copy_(source[name])


class DraftModelProposer(ChainProposer):
    """Chain drafting with an independent causal LM and its own KV cache."""

    kind = name = "draft-lm"


class DraftLMForTraining(nn.Module):
    """One forward: the draft LM's logits at the positions that count, [N, V] for positions [N, 2]."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, positions):
        decoder = self.model.get_decoder()
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, L, H]
        return self.model.get_output_embeddings()(hidden[positions[:, 0], positions[:, 1]])


@kinds.register
class DraftLMKind(ModelKind):
    name = "draft-lm"
    has_checkpoint = True
    trainable = True
    generates_text = True

    def save(self, drafter, out_dir, tokenizer, info):
        from draftsmith.speculative.checkpoint import RECORD_KEY, atomic_write

        model = self.final_model(drafter)

        def write(scratch: Path) -> None:
            setattr(model.config, RECORD_KEY, asdict(info))
            try:
                model.save_pretrained(scratch)
            finally:
                delattr(model.config, RECORD_KEY)
            tokenizer.save_pretrained(scratch)

        return atomic_write(Path(out_dir), write)

    def load(self, path, target, *, device=None, dtype=None):
        from draftsmith.speculative.loading import check_same_tokenizer, load_model

        drafter = load_model(str(path), device=device or target.model.device, dtype=dtype or target.model.dtype)
        check_same_tokenizer(target.tokenizer, drafter.tokenizer, target.name, str(path))
        return drafter.model

    def proposer(self, drafter):
        return DraftModelProposer(self.inference_module(drafter))

    def footprint(self, proposer, target):
        element = next(proposer.model.parameters()).element_size()
        return Footprint(weight_bytes(proposer.model), kv_bytes_per_token(proposer.model.config, element_size=element),
                         "own")

    def assistant_model(self, proposer):
        return proposer.model

    # --- training

    def build(self, recipe, target):
        from draftsmith.speculative.loading import check_same_tokenizer, load_model

        cfg = recipe.drafter
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
            model = add_lora(model, recipe.lora)
        return model

    def training_module(self, drafter):
        return DraftLMForTraining(drafter)

    def objective(self, module, drafter, batch, teacher, recipe):
        ids, mask = batch["input_ids"], batch["attention_mask"]
        positions = batch["loss_mask"][:, 1:].bool().nonzero()  # [N, 2]: (row, t), t predicts answer token t+1
        labels = ids[positions[:, 0], positions[:, 1] + 1]
        student = module(ids, mask, positions)  # [N, V]
        teacher_logits, teacher_probs = teacher.at(positions, batch)
        loss = teacher.loss(student, labels, teacher_logits=teacher_logits, teacher_probs=teacher_probs)
        teacher_top = (teacher_logits if teacher_logits is not None else teacher_probs).argmax(-1)
        return loss, int(positions.shape[0]), {"agreement/pos1": float(top1_agreement(student.detach(), teacher_top))}

    def inference_module(self, drafter):
        """The drafter as the runtime uses it: peft adapters stay active inside the base model's layers."""
        base = getattr(drafter, "base_model", None)
        if base is not None and hasattr(base, "model") and hasattr(drafter, "peft_config"):
            return base.model
        return drafter

    @staticmethod
    def final_model(drafter):
        """What is saved: LoRA adapters merged into the weights, so the drafter is a plain model."""
        if hasattr(drafter, "merge_and_unload"):
            return drafter.merge_and_unload()
        return drafter


def add_lora(model: nn.Module, cfg) -> nn.Module:
    """The model with LoRA adapters (`lora` section of a recipe), through peft."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                        target_modules=cfg.target_modules, task_type="CAUSAL_LM")
    return get_peft_model(model, config)
