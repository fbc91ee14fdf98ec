"""The eagle kind: an EAGLE-style feature drafter (Li et al. 2024, EAGLE-1), its chain proposer,
checkpoint and training objective.

The target's last hidden state f_t (the final-norm output its lm_head reads, `hidden_states[-1]` in
transformers) already says most of what the target will write next. The drafter is a few decoder
layers of the target's own architecture, with their own KV cache, whose input at position t is

    fc([f_t ; e(x_{t+1})])        the target's feature at t and the embedding of the token after it

Its output f^_{t+1} (after its final norm) is a guess of the target's feature at t+1, and the
target's lm_head turns it into a guess of token x_{t+2}. While drafting, the guess stands in for the
true feature: (f^_{t+1}, d_1) -> f^_{t+2} -> d_2 -> ... After each verification the drafter's own
draft slots are dropped and the target's true features for the emitted tokens take their place, so
only the first draft step of a round reads nothing but true features.

Unlike Medusa heads (which guess token t+1+k from f_t alone), the drafter knows every token it builds
on; unlike a small draft LM, it reads the target's features instead of re-deriving them from tokens.
The embeddings and lm_head are the target's, shared and frozen, stored nowhere in the checkpoint.

Draft vocabulary (optional, as in EAGLE-3 and FR-Spec): the product with the 49k-row lm_head is most
of a draft step's cost, so the drafter can draft only among the K tokens most frequent in its training
answers. Its logits are -inf elsewhere: q is exactly the distribution it drafts from, zero outside
the K tokens, and verification stays exact (a token it cannot propose is simply never drafted).

Checkpoint: config.json {"draftsmith": record, "eagle": {num_layers, hidden_size, vocab_size,
draft_vocab_size}}, eagle.safetensors (projection, decoder layers, final norm, the draft vocabulary's
token ids if any), tokenizer files. Objective: per unrolled draft step k (training-time test), the
recipe's divergence from the target's next-token distribution plus `feature_weight` times a smooth-L1
regression onto the target's next feature, weighted `head_decay`**k.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModel

from draftsmith.speculative import kinds
from draftsmith.speculative.draft_lm import draft_lm_config
from draftsmith.speculative.errors import ModelLoadError
from draftsmith.speculative.kinds import Footprint, ModelKind, kv_bytes_per_token, top1_agreement, weight_bytes
from draftsmith.speculative.kv import KVState, additive_mask
from draftsmith.speculative.proposers import ChainProposer, Draft, RoundContext, left_pad

WEIGHTS = "eagle.safetensors"


@dataclass
class EagleOutput:
    logits: torch.Tensor  # [B, T', V] at the kept positions
    features: torch.Tensor  # [B, T', H] the predicted next features there


class EagleDrafter(nn.Module):
    """fc over [feature ; token embedding], `num_layers` decoder layers of the target's architecture and
    a final norm; the target's embeddings and lm_head are attached with `attach_target`."""

    def __init__(self, target_config, num_layers: int = 1, draft_vocab_size: int | None = None):
        super().__init__()
        self.config = draft_lm_config(target_config, num_layers)
        self.num_layers = num_layers
        # Token ids the drafter may propose (None: all); filled by training or from a checkpoint.
        self.draft_vocab: torch.Tensor | None
        self.register_buffer("draft_vocab", torch.zeros(draft_vocab_size, dtype=torch.int64)
                             if draft_vocab_size else None)
        self._draft_head: tuple | None = None  # (key, weight rows of the draft vocabulary)
        hidden = self.config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.decoder = AutoModel.from_config(self.config)
        self.decoder.embed_tokens = None  # inputs come from fc; the target's embeddings are shared
        self._target: list[nn.Module] = []  # [embed_tokens, lm_head], a list so they are not submodules

    def attach_target(self, target: nn.Module, *, init_norm: bool = False) -> "EagleDrafter":
        """Share the target's embeddings and lm_head (not saved). `init_norm` copies the target's final
        norm into the drafter's, so an untrained drafter's outputs already live on the target's scale."""
        self._target = [target.get_input_embeddings(), target.get_output_embeddings()]
        if init_norm:
            with torch.no_grad():
                self.decoder.norm.weight.copy_(target.get_decoder().norm.weight)
        return self

    def set_draft_vocab(self, token_ids: torch.Tensor | None) -> None:
        self.draft_vocab = None if token_ids is None else token_ids.to(torch.int64).sort().values
        self._draft_head = None

    def spec(self) -> dict:
        return {"num_layers": self.num_layers, "hidden_size": self.config.hidden_size,
                "vocab_size": self.config.vocab_size,
                "draft_vocab_size": None if self.draft_vocab is None else len(self.draft_vocab)}

    def draft_logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary; with a draft vocabulary, only its rows of the lm_head are
        multiplied and every other token gets -inf."""
        if self.draft_vocab is None:
            return self.lm_head(predicted)
        small = self.draft_vocab_logits(predicted)
        logits = small.new_full((*small.shape[:-1], self.lm_head.weight.shape[0]), float("-inf"))
        return logits.scatter_(-1, self.draft_vocab.expand(*small.shape[:-1], -1), small)

    def draft_vocab_logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """[..., K] logits of the draft vocabulary's tokens only (in `draft_vocab` order), from the
        lm_head's rows for them (when serving, a copy kept until the lm_head changes; in training, where
        an inference-mode copy cannot enter autograd, gathered per call)."""
        weight = self.lm_head.weight
        if torch.is_grad_enabled():
            return nn.functional.linear(predicted, weight[self.draft_vocab])
        key = (weight.data_ptr(), weight._version, weight.dtype, self.draft_vocab.data_ptr())
        if self._draft_head is None or self._draft_head[0] != key:
            self._draft_head = (key, weight.detach()[self.draft_vocab].contiguous())
        return nn.functional.linear(predicted, self._draft_head[1])

    @property
    def lm_head(self) -> nn.Module:
        if not self._target:
            raise RuntimeError("EagleDrafter needs attach_target(target) before use")
        return self._target[1]

    def predict_features(self, input_ids, features, attention_mask=None, position_ids=None, cache=None,
                         use_cache: bool = False) -> torch.Tensor:
        """[B, T] tokens x_{t+1} and [B, T, H] target features f_t -> [B, T, H] predicted f^_{t+1}."""
        embed = self._target[0](input_ids)
        x = self.fc(torch.cat([features.to(embed.dtype), embed], dim=-1))
        out = self.decoder(inputs_embeds=x, attention_mask=attention_mask, position_ids=position_ids,
                           cache=cache, use_cache=use_cache)
        return out.last_hidden_state

    def predict_unrolled(self, input_ids, features, attention_mask, steps: int) -> list[torch.Tensor]:
        """Training-time test (HASS, EAGLE-3): what draft steps 1..`steps` of a round would predict at
        every slot at once, teacher-forced on the tokens. Returns `steps` tensors [B, T, H].

        Step 1 is `predict_features`. At step k the slot s pairs step k-1's guess at slot s-1 (its guess
        of f_s) with token x_{s+1} and attends, as drafting does, to the true slots 0..s-k+1 and to the
        chain of guessed slots after them (step m's slot s-k+m, m = 2..k): the round that started
        after true slot s-k+1 and whose drafts so far were the data's tokens. All steps run as one
        sequence of k*T slots under that mask (the earlier steps recomputed), so the gradient flows
        through the guesses. Slots s < k-1 of step k have no such round; their outputs mean nothing.
        """
        batch, length = input_ids.shape
        valid = (attention_mask if attention_mask is not None
                 else torch.ones_like(input_ids)).bool()
        s = torch.arange(length, device=input_ids.device)
        outputs = [self.predict_features(input_ids, features, attention_mask)]
        for k in range(2, steps + 1):
            guesses = [torch.cat([torch.zeros_like(o[:, :1]), o[:, :-1]], dim=1) for o in outputs]
            step_features = torch.cat([features] + [g.to(features.dtype) for g in guesses], dim=1)
            allowed = torch.zeros(k * length, k * length, dtype=torch.bool, device=input_ids.device)
            for m in range(1, k + 1):  # queries of step m
                rows = slice((m - 1) * length, m * length)
                allowed[rows, :length] = s[None, :] <= s[:, None] - m + 1
                for n in range(2, m + 1):  # step n's guessed slot s - m + n
                    allowed[rows, (n - 1) * length:n * length] = s[None, :] == s[:, None] - m + n
            allowed = allowed[None] & valid.repeat(1, k)[:, None, :]  # [B, kT, kT], padding masked
            mask = additive_mask(allowed, next(self.parameters()).dtype)
            predicted = self.predict_features(input_ids.repeat(1, k), step_features, mask,
                                              position_ids=s.repeat(k)[None].expand(batch, -1))
            outputs.append(predicted[:, -length:])
        return outputs

    def forward(self, input_ids, features, attention_mask=None, position_ids=None, cache=None,
                use_cache: bool = False, logits_to_keep: int = 0, **_) -> EagleOutput:
        """The runtime's call (through `KVState`): logits and predicted features at the last
        `logits_to_keep` slots (all with 0)."""
        predicted = self.predict_features(input_ids, features, attention_mask, position_ids, cache, use_cache)
        if logits_to_keep:
            predicted = predicted[:, -logits_to_keep:]
        return EagleOutput(logits=self.draft_logits(predicted), features=predicted)


class EagleProposer(ChainProposer):
    """Chain drafting with an `EagleDrafter`: greedy or sampled like a draft LM (q is the drafter's
    processed distribution), with the same confidence stop.

    Per row it keeps the pairs (true feature f_t, token x_{t+1}) not yet in its cache. A round's first
    draft step feeds them, later steps feed (predicted feature, draft token); `rollback` drops every
    slot but those true pairs and queues the round's new ones (the target's features at the emitted
    tokens' positions, with the emitted tokens). A row without any pair yet (a one-token prompt's
    first round) feeds a placeholder slot, which is dropped too, and drafts nothing.
    """

    kind = name = "eagle"
    needs_target_states = True

    def __init__(self, drafter: EagleDrafter, device=None):
        super().__init__(drafter, device)
        self.pending_features: list[torch.Tensor] = []  # per row: [n, H] true features, pairs with pending
        self._states: list[torch.Tensor] = []  # the target's states handed over for the next rollback
        self._first_valid: torch.Tensor | None = None  # [B, T] real pairs among the first step's slots
        self._features: torch.Tensor | None = None  # inputs of the next draft step's slots
        self._after_prefill = False

    def begin(self, prompts, sampling, rng):
        self.kv = KVState(self.model, len(prompts), self.device)
        self.pending = [list(p[1:]) for p in prompts]  # token x_{t+1} of each prompt position t but the last
        self.pending_features = [torch.zeros(0, self.model.config.hidden_size, device=self.device) for _ in prompts]
        self._after_prefill = True
        self._fed_drafts = -1

    def target_states(self, states):
        dtype, hidden = next(self.model.parameters()).dtype, self.model.config.hidden_size
        states = [s.to(self.device, dtype).reshape(-1, hidden) for s in states]
        if self._after_prefill:  # the prompts' states: they pair with the prompts' tokens
            self.pending_features, self._after_prefill = states, False
        else:  # a round's states: they pair with its emitted tokens, at rollback
            self._states = states

    def propose(self, ctx: RoundContext) -> Draft:
        # A row with no true pair yet has nothing to draft from.
        max_lens = [m if p else 0 for m, p in zip(ctx.max_lens, self.pending)]
        return super().propose(dataclasses.replace(ctx, max_lens=max_lens))

    def _draft_inputs(self):
        tokens, self._first_valid = left_pad(self.pending, self.device)  # some row has pairs (see propose)
        width = tokens.shape[1]
        self._features = torch.zeros(len(self.pending), width, self.model.config.hidden_size,
                                     dtype=next(self.model.parameters()).dtype, device=self.device)
        for b, f in enumerate(self.pending_features):
            if len(f):
                self._features[b, width - len(f):] = f
        valid = self._first_valid.clone()
        valid[:, -1] = True  # a placeholder slot for rows without pairs: dropped at rollback
        return tokens, valid

    def _draft_forward(self, tokens, valid):
        out = self.kv.forward(tokens, valid, logits_to_keep=1, features=self._features)
        self._features = out.features  # [B, 1, H]: the guess the next step builds on
        return out.logits

    def rollback(self, num_accepted, emitted):
        if self._fed_drafts >= 0:  # drop the draft slots and placeholders; the true pairs stay
            first = self._first_valid
            drafts = torch.zeros(first.shape[0], self._fed_drafts, dtype=torch.bool, device=self.device)
            self.kv.keep_last(torch.cat([first, drafts], dim=1))
            self.pending = [[] for _ in self.pending]
            self.pending_features = [f[:0] for f in self.pending_features]
        self.pending = [p + e for p, e in zip(self.pending, emitted)]
        self.pending_features = [torch.cat([f, s]) for f, s in zip(self.pending_features, self._states)]
        self._fed_drafts = -1  # until the next propose: a round the runtime drafts nothing in feeds nothing

    def select_rows(self, rows):
        self.kv.select_rows(rows)
        keep = rows.tolist()
        self.pending = [self.pending[i] for i in keep]
        self.pending_features = [self.pending_features[i] for i in keep]


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


def vocab_slots(vocab: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Token ids -> their index in the sorted draft vocabulary, -100 (ignored by cross-entropy, never
    an argmax) for tokens outside it."""
    slot = torch.searchsorted(vocab, token_ids).clamp(max=len(vocab) - 1)
    return torch.where(vocab[slot] == token_ids, slot, -100)


