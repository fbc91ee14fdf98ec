"""Teacher signals: what the target says about every training position.

Two modes. Online, the target runs inside each training step (`teacher_forward`, used by the
trainer). Offline, `cache_teacher_signals` runs the target once per example and stores, in compact
safetensors shards:

    topk_logprobs  [N_tok, k] float16   the target's top-k log-probabilities (temperature 1) per position
    topk_ids       [N_tok, k] int32     their token ids
    hidden         [N_tok, H] float16   the last hidden state (final-norm output, the lm_head's input)
    offsets        [n_ex + 1] int64     example i's positions are rows offsets[i]:offsets[i+1]

with a manifest.json (settings, target and tokenizer identity, dataset fingerprint, shards done). The
expected size is printed before anything is written; shards are written atomically and a rerun with
the same settings resumes; other settings in the same directory are refused.

A top-k cache holds a truncated distribution: `sparse_teacher_probs` renormalises it over the k ids.
"""

from __future__ import annotations

import json
import math
import sys
from hashlib import sha256
from pathlib import Path

import datasets
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from draftsmith.data.collate import pad_batch
from draftsmith.data.regenerate import atomic_path, open_run_dir, read_manifest, write_json_atomic
from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.loading import LoadedModel, tokenizer_hash

KIND = "draftsmith-teacher-cache"


