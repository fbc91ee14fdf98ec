"""Batching tokenized rows for the trainer and the teacher pass."""

from __future__ import annotations

import torch

from draftsmith.speculative.errors import InvalidInputError


def pad_batch(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad rows of `input_ids` (and `loss_mask`) into one batch.

    Returns
        input_ids       [B, L] int64, `pad_id` after each row's end
        attention_mask  [B, L] int64, 1 on real tokens
        loss_mask       [B, L] int64, 0 on padding (present when the rows carry loss_mask)
        index           [B] int64 dataset row indices (present when the rows carry "index")
    with L the longest row. Right padding keeps every row's positions 0..len-1, which is what a plain
    forward (no position_ids) assumes.
    """
    if not rows:
        raise InvalidInputError("cannot collate an empty batch")
    ids = [_as_list(row.get("input_ids"), "input_ids", b) for b, row in enumerate(rows)]
    if any(not seq for seq in ids):
        raise InvalidInputError(f"row {next(b for b, seq in enumerate(ids) if not seq)} of the batch has no input_ids")
    length = max(len(seq) for seq in ids)
    batch = {
        "input_ids": _padded(ids, length, pad_id),
        "attention_mask": _padded([[1] * len(seq) for seq in ids], length, 0),
    }
    if any("loss_mask" in row for row in rows):
        masks = [_as_list(row.get("loss_mask"), "loss_mask", b) for b, row in enumerate(rows)]
        for b, (mask, seq) in enumerate(zip(masks, ids)):
            if len(mask) != len(seq):
                raise InvalidInputError(f"row {b} of the batch has {len(seq)} input_ids but {len(mask)} loss_mask entries")
        batch["loss_mask"] = _padded(masks, length, 0)
    if any("index" in row for row in rows):
        if not all("index" in row for row in rows):
            raise InvalidInputError("some rows of the batch carry an index and some do not")
        batch["index"] = torch.tensor([int(row["index"]) for row in rows], dtype=torch.int64)
    return batch


def _as_list(value, name: str, b: int) -> list[int]:
    if value is None:
        raise InvalidInputError(f"row {b} of the batch has no {name}")
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return list(value)


def _padded(seqs: list[list[int]], length: int, fill: int) -> torch.Tensor:  # [B, length] int64
    out = torch.full((len(seqs), length), fill, dtype=torch.int64)
    for b, seq in enumerate(seqs):
        out[b, : len(seq)] = torch.as_tensor(seq, dtype=torch.int64)
    return out
