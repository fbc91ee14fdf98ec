"""Teacher signals: what the target says about every position of the training sequences.

Two modes share `teacher_forward`:

    online    the target runs inside each training step (in the trainer)
    offline   `cache_teacher_signals` runs the target once per example and stores its signals

The offline cache is a directory of safetensors shards, `shard_size` examples each:

    shard-00000.safetensors
        topk_logprobs  [N_tok, k] dtype    the target's k largest log-probabilities (log_softmax at
                                           temperature 1) at every position, descending
        topk_ids       [N_tok, k] int32    their token ids
        hidden         [N_tok, H] dtype    the last hidden state (final-norm output, the lm_head's input);
                                           only when cached with hidden=True
        offsets        [n_ex + 1] int64    example j of the shard holds token rows offsets[j]:offsets[j+1]
    manifest.json   settings, target weight hash, tokenizer hash, dataset fingerprint, shards done

Position t's signals describe the target's prediction of token t + 1, as logits[:, t] do. The expected
size is printed before anything is written; shards are written atomically, a rerun with the same
settings resumes, and other settings in the same directory are refused.

A top-k cache keeps a truncated distribution; `sparse_teacher_probs` renormalizes it over the k ids.
"""

from __future__ import annotations

import bisect
import math
import sys
from hashlib import sha256
from pathlib import Path

import datasets
import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from draftsmith.data.collate import pad_batch
from draftsmith.data.manifest import check_run_dir, create_run_dir, read_manifest, shard_range, write_manifest
from draftsmith.speculative.dtypes import DTYPES, dtype_name
from draftsmith.speculative.errors import InvalidInputError, first_line
from draftsmith.speculative.fileio import atomic_file
from draftsmith.speculative.loading import LoadedModel, tokenizer_hash

KIND = "draftsmith-teacher-cache"


@torch.no_grad()
def teacher_forward(
    model,
    input_ids: torch.Tensor,  # [B, L] int64, right-padded
    attention_mask: torch.Tensor,  # [B, L], 1 on real tokens
    *,
    want_hidden: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # logits [B, L, V], hidden [B, L, H] or None
    """The target's logits and (if wanted) last hidden states, without gradients.

    hidden is `hidden_states[-1]`, which in transformers 5 is the final-norm output: lm_head(hidden)
    == logits. no_grad rather than inference_mode, so the outputs may be saved for a student's backward.
    """
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=want_hidden)
    return out.logits, (out.hidden_states[-1] if want_hidden else None)


def cache_teacher_signals(
    target: LoadedModel,
    dataset: datasets.Dataset,
    out_dir: Path,
    *,
    top_k: int = 32,
    hidden: bool = True,
    batch_size: int = 8,
    shard_size: int = 256,
    dtype: torch.dtype = torch.float16,
    progress: bool = True,
) -> "TeacherCache":
    """Cache the target's signals for every example of `dataset` (an input_ids column) in `out_dir`.

    Resumable: a rerun with the same settings skips finished shards; batch_size changes speed only.
    """
    vocab_size, hidden_size = target.model.get_output_embeddings().weight.shape
    _check_args(dataset, top_k, vocab_size, batch_size, shard_size, dtype)
    out_dir = Path(out_dir)
    lengths, fingerprint = _lengths_and_fingerprint(dataset)
    settings = {
        "target": target.name,
        "target_weight_hash": target.weight_hash(),
        "tokenizer_hash": tokenizer_hash(target.tokenizer),
        "top_k": top_k,
        "hidden": bool(hidden),
        "hidden_size": int(hidden_size),
        "vocab_size": int(vocab_size),
        "dtype": dtype_name(dtype),
        "shard_size": shard_size,
        "num_examples": len(dataset),
        "num_tokens": sum(lengths),
        "dataset_fingerprint": fingerprint,
    }
    num_shards = math.ceil(len(dataset) / shard_size)
    manifest = check_run_dir(out_dir, KIND, settings)
    if manifest is not None and manifest["complete"]:
        return TeacherCache(out_dir)
    print(size_line(len(dataset), sum(lengths), top_k, hidden_size if hidden else None, dtype, num_shards),
          file=sys.stderr)
    manifest = manifest or create_run_dir(out_dir, KIND, settings, num_shards)
    done = {s for s in manifest["shards_done"] if (out_dir / shard_file(s)).is_file()}
    if done:
        print(f"teacher cache: resuming, {len(done)}/{num_shards} shards done in {out_dir}", file=sys.stderr)
    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    done_examples = sum(len(shard_range(s, shard_size, len(dataset))) for s in done)
    with tqdm(total=len(dataset), initial=done_examples, unit="ex", desc="teacher signals",
              disable=not progress, file=sys.stderr) as bar:
        for shard in range(num_shards):
            if shard in done:
                continue
            rows = shard_range(shard, shard_size, len(dataset))
            tensors = _shard_tensors(target.model, dataset, rows, top_k, hidden, batch_size, dtype, pad_id, bar)
            with atomic_file(out_dir / shard_file(shard)) as scratch:
                save_file(tensors, str(scratch), metadata={"examples": f"{rows.start}:{rows.stop}"})
            done.add(shard)
            manifest["shards_done"] = sorted(done)
            write_manifest(out_dir, manifest)
    manifest["complete"] = True
    write_manifest(out_dir, manifest)
    return TeacherCache(out_dir)


