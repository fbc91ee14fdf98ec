"""Masked attention over grouped key/value heads without copying them, for the runtime's passes on CPU.

A verification pass attends from D + 1 queries over the cache under a 4-D mask (the cache's holes, the
draft's causal pattern, a batch's left padding). Transformers' "sdpa" attention uses the kernel's own
grouped-query support only without a mask (its rule for CUDA, where a masked grouped call falls back to
the unfused kernel), so with one it first copies every key and value head `num_key_value_groups` times
(`repeat_kv`): SmolLM2's 3 key/value heads become 9, two copies of the layer's whole cache per layer per
pass. On the CPU, torch's fused attention takes the mask and the grouped heads together, so this module
registers "draftsmith_sdpa" (an attention function and its mask builder, under Transformers'
AttentionInterface): the same call with `enable_gqa=True` where a mask is given over several queries on
the CPU, and Transformers' own sdpa otherwise (one query: it folds the groups into the query instead;
other devices; no groups). The kernel and the values it reads are the same, so the outputs are equal.

`grouped_attention(*modules)` switches the configs of the given models that use "sdpa" on the CPU to it
for a `with` block and restores them after, as small_gemm.patched does for linear layers: a model used
outside draftsmith's runtime is unaffected. The decoder enters both per engine step.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "draftsmith_sdpa"


def grouped_sdpa_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Transformers' sdpa attention, with the key/value groups left to the kernel under a mask on the CPU."""
    if (attention_mask is None or query.shape[2] == 1 or query.device.type != "cpu"
            or getattr(module, "num_key_value_groups", 1) == 1 or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None or kwargs.get("output_attentions")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask[..., : key.shape[-2]],
                                                     dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, grouped_sdpa_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks it is given are sdpa's


def switchable(*modules: nn.Module | None) -> list:
    """The configs (each once) of the models among `modules` whose attention is "sdpa" and whose weights
    are on the CPU: those `grouped_attention` switches."""
    configs = {}
    for m in modules:
        config = getattr(m, "config", None)
        if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
            continue
        param = next(m.parameters(), None)
        if param is not None and param.device.type == "cpu":
            configs[id(config)] = config
    return list(configs.values())


@contextlib.contextmanager
def grouped_attention(configs: list) -> Iterator[None]:
    """Within the block the given configs (`switchable`) attend through "draftsmith_sdpa"; restored after.
    Nested blocks leave the switch to the outermost."""
    mine = [c for c in configs if c._attn_implementation == "sdpa"]
    try:
        for c in mine:
            c._attn_implementation = NAME
        yield
    finally:
        for c in mine:
            c._attn_implementation = "sdpa"
