"""Prompt sets and conversations from files and datasets, as one `datasets.Dataset` shape.

Every loader returns rows with these columns:

    id          str    stable id of the record (from an id column, else its index)
    messages    list   [{"role": "user"|"assistant"|"system", "content": str}, ...]
    category    str    a grouping for per-category figures ("" when the data has none)
    reference   str    a reference answer for quality metrics ("" when none)

Sources: `.jsonl`, `.json`, `.parquet`, `.csv` files (optionally gzip-compressed: `.jsonl.gz`), a
directory written by `Dataset.save_to_disk`, a shipped set (`builtin:NAME`) or a dataset through
`datasets.load_dataset` (`hf:NAME[:CONFIG][@SPLIT]`); see data/sources.py. Rows that carry `input_ids` and `loss_mask` (a regenerated
dataset: the exact tokens the target produced) keep those two columns too, so training can use them
as they are instead of re-rendering the text. How a record becomes messages is decided by a
`ColumnMap`; with none given it is inferred from the columns present:

    messages / conversations   a list of {"role", "content"} (or ShareGPT {"from", "value"}) dicts
    turns                      a list of user turns (MT-Bench / vicuna_bench); only the first is used
                               unless `all_turns`, which keeps them as consecutive user messages
    prompt / instruction / question / text / input   a single user message; with a self-instruct
                               `instances` column, the first instance's input is appended to the
                               instruction and its output is the reference
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import datasets

from draftsmith.data.sources import builtin_path, check_utf8, is_builtin, is_hf, load_hf
from draftsmith.speculative.errors import InvalidInputError, first_line

PROMPT_COLUMNS = ("prompt", "instruction", "question", "text", "input")
CONVERSATION_COLUMNS = ("messages", "conversations")
CATEGORY_COLUMNS = ("category", "cluster", "motivation_app")
REFERENCE_COLUMNS = ("reference", "answer", "output", "canonical_solution")
ID_COLUMNS = ("id", "question_id", "uid", "task_id")
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


@dataclass
class ColumnMap:
    """Which columns hold what; None means infer from the columns present."""

    prompt: str | None = None  # a column holding one user message
    messages: str | None = None  # a column holding a conversation (list of role/content dicts)
    turns: str | None = None  # a column holding a list of user turns
    category: str | None = None
    reference: str | None = None
    id: str | None = None


def read_table(path: str | Path) -> datasets.Dataset:
    """The raw records of a prompt source (a file, a saved dataset directory, builtin:NAME or
    hf:NAME[:CONFIG][@SPLIT]; see data/sources.py), as a Dataset (no column mapping)."""
    if is_hf(str(path)):
        return load_hf(str(path))
    path = builtin_path(str(path)) if is_builtin(str(path)) else Path(path).expanduser()
    if not path.exists():
        raise InvalidInputError(f"no such file or directory: {path}")
    if path.is_dir():
        try:
            loaded = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as exc:
            raise InvalidInputError(f"{path} is not a saved dataset directory ({first_line(exc)})") from exc
        if isinstance(loaded, datasets.DatasetDict):
            loaded = loaded[next(iter(loaded))]
        return loaded
    if path.stat().st_size == 0:
        raise InvalidInputError(f"{path} is empty (no records)")
    suffixes = [s.lower() for s in path.suffixes]
    kind = suffixes[-2] if suffixes and suffixes[-1] == ".gz" and len(suffixes) > 1 else (suffixes or [""])[-1]
    builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(kind)
    if builder is None:
        raise InvalidInputError(f"unsupported prompt file type '{''.join(path.suffixes)}' ({path}); "
                                "use .jsonl, .json, .parquet, .csv or a saved dataset directory")
    check_utf8(path)
    try:
        table = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:  # datasets raises many kinds for unreadable files
        raise InvalidInputError(f"cannot read {path}: {first_line(exc)}") from exc
    if len(table) == 0:
        raise InvalidInputError(f"{path} holds no records")
    return table


def load_conversations(
    path: str | Path,
    columns: ColumnMap | None = None,
    *,
    limit: int | None = None,
    all_turns: bool = False,
    shuffle_seed: int | None = None,
) -> datasets.Dataset:
    """Read `path` (any source `read_table` takes) and map it to the id / messages / category /
    reference shape (see module doc). With `shuffle_seed` the records are shuffled with that seed
    before `limit` takes the first ones: a reproducible random sample instead of the file's head."""
    table = read_table(path)
    if shuffle_seed is not None:
        table = table.shuffle(seed=shuffle_seed)
    if limit is not None:
        table = table.select(range(min(limit, len(table))))
    mapped = to_conversations(table, columns, path, all_turns=all_turns)
    if len(mapped) == 0:
        raise InvalidInputError(f"{path} holds no records")
    return mapped


def prompt_sources(spec: str) -> list[str]:
    """The sources a `--prompts` value names: one, or a comma list."""
    return [s.strip() for s in str(spec).split(",") if s.strip()]


