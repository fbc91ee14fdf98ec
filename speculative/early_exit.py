"""The early-exit kind: training-free self-speculation with the target's own first N layers.

    --drafter early-exit:N

The drafter is a view of the target (its first N decoder layers, final norm and lm_head, weights
shared, nothing copied) with a KV cache of its own, drafting as a chain (proposers.py).
"""

from __future__ import annotations

import copy

from torch import nn

from draftsmith.speculative import kinds
from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.kinds import Footprint, ModelKind, kv_bytes_per_token
from draftsmith.speculative.proposers import ChainProposer


class EarlyExitProposer(ChainProposer):
    """Training-free self-speculative drafter: the target's first N layers, its final norm and lm_head.

    The layers share the target's weights (no copy); the drafter keeps its own KV cache.
    """

    kind = name = "early-exit"

    def __init__(self, target: nn.Module, num_layers: int):
        super().__init__(truncated_model(target, num_layers))
        self.num_layers = num_layers


def truncated_model(model: nn.Module, num_layers: int) -> nn.Module:
    """A view of a decoder-only HF model keeping its first `num_layers` layers (weights shared)."""
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise InvalidInputError(f"early-exit needs a decoder with a `.layers` list; {type(model).__name__} has none")
    total = len(layers)
    if not 1 <= num_layers < total:
        raise InvalidInputError(f"early-exit:N needs 1 <= N < {total} (the target's layer count), got {num_layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types)[:num_layers]
    short_decoder = _shallow_module_copy(decoder)
    short_decoder.layers = nn.ModuleList(list(layers)[:num_layers])
    short_decoder.config = config
    shell = _shallow_module_copy(model)
    setattr(shell, _decoder_attribute(model, decoder), short_decoder)
    shell.config = config
    return shell


def _decoder_attribute(model: nn.Module, decoder: nn.Module) -> str:
    for name, child in model.named_children():
        if child is decoder:
            return name
    raise InvalidInputError(f"cannot locate the decoder module of {type(model).__name__}")


def _shallow_module_copy(module: nn.Module) -> nn.Module:
    """A new module object sharing parameters and submodules, whose own submodule table can change."""
    new = copy.copy(module)
    new._modules = dict(module._modules)
    new._parameters = dict(module._parameters)
    new._buffers = dict(module._buffers)
    for name, value in vars(module).items():  # hooks registered on the original must not fire on the view
        if name.endswith("hooks") and isinstance(value, dict):
            setattr(new, name, type(value)(value))
    return new


@kinds.register
class EarlyExitKind(ModelKind):
    name = "early-exit"
    from_spec_name = True

    def from_spec(self, arg, spec, target):
        if not arg:
            raise InvalidInputError("early-exit needs a layer count, e.g. --drafter early-exit:8")
        return EarlyExitProposer(target.model, kinds.positive_int(arg, spec))

    def footprint(self, proposer, target):
        element = next(target.parameters()).element_size()
        per_token = kv_bytes_per_token(proposer.model.config, proposer.num_layers, element)
        return Footprint(0, per_token, f"shared with the target (its first {proposer.num_layers} layers)")

    def identity(self, proposer):
        return {"weight_hash": None, "shares_target_weights": True, "layers": proposer.num_layers}

    def assistant_model(self, proposer):
        return proposer.model

