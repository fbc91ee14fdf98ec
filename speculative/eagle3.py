"""The eagle3 kind: an EAGLE-3 drafter (Li et al. 2025), its chain proposer, checkpoint and objective.

EAGLE-1 (eagle.py) reads the target's top feature and regresses onto the next one. EAGLE-3 drops the
regression and reads more of the target: the hidden states *entering* three of its layers (by default
[2, L//2, L-3] of L; `target_layers`, indices into transformers' `hidden_states`), concatenated,

    h_t = fc([s_t^a ; s_t^b ; s_t^c])                                   3H -> H, no bias

One decoder layer of the target's architecture (more are possible) then reads, at slot t, the pair
(h_t, x_{t+1}): its attention sees cat[input_layernorm(e(x_{t+1})), hidden_norm(h_t)] (2H -> q, k, v),
its residual stream starts from h_t (from hidden_norm(h_t) with `norm_before_residual`), then the
usual MLP block. Its output g_t (before the final `norm`) goes through `norm` and the drafter's own
`lm_head` to a guess of x_{t+2}. While drafting, g_t itself stands in for the next slot's h: the
pairs (g, d_1) -> g' -> d_2 ... have no target states and do not pass through `fc`.

The lm_head covers a draft vocabulary of Vd tokens (the training data's most frequent answer tokens,
then its prompts' tokens, then the tokenizer's lowest ids: kinds.draft_vocabulary), kept as `d2t`
[Vd] (draft index i -> target id i + d2t[i]) and `t2d` [V] (bool: the target id is in the draft
vocabulary), the convention of the speculators and EAGLE-3 checkpoints. The draft
logits over the target's vocabulary are -inf outside it, so q is exactly the distribution drafted
from (zero outside the Vd tokens) and verification stays exact. The token embeddings are the
target's, frozen and never stored.

Checkpoint: config.json {"draftsmith": record, "eagle3": spec (layer count, target layers, sizes, the
draft layer's config)}, eagle3.safetensors (fc, layers, norm, lm_head, d2t, t2d under the names the
speculators format uses), tokenizer files. formats.py writes and reads the speculators/vLLM and
SGLang/EAGLE-3 layouts. Objective: training-time test over `loss.draft_steps` steps, step k reading
the drafter's own outputs of step k-1 under the mask drafting's KV cache gives; per step the recipe's
divergence between the target's distribution restricted to the draft vocabulary (renormalised) and
the drafter's, weighted `loss.head_decay`**k. No feature regression.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from draftsmith.speculative import formats, kinds
from draftsmith.speculative.draft_lm import draft_lm_config
from draftsmith.speculative.errors import InvalidInputError, ModelLoadError
from draftsmith.speculative.kinds import (
    DrafterKind,
    Footprint,
    kv_bytes_per_token,
    top1_agreement,
    weight_bytes,
)
from draftsmith.speculative.kv import KVState, additive_mask
from draftsmith.speculative.proposers import ChainProposer, RoundContext, left_pad
from torch import nn
from transformers import AutoModel, DynamicCache
from transformers.masking_utils import create_causal_mask

WEIGHTS = "eagle3.safetensors"
SPEC_KEY = "eagle3"


def default_target_layers(num_layers: int) -> list[int]:
    """EAGLE-3's choice, the states entering layers [2, L//2, L-3]; an error for targets too shallow
    for those to be three increasing layers (name `drafter.target_layers` then)."""
    layers = [2, num_layers // 2, num_layers - 3]
    if not 2 < num_layers // 2 < num_layers - 3:
        raise InvalidInputError(f"a {num_layers}-layer target has no three distinct layers [2, L//2, L-3]; "
                                "name them with drafter.target_layers")
    return layers


def check_target_layers(layers, num_layers: int) -> list[int]:
    """Strictly increasing indices of states entering layers 0..L-1 (serving engines collect them in
    layer order, so fc's input blocks are in that order), or an InvalidInputError."""
    layers = [int(i) for i in layers]
    if not layers or any(b <= a for a, b in zip(layers, layers[1:])) or layers[0] < 0 or layers[-1] >= num_layers:
        raise InvalidInputError(f"target layers {layers} must be strictly increasing indices in 0..{num_layers - 1} "
                                f"(the states entering those layers of the {num_layers}-layer target)")
    return layers


@dataclass
class Eagle3Output:
    logits: torch.Tensor  # [B, T', V] at the kept slots, -inf outside the draft vocabulary
    hidden: torch.Tensor  # [B, T', H] the layers' output before `norm`: the next draft step's input


class Eagle3Drafter(nn.Module):
    """fc, `num_layers` decoder layers of the target's architecture (the first reading 2H), norm and a
    draft-vocabulary lm_head; the target's embeddings are attached with `attach_target`.

    State-dict names are the speculators format's: fc.weight, layers.N.*, layers.0.hidden_norm.weight,
    norm.weight, lm_head.weight [Vd, H], d2t [Vd] int64, t2d [V] bool."""

    def __init__(self, target_config, target_layers, num_layers: int = 1, draft_vocab_size: int | None = None,
                 norm_before_residual: bool = False, layer_config=None):
        """`layer_config`: the draft layers' config when it is not the target's with `num_layers`
        layers (an imported drafter's); its width and vocabulary must be the target's."""
        super().__init__()
        self.config = copy.deepcopy(layer_config) if layer_config is not None else \
            draft_lm_config(target_config, num_layers)
        self.config.num_hidden_layers = num_layers
        self.config._attn_implementation = "sdpa"  # takes the 4-D masks of the unrolled training passes
        self.target_layers = check_target_layers(target_layers, target_config.num_hidden_layers)
        self.num_layers, self.norm_before_residual = num_layers, norm_before_residual
        hidden, vocab = self.config.hidden_size, self.config.vocab_size
        draft_vocab_size = draft_vocab_size or vocab
        base = AutoModel.from_config(self.config)
        self.layers, self.norm, self.rotary_emb = base.layers, base.norm, base.rotary_emb
        widen_first_layer(self.layers[0], hidden)
        self.fc = nn.Linear(len(self.target_layers) * hidden, hidden, bias=False)
        self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
        # The first Vd ids until a draft vocabulary is chosen (prepare) or loaded (load_state_dict).
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.arange(vocab) < draft_vocab_size)
        self._target: list[nn.Module] = []  # [embed_tokens, lm_head], a list so they are not submodules
        self.target_architectures = list(getattr(target_config, "architectures", None) or [])

    # --- the target and the draft vocabulary ------------------------------------------------------

    def attach_target(self, target: nn.Module, *, init: bool = False) -> "Eagle3Drafter":
        """Share the target's embeddings (not saved). `init` copies the target's final norm and its
        lm_head rows for the draft vocabulary, so an untrained drafter's outputs start on the target's
        scale and vocabulary."""
        self._target = [target.get_input_embeddings(), target.get_output_embeddings()]
        self.target_architectures = list(target.config.architectures or [type(target).__name__])
        if init:
            with torch.no_grad():
                self.norm.weight.copy_(target.get_decoder().norm.weight)
            self.set_draft_vocab(self.draft_to_target, from_target=True)
        return self

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[Vd] the target id of each draft index (increasing)."""
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def set_draft_vocab(self, token_ids: torch.Tensor, *, from_target: bool = False) -> None:
        """Draft among these target ids (sorted here), with a new lm_head of the target's rows for them
        (`from_target`) or of the current lm_head's (they must be in the current draft vocabulary)."""
        ids = token_ids.to(device=self.d2t.device, dtype=torch.int64).unique(sorted=True)
        if from_target:
            rows = self._target[1].weight.detach()[ids.to(self._target[1].weight.device)]
        else:
            index = draft_index(self, ids)
            if bool((index < 0).any()):
                raise InvalidInputError("a restricted draft vocabulary must lie inside the current one")
            rows = self.lm_head.weight.detach()[index]
        self.lm_head = nn.Linear(rows.shape[1], len(ids), bias=False).to(rows.device, rows.dtype)
        with torch.no_grad():
            self.lm_head.weight.copy_(rows)
        self.d2t = ids - torch.arange(len(ids), device=ids.device)
        t2d = torch.zeros_like(self.t2d)
        t2d[ids] = True
        self.t2d = t2d

    def spec(self) -> dict:
        layer_config = self.config.to_dict()
        layer_config.pop("_attn_implementation_autoset", None)
        return {"num_layers": self.num_layers, "target_layers": list(self.target_layers),
                "hidden_size": self.config.hidden_size, "vocab_size": self.config.vocab_size,
                "draft_vocab_size": len(self.d2t), "norm_before_residual": self.norm_before_residual,
                "target_architectures": self.target_architectures, "layer_config": layer_config}

    # --- the forward passes -----------------------------------------------------------------------

    def decode(self, input_ids, hidden, attention_mask=None, position_ids=None, cache=None,
               use_cache: bool = False) -> torch.Tensor:
        """[B, T] tokens x_{t+1} and [B, T, H] inputs h_t -> [B, T, H] layer outputs g_t (before norm)."""
        if not self._target:
            raise RuntimeError("Eagle3Drafter needs attach_target(target) before use")
        embeds = self._target[0](input_ids).to(hidden.dtype)
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(input_ids.shape[1], device=input_ids.device) + past)[None]
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                  cache=cache, position_ids=position_ids)
        rotary = self.rotary_emb(hidden, position_ids=position_ids)
        shared = dict(attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=use_cache,
                      position_embeddings=rotary)
        x = self._first_layer(embeds, hidden, shared)
        for layer in self.layers[1:]:
            x = layer(x, **shared)
        return x

    def _first_layer(self, embeds, hidden, shared) -> torch.Tensor:
        layer = self.layers[0]
        normed = layer.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        attended, _ = layer.self_attn(hidden_states=torch.cat([layer.input_layernorm(embeds), normed], dim=-1),
                                      **shared)
        x = residual + attended
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def draft_vocab_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., Vd] logits of the draft vocabulary (draft-index order) from layer outputs g."""
        return self.lm_head(self.norm(hidden))

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., V] logits over the target's vocabulary: -inf outside the draft vocabulary."""
        small = self.draft_vocab_logits(hidden)
        if len(self.d2t) == len(self.t2d):
            return small  # the whole vocabulary, in order
        logits = small.new_full((*small.shape[:-1], len(self.t2d)), float("-inf"))
        return logits.scatter_(-1, self.draft_to_target.expand(*small.shape[:-1], -1), small)

    def forward(self, input_ids, features=None, hidden=None, attention_mask=None, position_ids=None, cache=None,
                use_cache: bool = False, logits_to_keep: int = 0, **_) -> Eagle3Output:
        """The runtime's call (through `KVState`): a round's first step gives the target's states
        `features` [B, T, len(target_layers) * H], later steps the drafter's own outputs `hidden`
        [B, T, H]. Logits and outputs at the last `logits_to_keep` slots (all with 0)."""
        h = self.fc(features.to(self.fc.weight.dtype)) if features is not None else hidden
        out = self.decode(input_ids, h, attention_mask, position_ids, cache, use_cache)
        if logits_to_keep:
            out = out[:, -logits_to_keep:]
        return Eagle3Output(logits=self.draft_logits(out), hidden=out)

    def predict_unrolled(self, input_ids, features, attention_mask, steps: int) -> list[torch.Tensor]:
        """Training-time test: the layer outputs g of draft steps 1..`steps` of a round at every slot,
        teacher-forced on the tokens; `steps` tensors [B, T, H].

        Step 1 reads (fc(features_s), x_{s+1}) causally. Step k at slot s reads step k-1's output at
        slot s-1 with x_{s+1} and attends, as drafting does, to step 1's slots 0..s-k+1 (the true
        pairs) and to step n's slot s-k+n, n = 2..k (the chain of guesses after them): the round that
        started after true slot s-k+1 with the data's tokens as drafts. The steps run one after the
        other over one cache (a step's keys and values never depend on later steps), so step k costs
        one pass of T queries over k*T keys and the gradient flows through the guesses and the
        cached keys. Slots s < k-1 of step k have no such round; their outputs mean nothing."""
        batch, length = input_ids.shape
        device = input_ids.device
        valid = (attention_mask if attention_mask is not None else torch.ones_like(input_ids)).bool()
        s = torch.arange(length, device=device)
        cache = DynamicCache(config=self.config)
        dtype = self.fc.weight.dtype
        hidden, outputs = self.fc(features.to(dtype)), []
        for k in range(1, steps + 1):
            blocks = [s[None, :] <= s[:, None] - k + 1]  # step 1's slots (causal for k = 1)
            blocks += [s[None, :] == s[:, None] - k + n for n in range(2, k + 1)]
            allowed = torch.cat(blocks, dim=1)[None] & valid.repeat(1, k)[:, None, :]  # [B, T, kT]
            out = self.decode(input_ids, hidden, additive_mask(allowed, dtype), s[None].expand(batch, -1), cache,
                              use_cache=True)
            outputs.append(out)
            hidden = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)  # slot s reads slot s-1's guess
        return outputs


