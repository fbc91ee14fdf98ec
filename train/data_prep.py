"""Everything a training run reads, prepared once and cached: the held-out prompts, the training
sequences (target-regenerated answers by default) and, for offline teachers, the teacher cache.

Caches live under `data.cache_dir` (default `<output_dir>/data`) in directories named by a hash of
what determines them (target identity, prompt files, regeneration settings), so a rerun, a resumed
run or another recipe with the same data reuses them, and different settings never mix.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets
import torch

from draftsmith.data.prompts import ColumnMap, load_conversations
from draftsmith.data.regenerate import datasets_progress, load_regenerated, regenerate
from draftsmith.data.render import TOKEN_FEATURES, render_prompt, tokenize_dataset
from draftsmith.data.self_prompts import is_self_spec, self_prompt_count, write_prompts
from draftsmith.data.sources import BUILTIN_DIR, builtin_path, hf_fingerprint, is_builtin, is_hf
from draftsmith.data.stream import stream_conversations
from draftsmith.data.teacher import ConcatTeacher, TeacherCache, teacher_signals
from draftsmith.speculative import kinds
from draftsmith.speculative.kinds import draft_vocabulary  # noqa: F401  (used by tests)
from draftsmith.speculative.calibrate import native_bf16
from draftsmith.speculative.dtypes import DTYPES
from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.loading import LoadedModel
from draftsmith.train.config import DataColumns, PromptSource, Recipe

BUILTIN_PROMPTS = BUILTIN_DIR
FIXED = "fixed_conversation"  # a record's tag while its source's regenerate setting differs from others'


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


def source_entries(recipe: Recipe) -> list[PromptSource]:
    """data.prompts with every entry a PromptSource (a plain string one takes the data section's settings)."""
    return [PromptSource(source=p) if isinstance(p, str) else p for p in recipe.data.prompts]


def regenerates(recipe: Recipe, entry: PromptSource) -> bool:
    """Whether the target answers `entry`'s prompts (else its conversations are trained on as they are)."""
    return recipe.data.regenerate if entry.regenerate is None else entry.regenerate


def column_map(recipe: Recipe, columns: DataColumns | None = None) -> ColumnMap:
    """`columns` (default data.columns, with data.prompt_column, its older spelling of columns.prompt)
    as a ColumnMap."""
    cfg = recipe.data
    c = columns or cfg.columns
    prompt_column = cfg.prompt_column if columns is None else None
    if prompt_column and (c.conversation or c.turns or (c.prompt and c.prompt != prompt_column)):
        raise InvalidInputError("data.prompt_column and data.columns name different prompt columns; keep one")
    return ColumnMap(prompt=c.prompt or prompt_column, messages=c.conversation, turns=c.turns,
                     category=c.category, reference=c.reference, id=c.id)


def data_seed(recipe: Recipe) -> int:
    return recipe.data.seed if recipe.data.seed is not None else recipe.train.seed


def data_options(recipe: Recipe, regen_dtype: str | None = None) -> dict:
    """The data settings added after cache keys were first written, in the key only when they are set,
    so that the caches written before them stay valid. `regen_dtype`: data.regen_dtype as resolved for the
    target (`resolve_regen_dtype`); default the recipe's own."""
    cfg = recipe.data
    regen_dtype = regen_dtype or cfg.regen_dtype
    options = {"columns": cfg.columns.model_dump(exclude_none=True) or None, "data_seed": cfg.seed,
               "shuffle": cfg.shuffle or None, "streaming": cfg.streaming or None,
               "stream_buffer": cfg.stream_buffer if cfg.streaming and cfg.shuffle else None,
               "regen_dtype": regen_dtype if regen_dtype != "float32" else None,
               "sources": [entry.model_dump(exclude_none=True) for entry in source_entries(recipe)]
               if any(isinstance(p, PromptSource) for p in cfg.prompts) else None}
    return {k: v for k, v in options.items() if v is not None}


def split_fixed(recipe: Recipe, records: datasets.Dataset) -> tuple[datasets.Dataset | None, datasets.Dataset | None]:
    """(the records the target answers, the records trained on as they are); None for an empty side."""
    if FIXED not in records.column_names:
        return (records, None) if regenerates(recipe, source_entries(recipe)[0]) else (None, records)
    answered = records.filter(lambda row: not row[FIXED], desc="regenerated sources").remove_columns(FIXED)
    fixed = records.filter(lambda row: row[FIXED], desc="fixed sources").remove_columns(FIXED)
    return (answered if len(answered) else None), (fixed if len(fixed) else None)


def resolve_regen_dtype(setting: str, target: LoadedModel) -> str:
    """data.regen_dtype as the target writes in: `auto` is bfloat16 where the target's device does bf16
    arithmetic in hardware, else float32."""
    if setting != "auto":
        return setting
    return "bfloat16" if native_bf16(next(target.model.parameters()).device) else "float32"


def regen_target(target: LoadedModel, dtype: str) -> LoadedModel:
    """`target` in `dtype` for writing prompts and answers (data.regen_dtype): itself when it already is,
    else a copy whose weights are cast as they are copied (no second full-precision copy at any time;
    the loaded target stays as it is for the teacher and the evaluation)."""
    wanted = DTYPES[dtype]
    model = target.model
    if all(p.dtype == wanted for p in model.parameters() if p.is_floating_point()):
        return target
    # deepcopy takes each tensor it meets from the memo: the floating weights and buffers (tied ones
    # once), made straight in the wanted dtype, so only the module tree itself is copied.
    memo = {id(p): torch.nn.Parameter(p.detach().to(wanted, copy=True), requires_grad=p.requires_grad)
            for p in model.parameters() if p.is_floating_point()}
    memo.update({id(b): b.to(wanted, copy=True) for b in model.buffers() if b.is_floating_point()})
    cast = dataclasses.replace(target, model=copy.deepcopy(model, memo))
    cast._weight_hash = target.weight_hash()  # the same checkpoint (its hash does not depend on the dtype)
    return cast


def load_records(recipe: Recipe, target: LoadedModel | None = None, cache_root: Path | None = None,
                 progress: bool = True, writer: Callable[[], LoadedModel] | None = None) -> datasets.Dataset:
    """Every data.prompts source as conversations, shuffled with the data seed. Files and datasets give
    at most data.limit records each (a seeded sample with data.shuffle); a streamed `hf:` source is read
    into shards under cache_root; a `self:N` source (N prompts the target writes, cached under
    cache_root) gives at most N. `writer`: the target in data.regen_dtype, made when first called
    (default: `regen_target` of `target`)."""
    cfg = recipe.data
    seed = data_seed(recipe)
    shuffle_seed = seed if cfg.shuffle else None
    regen_dtype = resolve_regen_dtype(cfg.regen_dtype, target) if target is not None else cfg.regen_dtype
    entries = source_entries(recipe)
    mixed = len({regenerates(recipe, entry) for entry in entries}) > 1

    def load(entry: PromptSource) -> datasets.Dataset:
        records = load_one(entry)
        if mixed:  # tagged, so that the answered and the fixed records can be told apart after the shuffle
            records = records.add_column(FIXED, [not regenerates(recipe, entry)] * len(records))
        return records

    def load_one(entry: PromptSource) -> datasets.Dataset:
        spec, columns, limit = entry.source, column_map(recipe, entry.columns), entry.limit or cfg.limit
        if cfg.streaming and is_hf(spec):
            key = cache_key(source=spec, fingerprint=hf_fingerprint(spec), columns=vars(columns), limit=limit,
                            shuffle_seed=shuffle_seed, buffer=cfg.stream_buffer)
            return stream_conversations(spec, Path(cache_root) / f"stream-{key}", columns, limit=limit,
                                        shuffle_seed=shuffle_seed, buffer_size=cfg.stream_buffer, progress=progress)
        if not is_self_spec(spec):
            return load_conversations(spec, columns, limit=limit, shuffle_seed=shuffle_seed)
        count = self_prompt_count(spec)
        key = cache_key(target=target.weight_hash(), self_prompts=count, seed=recipe.train.seed,
                        **({"dtype": regen_dtype} if regen_dtype != "float32" else {}))
        # Prompts written before (a smaller N, the same seed) are taken, not sampled again.
        return write_prompts(writer(), count, Path(cache_root) / f"prompts-{key}", seed=recipe.train.seed,
                             batch_size=cfg.regen_batch_size, progress=progress,
                             reuse=sorted(Path(cache_root).glob("prompts-*")))

    writer = writer or functools.cache(lambda: regen_target(target, regen_dtype))
    parts = [load(entry) for entry in entries]
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
    entries = source_entries(recipe)
    files = {entry.source: source_fingerprint(entry.source) for entry in entries}
    # The target in data.regen_dtype, cast once (when first needed) for the prompts it writes and its answers.
    regen_dtype = resolve_regen_dtype(cfg.regen_dtype, target)
    writer = functools.cache(lambda: regen_target(target, regen_dtype))
    records = load_records(recipe, target, cache_root, progress=progress and is_main, writer=writer)
    train_records, heldout = split_heldout(records, cfg.heldout)
    flags = [regenerates(recipe, entry) for entry in entries]
    source = {"prompts": recipe.model_dump()["data"]["prompts"], "records": len(train_records),
              "heldout": len(heldout), "regenerated": flags[0] if len(set(flags)) == 1 else flags,
              "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature}
    key = cache_key(target=target.weight_hash(), files=files, limit=cfg.limit, column=cfg.prompt_column,
                    heldout=cfg.heldout, seed=recipe.train.seed, regenerate=cfg.regenerate,
                    max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                    **data_options(recipe, regen_dtype))
    answered, fixed = split_fixed(recipe, train_records)
    if cfg.extra_samples and answered is None:
        raise InvalidInputError("data.extra_samples needs data.regenerate: true (they are the target's answers)")
    parts = []
    if answered is not None:
        # The main answers, then each extra sampled pass: every part has its own cache (keyed as if it
        # were the only one, so the main part is shared with recipes that take no extra samples).
        passes = [(key, cfg.temperature, recipe.train.seed)]
        passes += [(cache_key(main=key, extra_sample=i, temperature=cfg.sample_temperature), cfg.sample_temperature,
                    recipe.train.seed + 1 + i) for i in range(cfg.extra_samples)]
        for part_key, temperature, seed in passes:
            # Greedy answers the cache already holds for the same prompts (other prompt lists of this
            # target) are taken, not decoded again: adding prompts to a recipe answers only the new ones.
            regenerated = regenerate(writer(), answered, cache_root / f"regen-{part_key}",
                                     max_new_tokens=cfg.max_new_tokens, temperature=temperature, seed=seed,
                                     batch_size=cfg.regen_batch_size, progress=progress and is_main,
                                     reuse=sorted(cache_root.glob("regen-*")))
            parts.append((part_key, truncate(regenerated, cfg.max_length)))
        source["extra_samples"], source["sample_temperature"] = cfg.extra_samples, cfg.sample_temperature
        source["regen_dtype"] = regen_dtype
    writer.cache_clear()  # (the cast copy is not needed past here)
    if fixed is not None:  # conversations as they are: rendered, loss on their assistant turns only
        fixed_key = key if answered is None else cache_key(main=key, fixed_sources=True)
        parts.append((fixed_key, tokenize_dataset(answered_by_reference(fixed), target.tokenizer, cfg.max_length)))
    if answered is not None and fixed is not None:  # the token columns are what both kinds of rows share
        parts = [(k, part.select_columns(list(TOKEN_FEATURES)).cast(datasets.Features(TOKEN_FEATURES)))
                 for k, part in parts]
    train = datasets.concatenate_datasets([part for _, part in parts]) if len(parts) > 1 else parts[0][1]
    if len(train) == 0:
        raise InvalidInputError("no training sequences with answer tokens are left (empty dataset)")
    teacher = None
    if recipe.teacher.mode == "offline":
        # Named by the data; any finished cache of it with at least these signals is reused (teacher_signals).
        kind = kinds.get(recipe.drafter.kind)
        layers = kind.teacher_layers(recipe, target)
        # Rows other caches here hold (the same answers, under other prompt lists) are copied, not computed.
        caches = [teacher_signals(target, part, cache_root, f"teacher-{part_key}-{cfg.max_length}",
                                  top_k=recipe.teacher.top_k, hidden=kind.needs_teacher_hidden, layers=layers,
                                  dtype=DTYPES[recipe.teacher.dtype], progress=progress and is_main,
                                  reuse=teacher_donors(cache_root))
                  for part_key, part in parts]
        teacher = caches[0] if len(caches) == 1 else ConcatTeacher(caches)
    prompts = [render_prompt(target.tokenizer, strip_answers(m)) for m in heldout["messages"]]
    return TrainingData(train=train, heldout_prompts=prompts, teacher=teacher, source=source)


TEACHER_DIR = re.compile(r"teacher-([0-9a-f]{16})-(\d+)-k")


def teacher_donors(cache_root: Path) -> Iterator[tuple[Path, list[list[int]]]]:
    """(teacher cache directory, the token ids of its examples) for each teacher cache under `cache_root`
    of regenerated answers (`teacher-<key>-<max_length>-...` beside a finished `regen-<key>`): its examples
    are that regeneration's rows as `prepare_data` truncates them. Read lazily, only when a cache is written."""
    for directory in sorted(cache_root.glob("teacher-*")):
        match = TEACHER_DIR.match(directory.name)
        regen_dir = cache_root / f"regen-{match.group(1)}" if match else None
        if regen_dir is None or not (regen_dir / "dataset").is_dir():
            continue
        try:
            rows = truncate(load_regenerated(regen_dir), int(match.group(2)), progress=False)
        except InvalidInputError:
            continue
        yield directory, rows["input_ids"]


def answered_by_reference(records: datasets.Dataset) -> datasets.Dataset:
    """Fixed records as conversations: a prompt-and-answer record (instruction/output, question/answer:
    its messages end with the user's turn, its answer is the reference column) becomes the conversation
    it stands for, the reference as the assistant's turn. Conversations that hold assistant turns are
    kept as they are; a prompt with neither is left without answer tokens (and dropped when tokenized)."""
    if "reference" not in records.column_names or "input_ids" in records.column_names:
        return records

    def answer(row):
        messages = row["messages"]
        if messages and messages[-1]["role"] == "user" and row["reference"].strip():
            messages = [*messages, {"role": "assistant", "content": row["reference"]}]
        return {"messages": messages}

    return records.map(answer, desc="answers from the reference column")


def truncate(dataset: datasets.Dataset, max_length: int, progress: bool = True) -> datasets.Dataset:
    def cut(row):
        return {"input_ids": row["input_ids"][:max_length], "loss_mask": row["loss_mask"][:max_length]}

    with datasets_progress(progress):
        cut_rows = dataset.map(cut, desc="truncating")
        return cut_rows.filter(lambda row: sum(row["loss_mask"][1:]) > 0, desc="dropping empty rows")


def strip_answers(messages: list[dict]) -> list[dict]:
    """The conversation up to its last user turn (held-out prompts are answered by the runtime)."""
    end = len(messages)
    while end > 0 and messages[end - 1]["role"] == "assistant":
        end -= 1
    return messages[:end]