@torch.no_grad()
def to_draft_vocab(vocab, teacher_logits, teacher_probs):
    """The teacher restricted to the draft vocabulary's tokens: online logits are renormalised over them
    by the loss's softmax, offline probabilities here (the mass outside cannot be drafted)."""
    if teacher_logits is not None:
        return teacher_logits[:, vocab], None
    probs = teacher_probs[:, vocab]
    return None, probs / probs.sum(-1, keepdim=True).clamp(min=1e-12)


@kinds.register
class EagleKind(ModelKind):
    name = "eagle"
    has_checkpoint = True
    trainable = True
    needs_teacher_hidden = True

    def save(self, drafter, out_dir, tokenizer, info):
        from draftsmith.speculative.checkpoint import save_module

        return save_module(out_dir, drafter, WEIGHTS, {"eagle": drafter.spec()}, tokenizer, info)

    def load(self, path, target, *, device=None, dtype=None):
        from draftsmith.speculative.checkpoint import load_weights, read_spec

        spec = read_spec(path, "eagle")
        try:
            num_layers = int(spec["num_layers"])
            sizes = (int(spec["hidden_size"]), int(spec["vocab_size"]))
            draft_vocab_size = int(spec["draft_vocab_size"]) if spec.get("draft_vocab_size") else None
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"corrupt eagle config in {path}/config.json: {exc!r}") from None
        lm_head = target.model.get_output_embeddings()
        if sizes != (lm_head.weight.shape[1], lm_head.weight.shape[0]):
            raise ModelLoadError(f"eagle drafter in {path} is {sizes[0]}x{sizes[1]}, the target is "
                                 f"{lm_head.weight.shape[1]}x{lm_head.weight.shape[0]}")
        drafter = EagleDrafter(target.model.config, num_layers, draft_vocab_size)
        load_weights(drafter, Path(path) / WEIGHTS, "eagle")
        drafter.attach_target(target.model)
        return drafter.to(device=device or lm_head.weight.device, dtype=dtype or lm_head.weight.dtype).eval()

    def proposer(self, drafter):
        return EagleProposer(drafter)

    def footprint(self, proposer, target):
        element = next(proposer.model.parameters()).element_size()
        return Footprint(weight_bytes(proposer.model, exclude=target),
                         kv_bytes_per_token(proposer.model.config, element_size=element),
                         "own layers; embeddings and lm_head shared with the target")

    def build(self, recipe, target):
        cfg = recipe.drafter
        if cfg.init_from:
            drafter = self.load(Path(cfg.init_from), target)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(recipe.train.seed)
                drafter = EagleDrafter(target.model.config, cfg.num_layers)
            drafter.attach_target(target.model, init_norm=True)
        lm_head = target.model.get_output_embeddings()
        return drafter.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype).train()

    def prepare(self, drafter, train_rows, recipe):
        if recipe.drafter.draft_vocab:
            vocab = kinds.draft_vocabulary(train_rows, recipe.drafter.draft_vocab, drafter.config.vocab_size, fill=False)
            drafter.set_draft_vocab(vocab.to(next(drafter.parameters()).device))

    def training_module(self, drafter):
        return EagleForTraining(drafter)

    def objective(self, module, drafter, batch, teacher, recipe):
        ids, mask = batch["input_ids"], batch["attention_mask"]
        hidden = teacher.hidden(batch)  # [B, L, H], no grad
        dtype = next(module.parameters()).dtype
        vocab = drafter.draft_vocab
        # Slot t pairs the target's feature f_t with token t + 1; its output guesses f_{t+1}, whose
        # lm_head output predicts token t + 2 (an answer token at the positions that count). Draft step
        # k > 1 at slot t guesses the same from the drafter's own earlier guesses (predict_unrolled).
        cfg = recipe.loss
        positions = batch["loss_mask"][:, 2:].bool().nonzero()  # [N, 2]: (row, t)
        positions = positions[positions[:, 1] >= cfg.draft_steps - 1]  # slots every step has a round for
        rows, t = positions[:, 0], positions[:, 1]
        features = hidden[:, :-1].to(dtype)
        if cfg.feature_noise:
            features = features + (torch.rand_like(features) * 2 - 1) * cfg.feature_noise
        steps = module(ids[:, 1:], features, mask[:, 1:], positions, cfg.draft_steps)
        teacher_logits, teacher_probs = teacher.at(torch.stack([rows, t + 1], dim=1), batch, hidden=hidden)
        labels = ids[rows, t + 2]
        teacher_top = (teacher_logits if teacher_logits is not None else teacher_probs).argmax(-1)
        if vocab is not None:  # the student's logits are the draft vocabulary's: the teacher's and labels too
            teacher_logits, teacher_probs = to_draft_vocab(vocab, teacher_logits, teacher_probs)
            labels, teacher_top = vocab_slots(vocab, labels), vocab_slots(vocab, teacher_top)
        true_features = hidden[rows, t + 1].float()
        total, weights, metrics = 0.0, 0.0, {}
        for k, (student, predicted) in enumerate(steps):
            token_loss = teacher.loss(student, labels, teacher_logits=teacher_logits, teacher_probs=teacher_probs)
            feature_loss = torch.nn.functional.smooth_l1_loss(predicted.float(), true_features)
            weight = cfg.head_decay ** k
            total, weights = total + weight * (token_loss + cfg.feature_weight * feature_loss), weights + weight
            metrics[f"agreement/pos{k + 1}"] = float(top1_agreement(student.detach(), teacher_top))
            metrics[f"loss/feature{'' if k == 0 else k + 1}"] = float(feature_loss.detach())
        return total / weights, int(positions.shape[0]), metrics