def size_line(examples: int, tokens: int, top_k: int, hidden_size: int | None, dtype: torch.dtype,
              num_shards: int = 1) -> str:
    """The one-line size estimate printed before caching: exact tensor bytes, headers left out."""
    width = torch.finfo(dtype).bits // 8
    per_token = top_k * (width + 4) + (hidden_size * width if hidden_size else 0)
    total = tokens * per_token + 8 * (examples + num_shards)
    what = f"top-{top_k} log-probs" + (f" + {hidden_size}-d hidden states" if hidden_size else "")
    return (f"teacher cache: {examples:,} examples, {tokens:,} tokens, {what} in {dtype_name(dtype)} "
            f"= {_human_bytes(total)}")


def shard_file(shard: int) -> str:
    return f"shard-{shard:05d}.safetensors"


def sparse_teacher_probs(
    topk_logprobs: torch.Tensor,  # [..., k]
    topk_ids: torch.Tensor,  # [..., k] integer ids in 0..V-1
    vocab_size: int,
) -> torch.Tensor:  # [..., V] float32
    """Dense probabilities from a top-k cache: the truncated distribution renormalized over its k ids
    (softmax of the k log-probs), 0 elsewhere. Each row sums to 1."""
    probs = torch.softmax(topk_logprobs.float(), dim=-1)
    dense = torch.zeros(*topk_logprobs.shape[:-1], vocab_size, device=topk_logprobs.device)
    return dense.scatter_(-1, topk_ids.long(), probs)


class TeacherCache:
    """Read access to a finished cache: `cache[i]` holds example i's signals.

    Items: topk_logprobs [L, k] float32, topk_ids [L, k] int64 and, when cached, hidden [L, H]
    float32, L = len(input_ids[i]). Shards are memory-mapped on demand (one open at a time) and only
    the example's rows are read. Opening checks the manifest and every shard's header, so a missing or
    corrupt file is reported at once, by name.
    """

    def __init__(self, out_dir: Path):
        self.dir = Path(out_dir)
        self.manifest = read_manifest(self.dir, KIND)
        settings = self.manifest["settings"]
        if not self.manifest["complete"]:
            raise InvalidInputError(
                f"teacher cache {self.dir} is unfinished ({len(self.manifest['shards_done'])}/"
                f"{self.manifest['num_shards']} shards); rerun cache_teacher_signals to finish it"
            )
        self.top_k: int = settings["top_k"]
        self.has_hidden: bool = settings["hidden"]
        self.hidden_size: int = settings["hidden_size"]
        self.vocab_size: int = settings["vocab_size"]
        self.shard_size: int = settings["shard_size"]
        self._len: int = settings["num_examples"]
        self._open: tuple[int, object, list[int]] | None = None  # (shard, safe_open handle, offsets)
        for shard in range(self.manifest["num_shards"]):
            self._check_shard(shard)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        i = int(i)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"teacher cache index {i} out of range for {self._len} examples")
        shard, local = divmod(i, self.shard_size)
        handle, offsets = self._shard(shard)
        start, stop = offsets[local], offsets[local + 1]
        item = {
            "topk_logprobs": handle.get_slice("topk_logprobs")[start:stop].float(),
            "topk_ids": handle.get_slice("topk_ids")[start:stop].long(),
        }
        if self.has_hidden:
            item["hidden"] = handle.get_slice("hidden")[start:stop].float()
        return item

    def __getstate__(self) -> dict:
        # A safe_open handle cannot be pickled (DataLoader workers); each copy reopens its own.
        return {**self.__dict__, "_open": None}

    def _shard(self, shard: int):
        if self._open is None or self._open[0] != shard:
            path = self.dir / shard_file(shard)
            try:
                handle = safe_open(str(path), framework="pt")
                offsets = handle.get_tensor("offsets").tolist()
            except (OSError, SafetensorError) as exc:
                raise self._corrupt(path, exc) from None
            self._open = (shard, handle, offsets)
        return self._open[1], self._open[2]

    def _check_shard(self, shard: int) -> None:
        path = self.dir / shard_file(shard)
        if not path.is_file():
            raise InvalidInputError(f"teacher cache shard {path} is missing; delete {self.dir} and rerun")
        examples = len(shard_range(shard, self.shard_size, self._len))
        try:
            with safe_open(str(path), framework="pt") as f:
                shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
        except (OSError, SafetensorError) as exc:
            raise self._corrupt(path, exc) from None
        expected = {"topk_logprobs": self.top_k, "topk_ids": self.top_k}
        if self.has_hidden:
            expected["hidden"] = self.hidden_size
        tokens = shapes.get("topk_logprobs", [None])[0]
        wrong = shapes.get("offsets") != [examples + 1] or any(
            shapes.get(name) != [tokens, width] for name, width in expected.items()
        )
        if wrong:
            raise self._corrupt(path, ValueError("tensors missing or of the wrong shape"))

    def _corrupt(self, path: Path, exc: BaseException) -> InvalidInputError:
        return InvalidInputError(f"teacher cache shard {path} is unreadable or corrupt ({first_line(exc)}); "
                                 f"delete {self.dir} and rerun")


