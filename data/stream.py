"""Streamed sources: an `hf:` dataset read as a stream and written to disk in resumable shards, for
sets too large to download and convert whole (`data.streaming: true`).

Only the records used are fetched: the first `limit` of the stream, after a seeded shuffle of the
shard order and of a buffer of records when one is asked for. They are mapped to the conversation
shape (data/prompts.py) as they arrive and written the way regeneration writes (data/regenerate.py):

    manifest.json              settings (source and its fingerprint, columns, limit, shuffle, shard
                               size) and the shards done; a rerun with other settings is refused
    shards/shard-00000.jsonl   shard_size records each, in stream order
    dataset/                   every record (`Dataset.save_to_disk`, read back memory-mapped), once
                               the stream is read

An interrupted read resumes after its last whole shard (the stream is skipped to there: the same
seed gives the same order), and a finished one is reused as it is. Memory stays at one shard of
records (plus the shuffle buffer) whatever the size of the set.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import datasets
from tqdm.auto import tqdm

from draftsmith.data.manifest import open_run_dir, write_manifest
from draftsmith.data.prompts import ColumnMap, to_conversations
from draftsmith.data.regenerate import save_dataset_atomic, shard_name
from draftsmith.data.sources import hf_fingerprint, is_hf, load_hf
from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.fileio import atomic_write_text

KIND = "draftsmith-streamed"
SHARD_SIZE = 1000
FEATURES = datasets.Features({
    "id": datasets.Value("string"),
    "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
    "category": datasets.Value("string"),
    "reference": datasets.Value("string"),
})


def stream_conversations(spec: str, out_dir: Path, columns: ColumnMap | None = None, *, limit: int | None = None,
                         shuffle_seed: int | None = None, buffer_size: int = 10_000, shard_size: int = SHARD_SIZE,
                         all_turns: bool = False, progress: bool = True) -> datasets.Dataset:
    """The first `limit` records (all with None) of the `hf:` source `spec`, streamed, as conversations
    cached in `out_dir` (see the module docstring). With `shuffle_seed`, the stream's shard order and a
    buffer of `buffer_size` records are shuffled with that seed first."""
    if not is_hf(spec):
        raise InvalidInputError(f"'{spec}': only hf: sources are streamed (files are read memory-mapped as they are)")
    out_dir = Path(out_dir)
    settings = {"source": spec, "fingerprint": hf_fingerprint(spec),
                "columns": dataclasses.asdict(columns or ColumnMap()), "all_turns": all_turns, "limit": limit,
                "shuffle_seed": shuffle_seed, "buffer_size": buffer_size if shuffle_seed is not None else None,
                "shard_size": shard_size}
    manifest = open_run_dir(out_dir, KIND, settings, None)
    if not (manifest["complete"] and (out_dir / "dataset").is_dir()):
        _read_stream(spec, out_dir, manifest, columns, all_turns, progress)
    return datasets.load_from_disk(str(out_dir / "dataset"))


def _read_stream(spec: str, out_dir: Path, manifest: dict, columns, all_turns: bool, progress: bool) -> None:
    s = manifest["settings"]
    shard_dir = out_dir / "shards"
    shard_dir.mkdir(exist_ok=True)
    done = 0  # shards are written in stream order: resume after the whole ones at the front
    while done in manifest["shards_done"] and (shard_dir / shard_name(done)).is_file():
        done += 1
    if done:
        print(f"stream: resuming {spec}, {done} shards read in {out_dir}", file=sys.stderr)
    stream = load_hf(spec, streaming=True)
    if s["shuffle_seed"] is not None:
        stream = stream.shuffle(seed=s["shuffle_seed"], buffer_size=s["buffer_size"])
    if s["limit"] is not None:
        stream = stream.take(s["limit"])
    rows = to_conversations(stream, columns, spec, all_turns=all_turns).skip(done * s["shard_size"])
    shard, buffer = done, []
    with tqdm(total=s["limit"], initial=done * s["shard_size"], unit="rec", desc=f"streaming {spec}",
              disable=not progress, file=sys.stderr) as bar:
        for row in _checked(rows, spec):
            buffer.append({k: row[k] for k in FEATURES})
            bar.update(1)
            if len(buffer) == s["shard_size"]:
                _write_shard(out_dir, manifest, shard, buffer)
                shard, buffer = shard + 1, []
        if buffer:
            _write_shard(out_dir, manifest, shard, buffer)
            shard += 1
    if shard == 0:
        raise InvalidInputError(f"'{spec}' holds no records")
    manifest["num_shards"] = shard
    paths = [str(shard_dir / shard_name(k)) for k in range(shard)]
    build = out_dir / ".build"
    dataset = datasets.Dataset.from_generator(_read_shards, features=FEATURES, gen_kwargs={"paths": paths},
                                              cache_dir=str(build))
    save_dataset_atomic(dataset, out_dir / "dataset")
    shutil.rmtree(build, ignore_errors=True)
    manifest["complete"] = True
    write_manifest(out_dir, manifest)


def _checked(rows, spec: str):
    """The stream's rows; bytes that are not UTF-8 surface while reading, as a one-line error."""
    try:
        yield from rows
    except UnicodeDecodeError as exc:
        raise InvalidInputError(f"'{spec}' holds text that is not UTF-8 ({exc.reason}); convert it to UTF-8") from None


def _write_shard(out_dir: Path, manifest: dict, shard: int, rows: list[dict]) -> None:
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    atomic_write_text(out_dir / "shards" / shard_name(shard), text)
    manifest["shards_done"] = sorted(set(manifest["shards_done"]) | {shard})
    write_manifest(out_dir, manifest)


def _read_shards(paths: list[str]):
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                if line.strip():
                    yield json.loads(line)
