"""A causal LM's KV cache for a batch whose rows advance by different amounts.

Rows of one batch accept different numbers of draft tokens each round, but a Hugging Face
`DynamicCache` holds one slot count for the whole batch. `KVState` keeps a validity mask beside the
cache, one entry per slot and row:

- new tokens are appended for every row at once; a row that has fewer real tokens this step fills the
  rest with masked slots ("holes");
- rolling back a row marks its rejected slots invalid, so they are never attended to again; the prefix
  is never re-encoded;
- slots that are invalid in every row at the end of the cache are cropped away, and when holes fill
  more than half of a long cache the rows are compacted (valid slots packed to the right, in order).

Position ids count only valid slots, so rotary positions are those of the unpadded sequence, and a row
computes the same logits in any batch as alone (up to floating-point reduction order).
Supported: models whose cache is made of full-attention `DynamicLayer`s (Llama, Mistral, Qwen2/3,
SmolLM, GPT-NeoX style models ...).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from draftsmith.speculative.errors import InvalidInputError

COMPACT_MIN_SLOTS = 64  # below this, holes cost less than a compaction copy
COMPACT_WASTE = 0.5  # compact once holes would be more than this share of the slots after packing


class KVState:
    def __init__(self, model, batch_size: int, device: torch.device | str):
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.device = torch.device(device)
        self.mask = torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device)  # [B, L] valid slots
        self.lengths = torch.zeros(batch_size, dtype=torch.int64, device=self.device)  # [B] valid slots per row
        self._checked_layout = False

    @property
    def batch_size(self) -> int:
        return self.mask.shape[0]

    def forward(
        self,
        tokens: torch.Tensor,  # [B, T] int64; entries at invalid slots may be any id
        valid: torch.Tensor,  # [B, T] bool
        *,
        logits_to_keep: int = 0,  # 0 = logits for all T slots
        output_hidden_states: bool | list[int] = False,  # a list: only those indices (the others None)
        tree: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([T] depth, [T, T] bool sees), see tree.py
        **model_inputs,  # further per-slot inputs of the model (an EAGLE drafter's features)
    ):
        """Run the model on T new slots per row and append them to the cache.

        Without `tree` the new slots form a sequence (each attends to the valid ones before it). With
        it, new slot t sits at position offset depth[t] from the row's next position and attends to the
        cached context and to the valid new slots s with sees[t, s]; the caller then keeps one
        root-to-leaf path with `keep_last`."""
        full_mask = torch.cat([self.mask, valid], dim=1)
        if tree is None:
            positions = self.lengths[:, None] + valid.long().cumsum(dim=1) - 1
            positions = positions.clamp(min=0)  # holes before a row's first token
            attention = full_mask
        else:
            depth, sees = tree
            positions = self.lengths[:, None] + depth[None, :]
            attention = self._tree_mask(valid, sees)
        out = self.model(
            input_ids=tokens,
            attention_mask=attention,
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            output_hidden_states=output_hidden_states,
            **model_inputs,
        )
        self.mask = full_mask
        self.lengths = self.lengths + valid.sum(dim=1)
        if not self._checked_layout:
            self._check_layout()
        return out

    def _tree_mask(self, valid: torch.Tensor, sees: torch.Tensor) -> torch.Tensor:
        """[B, 1, T, L + T] additive mask (0 = attend): the valid cached slots, then `sees` among the valid
        new slots. Transformers passes a 4-D mask to attention as it is."""
        batch, width = valid.shape
        allowed = torch.cat([self.mask[:, None, :].expand(batch, width, -1), sees[None] & valid[:, None, :]], dim=2)
        return additive_mask(allowed, next(self.model.parameters()).dtype)

    def keep_last(self, keep: torch.Tensor) -> None:  # keep: [B, T] bool over the last T slots
        """Roll back: of the last T slots, only those marked in `keep` stay valid."""
        width = keep.shape[1]
        tail = self.mask[:, -width:]
        dropped = (tail & ~keep).sum(dim=1)
        self.mask[:, -width:] = tail & keep
        self.lengths = self.lengths - dropped
        self._trim()

    def select_rows(self, rows: torch.Tensor) -> None:  # rows: [B'] int64 indices of rows to keep
        # Indexed here rather than by DynamicCache.batch_select_indices, which leaves a layer with no slot
        # (every row rolled back, or none fed yet) at its old batch size, so the next forward fails.
        for layer in self.cache.layers:
            keys = _keys(layer)
            if keys is not None:
                layer.keys, layer.values = keys[rows], layer.values[rows]
        self.mask = self.mask[rows]
        self.lengths = self.lengths[rows]
        self._trim()

    def append_rows(self, other: "KVState") -> None:
        """Append the rows of `other` (a cache of the same model, e.g. new requests prefilled apart) after
        this batch's rows. The narrower of the two is widened with holes on the left, so every row keeps
        its valid slots in order and its positions (which count valid slots only) are unchanged; the
        caches are copied once."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            # A layer that held slots and lost them all (every row rolled back or left) still has keys
            # shaped for the old batch: it is rebuilt at the new batch size, zero slots wide. (`like` lends
            # only dtype, device, heads and head size.)
            like = next((t for t in (_keys(mine), _keys(theirs)) if t is not None), None)
            if like is None:  # neither layer made yet: its first update makes it at the batch's size
                continue
            if not mine.is_initialized:
                mine.lazy_initialization(like, like)
            for name in ("keys", "values"):
                setattr(mine, name, torch.cat([_widened(getattr(mine, name), self.batch_size, width, like),
                                               _widened(getattr(theirs, name, None), other.batch_size, width, like)]))
        self.mask = torch.cat([_widened(self.mask, self.batch_size, width), _widened(other.mask, other.batch_size, width)])
        self.lengths = torch.cat([self.lengths, other.lengths.to(self.device)])
        self._trim()

    def _trim(self) -> None:
        any_valid = self.mask.any(dim=0)  # [L]
        total = any_valid.shape[0]
        last_valid = int(any_valid.nonzero().max()) + 1 if bool(any_valid.any()) else 0
        if last_valid < total:
            self.cache.crop(-(total - last_valid))
            self.mask = self.mask[:, :last_valid]
        slots = self.mask.shape[1]
        if slots >= COMPACT_MIN_SLOTS and slots - int(self.lengths.max()) > COMPACT_WASTE * slots:
            self._compact()

    def _compact(self) -> None:
        """Pack each row's valid slots to the right end, keeping their order (positions are unchanged)."""
        width = int(self.lengths.max())
        # A stable sort on validity puts a row's invalid slots first and its valid slots after, in order.
        order = torch.sort(self.mask.to(torch.int8), dim=1, stable=True).indices[:, -width:]  # [B, width]
        self.mask = self.mask.gather(1, order)
        for layer in self.cache.layers:
            if not layer.is_initialized:
                continue
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, index)
            layer.values = layer.values.gather(2, index)

    def _check_layout(self) -> None:
        unsupported = {type(layer).__name__ for layer in self.cache.layers if type(layer) is not DynamicLayer}
        if unsupported:
            raise InvalidInputError(
                f"{type(self.model).__name__} uses cache layers {sorted(unsupported)}; draftsmith's runtime "
                "supports full-attention models (DynamicLayer caches) only"
            )
        self._checked_layout = True


def _keys(layer) -> torch.Tensor | None:
    """A cache layer's keys [B, H, L, d] (L may be 0) once it has been made, else None."""
    keys = getattr(layer, "keys", None) if layer.is_initialized else None
    return keys if keys is not None and keys.dim() == 4 else None


def _widened(x: torch.Tensor | None, batch: int, width: int, like: torch.Tensor | None = None) -> torch.Tensor:
    """x ([B, L] mask or [B, H, L, d] keys/values) with holes (False / zeros) prepended to `width` slots;
    a missing or empty x becomes all holes, shaped after `like` for keys/values."""
    if like is None:  # a validity mask
        return torch.cat([x.new_zeros(batch, width - x.shape[1]), x], dim=1)
    if x is None or x.dim() != 4 or x.shape[2] == 0:
        return like.new_zeros(batch, like.shape[1], width, like.shape[3])
    return torch.nn.functional.pad(x, (0, 0, width - x.shape[2], 0))


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, Q, K] bool (True = may attend) -> the [B, 1, Q, K] additive float mask attention layers take
    as a custom 4-D mask: 0 where allowed, the dtype's most negative value elsewhere (not -inf, so a
    query slot that may attend to nothing gives no NaN)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]
