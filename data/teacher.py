"""Teacher signals: what the target says about every position of the training sequences.

Two modes:

    online    the target runs inside each training step (in the trainer)
    offline   `cache_teacher_signals` runs the target once per example and stores its signals

The offline cache is a directory of safetensors shards, `shard_size` examples each (by default as many
as fit in SHARD_BYTES at the longest example's length, at most MAX_SHARD_EXAMPLES):

    shard-00000.safetensors
        topk_logprobs  [N_tok, k] dtype    the target's k largest log-probabilities (log_softmax at
                                           temperature 1) at every position, descending
        topk_ids       [N_tok, k] int32    their token ids
        hidden         [N_tok, H] dtype    the last hidden state (final-norm output, the lm_head's input);
                                           only when cached with hidden=True
        states         [N_tok, n*H] dtype  the states entering the n target layers `layers` (transformers'
                                           `hidden_states[i]`), concatenated in that order; only when
                                           cached with layers (EAGLE-3 reads three of them)
        offsets        [n_ex + 1] int64    example j of the shard holds token rows offsets[j]:offsets[j+1]
    manifest.json   settings, target weight hash, tokenizer hash, dataset fingerprint, shards done

Position t's signals describe the target's prediction of token t + 1, as logits[:, t] do. The expected
size is printed before anything is written; shards are written atomically, a rerun with the same
settings resumes (redoing a finished shard whose file is damaged), and other settings in the same
directory are refused.

Memory is bounded by the shard, whatever the data size. Writing holds one shard's tensors (allocated
once) and one batch's last hidden states; the log-probs come from the lm_head over POSITIONS positions
at a time, never a [batch, length, vocab] logits tensor. Reading maps one shard file at a time and
copies out only the rows asked for (`TeacherCache.padded` builds a batch in the stored dtype).

`teacher_signals` is what training calls: it names a cache by its data and the signals asked for, and
reuses any finished cache of the same target, tokenizer and data that holds at least those signals (a
recipe wanting top-8 log-probs reads a top-32 cache with hidden states), so recipes share one pass.

A top-k cache keeps a truncated distribution; `sparse_teacher_probs` renormalizes it over the k ids.
"""

from __future__ import annotations

import bisect
import math
import sys
from collections.abc import Iterable, Sequence
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
SHARD_BYTES = 256 * 2**20  # a shard's tensors at most, unless one example alone is larger
MAX_SHARD_EXAMPLES = 256
POSITIONS = 256  # positions whose [POSITIONS, vocab] logits exist at once while caching
FIELDS = ("topk_logprobs", "topk_ids", "hidden", "states")
RERUN = "rerun the caching (the same command) to compute it again"


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
    # Only the state it returns is kept (transformers >= 5.25 selects by index), not every layer's.
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=[-1] if want_hidden else False)
    return out.logits, (out.hidden_states[-1] if want_hidden else None)


def cache_teacher_signals(
    target: LoadedModel,
    dataset: datasets.Dataset,
    out_dir: Path,
    *,
    top_k: int = 32,
    hidden: bool = True,
    layers: tuple[int, ...] = (),
    batch_size: int = 8,
    shard_size: int | None = None,
    dtype: torch.dtype = torch.float16,
    progress: bool = True,
) -> "TeacherCache":
    """Cache the target's signals for every example of `dataset` (an input_ids column) in `out_dir`.

    layers: indices into the target's `hidden_states` (0 the embeddings, i the state entering layer i)
    whose states are stored too, as `states`. Resumable: a rerun with the same settings skips finished
    shards; batch_size changes speed only. shard_size None: the most examples of the longest length that
    fit in SHARD_BYTES (1..MAX_SHARD_EXAMPLES).
    """
    _check_args(dataset, top_k, target.model.get_output_embeddings().weight.shape[0], batch_size, shard_size, dtype)
    out_dir = Path(out_dir)
    settings = _settings(target, dataset, top_k, hidden, _checked_layers(layers, target), dtype, shard_size)
    return _write_cache(target, dataset, out_dir, settings, batch_size, progress)


