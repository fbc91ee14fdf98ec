"""Bad input to `draftsmith eval`: one `error:` line and exit code 2, before any decoding where possible."""

import json
import subprocess
import sys

import pytest

from draftsmith.cli import main

SMALL = ["--modes", "greedy", "--draft-lens", "1", "--max-new-tokens", "4",
         "--fidelity-contexts", "0", "--no-progress"]


@pytest.fixture(scope="module")
def baseline(models, prompt_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("bad-input") / "baseline"
    assert main(["eval", "--target", str(models / "target"), "--drafter", "ngram", "--prompts", str(prompt_file),
                 *SMALL, "--out", str(out)]) == 0
    return out / "report.json"


def run_eval(capsys, *args):
    code = main(["eval", *args])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    return code, lines


def edited(baseline, tmp_path, edit):
    report = json.loads(baseline.read_text())
    edit(report)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(report))
    return path


@pytest.mark.parametrize("case, message", [
    ("missing prompts", "no such file or directory"),
    ("empty prompts", "is empty"),
    ("unknown column", "has no column 'nope'"),
    ("mismatched tokenizer", "tokenizers differ"),
    ("bad mode", "unknown mode 'beam'"),
    ("bad draft lens", "--draft-lens: 'x' is not an integer"),
    ("negative adaptive draft len", "--adaptive-draft-len must be an integer >= 0"),
    ("no drafter", "eval needs --drafter"),
])
def test_bad_arguments(case, message, models, prompt_file, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    args = {"target": str(models / "target"), "drafter": "ngram", "prompts": str(prompt_file)}
    extra = []
    if case == "missing prompts":
        args["prompts"] = str(tmp_path / "absent.jsonl")
    elif case == "empty prompts":
        args["prompts"] = str(empty)
    elif case == "unknown column":
        extra = ["--prompt-column", "nope"]
    elif case == "mismatched tokenizer":
        args["drafter"] = str(models / "other_tok")
    elif case == "bad mode":
        extra = ["--modes", "beam"]
    elif case == "bad draft lens":
        extra = ["--draft-lens", "1,x"]
    elif case == "negative adaptive draft len":
        extra = ["--adaptive-draft-len", "-1"]
    elif case == "no drafter":
        args.pop("drafter")
    flags = [x for k, v in args.items() for x in (f"--{k}", v)]
    code, lines = run_eval(capsys, *flags, *SMALL, *extra, "--out", str(tmp_path / "out"))
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


@pytest.mark.parametrize("edit, message", [
    (lambda r: r.update(schema="draftsmith.eval/0"), "has schema 'draftsmith.eval/0'"),
    (lambda r: r.pop("per_prompt"), "no 'per_prompt' field"),
    (lambda r: r["per_prompt"][0].pop("rounds"), "a record lacks 'rounds'"),
    (lambda r: r["settings"].update(bogus=1), "unknown eval setting 'bogus'"),
    (lambda r: r["settings"].update(max_new_tokens=99), "max_new_tokens is 4 here but 99"),
    (lambda r: r["prompts"].update(fingerprint="0" * 64), "the prompt set (4 prompts) differs"),
    (lambda r: r["target"].update(tokenizer_hash="0" * 64), "tokenizer differs"),
])
def test_incompatible_or_corrupt_baseline(edit, message, baseline, models, tmp_path, capsys):
    path = edited(baseline, tmp_path, edit)
    extra = ["--max-new-tokens", "4"] if "max_new_tokens" in message else []
    code, lines = run_eval(capsys, "--target", str(models / "target"), "--baseline", str(path), *extra,
                           "--out", str(tmp_path / "out"), "--no-progress")
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def test_refuses_a_non_empty_out_dir(baseline, models, prompt_file, tmp_path, capsys):
    code, lines = run_eval(capsys, "--target", str(models / "target"), "--drafter", "ngram", "--prompts",
                           str(prompt_file), *SMALL, "--out", str(baseline.parent))
    assert code == 2 and "already holds files" in lines[-1] and "--overwrite" in lines[-1]


@pytest.mark.slow  # a fresh interpreter spends seconds importing; the default run has one such check
def test_corrupt_baseline_in_a_subprocess_has_no_traceback(baseline, models, tmp_path):
    corrupt = tmp_path / "report.json"
    corrupt.write_text(baseline.read_text()[:200])
    proc = subprocess.run([sys.executable, "-m", "draftsmith", "eval", "--target", str(models / "target"),
                           "--baseline", str(corrupt), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [lines[-1]] and lines[-1].startswith("error: corrupt baseline report")
    assert "Traceback" not in proc.stderr
