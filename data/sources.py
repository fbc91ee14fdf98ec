"""Prompt sources by name: what a `data.prompts` entry or a `--prompts` value may be.

    builtin:NAME                a prompt set that ships with draftsmith (data/prompts/, listed with its
                                source and licence in data/prompts/README.md)
    hf:NAME[:CONFIG][@SPLIT]    a dataset through `datasets.load_dataset(NAME, CONFIG, split=SPLIT)`: a hub
                                id (`HuggingFaceH4/ultrachat_200k:default@train_sft`), or a local dataset
                                repository or directory (data files, optionally a README dataset card
                                that names configs and splits). SPLIT may slice (`train[:500]`); without
                                it, `train`, or the only split there is
    anything else               a file (.jsonl, .json, .parquet, .csv, optionally .gz) or a directory
                                written by `Dataset.save_to_disk` (read by data/prompts.py)

(`self:N`, prompts the target writes itself, is a training source only: see data/self_prompts.py.)
Every failure to find or read a source is an `InvalidInputError` with a one-line message.
"""

from __future__ import annotations

import codecs
import gzip
from dataclasses import dataclass
from pathlib import Path

import datasets

from draftsmith.speculative.errors import InvalidInputError

BUILTIN = "builtin:"
HF = "hf:"
BUILTIN_DIR = Path(__file__).resolve().parent / "prompts"
_BUILTIN_SUFFIXES = (".jsonl", ".jsonl.gz")
_TEXT_SUFFIXES = (".jsonl", ".json", ".csv")


def is_builtin(spec: str) -> bool:
    return str(spec).startswith(BUILTIN)


def is_hf(spec: str) -> bool:
    return str(spec).startswith(HF)


def builtin_names() -> list[str]:
    names = {p.name.removesuffix(s) for s in _BUILTIN_SUFFIXES for p in BUILTIN_DIR.glob(f"*{s}")}
    return sorted(names)


def builtin_path(spec: str) -> Path:
    """The file of `builtin:NAME`; a one-line error listing the shipped sets for an unknown NAME."""
    name = str(spec).removeprefix(BUILTIN)
    for suffix in _BUILTIN_SUFFIXES:
        path = BUILTIN_DIR / f"{name}{suffix}"
        if name and "/" not in name and path.is_file():
            return path
    raise InvalidInputError(f"no builtin prompt set '{name}' (builtin sets: {', '.join(builtin_names())})")


@dataclass(frozen=True)
class HfSource:
    """A parsed `hf:NAME[:CONFIG][@SPLIT]` (None: the dataset's default config / split)."""

    name: str
    config: str | None = None
    split: str | None = None

    @classmethod
    def parse(cls, spec: str) -> "HfSource":
        text = str(spec).removeprefix(HF)
        split = config = None
        head, at, tail = text.rpartition("@")
        if at and "/" not in tail:  # an "@" inside a path is part of the path
            text, split = head, tail
        head, colon, tail = text.rpartition(":")
        if colon and "/" not in tail:
            text, config = head, tail
        if not text or split == "" or config == "":
            raise InvalidInputError(f"'{spec}': a dataset source is hf:NAME[:CONFIG][@SPLIT]")
        return cls(text, config, split)

    def is_local(self) -> bool:
        return self.name.startswith(("/", ".", "~")) or Path(self.name).expanduser().exists()


def load_hf(spec: str, *, streaming: bool = False) -> datasets.Dataset | datasets.IterableDataset:
    """The records of an `hf:` source: a Dataset, or with `streaming` an IterableDataset that reads
    the files as it is iterated (nothing is downloaded or converted up front)."""
    source = HfSource.parse(spec)
    builder = _builder(source, spec)
    split = _split(source, builder, spec)
    if streaming and "[" in split:
        raise InvalidInputError(f"'{spec}': a streamed split cannot be sliced; take fewer records with data.limit")
    try:
        return datasets.load_dataset(_path(source), source.config, split=split, streaming=streaming)
    except Exception as exc:  # datasets raises many kinds (ValueError, OSError, pyarrow errors)
        raise InvalidInputError(f"cannot read '{spec}': {_first_line(exc)}") from exc


def hf_fingerprint(spec: str) -> str:
    """What identifies an `hf:` source's content without reading it: its config, split and data files
    (with their modification times, or the hub revision they were resolved at)."""
    from datasets.fingerprint import Hasher

    source = HfSource.parse(spec)
    builder = _builder(source, spec)
    files = builder.config.data_files
    return Hasher.hash([builder.config.name, _split(source, builder, spec), files if files else builder.config_id])


def check_utf8(path: Path) -> None:
    """Refuse a text prompt file that is not UTF-8 (pyarrow reads such bytes and fails far later)."""
    suffixes = [s.lower() for s in path.suffixes]
    compressed = suffixes[-1:] == [".gz"]
    kind = suffixes[-2] if compressed and len(suffixes) > 1 else (suffixes or [""])[-1]
    if kind not in _TEXT_SUFFIXES or path.is_dir():
        return
    decoder = codecs.getincrementaldecoder("utf-8")()
    line = 1
    with (gzip.open if compressed else open)(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                line += chunk[: exc.start].count(b"\n")
                raise InvalidInputError(f"{path} is not UTF-8 text (line {line}: byte 0x{chunk[exc.start]:02x}); "
                                        "convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
            line += chunk.count(b"\n")
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise InvalidInputError(f"{path} is not UTF-8 text (it ends inside a character)") from None


# --- resolving a dataset ----------------------------------------------------------------------


def _path(source: HfSource) -> str:
    return str(Path(source.name).expanduser()) if source.is_local() else source.name


def _builder(source: HfSource, spec: str):
    if source.name.startswith(("/", ".", "~")) and not Path(source.name).expanduser().exists():
        raise InvalidInputError(f"'{spec}': no such dataset directory {source.name}")
    try:
        return datasets.load_dataset_builder(_path(source), source.config)
    except Exception as exc:  # not found, offline, a loading script, an unknown config ...
        raise InvalidInputError(f"cannot load dataset '{spec}': {_first_line(exc)}") from exc


def _split(source: HfSource, builder, spec: str) -> str:
    """The split asked for (checked against the splits there are), or the default one."""
    names = list(builder.config.data_files or {}) or list(builder.info.splits or {})
    if source.split is not None:
        base = source.split.split("[", 1)[0]
        if names and base not in names:
            raise InvalidInputError(f"'{spec}' has no split '{base}' (splits: {', '.join(names)})")
        return source.split
    if "train" in names or not names:
        return "train"
    if len(names) == 1:
        return names[0]
    raise InvalidInputError(f"'{spec}' has several splits and no train split; name one: "
                            + ", ".join(f"{HF}{source.name}{':' + source.config if source.config else ''}@{n}"
                                        for n in names))


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0].strip() if lines else type(exc).__name__