def teacher_signals(
    target: LoadedModel,
    dataset: datasets.Dataset,
    root: Path,
    name: str,
    *,
    top_k: int = 32,
    hidden: bool = True,
    layers: tuple[int, ...] = (),
    batch_size: int = 8,
    dtype: torch.dtype = torch.float16,
    progress: bool = True,
    reuse: Iterable[tuple[Path, Sequence[Sequence[int]]]] = (),
) -> "TeacherCache":
    """The signals of `dataset` from a cache under `root` named `name-k*`, computed only when none has them.

    `name` stands for the data (training calls it with a hash of the target and the data settings). In
    order: a finished cache of the same target, tokenizer and token ids that holds at least these signals
    (>= top_k log-probs, hidden states if asked, the states of `layers` if asked, all in `dtype`; the
    smallest such) is read as it is, through a view of just these signals; a cache with exactly these
    settings is resumed; else the signals are cached in `root / name-k<top_k>-<signals>-<dtype>`.
    `reuse`: (directory, the token ids of its examples in order) of other finished caches: an example
    whose ids one of them holds, with at least these signals, is copied from it, not computed again
    (adding prompts to a recipe computes only the new rows' signals)."""
    _check_args(dataset, top_k, target.model.get_output_embeddings().weight.shape[0], batch_size, None, dtype)
    layers = _checked_layers(layers, target)
    settings = _settings(target, dataset, top_k, hidden, layers, dtype, None)
    found, finished = _find_cache(Path(root), name, settings)
    if finished:
        return TeacherCache(found, top_k=top_k, hidden=hidden, layers=layers)
    out_dir = found or Path(root) / f"{name}-k{top_k}-{_signals_tag(hidden, layers, dtype)}"
    return _write_cache(target, dataset, out_dir, settings, batch_size, progress, reuse)


def _settings(target: LoadedModel, dataset: datasets.Dataset, top_k: int, hidden: bool, layers: list[int],
              dtype: torch.dtype, shard_size: int | None) -> dict:
    """What decides a cache's contents: its manifest's settings."""
    vocab_size, hidden_size = target.model.get_output_embeddings().weight.shape
    tokens, longest, fingerprint = _token_stats(dataset)
    if shard_size is None:
        shard_size = default_shard_size(longest, top_k, _token_width(hidden, layers, hidden_size), dtype)
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
        "num_tokens": tokens,
        "dataset_fingerprint": fingerprint,
    }
    if layers:  # (absent when none, so the manifests written before this option still match)
        settings["layers"] = list(layers)
    return settings


def _checked_layers(layers, target: LoadedModel) -> list[int]:
    """`layers` as a list of distinct indices into `hidden_states` (0..num_hidden_layers; the last, the
    final-norm output, is `hidden`), else a one-line InvalidInputError."""
    top = target.model.config.num_hidden_layers
    try:
        layers = [int(i) for i in layers]
    except (TypeError, ValueError):
        raise InvalidInputError(f"teacher cache layers must be integers, got {layers!r}") from None
    if len(set(layers)) != len(layers) or not all(0 <= i < top for i in layers):
        raise InvalidInputError(f"teacher cache layers must be distinct indices in 0..{top - 1} (states entering "
                                f"those layers of {target.name}), got {layers}")
    return layers


def _token_width(hidden: bool, layers: list[int], hidden_size: int) -> int:
    """The state elements stored per token: the last hidden state and those of `layers`."""
    return (int(hidden) + len(layers)) * hidden_size