def widen_first_layer(layer: nn.Module, hidden: int) -> None:
    """EAGLE-3's first layer: q, k, v read 2H (embedding and hidden halves); a `hidden_norm` of the
    layer's norm type for the hidden half."""
    attn = layer.self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        old = getattr(attn, name)
        setattr(attn, name, nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None))
    layer.hidden_norm = copy.deepcopy(layer.input_layernorm)


class Eagle3Proposer(ChainProposer):
    """Chain drafting with an `Eagle3Drafter`, greedy or sampled (q is its processed distribution),
    with the confidence stop and sibling leaves of the shared chain machinery.

    Per row it keeps the pairs (target states s_t, token x_{t+1}) not yet in its cache. A round's
    first draft step feeds them (through fc), later steps feed (its own output g, draft token);
    `rollback` drops every slot but the true pairs and queues the round's new ones (the target's
    states at the emitted tokens' positions, with the emitted tokens). A row without a pair yet (a
    one-token prompt's first round) feeds a placeholder slot, dropped too, and drafts nothing."""

    kind = name = "eagle3"
    needs_target_states = True

    def __init__(self, drafter: Eagle3Drafter, device=None):
        super().__init__(drafter, device)
        self.target_layers = tuple(drafter.target_layers)
        self.state_size = drafter.fc.in_features
        self.pending_states: list[torch.Tensor] = []  # per row: [n, state_size], pairs with `pending`
        self._new_states: list[torch.Tensor] = []  # the target's states handed over for the next rollback
        self._first_valid: torch.Tensor | None = None  # [B, T] real pairs among the first step's slots
        self._step_inputs: dict = {}  # the next draft step's `features` or `hidden`
        self._after_prefill = False

    def begin(self, prompts, sampling, rng):
        self.kv = KVState(self.model, len(prompts), self.device)
        self.pending = [list(p[1:]) for p in prompts]  # token x_{t+1} of each prompt position t but the last
        self.pending_states = [torch.zeros(0, self.state_size, device=self.device) for _ in prompts]
        self._after_prefill = True
        self._fed_drafts = -1

    def target_states(self, states):
        dtype = self.model.fc.weight.dtype
        states = [s.to(self.device, dtype).reshape(-1, self.state_size) for s in states]
        if self._after_prefill:  # the prompts' states: they pair with the prompts' tokens
            self.pending_states, self._after_prefill = states, False
        else:  # a round's states: they pair with its emitted tokens, at rollback
            self._new_states = states

    def propose(self, ctx: RoundContext):
        max_lens = [m if p else 0 for m, p in zip(ctx.max_lens, self.pending)]  # no pair: nothing to draft from
        return super().propose(dataclasses.replace(ctx, max_lens=max_lens))

    def _draft_inputs(self):
        tokens, self._first_valid = left_pad(self.pending, self.device)
        width = tokens.shape[1]
        features = torch.zeros(len(self.pending), width, self.state_size, dtype=self.model.fc.weight.dtype,
                               device=self.device)
        for b, f in enumerate(self.pending_states):
            if len(f):
                features[b, width - len(f):] = f
        self._step_inputs = {"features": features}
        valid = self._first_valid.clone()
        valid[:, -1] = True  # a placeholder slot for rows without pairs: dropped at rollback
        return tokens, valid

    def _draft_forward(self, tokens, valid):
        out = self.kv.forward(tokens, valid, logits_to_keep=1, **self._step_inputs)
        self._step_inputs = {"hidden": out.hidden}  # [B, 1, H]: what the next step builds on
        return out.logits

    def rollback(self, num_accepted, emitted):
        if self._fed_drafts >= 0:  # drop the draft slots and placeholders; the true pairs stay
            first = self._first_valid
            drafts = torch.zeros(first.shape[0], self._fed_drafts, dtype=torch.bool, device=self.device)
            self.kv.keep_last(torch.cat([first, drafts], dim=1))
            self.pending = [[] for _ in self.pending]
            self.pending_states = [f[:0] for f in self.pending_states]
        self.pending = [p + e for p, e in zip(self.pending, emitted)]
        self.pending_states = [torch.cat([f, s]) for f, s in zip(self.pending_states, self._new_states)]
        self._fed_drafts = -1  # until the next propose: a round the runtime drafts nothing in feeds nothing

    def select_rows(self, rows):
        self.kv.select_rows(rows)
        keep = rows.tolist()
        self.pending = [self.pending[i] for i in keep]
        self.pending_states = [self.pending_states[i] for i in keep]


