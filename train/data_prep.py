"""Everything a training run reads, prepared once and cached: the held-out prompts, the training
sequences (target-regenerated answers by default) and, for offline teachers, the teacher cache.

Caches live under `data.cache_dir` (default `<output_dir>/data`) in directories named by a hash of
what determines them (target identity, prompt files, regeneration settings), so a rerun, a resumed
run or another recipe with the same data reuses them, and different settings never mix.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import datasets

from draftsmith.data.prompts import ColumnMap, load_conversations
from draftsmith.data.regenerate import regenerate
from draftsmith.data.render import render_prompt, tokenize_dataset
from draftsmith.data.self_prompts import is_self_spec, self_prompt_count, write_prompts
from draftsmith.data.sources import BUILTIN_DIR, builtin_path, hf_fingerprint, is_builtin, is_hf
from draftsmith.data.stream import stream_conversations
from draftsmith.data.teacher import ConcatTeacher, TeacherCache, cache_teacher_signals
from draftsmith.speculative import kinds
from draftsmith.speculative.kinds import frequent_answer_tokens  # noqa: F401  (used by tests)
from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.loading import LoadedModel
from draftsmith.train.config import Recipe

BUILTIN_PROMPTS = BUILTIN_DIR


@dataclass
class TrainingData:
    train: datasets.Dataset  # input_ids, loss_mask (1 on the answer tokens), truncated to max_length
    heldout_prompts: list[list[int]]  # rendered prompts for the acceptance-length evaluation
    teacher: TeacherCache | ConcatTeacher | None  # offline teacher signals, aligned with `train` rows
    source: dict  # what the data was built from (recorded in the drafter)


def resolve_prompt_file(spec: str) -> Path:
    if is_self_spec(spec):
        raise InvalidInputError(f"'{spec}' (prompts the target writes) is a training-data source only; list a file here")
    if is_hf(spec):
        raise InvalidInputError(f"'{spec}' names a dataset, not a file")
    if is_builtin(spec):
        return builtin_path(spec)
    path = Path(spec).expanduser()
    if not path.exists():
        raise InvalidInputError(f"data file not found: {spec}")
    return path


def source_fingerprint(spec: str) -> str:
    """What a data.prompts entry contributes to the cache keys: a file's content hash, or for `self:N`
    the count (the prompts themselves follow from the target, the seed and this draftsmith)."""
    if is_self_spec(spec):
        return f"self-written:{self_prompt_count(spec)}"
    if is_hf(spec):
        return f"dataset:{hf_fingerprint(spec)}"
    return file_fingerprint(resolve_prompt_file(spec))


def column_map(recipe: Recipe) -> ColumnMap:
    """data.columns (and data.prompt_column, its older spelling of columns.prompt) as a ColumnMap."""
    cfg = recipe.data
    c = cfg.columns
    if cfg.prompt_column and (c.conversation or c.turns or (c.prompt and c.prompt != cfg.prompt_column)):
        raise InvalidInputError("data.prompt_column and data.columns name different prompt columns; keep one")
    return ColumnMap(prompt=c.prompt or cfg.prompt_column, messages=c.conversation, turns=c.turns,
                     category=c.category, reference=c.reference, id=c.id)


def data_seed(recipe: Recipe) -> int:
    return recipe.data.seed if recipe.data.seed is not None else recipe.train.seed


def data_options(recipe: Recipe) -> dict:
    """The data settings added after cache keys were first written, in the key only when they are set,
    so that the caches written before them stay valid."""
    cfg = recipe.data
    options = {"columns": cfg.columns.model_dump(exclude_none=True) or None, "data_seed": cfg.seed,
               "shuffle": cfg.shuffle or None, "streaming": cfg.streaming or None,
               "stream_buffer": cfg.stream_buffer if cfg.streaming and cfg.shuffle else None}
    return {k: v for k, v in options.items() if v is not None}


def load_records(recipe: Recipe, target: LoadedModel | None = None, cache_root: Path | None = None,
                 progress: bool = True) -> datasets.Dataset:
    """Every data.prompts source as conversations, shuffled with the data seed. Files and datasets give
    at most data.limit records each (a seeded sample with data.shuffle); a streamed `hf:` source is read
    into shards under cache_root; a `self:N` source (N prompts the target writes, cached under
    cache_root) gives at most N."""
    cfg = recipe.data
    columns, seed = column_map(recipe), data_seed(recipe)
    shuffle_seed = seed if cfg.shuffle else None

    def load(spec: str) -> datasets.Dataset:
        if cfg.streaming and is_hf(spec):
            key = cache_key(source=spec, fingerprint=hf_fingerprint(spec), columns=vars(columns), limit=cfg.limit,
                            shuffle_seed=shuffle_seed, buffer=cfg.stream_buffer)
            return stream_conversations(spec, Path(cache_root) / f"stream-{key}", columns, limit=cfg.limit,
                                        shuffle_seed=shuffle_seed, buffer_size=cfg.stream_buffer, progress=progress)
        if not is_self_spec(spec):
            return load_conversations(spec, columns, limit=cfg.limit, shuffle_seed=shuffle_seed)
        count = self_prompt_count(spec)
        key = cache_key(target=target.weight_hash(), self_prompts=count, seed=recipe.train.seed)
        return write_prompts(target, count, Path(cache_root) / f"prompts-{key}", seed=recipe.train.seed,
                             batch_size=cfg.regen_batch_size, progress=progress)

    parts = [load(spec) for spec in cfg.prompts]
    if not parts:
        raise InvalidInputError("data.prompts lists no files")
    if len({"input_ids" in part.column_names for part in parts}) > 1:
        raise InvalidInputError("data.prompts mixes regenerated datasets (with input_ids) and prompt files; "
                                "list only one kind")
    records = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    return records.shuffle(seed=seed)


def split_heldout(records: datasets.Dataset, heldout: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    if len(records) <= heldout:
        raise InvalidInputError(
            f"the training data holds {len(records)} records, not more than data.heldout={heldout}; "
            "add prompts or lower data.heldout"
        )
    return records.select(range(heldout, len(records))), records.select(range(heldout))


def cache_key(**parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_fingerprint(path: Path) -> str:
    if path.is_dir():
        return ";".join(f"{p.name}:{p.stat().st_size}" for p in sorted(path.rglob("*")) if p.is_file())
    return hashlib.sha256(path.read_bytes()).hexdigest()


def prepare_data(recipe: Recipe, target: LoadedModel, *, is_main: bool, progress: bool = True) -> TrainingData:
    """Build (main process) or load (other processes, after the main one) the run's data."""
    cfg = recipe.data
    cache_root = Path(cfg.cache_dir or Path(recipe.output_dir) / "data")
    files = {spec: source_fingerprint(spec) for spec in cfg.prompts}
    records = load_records(recipe, target, cache_root, progress=progress and is_main)
    train_records, heldout = split_heldout(records, cfg.heldout)
    source = {"prompts": cfg.prompts, "records": len(train_records), "heldout": len(heldout),
              "regenerated": cfg.regenerate, "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature}
    key = cache_key(target=target.weight_hash(), files=files, limit=cfg.limit, column=cfg.prompt_column,
                    heldout=cfg.heldout, seed=recipe.train.seed, regenerate=cfg.regenerate,
                    max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, **data_options(recipe))
    if cfg.extra_samples and not cfg.regenerate:
        raise InvalidInputError("data.extra_samples needs data.regenerate: true (they are the target's answers)")
    if cfg.regenerate:
        # The main answers, then each extra sampled pass: every part has its own cache (keyed as if it
        # were the only one, so the main part is shared with recipes that take no extra samples).
        passes = [(key, cfg.temperature, recipe.train.seed)]
        passes += [(cache_key(main=key, extra_sample=i, temperature=cfg.sample_temperature), cfg.sample_temperature,
                    recipe.train.seed + 1 + i) for i in range(cfg.extra_samples)]
        parts = []
        for part_key, temperature, seed in passes:
            regenerated = regenerate(target, train_records, cache_root / f"regen-{part_key}",
                                     max_new_tokens=cfg.max_new_tokens, temperature=temperature, seed=seed,
                                     batch_size=cfg.regen_batch_size, progress=progress and is_main)
            parts.append((part_key, truncate(regenerated, cfg.max_length)))
        source["extra_samples"], source["sample_temperature"] = cfg.extra_samples, cfg.sample_temperature
    else:
        parts = [(key, tokenize_dataset(train_records, target.tokenizer, cfg.max_length))]
    train = datasets.concatenate_datasets([part for _, part in parts]) if len(parts) > 1 else parts[0][1]
    if len(train) == 0:
        raise InvalidInputError("no training sequences with answer tokens are left (empty dataset)")
    teacher = None
    if recipe.teacher.mode == "offline":
        caches = [cache_teacher_signals(target, part, cache_root / f"teacher-{part_key}-{cfg.max_length}"
                                        f"-k{recipe.teacher.top_k}", top_k=recipe.teacher.top_k,
                                        hidden=kinds.get(recipe.drafter.kind).needs_teacher_hidden, progress=progress and is_main)
                  for part_key, part in parts]
        teacher = caches[0] if len(caches) == 1 else ConcatTeacher(caches)
    prompts = [render_prompt(target.tokenizer, strip_answers(m)) for m in heldout["messages"]]
    return TrainingData(train=train, heldout_prompts=prompts, teacher=teacher, source=source)


def truncate(dataset: datasets.Dataset, max_length: int) -> datasets.Dataset:
    def cut(row):
        return {"input_ids": row["input_ids"][:max_length], "loss_mask": row["loss_mask"][:max_length]}

    cut_rows = dataset.map(cut, desc="truncating")
    return cut_rows.filter(lambda row: sum(row["loss_mask"][1:]) > 0, desc="dropping empty rows")


def strip_answers(messages: list[dict]) -> list[dict]:
    """The conversation up to its last user turn (held-out prompts are answered by the runtime)."""
    end = len(messages)
    while end > 0 and messages[end - 1]["role"] == "assistant":
        end -= 1
    return messages[:end]
