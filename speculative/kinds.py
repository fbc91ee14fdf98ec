"""The drafter kinds, registered by name: the one place the rest of draftsmith asks about a kind.

A kind (draft LM, early exit, Medusa heads, EAGLE, n-gram lookup, lookup+drafter, ...) lives in one
module that holds its model, its proposer, its checkpoint I/O, its memory footprint and its training
objective, and registers one `DrafterKind` under its name:

    @register
    class MedusaKind(DrafterKind):
        name = "medusa"
        ...

The runtime, the trainer, the eval, the memory ledger, the advice and the benchmarks call the
registry (`get(name)`, `of(proposer)`) and never test a drafter's type. Every proposer carries its
kind's name in `Proposer.kind`; a trained module is always handled through the kind its recipe or
checkpoint names.

Adding a kind: one module defining and registering its `DrafterKind` (and the module name in
`BUILTIN_MODULES`), plus its recipe and tests.

The training objective is written against the `Teacher` protocol below, which `train/` implements:
the target's signals reach a kind through it, so this core package never imports the trainer.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from draftsmith.speculative.errors import InvalidInputError

if TYPE_CHECKING:  # imported for annotations only: the kinds' modules import this one
    from draftsmith.speculative.checkpoint import DrafterInfo
    from draftsmith.speculative.loading import LoadedModel
    from draftsmith.speculative.proposers import Proposer

# The modules that register draftsmith's own kinds, imported on the first registry lookup.
BUILTIN_MODULES = (
    "draftsmith.speculative.draft_lm",
    "draftsmith.speculative.early_exit",
    "draftsmith.speculative.medusa",
    "draftsmith.speculative.eagle",
    "draftsmith.speculative.eagle3",
    "draftsmith.speculative.ngram",
    "draftsmith.speculative.lookup",
)

_REGISTRY: dict[str, "DrafterKind"] = {}
_loaded = False


@dataclass(frozen=True)
class Footprint:
    """What a drafter adds to the target's memory."""

    weight_bytes: int  # weights of its own (shared target weights excluded)
    kv_bytes_per_token: int  # its KV cache per context token and row
    note: str  # how it shares with the target, in words


class Teacher(Protocol):
    """The target's signals for a training objective (implemented by the trainer).

    `hidden(batch)`: [B, L, H] the target's last hidden states (no grad). `states(batch, layers)`:
    [B, L, len(layers) * H] the states entering those layers (-1: the last), online or from the cache
    when the kind names them in `teacher_layers`. `logits(hidden, vocab=None)`: [N, V] the target's lm_head
    over last hidden states [N, H]; given target ids `vocab` [V'], [N, V'] from those rows of the lm_head
    only. `top(positions, batch, hidden)`: [N] the target's greedy token after positions [N, 2] (row, t),
    from the teacher cache's top-1 (no lm_head pass) or the lm_head over `hidden` [B, L, H].
    `at(positions, batch, hidden=None)`: (teacher logits [N, V], None) online or (None, probabilities
    [N, V]) offline, at positions [N, 2] (row, t). `loss(student, labels)`: the recipe's divergence
    between the student's logits [N, V'] and the teacher given as `teacher_logits=` / `teacher_probs=`."""

    def hidden(self, batch: dict) -> torch.Tensor: ...

    def states(self, batch: dict, layers) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor: ...

    def top(self, positions: torch.Tensor, batch: dict, hidden: torch.Tensor) -> torch.Tensor: ...

    def at(self, positions: torch.Tensor, batch: dict, hidden: torch.Tensor | None = None): ...

    def loss(self, student: torch.Tensor, labels: torch.Tensor, **teacher) -> torch.Tensor: ...