def _write_cache(target: LoadedModel, dataset: datasets.Dataset, out_dir: Path, settings: dict, batch_size: int,
                 progress: bool, reuse=()) -> "TeacherCache":
    top_k, hidden, shard_size = settings["top_k"], settings["hidden"], settings["shard_size"]
    layers, dtype = settings.get("layers", []), DTYPES[settings["dtype"]]
    num_shards = math.ceil(len(dataset) / shard_size)
    manifest = check_run_dir(out_dir, KIND, settings)
    damaged = _damaged_shards(out_dir, manifest) if manifest is not None else {}
    if manifest is not None and manifest["complete"] and not damaged:
        return TeacherCache(out_dir)
    print(size_line(len(dataset), settings["num_tokens"], top_k, settings["hidden_size"] if hidden else None, dtype,
                    num_shards, layers), file=sys.stderr)
    manifest = manifest or create_run_dir(out_dir, KIND, settings, num_shards)
    for problem in damaged.values():
        print(f"teacher cache: {problem}; computing it again", file=sys.stderr)
    done = set(manifest["shards_done"]) - set(damaged)
    manifest["complete"] = manifest["complete"] and not damaged
    if done:
        print(f"teacher cache: resuming, {len(done)}/{num_shards} shards done in {out_dir}", file=sys.stderr)
    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    done_examples = sum(len(shard_range(s, shard_size, len(dataset))) for s in done)
    donors = _donor_rows(reuse, settings, out_dir)
    copied = [0]
    with tqdm(total=len(dataset), initial=done_examples, unit="ex", desc="teacher signals",
              disable=not progress, file=sys.stderr) as bar:
        for shard in range(num_shards):
            if shard in done:
                continue
            rows = shard_range(shard, shard_size, len(dataset))
            tensors = _shard_tensors(target.model, dataset, rows, top_k, hidden, layers, batch_size, dtype, pad_id, bar,
                                     donors, copied)
            with atomic_file(out_dir / shard_file(shard)) as scratch:
                save_file(tensors, str(scratch), metadata={"examples": f"{rows.start}:{rows.stop}"})
            done.add(shard)
            manifest["shards_done"] = sorted(done)
            write_manifest(out_dir, manifest)
    if copied[0]:
        print(f"teacher cache: {copied[0]} of {len(dataset) - done_examples} examples copied from other caches "
              "(the same token ids, the same target)", file=sys.stderr)
    manifest["complete"] = True
    write_manifest(out_dir, manifest)
    return TeacherCache(out_dir)


def size_line(examples: int, tokens: int, top_k: int, hidden_size: int | None, dtype: torch.dtype,
              num_shards: int = 1, layers: list[int] = (), state_size: int | None = None) -> str:
    """The one-line size estimate printed before caching: exact tensor bytes, headers left out.
    hidden_size None: no last hidden states; `layers` states of state_size (default hidden_size) each."""
    width = torch.finfo(dtype).bits // 8
    state_size = state_size or hidden_size
    per_token = top_k * (width + 4) + ((hidden_size or 0) + len(layers) * (state_size or 0)) * width
    total = tokens * per_token + 8 * (examples + num_shards)
    what = f"top-{top_k} log-probs" + (f" + {hidden_size}-d hidden states" if hidden_size else "")
    what += f" + states entering layers {list(layers)}" if layers else ""
    return (f"teacher cache: {examples:,} examples, {tokens:,} tokens, {what} in {dtype_name(dtype)} "
            f"= {_human_bytes(total)}")


def shard_file(shard: int) -> str:
    return f"shard-{shard:05d}.safetensors"