def load_prompt_sets(spec: str, columns: ColumnMap | None = None, *, limit: int | None = None) -> datasets.Dataset:
    """One prompt source, or a comma list of them (`builtin:vicuna_bench,builtin:unlike_training`: an eval
    set with every category of both), each read by `load_conversations` (`limit`: the first N of each) and
    concatenated in order. With several sources each id is prefixed with its source (`builtin:vicuna_bench/12`),
    so ids stay unique across them."""
    sources = prompt_sources(spec)
    if not sources:
        raise InvalidInputError("no prompt source given")
    if len(sources) == 1:
        return load_conversations(sources[0], columns, limit=limit)
    if len(set(sources)) < len(sources):
        raise InvalidInputError(f"a prompt source is named twice in '{spec}'")
    parts = []
    for source in sources:
        part = load_conversations(source, columns, limit=limit)
        parts.append(part.map(lambda row: {"id": f"{source}/{row['id']}"}))
    return datasets.concatenate_datasets(parts)


def to_conversations(table: datasets.Dataset | datasets.IterableDataset, columns: ColumnMap | None, path,
                     *, all_turns: bool = False) -> datasets.Dataset | datasets.IterableDataset:
    """`table`'s records in the conversation shape (an IterableDataset is mapped as it is read);
    `path` names the source in errors."""
    names = table.column_names
    if names is None:  # a stream whose features are not known before reading (JSON files)
        names = list(next(iter(table), {}).keys())
    columns = resolve_columns(names, dataclasses.replace(columns or ColumnMap()), path)
    tokens = [c for c in ("input_ids", "loss_mask") if c in names]
    tokens = tokens if len(tokens) == 2 else []

    def to_row(record: dict, index: int) -> dict:
        return {
            "id": str(record[columns.id]) if columns.id else str(index),
            "messages": _messages(record, columns, all_turns, path, index),
            "category": str(record[columns.category] or "") if columns.category else "",
            "reference": _reference(record, columns),
            **{c: list(record[c]) for c in tokens},
        }

    if isinstance(table, datasets.IterableDataset):
        return table.map(to_row, with_indices=True, remove_columns=names)
    try:
        return table.map(to_row, with_indices=True, remove_columns=names, desc="reading prompts")
    except UnicodeDecodeError as exc:  # bytes that are not UTF-8 inside a dataset's string columns
        raise InvalidInputError(f"{path} holds text that is not UTF-8 ({exc.reason} at byte {exc.start} "
                                "of a value); convert it to UTF-8") from None


def resolve_columns(names: list[str], given: ColumnMap, path) -> ColumnMap:
    """Fill in the unset fields of `given` from the column names; error when no prompt source is found."""
    for field_name in ("prompt", "messages", "turns", "category", "reference", "id"):
        value = getattr(given, field_name)
        if value is not None and value not in names:
            raise InvalidInputError(f"{path} has no column '{value}' (columns: {', '.join(names)})")
    if not (given.prompt or given.messages or given.turns):
        given.messages = next((c for c in CONVERSATION_COLUMNS if c in names), None)
        given.turns = "turns" if not given.messages and "turns" in names else None
        if not (given.messages or given.turns):
            given.prompt = next((c for c in PROMPT_COLUMNS if c in names), None)
    if not (given.prompt or given.messages or given.turns):
        raise InvalidInputError(
            f"{path} has no prompt column; name it with --prompt-column (in a recipe: data.columns.prompt, "
            f".conversation or .turns) (columns: {', '.join(names)})"
        )
    given.category = given.category or next((c for c in CATEGORY_COLUMNS if c in names), None)
    given.reference = given.reference or next((c for c in REFERENCE_COLUMNS if c in names), None)
    given.id = given.id or next((c for c in ID_COLUMNS if c in names), None)
    return given


def _messages(record: dict, columns: ColumnMap, all_turns: bool, path, index: int) -> list[dict]:
    if columns.messages:
        raw = record[columns.messages] or []
        if not isinstance(raw, list):
            raise InvalidInputError(f"record {index} of {path}: column '{columns.messages}' holds no list of "
                                    "messages; name the right column with data.columns")
        messages = [_message(m, path, index) for m in raw]
    elif columns.turns:
        turns = record[columns.turns] or []
        if not isinstance(turns, list):
            raise InvalidInputError(f"record {index} of {path}: column '{columns.turns}' holds no list of turns; "
                                    "name the right column with data.columns")
        turns = turns if all_turns else turns[:1]
        messages = [{"role": "user", "content": str(t)} for t in turns]
    else:
        text = str(record[columns.prompt] or "")
        instance = _first_instance(record)
        if instance and str(instance.get("input") or "").strip():
            text = f"{text}\n\n{instance['input']}"
        messages = [{"role": "user", "content": text}]
    if not messages or not any(m["content"].strip() for m in messages):
        raise InvalidInputError(f"record {index} of {path} has an empty prompt")
    return messages


def _message(raw: dict, path, index: int) -> dict:
    if not isinstance(raw, dict):
        raise InvalidInputError(f"record {index} of {path}: a message needs a role (user/assistant/system) and content")
    role = raw.get("role", raw.get("from"))
    content = raw.get("content", raw.get("value"))
    if role not in _ROLES or content is None:
        raise InvalidInputError(f"record {index} of {path}: a message needs a role (user/assistant/system) and content")
    return {"role": _ROLES[role], "content": str(content)}


def _reference(record: dict, columns: ColumnMap) -> str:
    if columns.reference:
        return str(record[columns.reference] or "")
    instance = _first_instance(record)
    return str(instance.get("output") or "") if instance else ""


def _first_instance(record: dict) -> dict | None:
    """Self-instruct records carry "instances": [{"input", "output"}, ...]."""
    instances = record.get("instances")
    return instances[0] if isinstance(instances, list) and instances and isinstance(instances[0], dict) else None
