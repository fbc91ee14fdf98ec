"""Bad prompt sources through the command line: one `error:` line and exit code 2, for `draftsmith eval`
and `draftsmith train` alike."""

import os
import subprocess
import sys

import pytest

from draftsmith.cli import main

EVAL = ["eval", "--target", "tiny:0", "--drafter", "ngram", "--modes", "greedy", "--draft-lens", "1",
        "--max-new-tokens", "4", "--fidelity-contexts", "0", "--no-progress"]


def one_error_line(capsys, argv) -> str:
    code = main(argv)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, lines)
    return lines[0]


@pytest.fixture
def latin1(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"prompt": "caf\u00e9 cr\u00e8me"}\n'.encode("latin-1"))
    return path


@pytest.mark.parametrize("prompts, extra, message", [
    ("builtin:nope", [], "no builtin prompt set 'nope' (builtin sets: arena_hard_v0.1, arithmetic"),
    ("hf:{repo}@validation", [], "has no split 'validation' (splits: train, test)"),
    ("hf:{repo}:nope", [], "BuilderConfig 'nope' not found"),
    ("hf:{repo}", [], "has no prompt column"),
    ("hf:{repo}", ["--prompt-column", "nope"], "has no column 'nope' (columns: query, topic)"),
    ("{latin1}", [], "is not UTF-8 text (line 1: byte 0xe9)"),
])
def test_eval_with_a_bad_prompt_source(prompts, extra, message, dataset_repo, latin1, tmp_path, capsys):
    spec = prompts.format(repo=dataset_repo, latin1=latin1)
    line = one_error_line(capsys, [*EVAL, "--prompts", spec, *extra, "--out", str(tmp_path / "out")])
    assert message in line


@pytest.mark.parametrize("override, message", [
    ("data.prompts=[builtin:nope]", "no builtin prompt set 'nope'"),
    ("data.prompts=[hf:{repo}@dev]", "has no split 'dev'"),
    ("data.prompts=[hf:{repo}:chat]", "has no prompt column"),
    ("data.columns.conversation=topic", "column 'topic' holds no list of messages"),
    ("data.columns.turns=nope", "has no column 'nope'"),
])
def test_train_with_a_bad_prompt_source(override, message, dataset_repo, tmp_path, capsys):
    argv = ["train", "tiny-draft-lm", f"output_dir={tmp_path / 'run'}", "target=tiny:0",
            f"data.prompts=[hf:{dataset_repo}]", override.format(repo=dataset_repo), "tracking.report_to=none",
            "--no-progress"]
    assert message in one_error_line(capsys, argv)


@pytest.mark.slow  # a fresh interpreter spends seconds importing; the default run has one such check
def test_a_missing_hub_dataset_offline_is_one_line(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-m", "draftsmith", *EVAL, "--prompts", "hf:nobody/no-such-dataset",
                             "--out", str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: cannot load dataset 'hf:nobody/no-such-dataset'")
