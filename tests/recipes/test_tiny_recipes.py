"""End to end on the tiny recipes: regenerate data, train, checkpoint, resume, serve the drafter."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.speculative.checkpoint import read_drafter_info
from draftsmith.speculative.drafters import build_proposer
from draftsmith.speculative.generate import SpeculativeDecoder
from draftsmith.speculative.loading import load_model
from draftsmith.train.cli import main as train_main
from draftsmith.train.config import load_recipe
from draftsmith.train.loop import train
from draftsmith.speculative.options import DecodeOptions


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    """One regeneration of the tiny target's answers, shared by every run in this module."""
    return tmp_path_factory.mktemp("tiny-data")


def tiny(name, out, data_cache, *extra):
    return load_recipe(name, [f"output_dir={out}", f"data.cache_dir={data_cache}", *extra])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-draft-lm", "tiny-medusa", "tiny-eagle"])
def test_trained_drafter_beats_untrained_and_serves_exactly(name, tmp_path, data_cache, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / name
    summary = train(tiny(name, out, data_cache), progress=False)
    before, after = summary["al_before"]["acceptance_length"], summary["al_after"]["acceptance_length"]
    assert after > before + 0.3, (before, after)  # clearly higher on the held-out prompts
    assert summary["tokens_trained"] > 0 and summary["steps"] == 60

    drafter = out / "drafter"
    info = read_drafter_info(drafter)
    assert info.kind == name.removeprefix("tiny-")
    assert info.target_name == "tiny-lm:0:4" and info.recipe["name"] == name
    assert info.training["al_after"]["acceptance_length"] == after
    assert list((out / "checkpoints").glob("step-*"))  # periodic checkpoints were written
    assert list(out.glob("wandb/offline-run-*/run-*.wandb"))  # W&B ran offline and wrote its run file

    target = load_model("tiny-lm:0:4")
    proposer = build_proposer(str(drafter), target)
    prompts = [[1, 72, 101, 108, 108, 111], [1, 87, 104, 121, 63]]
    decoder = SpeculativeDecoder(target.model, proposer, stop_token_ids=[2])
    plain = SpeculativeDecoder(target.model, None, stop_token_ids=[2])
    assert decoder.generate(prompts, options=DecodeOptions(max_new_tokens=24, draft_len=3)).tokens == \
        plain.generate(prompts, options=DecodeOptions(max_new_tokens=24)).tokens


def run_train_subprocess(args, **kwargs):
    env = dict(os.environ, WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    return subprocess.Popen([sys.executable, "-m", "draftsmith.train", *args, "--no-progress"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def drafter_weights(out: Path) -> dict:
    return load_file(str(out / "drafter" / "model.safetensors"))


@pytest.mark.slow
def test_sigkill_and_resume_equals_an_uninterrupted_run(tmp_path, data_cache):
    common = ["tiny-draft-lm", f"data.cache_dir={data_cache}", "train.steps=20", "train.checkpoint_every=10",
              "train.eval_every=15", "tracking.report_to=none", "train.warmup_steps=3"]
    straight = run_train_subprocess([*common, f"output_dir={tmp_path / 'straight'}"])
    assert straight.wait(timeout=600) == 0, straight.stderr.read()

    out = tmp_path / "killed"
    victim = run_train_subprocess([*common, f"output_dir={out}"])
    deadline = time.time() + 600
    while not list((out / "checkpoints").glob("step-*")) and time.time() < deadline and victim.poll() is None:
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    assert not (out / "drafter").exists()  # killed mid-run: the step-10 checkpoint is all it left
    resumed = run_train_subprocess([*common, f"output_dir={out}"])
    stdout, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr
    assert "resuming from" in stderr

    a, b = drafter_weights(tmp_path / "straight"), drafter_weights(out)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed"] and summary["steps"] == 20


@pytest.mark.slow
def test_accelerate_launch_with_two_processes(tmp_path, data_cache):
    env = dict(os.environ, WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    out = tmp_path / "ddp"
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--cpu",
         "-m", "draftsmith.train", "tiny-medusa", f"output_dir={out}", f"data.cache_dir={data_cache}",
         "train.steps=6", "train.eval_every=0", "train.checkpoint_every=3", "tracking.report_to=none",
         "--no-progress"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "drafter" / "heads.safetensors").is_file()
    assert json.loads((out / "summary.json").read_text())["steps"] == 6


def bad_run(capsys, *args):
    code = train_main([*args, "--no-progress"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in err
    return lines[-1]


def test_bad_input_is_refused_with_one_line(tmp_path, data_cache, capsys):
    base = ["tiny-draft-lm", f"output_dir={tmp_path / 'run'}", "tracking.report_to=none"]
    assert "unknown key 'train.stepz'" in bad_run(capsys, *base, "train.stepz=3")
    assert "train.steps" in bad_run(capsys, *base, "train.steps=lots")
    assert "data file not found" in bad_run(capsys, *base, f"data.prompts=[{tmp_path / 'missing.jsonl'}]")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "empty.jsonl" in bad_run(capsys, *base, f"data.prompts=[{empty}]")
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps({"prompt": f"hi {i}"}) + "\n" for i in range(3)))
    assert "data.heldout" in bad_run(capsys, *base, f"data.prompts=[{few}]")

    other = tmp_path / "other-tokenizer"
    model = load_model("tiny:1:1")
    model.model.save_pretrained(other)
    model.tokenizer.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    model.tokenizer.save_pretrained(other)
    assert "tokenizers differ" in bad_run(capsys, *base, f"drafter.init_from={other}",
                                          f"data.cache_dir={data_cache}")

    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if not os.access(locked, os.W_OK):  # root can write anywhere; then this case cannot be built
            assert "cannot write" in bad_run(capsys, "tiny-draft-lm", f"output_dir={locked / 'run'}")
    finally:
        locked.chmod(0o700)
    blocker = tmp_path / "a-file"
    blocker.write_text("keep me")
    assert "cannot write" in bad_run(capsys, "tiny-draft-lm", f"output_dir={blocker / 'run'}")
    assert blocker.read_text() == "keep me"


def test_finished_run_is_never_overwritten(tmp_path, capsys):
    out = tmp_path / "done"
    (out / "drafter").mkdir(parents=True)
    (out / "drafter" / "config.json").write_text("{}")
    message = bad_run(capsys, "tiny-medusa", f"output_dir={out}", "tracking.report_to=none")
    assert "already holds a finished run" in message
    assert (out / "drafter" / "config.json").read_text() == "{}"


@pytest.mark.slow
@pytest.mark.parametrize("keep_best", [True, False])
def test_keep_best_writes_the_weights_of_the_best_evaluation(keep_best, tmp_path, data_cache, monkeypatch):
    """Held-out ALs scripted to peak at step 10 of 30: with train.keep_best the drafter written is the
    one evaluated at step 10 (and the summary says so); without it, the last one."""
    import draftsmith.train.loop as loop

    scripted = iter([1.1, 2.0, 1.5, 1.2])  # steps 0, 10, 20 and the final 30
    snapshots = []

    def scripted_al(drafter, kind, target, prompts, **_):
        snapshots.append({k: v.detach().clone() for k, v in drafter.state_dict().items()})
        return {"acceptance_length": next(scripted), "position_acceptance": []}

    monkeypatch.setattr(loop, "acceptance_length", scripted_al)
    out = tmp_path / "run"
    recipe = tiny("tiny-draft-lm", out, data_cache, "train.steps=30", "train.eval_every=10",
                  "train.checkpoint_every=10", "tracking.report_to=none", f"train.keep_best={keep_best}")
    summary = train(recipe, progress=False)
    assert len(snapshots) == 4
    kept = 1 if keep_best else 3
    assert summary["kept_step"] == (10 if keep_best else 30)
    assert summary["al_after"]["acceptance_length"] == (2.0 if keep_best else 1.2)
    saved = drafter_weights(out)
    common = [k for k in saved if k in snapshots[kept]]
    assert common
    assert all(torch.equal(saved[k], snapshots[kept][k]) for k in common)
    assert not all(torch.equal(saved[k], snapshots[4 - kept][k]) for k in common)  # steps 10 and 30 differ


@pytest.mark.slow
def test_a_time_budget_takes_the_steps_that_fit_and_ends_the_schedule_there(tmp_path, data_cache, monkeypatch):
    """100,000 steps asked, 6 seconds given: the run times its first steps, takes what fits, and its learning
    rate reaches zero at the last of them; the summary says how many."""
    out = tmp_path / "budget"
    recipe = tiny("tiny-eagle", out, data_cache, "train.steps=100000", "train.time_budget_min=0.1",
                  "train.eval_every=0", "train.checkpoint_every=0", "tracking.report_to=none")
    lrs = []
    from draftsmith.train import loop

    real = loop.train_step
    monkeypatch.setattr(loop, "train_step", lambda *a, **k: (lambda m: lrs.append(m["lr"]) or m)(real(*a, **k)))
    summary = train(recipe, progress=False)
    assert loop.BUDGET_PROBE_STEPS <= summary["steps"] == summary["planned_steps"] < 100000
    assert summary["loop_seconds"] < 2 * 6  # about the budget: steps and the evaluations before and after
    assert len(lrs) == summary["steps"] and lrs[-1] == 0.0 and max(lrs) == pytest.approx(recipe.train.lr)
    assert read_drafter_info(out / "drafter").training["planned_steps"] == summary["steps"]