class DrafterKind:
    """One kind of drafter. Subclasses set the class attributes and override what their kind has."""

    name: str = ""
    # A drafter of this kind is a draftsmith checkpoint directory (else it is built from a spec).
    has_checkpoint: bool = False
    # The trainer can train it (`build`, `training_module` and `objective` are defined).
    trainable: bool = False
    # Training signals: the teacher cache stores the target's hidden states for it.
    needs_teacher_hidden: bool = False
    # Trained modules of this kind generate text on their own (on-policy distillation, LoRA).
    generates_text: bool = False
    # Named on the command line as NAME[:ARG] (`from_spec`), not by a directory.
    from_spec_name: bool = False
    # Can draft the rows prompt lookup finds nothing for (`ngram+DRAFTER`).
    behind_lookup: bool = True

    # --- from the command line ---------------------------------------------------------------

    def from_spec(self, arg: str, spec: str, target: "LoadedModel") -> "Proposer":
        """A training-free proposer from `NAME[:ARG]` on the command line."""
        raise InvalidInputError(f"'{spec}': a {self.name} drafter is loaded from a directory, not a spec")

    # --- checkpoints ----------------------------------------------------------------------------

    def save(self, drafter: nn.Module, out_dir: Path, tokenizer, info: "DrafterInfo") -> Path:
        raise NotImplementedError(f"{self.name} drafters have no checkpoint")

    def load(self, path: Path, target: "LoadedModel", *, device=None, dtype=None) -> nn.Module:
        """The drafter module of a checkpoint directory, on the target's device and dtype unless given."""
        raise NotImplementedError(f"{self.name} drafters have no checkpoint")

    def proposer(self, drafter: nn.Module) -> "Proposer":
        """The runtime's proposer around a drafter module of this kind (loaded or being trained)."""
        raise NotImplementedError(f"{self.name} has no drafter module")

    # --- what a proposer is and costs -----------------------------------------------------------

    def footprint(self, proposer: "Proposer", target: nn.Module) -> Footprint:
        return Footprint(0, 0, "none")

    def identity(self, proposer: "Proposer") -> dict:
        """Facts for a report: `weight_hash` of its own weights (None when it has none) and
        `shares_target_weights`, plus anything kind-specific."""
        return {"weight_hash": None, "shares_target_weights": False}

    def draft_model(self, proposer: "Proposer") -> nn.Module | None:
        """The module one autoregressive draft step runs (for timing it alone), or None."""
        return None

    def assistant_model(self, proposer: "Proposer") -> nn.Module | None:
        """A Hugging Face causal LM that `generate(assistant_model=...)` can draft with, or None."""
        return None

    def modules(self, proposer: "Proposer") -> list[nn.Module]:
        """The modules the proposer runs while decoding (for the runtime's few-row linear layers)."""
        return []

    def draft_cost(self, proposer: "Proposer", target: nn.Module) -> float:
        """What drafting one token costs relative to one decoding step of the target: the weights of the
        linear layers it multiplies over the target's (adaptive draft length, adaptive.py)."""
        return linear_params(*self.modules(proposer)) / max(linear_params(target), 1)

    # --- training --------------------------------------------------------------------------------

    def build(self, recipe: Any, target: "LoadedModel") -> nn.Module:
        """The untrained (or `drafter.init_from`) drafter a recipe asks for."""
        raise InvalidInputError(f"drafter kind '{self.name}' cannot be trained")

    def prepare(self, drafter: nn.Module, train_rows, recipe: Any) -> None:
        """Anything the drafter needs from the training data before the first step."""

    def teacher_layers(self, recipe: Any, target: "LoadedModel") -> list[int]:
        """The target layers whose entering states `objective` reads through `Teacher.states` (besides
        the last state): the offline teacher cache stores them. Asked before the drafter is built."""
        return []

    def training_module(self, drafter: nn.Module) -> nn.Module:
        """The module DDP wraps: its one `forward` computes what `objective` needs."""
        raise NotImplementedError

    def objective(self, module: nn.Module, drafter: nn.Module, batch: dict, teacher: Teacher, recipe: Any) -> tuple:
        """(loss, tokens counted, metrics) for one micro-batch; `module` is the (possibly wrapped)
        training module to call, `drafter` the drafter inside it."""
        raise NotImplementedError

    def inference_module(self, drafter: nn.Module) -> nn.Module:
        """The trained module as the runtime and the checkpoint see it."""
        return drafter


class ModelKind(DrafterKind):
    """A kind whose proposer drafts with one module of its own, `proposer.model` (a draft LM, the
    target's first layers, an EAGLE drafter): that module is what it runs, times and is identified by."""

    def identity(self, proposer):
        from draftsmith.speculative.loading import state_dict_hash

        return {"weight_hash": state_dict_hash(proposer.model), "shares_target_weights": False}

    def draft_model(self, proposer):
        return proposer.model

    def modules(self, proposer):
        return [proposer.model]


def linear_params(*modules: nn.Module) -> int:
    """Weights of the linear layers in `modules`, each tensor once: a decoding step's matmul work per
    token (embedding lookups cost next to nothing; a tied lm_head is a linear layer and counts)."""
    seen: dict[int, int] = {}
    for module in modules:
        for layer in module.modules():
            if isinstance(layer, nn.Linear):
                seen[layer.weight.data_ptr()] = layer.weight.numel()
    return sum(seen.values())


