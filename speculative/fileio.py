"""Atomic writes: a file or directory appears under its final name whole, or not at all.

Every helper writes under a scratch name beside the destination (the same directory, so the same
filesystem, so the final rename is atomic) and renames it into place only once the write has
finished. A write that raises removes its scratch and leaves the destination as it was. Scratch
names start with a dot (`.<name>.<random>.tmp` for a file, `.<name>-<random>` for a directory), so
a killed process leaves at worst a hidden leftover, never a half-written file under the real name.

What is published gets the mode a plain `open` or `mkdir` would give (0o666 or 0o777 less the
umask), not the private 0o600 / 0o700 that `mkstemp` and `mkdtemp` create scratch with.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from draftsmith.speculative.errors import InvalidInputError


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """A scratch file name beside `path` (the file exists, empty) for the body to write to.

    When the body finishes, the scratch replaces `path` (any file there is overwritten); when it
    raises, the scratch is removed and `path` is untouched. The body must close what it opened on the
    scratch before leaving the block. The parent directory must exist.
    """
    path = Path(path)
    fd, scratch = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(scratch)
        os.chmod(scratch, 0o666 & ~_umask())
        os.replace(scratch, path)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write `text` (UTF-8) to `path` through `atomic_file`, flushed to disk before the rename.

    A reader sees the old file or the new one, never half of it. Returns `path`.
    """
    with atomic_file(path) as scratch:
        with open(scratch, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
    return Path(path)


def atomic_write_json(path: str | Path, value, *, sort_keys: bool = False) -> Path:
    """`value` as JSON (indent 2, one trailing newline) written with `atomic_write_text`. Returns `path`."""
    return atomic_write_text(path, json.dumps(value, indent=2, sort_keys=sort_keys) + "\n")


def check_destination(dest: str | Path, *, overwrite: bool = False, label: str | None = None,
                      advice: str = "choose another output directory") -> Path:
    """Refuse, with a one-line InvalidInputError, a `dest` that is a file, or a directory that already
    holds files unless `overwrite`. A missing or empty directory passes. Writes nothing; returns `dest`.

    The messages read "<label> exists and is not a directory" and "<label> already holds files;
    <advice>", where label defaults to the path itself.
    """
    dest = Path(dest)
    label = label or str(dest)
    if dest.exists() and not dest.is_dir():
        raise InvalidInputError(f"{label} exists and is not a directory")
    if dest.is_dir() and any(dest.iterdir()) and not overwrite:
        raise InvalidInputError(f"{label} already holds files; {advice}")
    return dest


@contextlib.contextmanager
def atomic_directory(dest: str | Path, *, overwrite: bool = False, keep_existing: bool = False) -> Iterator[Path]:
    """A fresh scratch directory beside `dest` for the body to fill; renamed to `dest` if the body
    finishes, removed (with everything in it) if it raises. Missing parents of `dest` are created.

    Before anything is written, `dest` is checked with `check_destination`: a file, or a directory
    that holds files, is refused unless `overwrite`. An empty directory, or any directory under
    `overwrite`, is replaced: it is renamed aside, the scratch renamed in, then the old one deleted.

    keep_existing: for caches that several processes may fill at once with the same content. No
    check before writing; if `dest` is a non-empty directory when the scratch is ready (another
    process published first), theirs is kept and the scratch dropped, without an error.

    An unwritable parent is an InvalidInputError "cannot write to <parent>: <reason>".
    """
    dest = Path(dest)
    if not keep_existing:
        check_destination(dest, overwrite=overwrite)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    except OSError as exc:
        raise InvalidInputError(f"cannot write to {dest.parent}: {exc.strerror or exc}") from None
    try:
        yield scratch
        os.chmod(scratch, 0o777 & ~_umask())
        _publish(scratch, dest, keep_existing)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _publish(scratch: Path, dest: Path, keep_existing: bool) -> None:
    if keep_existing:
        try:
            os.rename(scratch, dest)
        except OSError:
            if not dest.is_dir():  # a real failure, not a race lost to another process
                raise
        return
    if dest.is_dir():  # empty, or overwrite asked for: move the old one aside, then drop it
        old = dest.with_name(f".{dest.name}-old-{os.getpid()}")
        os.rename(dest, old)
        os.rename(scratch, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(scratch, dest)


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it; set straight back
    os.umask(mask)
    return mask