class Eagle3ForTraining(nn.Module):
    def __init__(self, drafter: Eagle3Drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, input_ids, features, attention_mask, positions, steps: int = 1) -> list[torch.Tensor]:
        """Pairs (features[b, t], input_ids[b, t]) -> per draft step k = 1..steps, the draft-vocabulary
        logits [N, Vd] at positions [N, 2] (row, t)."""
        outputs = self.drafter.predict_unrolled(input_ids, features, attention_mask, steps)
        return [self.drafter.draft_vocab_logits(g[positions[:, 0], positions[:, 1]]) for g in outputs]


def draft_index(drafter: Eagle3Drafter, token_ids: torch.Tensor) -> torch.Tensor:
    """Target ids -> their draft index, -100 (ignored by cross-entropy, never an argmax) outside."""
    ids = drafter.draft_to_target
    slot = torch.searchsorted(ids, token_ids).clamp(max=len(ids) - 1)
    return torch.where(ids[slot] == token_ids, slot, -100)


@kinds.register
class Eagle3Kind(DrafterKind):
    name = "eagle3"
    has_checkpoint = True
    trainable = True
    # Its objective reads the last state (the target's logits) and the states entering `teacher_layers`.
    needs_teacher_hidden = True

    def save(self, drafter, out_dir, tokenizer, info):
        from draftsmith.speculative.checkpoint import save_module

        return save_module(out_dir, drafter, WEIGHTS, {SPEC_KEY: drafter.spec()}, tokenizer, info)

    def load(self, path, target, *, device=None, dtype=None):
        from draftsmith.speculative.checkpoint import load_weights, read_spec

        spec = read_spec(path, SPEC_KEY)
        drafter = drafter_for(spec, target, str(path))
        load_weights(drafter, Path(path) / WEIGHTS, SPEC_KEY)
        return placed(drafter.attach_target(target.model), target, device, dtype).eval()

    def proposer(self, drafter):
        return Eagle3Proposer(drafter)

    def footprint(self, proposer, target):
        element = next(proposer.model.parameters()).element_size()
        return Footprint(weight_bytes(proposer.model, exclude=target),
                         kv_bytes_per_token(proposer.model.config, element_size=element),
                         "own layers and draft-vocabulary lm_head; embeddings shared with the target")

    def identity(self, proposer):
        from draftsmith.speculative.loading import state_dict_hash

        return {"weight_hash": state_dict_hash(proposer.model), "shares_target_weights": False}

    def draft_model(self, proposer):
        return proposer.model

    def modules(self, proposer):
        return [proposer.model]

    def build(self, recipe, target):
        cfg = recipe.drafter
        if cfg.init_from:  # a draftsmith eagle3 checkpoint, or one in the speculators or SGLang layout
            foreign = formats.recognise(cfg.init_from) is not None
            drafter = (formats.load if foreign else self.load)(Path(cfg.init_from), target)
        else:
            config = target.model.config
            layers = cfg.target_layers or default_target_layers(config.num_hidden_layers)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(recipe.train.seed)
                drafter = Eagle3Drafter(config, layers, cfg.num_layers, None, cfg.norm_before_residual)
            drafter.attach_target(target.model, init=True)
        return placed(drafter, target).train()

    def prepare(self, drafter, train_rows, recipe):
        if recipe.drafter.draft_vocab and not recipe.drafter.init_from:
            vocab = kinds.draft_vocabulary(train_rows, recipe.drafter.draft_vocab, len(drafter.t2d))
            drafter.set_draft_vocab(vocab, from_target=True)

    def teacher_layers(self, recipe, target):
        cfg = recipe.drafter
        if cfg.init_from:
            foreign = formats.recognise(cfg.init_from) is not None
            return list((formats.load if foreign else self.load)(Path(cfg.init_from), target).target_layers)
        return list(cfg.target_layers or default_target_layers(target.model.config.num_hidden_layers))

    def training_module(self, drafter):
        return Eagle3ForTraining(drafter)

    def objective(self, module, drafter, batch, teacher, recipe):
        ids, mask = batch["input_ids"], batch["attention_mask"]
        hidden_size, steps = drafter.config.hidden_size, recipe.loss.draft_steps
        # One target pass: the drafter's input states and the last state (the target's logits).
        states = teacher.states(batch, (*drafter.target_layers, -1))  # [B, L, (layers + 1) * H], no grad
        features, last = states[..., :-hidden_size], states[..., -hidden_size:]
        # Slot t pairs the states at t with token t + 1 and guesses token t + 2 (an answer token at the
        # positions that count); every step must have a round there (t >= steps - 1).
        counted = batch["attention_mask"] if recipe.loss.prompt_positions else batch["loss_mask"]
        positions = counted[:, 2:].bool().nonzero()  # [N, 2]: (row, t)
        positions = positions[positions[:, 1] >= steps - 1]
        rows, t = positions[:, 0], positions[:, 1]
        students = module(ids[:, 1:], features[:, :-1], mask[:, 1:], positions, steps)
        # The target restricted to the draft vocabulary (only its lm_head rows: a sixth of SmolLM2's); the
        # loss's softmax renormalises it. Exact, online or from cached states.
        teacher_logits = teacher.logits(last[rows, t + 1], vocab=drafter.draft_to_target)
        target_top = teacher.top(torch.stack([rows, t + 1], dim=-1), batch, last)
        labels = draft_index(drafter, ids[rows, t + 2])
        top = draft_index(drafter, target_top)  # -100 where the target's top token cannot be drafted
        total, weights, metrics = 0.0, 0.0, {}
        for k, student in enumerate(students):
            weight = recipe.loss.head_decay ** k
            total = total + weight * teacher.loss(student, labels, teacher_logits=teacher_logits)
            weights += weight
            metrics[f"agreement/pos{k + 1}"] = float(top1_agreement(student.detach(), top))
        return total / weights, int(positions.shape[0]), metrics


