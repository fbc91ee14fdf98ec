"""Atomic writes (speculative/fileio.py): whole or absent, never a scratch left behind."""

import json
import os
import stat

import pytest

from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.fileio import (atomic_directory, atomic_file, atomic_write_json, atomic_write_text,
                                           check_destination)


class Boom(Exception):
    pass


def names(directory):
    return sorted(p.name for p in directory.iterdir())


def mode(path):
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


# --- files -------------------------------------------------------------------------------------


def test_write_text_publishes_the_text_with_a_normal_mode(tmp_path, umask_022):
    path = atomic_write_text(tmp_path / "a.txt", "héllo\n")
    assert path == tmp_path / "a.txt"
    assert path.read_text(encoding="utf-8") == "héllo\n"
    assert mode(path) == 0o644  # not mkstemp's private 0o600
    assert names(tmp_path) == ["a.txt"]


def test_write_text_replaces_an_existing_file(tmp_path):
    (tmp_path / "a.txt").write_text("old")
    atomic_write_text(tmp_path / "a.txt", "new")
    assert (tmp_path / "a.txt").read_text() == "new"
    assert names(tmp_path) == ["a.txt"]


def test_write_json_is_indented_with_a_trailing_newline(tmp_path):
    atomic_write_json(tmp_path / "a.json", {"b": 1, "a": [1, 2]}, sort_keys=True)
    text = (tmp_path / "a.json").read_text()
    assert text == json.dumps({"a": [1, 2], "b": 1}, indent=2) + "\n"
    atomic_write_json(tmp_path / "b.json", {"b": 1, "a": 2})
    assert list(json.loads((tmp_path / "b.json").read_text())) == ["b", "a"]  # insertion order kept


def test_a_file_write_that_raises_leaves_no_file_and_no_scratch(tmp_path):
    with pytest.raises(Boom):
        with atomic_file(tmp_path / "a.bin") as scratch:
            scratch.write_bytes(b"half")
            raise Boom
    assert names(tmp_path) == []


def test_a_file_write_that_raises_leaves_the_old_file_untouched(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"old")
    with pytest.raises(Boom):
        with atomic_file(tmp_path / "a.bin") as scratch:
            scratch.write_bytes(b"new")
            raise Boom
    assert (tmp_path / "a.bin").read_bytes() == b"old"
    assert names(tmp_path) == ["a.bin"]


def test_the_scratch_file_sits_beside_the_destination_under_a_hidden_name(tmp_path):
    with atomic_file(tmp_path / "a.bin") as scratch:
        assert scratch.parent == tmp_path and scratch.name.startswith(".a.bin.")
        assert not (tmp_path / "a.bin").exists()  # nothing under the real name until the body is done
        scratch.write_bytes(b"x")
    assert (tmp_path / "a.bin").read_bytes() == b"x"


# --- directories -------------------------------------------------------------------------------


def test_a_directory_appears_whole_with_a_normal_mode(tmp_path, umask_022):
    dest = tmp_path / "deep" / "out"
    with atomic_directory(dest) as scratch:
        assert scratch.parent == dest.parent and scratch.name.startswith(".out-")
        (scratch / "a.txt").write_text("a")
        assert not dest.exists()
    assert names(dest) == ["a.txt"]
    assert names(dest.parent) == ["out"]
    assert mode(dest) == 0o755  # not mkdtemp's private 0o700


def test_a_directory_write_that_raises_leaves_no_destination_and_no_scratch(tmp_path):
    with pytest.raises(Boom):
        with atomic_directory(tmp_path / "out") as scratch:
            (scratch / "a.txt").write_text("a")
            raise Boom
    assert names(tmp_path) == []


@pytest.mark.parametrize("content", ["file", "directory"])
def test_an_occupied_destination_is_refused_before_anything_is_written(tmp_path, content):
    dest = tmp_path / "out"
    if content == "file":
        dest.write_text("x")
        expected = f"{dest} exists and is not a directory"
    else:
        dest.mkdir()
        (dest / "keep.txt").write_text("x")
        expected = f"{dest} already holds files; choose another output directory"
    entered = False
    with pytest.raises(InvalidInputError) as info:
        with atomic_directory(dest):
            entered = True
    assert str(info.value) == expected and "\n" not in str(info.value)
    assert not entered
    assert names(tmp_path) == ["out"]


def test_a_file_is_refused_even_with_overwrite(tmp_path):
    (tmp_path / "out").write_text("x")
    with pytest.raises(InvalidInputError, match="exists and is not a directory"):
        with atomic_directory(tmp_path / "out", overwrite=True):
            pass


def test_an_empty_directory_is_replaced(tmp_path):
    (tmp_path / "out").mkdir()
    with atomic_directory(tmp_path / "out") as scratch:
        (scratch / "a.txt").write_text("a")
    assert names(tmp_path / "out") == ["a.txt"]
    assert names(tmp_path) == ["out"]


def test_overwrite_replaces_the_whole_directory(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    with atomic_directory(dest, overwrite=True) as scratch:
        (scratch / "new.txt").write_text("new")
    assert names(dest) == ["new.txt"]  # replaced, not merged
    assert names(tmp_path) == ["out"]  # the old one, moved aside, is gone


def test_overwrite_that_raises_keeps_the_old_directory(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    with pytest.raises(Boom):
        with atomic_directory(dest, overwrite=True) as scratch:
            (scratch / "new.txt").write_text("new")
            raise Boom
    assert names(dest) == ["old.txt"]
    assert names(tmp_path) == ["out"]


def test_an_unwritable_parent_is_a_one_line_error(tmp_path):
    (tmp_path / "blocker").write_text("a file where a directory should be")
    with pytest.raises(InvalidInputError) as info:
        with atomic_directory(tmp_path / "blocker" / "out"):
            pass
    assert str(info.value).startswith(f"cannot write to {tmp_path / 'blocker'}: ")
    assert "\n" not in str(info.value)


def test_keep_existing_keeps_what_another_process_published_first(tmp_path):
    dest = tmp_path / "cache"
    with atomic_directory(dest, keep_existing=True) as scratch:
        (scratch / "ours.txt").write_text("ours")
        dest.mkdir()  # the other process wins the race
        (dest / "theirs.txt").write_text("theirs")
    assert names(dest) == ["theirs.txt"]
    assert names(tmp_path) == ["cache"]


def test_keep_existing_publishes_when_nobody_else_did(tmp_path):
    with atomic_directory(tmp_path / "cache", keep_existing=True) as scratch:
        (scratch / "ours.txt").write_text("ours")
    assert names(tmp_path / "cache") == ["ours.txt"]


def test_keep_existing_still_fails_on_a_file_in_the_way(tmp_path):
    dest = tmp_path / "cache"
    with pytest.raises(OSError):
        with atomic_directory(dest, keep_existing=True):
            dest.write_text("not a directory")
    assert dest.read_text() == "not a directory"
    assert names(tmp_path) == ["cache"]


def test_check_destination_names_the_option_and_the_way_out(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "a").write_text("a")
    with pytest.raises(InvalidInputError) as info:
        check_destination(tmp_path / "out", label="--out x", advice="pass --overwrite")
    assert str(info.value) == "--out x already holds files; pass --overwrite"
    assert check_destination(tmp_path / "out", overwrite=True) == tmp_path / "out"
    assert check_destination(tmp_path / "missing") == tmp_path / "missing"
