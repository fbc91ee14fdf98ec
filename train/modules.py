"""The trainable drafter, from the recipe's kind (speculative/kinds.py).

Each kind builds its drafter and wraps it in a training module whose one `forward` computes exactly
the logits its objective needs (distributed wrappers such as DDP only synchronise gradients for calls
through the module's own `forward`, and the [batch, length, vocab] tensor is never built for
positions the loss ignores).
"""

from __future__ import annotations

from torch import nn

from draftsmith.speculative import kinds
from draftsmith.speculative.loading import LoadedModel
from draftsmith.train.config import Recipe


def build_drafter(recipe: Recipe, target: LoadedModel) -> nn.Module:
    """The untrained (or `drafter.init_from`) drafter the recipe asks for (requires_grad set on what trains)."""
    return kinds.get(recipe.drafter.kind).build(recipe, target)


def freeze(model: nn.Module) -> nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model
