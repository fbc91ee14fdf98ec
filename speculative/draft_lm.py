"""Building a small draft LM from the target's own architecture.

The draft LM is the target's config with fewer layers (and optionally a narrower width). When the
width matches, it starts from the target: embeddings, final norm and lm_head copied, and the first N
decoder layers copied, so an untrained draft LM is already the early-exit drafter. A narrower draft
starts random. Which parameters train (the copied embeddings and lm_head are frozen by default) is
the trainer's business.
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from draftsmith.speculative.errors import InvalidInputError


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