# --- computing one shard -----------------------------------------------------------------------


class ConcatTeacher:
    """Finished caches read as one, in order: item i of the concatenation of the datasets they cache."""

    def __init__(self, caches: list[TeacherCache]):
        settings = {(c.top_k, c.has_hidden, c.hidden_size, c.vocab_size) for c in caches}
        if len(settings) != 1:
            raise InvalidInputError(f"teacher caches with different settings cannot be read as one: {settings}")
        self.caches = caches
        self.top_k, self.has_hidden, self.hidden_size, self.vocab_size = settings.pop()
        self._starts = np.cumsum([0] + [len(c) for c in caches]).tolist()

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        i = int(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"teacher cache index {i} out of range for {len(self)} examples")
        part = bisect.bisect_right(self._starts, i) - 1
        return self.caches[part][i - self._starts[part]]


def _shard_tensors(model, dataset, rows: range, top_k: int, hidden: bool, batch_size: int, dtype: torch.dtype,
                   pad_id: int, bar) -> dict[str, torch.Tensor]:
    """The shard's tensors, examples in dataset order; batched by length for less padding."""
    sequences = dataset[rows.start: rows.stop]["input_ids"]
    order = sorted(range(len(sequences)), key=lambda j: len(sequences[j]))
    per_example: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = [None] * len(sequences)
    device = next(model.parameters()).device
    for begin in range(0, len(order), batch_size):
        chunk = order[begin: begin + batch_size]
        batch = pad_batch([{"input_ids": sequences[j]} for j in chunk], pad_id)
        logits, states = teacher_forward(model, batch["input_ids"].to(device), batch["attention_mask"].to(device),
                                         want_hidden=hidden)
        for b, j in enumerate(chunk):
            n = len(sequences[j])
            # Row by row: a float32 copy of the whole batch's [B, L, V] logits would double the peak memory.
            top = torch.log_softmax(logits[b, :n].float(), dim=-1).topk(top_k, dim=-1)  # [n, k]
            per_example[j] = (
                top.values.to(dtype).cpu(),
                top.indices.to(torch.int32).cpu(),
                states[b, :n].to(dtype).cpu() if hidden else None,
            )
        bar.update(len(chunk))
    lengths = torch.tensor([0] + [len(s) for s in sequences], dtype=torch.int64)
    tensors = {
        "topk_logprobs": torch.cat([e[0] for e in per_example]).contiguous(),
        "topk_ids": torch.cat([e[1] for e in per_example]).contiguous(),
        "offsets": lengths.cumsum(0),
    }
    if hidden:
        tensors["hidden"] = torch.cat([e[2] for e in per_example]).contiguous()
    return tensors


def _lengths_and_fingerprint(dataset: datasets.Dataset) -> tuple[list[int], str]:
    """Token count of every example, and sha256 over all input_ids in order."""
    digest, lengths = sha256(), []
    for batch in dataset.select_columns(["input_ids"]).iter(batch_size=1000):
        for ids in batch["input_ids"]:
            if len(ids) == 0:
                raise InvalidInputError(f"example {len(lengths)} of the dataset has no input_ids")
            lengths.append(len(ids))
            digest.update(len(ids).to_bytes(8, "little"))
            digest.update(np.asarray(ids, dtype=np.int64).tobytes())
    return lengths, digest.hexdigest()


def _check_args(dataset, top_k, vocab_size, batch_size, shard_size, dtype) -> None:
    if not isinstance(dataset, datasets.Dataset) or "input_ids" not in dataset.column_names:
        raise InvalidInputError("teacher signals need a tokenized Dataset with an input_ids column")
    if len(dataset) == 0:
        raise InvalidInputError("no examples to cache teacher signals for")
    if not isinstance(top_k, int) or not 1 <= top_k <= vocab_size:
        raise InvalidInputError(f"top_k must be in 1..{vocab_size} (the vocabulary size), got {top_k!r}")
    for name, value in (("batch_size", batch_size), ("shard_size", shard_size)):
        if not isinstance(value, int) or value < 1:
            raise InvalidInputError(f"{name} must be a positive integer, got {value!r}")
    if dtype not in DTYPES.values():
        raise InvalidInputError(f"teacher cache dtype must be one of {', '.join(DTYPES)}, got {dtype}")


def _human_bytes(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")