@torch.no_grad()
def teacher_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, want_hidden: bool):
    """(logits [B, L, V], hidden [B, L, H] or None); hidden = hidden_states[-1], which feeds the lm_head."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=want_hidden)
    return out.logits, (out.hidden_states[-1] if want_hidden else None)


def dataset_fingerprint(dataset: datasets.Dataset) -> str:
    digest = sha256()
    for ids in dataset["input_ids"]:
        digest.update(json.dumps(ids).encode())
    return digest.hexdigest()


def expected_size(dataset: datasets.Dataset, top_k: int, hidden_size: int | None, dtype: torch.dtype) -> tuple[int, int]:
    tokens = sum(len(ids) for ids in dataset["input_ids"])
    width = torch.finfo(dtype).bits // 8
    per_token = top_k * (width + 4) + (hidden_size * width if hidden_size else 0)
    return tokens, tokens * per_token


def cache_teacher_signals(target: LoadedModel, dataset: datasets.Dataset, out_dir: Path, *, top_k: int = 32,
                          hidden: bool = True, batch_size: int = 8, shard_size: int = 256,
                          dtype: torch.dtype = torch.float16, progress: bool = True) -> "TeacherCache":
    out_dir = Path(out_dir)
    hidden_size = target.model.config.hidden_size if hidden else None
    settings = {"target": target.name, "target_weight_hash": target.weight_hash(),
                "tokenizer_hash": tokenizer_hash(target.tokenizer), "top_k": top_k, "hidden": hidden,
                "dtype": str(dtype), "shard_size": shard_size, "num_examples": len(dataset),
                "dataset_hash": dataset_fingerprint(dataset)}
    num_shards = math.ceil(len(dataset) / shard_size)
    manifest = open_run_dir(out_dir, KIND, settings, num_shards)
    if not manifest["complete"]:
        tokens, size = expected_size(dataset, top_k, hidden_size, dtype)
        what = f"top-{top_k} log-probs" + (f" + {hidden_size}-d hidden states" if hidden else "")
        print(f"teacher cache: {len(dataset):,} examples, {tokens:,} tokens, {what} in "
              f"{str(dtype).removeprefix('torch.')} = {size / 1e6:.1f} MB -> {out_dir}", file=sys.stderr)
        done = set(manifest["shards_done"])
        with tqdm(total=num_shards, initial=len(done), unit="shard", desc="teacher signals",
                  disable=not progress, file=sys.stderr) as bar:
            for shard in range(num_shards):
                if shard in done:
                    continue
                rows = range(shard * shard_size, min((shard + 1) * shard_size, len(dataset)))
                tensors = _shard_tensors(target, dataset, rows, top_k, hidden, batch_size, dtype)
                with atomic_path(out_dir / shard_file(shard)) as tmp:
                    save_file(tensors, str(tmp))
                done.add(shard)
                manifest["shards_done"] = sorted(done)
                write_json_atomic(out_dir / "manifest.json", manifest)
                bar.update(1)
        manifest["complete"] = True
        write_json_atomic(out_dir / "manifest.json", manifest)
    return TeacherCache(out_dir)


def shard_file(shard: int) -> str:
    return f"shard-{shard:05d}.safetensors"


def _shard_tensors(target, dataset, rows: range, top_k, hidden, batch_size, dtype) -> dict[str, torch.Tensor]:
    values, ids, states, lengths = [], [], [], []
    device = target.model.device
    for start in range(rows.start, rows.stop, batch_size):
        batch_rows = [{"input_ids": dataset[i]["input_ids"], "loss_mask": [0] * len(dataset[i]["input_ids"])}
                      for i in range(start, min(start + batch_size, rows.stop))]
        batch = pad_batch(batch_rows, pad_id=0)
        logits, h = teacher_forward(target.model, batch["input_ids"].to(device), batch["attention_mask"].to(device),
                                    want_hidden=hidden)
        top = torch.log_softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
        for b, row in enumerate(batch_rows):
            n = len(row["input_ids"])
            values.append(top.values[b, :n].to(dtype).cpu())
            ids.append(top.indices[b, :n].to(torch.int32).cpu())
            if hidden:
                states.append(h[b, :n].to(dtype).cpu())
            lengths.append(n)
    offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    tensors = {"topk_logprobs": torch.cat(values), "topk_ids": torch.cat(ids), "offsets": offsets}
    if hidden:
        tensors["hidden"] = torch.cat(states)
    return tensors


class TeacherCache:
    """Read access to a finished teacher cache; shards are opened lazily, one at a time."""

    def __init__(self, out_dir: Path):
        self.dir = Path(out_dir)
        self.manifest = read_manifest(self.dir, KIND)
        if not self.manifest.get("complete"):
            raise InvalidInputError(f"teacher cache {self.dir} is incomplete; rerun to finish it")
        settings = self.manifest["settings"]
        self.top_k, self.has_hidden = settings["top_k"], settings["hidden"]
        self.shard_size, self._len = settings["shard_size"], settings["num_examples"]
        self._shard: tuple[int, dict] | None = None

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self._len:
            raise IndexError(i)
        shard, local = divmod(i, self.shard_size)
        tensors = self._open(shard)
        start, stop = int(tensors["offsets"][local]), int(tensors["offsets"][local + 1])
        item = {"topk_logprobs": tensors["topk_logprobs"][start:stop].float(),
                "topk_ids": tensors["topk_ids"][start:stop].long()}
        if self.has_hidden:
            item["hidden"] = tensors["hidden"][start:stop].float()
        return item

    def _open(self, shard: int) -> dict[str, torch.Tensor]:
        if self._shard is None or self._shard[0] != shard:
            path = self.dir / shard_file(shard)
            try:
                with safe_open(str(path), framework="pt") as f:
                    tensors = {name: f.get_tensor(name) for name in f.keys()}
            except (OSError, SafetensorError) as exc:
                raise InvalidInputError(f"teacher cache shard {path} is unreadable ({str(exc).splitlines()[0]}); "
                                        "delete the cache directory and rerun") from None
            self._shard = (shard, tensors)
        return self._shard[1]


def sparse_teacher_probs(topk_logprobs: torch.Tensor, topk_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Dense [..., V] probabilities from top-k log-probs, renormalised over the k kept ids."""
    probs = torch.softmax(topk_logprobs.float(), dim=-1)  # renormalises the truncated distribution
    dense = torch.zeros(*topk_logprobs.shape[:-1], vocab_size, device=topk_logprobs.device)
    return dense.scatter_(-1, topk_ids.long(), probs)
