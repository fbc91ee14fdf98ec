"""Run directories: the manifest that ties a resumable, sharded run to its settings.

`regenerate` and `cache_teacher_signals` write their output in shards, so an interrupted run resumes
where it stopped. Each run directory holds `manifest.json`:

    kind            what wrote the directory ("draftsmith-regenerated", "draftsmith-teacher-cache")
    format_version  FORMAT_VERSION; another version is refused
    settings        everything that decides the output (target and tokenizer hashes, sampling, shard
                    size, an input hash); a rerun with other settings is refused, never mixed in
    num_shards      shards the finished run holds
    shards_done     the shards written so far, sorted
    complete        whether the run has finished

The manifest is rewritten atomically after every shard, so it never names a shard that is not whole.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.speculative.errors import InvalidInputError, first_line
from draftsmith.speculative.fileio import atomic_write_json

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def open_run_dir(out_dir: Path, kind: str, settings: dict, num_shards: int) -> dict:
    """The manifest of the `kind` run in `out_dir` (see `check_run_dir`), created if there is none."""
    return check_run_dir(out_dir, kind, settings) or create_run_dir(out_dir, kind, settings, num_shards)


def check_run_dir(out_dir: Path, kind: str, settings: dict) -> dict | None:
    """The manifest of an existing run in `out_dir` with these settings, or None for a new or empty
    directory. Writes nothing. An existing run with other settings, or a non-empty directory that is
    not a `kind` run, is refused with a one-line error: results are never mixed or overwritten."""
    out_dir = Path(out_dir)
    if (out_dir / MANIFEST).exists():
        manifest = read_manifest(out_dir, kind)
        _check_same_settings(out_dir, manifest["settings"], settings)
        return manifest
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise InvalidInputError(f"{out_dir} exists and is not a {kind} directory (no {MANIFEST}); "
                                "pass a new or empty directory")
    return None


def create_run_dir(out_dir: Path, kind: str, settings: dict, num_shards: int) -> dict:
    """Create `out_dir` (and parents) and write the manifest of a new run with no shards done."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = {"kind": kind, "format_version": FORMAT_VERSION, "settings": settings,
                "num_shards": num_shards, "shards_done": [], "complete": False}
    write_manifest(out_dir, manifest)
    return manifest


def write_manifest(out_dir: Path, manifest: dict) -> None:
    """Replace the manifest of `out_dir` atomically (keys sorted, so reruns write identical bytes)."""
    atomic_write_json(Path(out_dir) / MANIFEST, manifest, sort_keys=True)


def read_manifest(out_dir: Path, kind: str) -> dict:
    """The manifest of the `kind` run in `out_dir`; a missing, corrupt, foreign or newer-format
    manifest is a one-line InvalidInputError that names the file."""
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        raise InvalidInputError(f"{out_dir} holds no {kind} run (missing {path})")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidInputError(f"corrupt manifest {path}: {first_line(exc)}") from exc
    keys = ("kind", "settings", "num_shards", "shards_done", "complete")
    if not isinstance(manifest, dict) or any(k not in manifest for k in keys):
        raise InvalidInputError(f"corrupt manifest {path}: missing fields")
    if manifest["kind"] != kind:
        raise InvalidInputError(f"{out_dir} holds a {manifest['kind']} run, not a {kind} run")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise InvalidInputError(f"{path} has format version {manifest.get('format_version')}, "
                                f"this draftsmith reads {FORMAT_VERSION}")
    return manifest


def shard_range(shard: int, shard_size: int, total: int) -> range:
    """The record indices of `shard` when `total` records are cut into shards of `shard_size`."""
    return range(shard * shard_size, min((shard + 1) * shard_size, total))


def _check_same_settings(out_dir: Path, stored: dict, wanted: dict) -> None:
    for key in sorted(stored.keys() | wanted.keys()):
        if stored.get(key) != wanted.get(key):
            raise InvalidInputError(
                f"{out_dir} was written with other settings ({key}: {_short(stored.get(key))} there, "
                f"{_short(wanted.get(key))} now); pass another directory or delete it"
            )


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 24 else text[:12] + "..." + text[-8:]