def weight_bytes(module: nn.Module, exclude: nn.Module | None = None) -> int:
    """Bytes of a module's parameters, each tensor once, leaving out those of `exclude`."""
    skip = {p.data_ptr() for p in exclude.parameters()} if exclude is not None else set()
    seen, total = set(), 0
    for p in module.parameters():
        if p.data_ptr() in seen or p.data_ptr() in skip:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(config, layers: int | None = None, element_size: int = 4) -> int:
    """Bytes of keys and values one token occupies in a full-attention cache of this config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * (layers or config.num_hidden_layers) * kv_heads * head_dim * element_size


def top1_agreement(student_logits: torch.Tensor, teacher_argmax: torch.Tensor) -> torch.Tensor:
    """Share of positions where the drafter's top token is the target's (ties: lowest index)."""
    if student_logits.shape[0] == 0:
        return torch.tensor(float("nan"))
    return (student_logits.argmax(-1) == teacher_argmax).float().mean()


def draft_vocabulary(rows, count: int, vocab_size: int, fill: bool = True) -> torch.Tensor:
    """`count` target ids to draft among (fewer only when the vocabulary is smaller): the answer tokens
    of the training rows (`input_ids`, `loss_mask`) by frequency, then the prompts' other tokens by
    frequency, then the tokenizer's lowest unused ids (a BPE vocabulary is numbered in merge order, the
    most common text first); ties to the lower id.

    The answers alone name too few tokens on a small set (the SmolLM2 recipe's 876 answers: 6,467
    distinct tokens for a vocabulary of 8,192), and a token never drafted is never accepted: on the eval
    prompts the target wrote 13.5% of its tokens outside those answers' tokens. With `fill` off, only
    the answers' tokens (at most `count`): a drafter whose lm_head rows are the target's, untrained (the
    eagle kind), picks filled tokens it never learnt to avoid (the quickstart's EAGLE drafter, 4,096
    asked: held-out AL 1.505 answers' tokens only, 1.459 filled)."""
    answers, prompts = [], []
    for row in rows:
        ids = torch.tensor(row["input_ids"], dtype=torch.int64)
        mask = torch.tensor(row["loss_mask"], dtype=torch.bool)
        answers.append(ids[mask])
        prompts.append(ids[~mask])
    if not answers or sum(len(a) for a in answers) == 0:
        raise InvalidInputError("no answer tokens to choose a draft vocabulary from")
    answer_counts = torch.bincount(torch.cat(answers), minlength=vocab_size)[:vocab_size]
    prompt_counts = torch.bincount(torch.cat(prompts), minlength=vocab_size)[:vocab_size]
    order = torch.arange(vocab_size)  # stable sorts: by answer count, then prompt count, then id
    order = order[torch.sort(prompt_counts[order], descending=True, stable=True).indices]
    order = order[torch.sort(answer_counts[order], descending=True, stable=True).indices]
    if not fill:
        count = min(count, int((answer_counts > 0).sum()))
    return order[: min(count, vocab_size)]


def positive_int(text: str, spec: str) -> int:
    """An integer >= 1 from a drafter spec's argument, or a one-line InvalidInputError."""
    try:
        value = int(text)
    except ValueError:
        raise InvalidInputError(f"bad drafter spec '{spec}': '{text}' is not an integer") from None
    if value < 1:
        raise InvalidInputError(f"bad drafter spec '{spec}': {value} must be >= 1")
    return value


def register(cls: type[DrafterKind]) -> type[DrafterKind]:
    """Class decorator: register one instance of a kind under its `name`."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and type(_REGISTRY[cls.name]) is not cls:
        raise ValueError(f"drafter kind '{cls.name}' is registered twice")
    _REGISTRY[cls.name] = cls()
    return cls


def _load_builtin() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in BUILTIN_MODULES:
            importlib.import_module(module)


def get(name: str) -> DrafterKind:
    _load_builtin()
    kind = _REGISTRY.get(name)
    if kind is None:
        raise InvalidInputError(f"unknown drafter kind '{name}' (known: {', '.join(names())})")
    return kind


def find(name: str) -> DrafterKind | None:
    """The kind registered under `name`, or None (a proposer written for a test or an experiment need
    not register one to run in the runtime)."""
    _load_builtin()
    return _REGISTRY.get(name)


def names(*, trainable: bool | None = None, has_checkpoint: bool | None = None,
          from_spec: bool | None = None) -> list[str]:
    """The registered kinds' names, optionally only those with the given capabilities."""
    _load_builtin()
    wanted = {"trainable": trainable, "has_checkpoint": has_checkpoint, "from_spec_name": from_spec}
    return sorted(n for n, k in _REGISTRY.items()
                  if all(v is None or getattr(k, a) == v for a, v in wanted.items()))


def of(proposer: "Proposer") -> DrafterKind:
    """The kind of a proposer."""
    return get(proposer.kind)