def drafter_for(spec: dict, target, where: str) -> Eagle3Drafter:
    """An untrained drafter shaped as `spec` says, checked against the target (one-line errors)."""
    try:
        num_layers, layers = int(spec["num_layers"]), [int(i) for i in spec["target_layers"]]
        sizes = (int(spec["hidden_size"]), int(spec["vocab_size"]))
        draft_vocab_size = int(spec["draft_vocab_size"])
        norm_before_residual = bool(spec.get("norm_before_residual", False))
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"corrupt eagle3 config in {where}: {exc!r}") from None
    config = target.model.config
    if sizes != (config.hidden_size, config.vocab_size):
        raise ModelLoadError(f"eagle3 drafter in {where} is {sizes[0]} wide over {sizes[1]} tokens; the target "
                             f"{target.name} is {config.hidden_size} wide over {config.vocab_size}")
    try:
        return Eagle3Drafter(config, layers, num_layers, draft_vocab_size, norm_before_residual)
    except InvalidInputError as exc:
        raise ModelLoadError(f"eagle3 drafter in {where} does not fit {target.name}: {exc}") from None


def placed(drafter: Eagle3Drafter, target, device=None, dtype=None) -> Eagle3Drafter:
    """On the target's device and dtype unless given; buffers keep their integer and bool types."""
    weight = target.model.get_output_embeddings().weight
    return drafter.to(device=device or weight.device, dtype=dtype or weight.dtype)