def default_shard_size(longest: int, top_k: int, state_width: int | None, dtype: torch.dtype) -> int:
    """Examples per shard: as many of `longest` tokens as fit in SHARD_BYTES, 1..MAX_SHARD_EXAMPLES.
    state_width: the state elements stored per token (hidden and inner-layer states), None for none."""
    width = torch.finfo(dtype).bits // 8
    per_example = longest * (top_k * (width + 4) + (state_width * width if state_width else 0))
    return max(1, min(MAX_SHARD_EXAMPLES, SHARD_BYTES // per_example))


def _signals_tag(hidden: bool, layers: list[int], dtype: torch.dtype) -> str:
    states = "-layers-" + "_".join(map(str, layers)) if layers else ""
    return f"{'hidden' if hidden else 'logprobs'}{states}-{dtype_name(dtype)}"


def _find_cache(root: Path, name: str, settings: dict) -> tuple[Path | None, bool]:
    """The cache under `root` to use for `settings`: (the smallest finished, whole one that covers them,
    True), else (one with exactly these settings, to resume or repair, False), else (None, False).
    Directories that hold no readable teacher cache manifest are passed over."""
    same_data = ("num_examples", "num_tokens", "dataset_fingerprint")  # (the same target: `_holds_signals`)
    covering, exact = [], None
    for path in sorted(root.glob(f"{name}-k*")):
        try:
            manifest = read_manifest(path, KIND)
        except InvalidInputError:
            continue
        have = manifest["settings"]
        if have == settings:
            exact = path
        if manifest["complete"] and all(have.get(k) == settings[k] for k in same_data) and \
                _holds_signals(have, settings) and not _damaged_shards(path, manifest):
            covering.append((have["top_k"], bool(have["hidden"]), len(have.get("layers", [])), str(path)))
    if covering:
        return Path(min(covering)[-1]), True
    return exact, False


def _holds_signals(have: dict, wanted: dict) -> bool:
    """Whether a cache with settings `have` holds at least the signals `wanted` asks for, of the same target
    in the same dtype: >= top_k log-probs, hidden states if asked, the states of every layer asked."""
    return (all(have.get(k) == wanted[k] for k in ("target_weight_hash", "tokenizer_hash", "vocab_size",
                                                   "hidden_size", "dtype"))
            and have.get("top_k", 0) >= wanted["top_k"] and (have.get("hidden") or not wanted["hidden"])
            and set(wanted.get("layers", [])) <= set(have.get("layers", [])))


def _donor_rows(reuse, settings: dict, out_dir: Path) -> dict[bytes, tuple["TeacherCache", int]]:
    """sequence key -> (a finished cache holding at least `settings`' signals, its example index), from the
    `reuse` pairs (directory, its examples' token ids). Unreadable, unfinished or other caches, and a
    pair whose ids do not match the cache's example count, give nothing; `out_dir` itself is skipped."""
    rows: dict[bytes, tuple[TeacherCache, int]] = {}
    for directory, sequences in reuse:
        directory = Path(directory)
        if not directory.is_dir() or directory.resolve() == Path(out_dir).resolve():
            continue
        try:
            manifest = read_manifest(directory, KIND)
            if not (manifest["complete"] and _holds_signals(manifest["settings"], settings)
                    and manifest["settings"]["num_examples"] == len(sequences)):
                continue
            cache = TeacherCache(directory, top_k=settings["top_k"], hidden=settings["hidden"],
                                 layers=settings.get("layers"))
        except InvalidInputError:
            continue
        for i, ids in enumerate(sequences):
            rows.setdefault(_sequence_key(ids), (cache, i))
    return rows


def _sequence_key(ids: Sequence[int]) -> bytes:
    return sha256(np.asarray(ids, dtype=np.int64).tobytes()).digest()


def _damaged_shards(out_dir: Path, manifest: dict) -> dict[int, str]:
    """The shards the manifest calls done whose files are not whole (headers checked), with what is wrong."""
    settings = manifest["settings"]
    hidden_size = settings["hidden_size"] if settings["hidden"] else None
    states_size = len(settings.get("layers", [])) * settings["hidden_size"] or None
    damaged = {}
    for shard in manifest["shards_done"]:
        examples = len(shard_range(shard, settings["shard_size"], settings["num_examples"]))
        try:
            check_shard(out_dir / shard_file(shard), examples, settings["top_k"], hidden_size, states_size)
        except InvalidInputError as exc:
            damaged[shard] = str(exc)
    return damaged


def check_shard(path: Path, examples: int, top_k: int, hidden_size: int | None, states_size: int | None = None) -> None:
    """A one-line InvalidInputError unless `path` is a readable shard of `examples` examples with top_k
    log-probs and ids (and hidden states of hidden_size, inner-layer states of states_size, if not None)
    for the same tokens."""
    if not path.is_file():
        raise InvalidInputError(f"teacher cache shard {path} is missing")
    try:
        with safe_open(str(path), framework="pt") as f:
            shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    except (OSError, SafetensorError) as exc:
        raise InvalidInputError(f"teacher cache shard {path} is unreadable or corrupt ({first_line(exc)})") from None
    expected = {"topk_logprobs": top_k, "topk_ids": top_k}
    if hidden_size is not None:
        expected["hidden"] = hidden_size
    if states_size is not None:
        expected["states"] = states_size
    tokens = shapes.get("topk_logprobs", [None])[0]
    if shapes.get("offsets") != [examples + 1] or any(shapes.get(n) != [tokens, w] for n, w in expected.items()):
        raise InvalidInputError(f"teacher cache shard {path} is unreadable or corrupt (tensors missing or of "
                                "the wrong shape)")


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

    Items: topk_logprobs [L, k] float32, topk_ids [L, k] int64 and, when cached, hidden [L, H] and
    states [L, len(layers) * H] float32, L = len(input_ids[i]); `field` and `padded` give the same in the stored dtypes. Shards are
    memory-mapped on demand (one open at a time, so resident memory is bounded by a shard) and only the
    example's rows are read. Opening checks the manifest and every shard's header, so a missing or
    corrupt file is reported at once, by name.

    top_k, hidden: a view of fewer signals than the cache holds (its first top_k log-probs; no hidden
    states), for a recipe that reuses a larger cache (`teacher_signals`). None: all it holds. layers: the
    inner-layer states a reader needs, checked to be there; `layers` always lists all the cache holds, in
    the order of the `states` columns (`state_columns` finds a layer's).
    """

    def __init__(self, out_dir: Path, *, top_k: int | None = None, hidden: bool | None = None,
                 layers: list[int] | None = None):
        self.dir = Path(out_dir)
        self.manifest = read_manifest(self.dir, KIND)
        settings = self.manifest["settings"]
        if not self.manifest["complete"]:
            raise InvalidInputError(
                f"teacher cache {self.dir} is unfinished ({len(self.manifest['shards_done'])}/"
                f"{self.manifest['num_shards']} shards); rerun cache_teacher_signals to finish it"
            )
        if top_k is not None and not 1 <= top_k <= settings["top_k"]:
            raise InvalidInputError(f"teacher cache {self.dir} holds top-{settings['top_k']} log-probs, not {top_k}")
        if hidden and not settings["hidden"]:
            raise InvalidInputError(f"teacher cache {self.dir} holds no hidden states")
        self.layers: list[int] = list(settings.get("layers", []))
        if layers and not set(layers) <= set(self.layers):
            raise InvalidInputError(f"teacher cache {self.dir} holds the states of layers {self.layers}, not "
                                    f"{sorted(set(layers) - set(self.layers))}")
        self._stored = settings
        self.top_k: int = top_k or settings["top_k"]
        self.has_hidden: bool = settings["hidden"] if hidden is None else hidden
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
        item = {"topk_logprobs": self.field(i, "topk_logprobs").float(), "topk_ids": self.field(i, "topk_ids").long()}
        if self.has_hidden:
            item["hidden"] = self.field(i, "hidden").float()  # (copies: an item never pins the mapped file)
        if self.layers:
            item["states"] = self.field(i, "states").float()
        return item

    def state_columns(self, layer: int) -> slice:
        """The columns of `states` that hold the state entering `layer`."""
        return _state_columns(self.layers, layer, self.hidden_size)

    def field(self, i: int, name: str) -> torch.Tensor:
        """Example i's rows of one signal as stored: topk_logprobs [L, top_k] and hidden [L, H] in the
        cache's dtype, topk_ids [L, top_k] int32, states [L, len(layers) * H]. A copy, which holds no part
        of the mapped file."""
        return self._rows(i, name).clone(memory_format=torch.contiguous_format)

    def _rows(self, i: int, name: str) -> torch.Tensor:
        # A view of the mapped shard file (safetensors' slices share its pages): to be copied, not kept.
        i = _checked_index(i, self._len)
        if name not in FIELDS or (name == "hidden" and not self.has_hidden) or (name == "states" and not self.layers):
            raise KeyError(f"teacher cache {self.dir} has no {name!r} signal here")
        shard, local = divmod(i, self.shard_size)
        handle, offsets = self._shard(shard)
        rows = handle.get_slice(name)
        start, stop = offsets[local], offsets[local + 1]
        try:
            return rows[start:stop] if name in ("hidden", "states") else rows[start:stop, : self.top_k]
        except SafetensorError as exc:  # the header was whole, the data behind it is not
            raise self._corrupt(self.dir / shard_file(shard), exc) from None

    def padded(self, indices: list[int], name: str, length: int | None = None) -> torch.Tensor:
        """[B, length, width]: `field` of each example in `indices`, zero-padded (or cut) to `length`
        (default: the longest), in the stored dtype; what a training batch reads."""
        return _padded(self, indices, name, length)

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
        examples = len(shard_range(shard, self.shard_size, self._len))
        hidden_size = self.hidden_size if self._stored["hidden"] else None
        try:
            check_shard(self.dir / shard_file(shard), examples, self._stored["top_k"], hidden_size,
                        len(self.layers) * self.hidden_size or None)
        except InvalidInputError as exc:
            raise InvalidInputError(f"{exc}; {RERUN}") from None

    def _corrupt(self, path: Path, exc: BaseException) -> InvalidInputError:
        return InvalidInputError(f"teacher cache shard {path} is unreadable or corrupt ({first_line(exc)}); {RERUN}")


class ConcatTeacher:
    """Finished caches read as one, in order: item i of the concatenation of the datasets they cache."""

    def __init__(self, caches: list[TeacherCache]):
        settings = {(c.top_k, c.has_hidden, c.hidden_size, c.vocab_size, tuple(c.layers)) for c in caches}
        if len(settings) != 1:
            raise InvalidInputError(f"teacher caches with different settings cannot be read as one: {settings}")
        self.caches = caches
        self.top_k, self.has_hidden, self.hidden_size, self.vocab_size, layers = settings.pop()
        self.layers = list(layers)
        self._starts = np.cumsum([0] + [len(c) for c in caches]).tolist()

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        part, local = self._locate(i)
        return self.caches[part][local]

    def field(self, i: int, name: str) -> torch.Tensor:
        part, local = self._locate(i)
        return self.caches[part].field(local, name)

    def _rows(self, i: int, name: str) -> torch.Tensor:
        part, local = self._locate(i)
        return self.caches[part]._rows(local, name)

    def padded(self, indices: list[int], name: str, length: int | None = None) -> torch.Tensor:
        return _padded(self, indices, name, length)

    def state_columns(self, layer: int) -> slice:
        return _state_columns(self.layers, layer, self.hidden_size)

    def _locate(self, i: int) -> tuple[int, int]:
        i = _checked_index(i, len(self))
        part = bisect.bisect_right(self._starts, i) - 1
        return part, i - self._starts[part]


def _checked_index(i: int, length: int) -> int:
    i = int(i)
    if i < 0:
        i += length
    if not 0 <= i < length:
        raise IndexError(f"teacher cache index {i} out of range for {length} examples")
    return i


def _state_columns(layers: list[int], layer: int, hidden_size: int) -> slice:
    if layer not in layers:
        raise KeyError(f"the teacher cache holds no states of layer {layer} (it holds {layers})")
    k = layers.index(layer)
    return slice(k * hidden_size, (k + 1) * hidden_size)


def _padded(reader, indices: list[int], name: str, length: int | None) -> torch.Tensor:
    # In index order, so that rows of one shard are read while it is open.
    rows: list[torch.Tensor | None] = [None] * len(indices)
    for b in sorted(range(len(indices)), key=lambda b: int(indices[b])):
        rows[b] = reader._rows(indices[b], name)
    length = max(r.shape[0] for r in rows) if length is None else length
    out = rows[0].new_zeros(len(rows), length, rows[0].shape[1])
    for b, r in enumerate(rows):
        out[b, : min(r.shape[0], length)] = r[:length]
    return out


# --- computing one shard -----------------------------------------------------------------------


def _shard_tensors(model, dataset, rows: range, top_k: int, hidden: bool, layers: list[int], batch_size: int,
                   dtype: torch.dtype, pad_id: int, bar, donors: dict | None = None,
                   copied: list[int] | None = None) -> dict[str, torch.Tensor]:
    """The shard's tensors, examples in dataset order; batched by length for less padding.

    The tensors are allocated once at their final size and filled batch by batch; the log-probs come from
    the lm_head over POSITIONS positions at a time (`teacher_at_positions`). An example whose token ids
    are in `donors` (`_donor_rows`) is copied from that cache instead; `copied` counts them."""
    sequences = dataset[rows.start: rows.stop]["input_ids"]
    offsets = torch.tensor([0] + [len(s) for s in sequences], dtype=torch.int64).cumsum(0)
    tokens = int(offsets[-1])
    lm_head = model.get_output_embeddings()
    tensors = {"topk_logprobs": torch.empty(tokens, top_k, dtype=dtype),
               "topk_ids": torch.empty(tokens, top_k, dtype=torch.int32), "offsets": offsets}
    width = lm_head.weight.shape[1]
    if hidden:
        tensors["hidden"] = torch.empty(tokens, width, dtype=dtype)
    if layers:
        tensors["states"] = torch.empty(tokens, len(layers) * width, dtype=dtype)
    todo, copied = [], [0] if copied is None else copied
    for j, ids in enumerate(sequences):
        donor = donors.get(_sequence_key(ids)) if donors else None
        if donor is None:
            todo.append(j)
            continue
        cache, i = donor
        start, stop = int(offsets[j]), int(offsets[j + 1])
        tensors["topk_logprobs"][start:stop] = cache.field(i, "topk_logprobs")
        tensors["topk_ids"][start:stop] = cache.field(i, "topk_ids")
        if hidden:
            tensors["hidden"][start:stop] = cache.field(i, "hidden")
        if layers:
            states = cache.field(i, "states")
            for n, layer in enumerate(layers):
                tensors["states"][start:stop, n * width: (n + 1) * width] = states[:, cache.state_columns(layer)]
        copied[0] += 1
        bar.update(1)
    order = sorted(todo, key=lambda j: len(sequences[j]))
    device = next(model.parameters()).device
    for begin in range(0, len(order), batch_size):
        chunk = order[begin: begin + batch_size]
        batch = pad_batch([{"input_ids": sequences[j]} for j in chunk], pad_id)
        states, inner = teacher_states(model, batch["input_ids"].to(device), batch["attention_mask"].to(device),
                                       layers)
        for b, j in enumerate(chunk):
            start, stop = int(offsets[j]), int(offsets[j + 1])
            values, ids = teacher_at_positions(lm_head, states[b, : stop - start], top_k)
            tensors["topk_logprobs"][start:stop] = values
            tensors["topk_ids"][start:stop] = ids
            if hidden:
                tensors["hidden"][start:stop] = states[b, : stop - start]
            if layers:
                tensors["states"][start:stop] = inner[b, : stop - start]
        bar.update(len(chunk))
    return tensors


@torch.no_grad()
def teacher_states(
    model,
    input_ids: torch.Tensor,  # [B, L] int64, right-padded
    attention_mask: torch.Tensor,  # [B, L], 1 on real tokens
    layers: list[int] = (),
) -> tuple[torch.Tensor, torch.Tensor | None]:  # [B, L, H], [B, L, len(layers) * H] or None
    """The target's last hidden states (the final-norm output, `teacher_forward`'s hidden) without its
    logits: lm_head(states) are the logits, as the online teacher computes them (train/loop.py); and the
    states entering `layers` (`hidden_states[i]`), concatenated, when any are asked for."""
    out = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                              output_hidden_states=list(layers) if layers else False)  # those states only
    inner = torch.cat([out.hidden_states[i] for i in layers], dim=-1) if layers else None
    return out.last_hidden_state, inner


@torch.no_grad()
def teacher_at_positions(
    lm_head: torch.nn.Module,
    states: torch.Tensor,  # [n, H] one example's last hidden states
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # values [n, k] float32, descending; ids [n, k] int64
    """The k largest log-probabilities (log_softmax at temperature 1) at each position, and their ids,
    from the lm_head over POSITIONS positions at a time: [POSITIONS, vocab] float32 logits at most."""
    parts = [torch.log_softmax(lm_head(states[p: p + POSITIONS]).float(), dim=-1).topk(top_k, dim=-1)
             for p in range(0, states.shape[0], POSITIONS)]
    return torch.cat([t.values for t in parts]), torch.cat([t.indices for t in parts])


def _token_stats(dataset: datasets.Dataset) -> tuple[int, int, str]:
    """(total tokens, the longest example's tokens, sha256 over every example's length and input_ids in
    order), in one pass that holds a thousand examples at a time."""
    digest, tokens, longest, index = sha256(), 0, 0, 0
    for batch in dataset.select_columns(["input_ids"]).iter(batch_size=1000):
        for ids in batch["input_ids"]:
            if len(ids) == 0:
                raise InvalidInputError(f"example {index} of the dataset has no input_ids")
            tokens, longest, index = tokens + len(ids), max(longest, len(ids)), index + 1
            digest.update(len(ids).to_bytes(8, "little"))
            digest.update(np.asarray(ids, dtype=np.int64).tobytes())
    return tokens, longest, digest.hexdigest()


def _check_args(dataset, top_k, vocab_size, batch_size, shard_size, dtype) -> None:
    if not isinstance(dataset, datasets.Dataset) or "input_ids" not in dataset.column_names:
        raise InvalidInputError("teacher signals need a tokenized Dataset with an input_ids column")
    if len(dataset) == 0:
        raise InvalidInputError("no examples to cache teacher signals for")
    if not isinstance(top_k, int) or not 1 <= top_k <= vocab_size:
        raise InvalidInputError(f"top_k must be in 1..{vocab_size} (the vocabulary size), got {top_k!r}")
    for name, value in (("batch_size", batch_size), ("shard_size", shard_size)):
        if (value is not None or name == "batch_size") and (not isinstance(value, int) or value < 1):
            raise InvalidInputError(f"{name} must be a positive integer, got {value!r}")
    if dtype not in DTYPES.values():
        raise InvalidInputError(f"teacher cache dtype must be one of {', '.join(DTYPES)}, got {dtype}")


def _human_bytes(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")
