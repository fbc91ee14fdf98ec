"""`draftsmith eval` end to end on tiny models: the report, a perfect drafter, and the re-tune verdict."""

import json
import os

import pytest

from draftsmith.cli import main
from draftsmith.eval.verdict import compare_reports

SWEEP = ["--modes", "greedy,sample:1.0", "--draft-lens", "1,3", "--batch-sizes", "1,2", "--max-new-tokens", "12",
         "--fidelity-contexts", "2", "--fidelity-samples", "100"]


@pytest.fixture(scope="module")
def base_run(models, prompt_file, tmp_path_factory):
    """The target against a saved copy of itself, logged to an offline W&B run; later the baseline."""
    out = tmp_path_factory.mktemp("runs") / "base"
    saved = {k: os.environ.get(k) for k in ("WANDB_MODE", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")}
    os.environ.update(WANDB_MODE="offline", WANDB_CONFIG_DIR=str(out.parent / "wandb-config"),
                      WANDB_CACHE_DIR=str(out.parent / "wandb-cache"), WANDB_DATA_DIR=str(out.parent / "wandb-data"))
    try:
        code = main(["eval", "--target", str(models / "target"), "--drafter", str(models / "copy"),
                     "--prompts", str(prompt_file), *SWEEP, "--out", str(out), "--report-to", "wandb"])
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return code, out, json.loads((out / "report.json").read_text())


def test_perfect_drafter_accepts_everything_and_is_exact(base_run):
    code, _, report = base_run
    assert code == 0 and report["exit_code"] == 0
    for row in report["acceptance"]:  # 12 new tokens: a multiple of D + 1 for D = 1 and 3
        assert row["al"] == pytest.approx(row["draft_len"] + 1)
        assert row["predicted_al"] == pytest.approx(row["draft_len"] + 1)
        assert row["emitted_hist"][-1] == row["rounds"]
        assert all(p["rate"] == 1.0 for p in row["positions"])
    greedy = report["exactness"]["greedy"]
    assert greedy["share_identical"] == 1.0 and greedy["passed"] and not greedy["divergences"]
    assert {(c["decoder"], c["draft_len"], c["batch_size"]) for c in greedy["checks"]} == {
        ("speculative", 1, 1), ("speculative", 3, 1), ("adaptive", 4, 1), ("plain", 0, 2), ("speculative", 1, 2),
        ("speculative", 3, 2), ("adaptive", 4, 2)}  # the adaptive row (up to D=4, the default) is checked too
    (fidelity,) = report["exactness"]["sampling"]
    assert fidelity["passed"] and fidelity["samples_per_side"] == 100 and len(fidelity["contexts"]) == 2
    for q in report["quality"]:
        if q["mode"] == "greedy" and q["decoder"] == "speculative":
            assert q["identical_to_plain"] == 4


def test_report_schema_and_files(base_run):
    _, out, report = base_run
    assert report["schema"] == "draftsmith.eval/1"
    for key in ("settings", "target", "drafter", "prompts", "acceptance", "per_prompt", "exactness", "quality",
                "speed", "memory", "advice", "comparison", "exit_code"):
        assert key in report, key
    assert len(report["target"]["weight_hash"]) == 64 and len(report["target"]["tokenizer_hash"]) == 64
    assert report["drafter"]["weight_hash"] == report["target"]["weight_hash"]  # the copy has the same weights
    assert report["prompts"]["count"] == 4 and report["prompts"]["categories"] == {"chat": 2, "code": 2}
    acceptance = report["acceptance"][0]
    assert set(acceptance["by_category"]) == {"chat", "code"}
    assert len(acceptance["al_ci"]) == 2 and acceptance["al_ci"][0] <= acceptance["al"] <= acceptance["al_ci"][1]
    assert len(report["per_prompt"]) == 4 * 2 * 2
    speed = {(v["mode"], v["batch_size"], v["decoder"], v["draft_len"]) for v in report["speed"]}
    assert len(speed) == 2 * 2 * 4  # plain, D=1, D=3 and the adaptive row, per mode and batch size
    assert {(d, n) for _, _, d, n in speed} == {("plain", 0), ("speculative", 1), ("speculative", 3), ("adaptive", 4)}
    assert all(0 <= v["mean_draft_len"] <= 4 for v in report["speed"] if v["decoder"] == "adaptive")
    by_category = report["speed_by_category"]
    assert [(c["mode"], c["decoder"], c["draft_len"]) for c in by_category] == [
        (m, d, n) for m in ("greedy", "sample:1.0") for d, n in (("speculative", 1), ("speculative", 3), ("adaptive", 4))]
    for c in by_category:
        assert set(c["categories"]) == {"chat", "code"} and c["all"]["prompts"] == 4
        low, high = c["all"]["speedup_ci"]
        assert low <= c["all"]["speedup"] <= high
    row = report["speed"][1]
    assert row["speedup"] > 0 and row["latency_ms"]["p99"] >= row["latency_ms"]["p50"] > 0
    assert row["ttft_s"]["p50"] > 0 and row["compute_s_per_1k_tokens"] > 0
    ledger = report["memory"]["ledger"]
    assert [r["batch_size"] for r in ledger] == [1, 2] and ledger[1]["target_kv"] == 2 * ledger[0]["target_kv"]
    assert ledger[0]["target_kv"] == 2 * 3 * 2 * 16 * ledger[0]["context_len"] * 4  # 2 * layers * kv_heads * head_dim
    assert all(r["target_kv"] == r["batch_size"] * r["target_kv_per_request"] for r in ledger)
    assert report["memory"]["measured"]["per_batch_size"][0]["peak_bytes"] > 0
    for advice in report["advice"]:
        assert advice["recommended_draft_len"] in range(0, 4)
        assert [e["draft_len"] for e in advice["expected"]] == [0, 1, 2, 3]
    quality = report["quality"]
    assert any(q["reference_metric"] and q["reference_metric"]["name"] == "rougeL_f1" for q in quality)
    md = (out / "report.md").read_text()
    assert "## Acceptance" in md and "## Speed" in md and "## Draft-length advice" in md
    assert "## Speed against plain decoding, per category" in md and "| greedy: category |" in md
    assert "adaptive D<=4 (the default): slower than plain decoding in:" in md
    for name in ("al_histogram.png", "position_acceptance.png", "speed_vs_draft_len.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_wandb_offline_run_writes_files(base_run):
    _, out, _ = base_run
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert any(runs[0].rglob("*.wandb"))


def test_same_target_keeps(base_run, models, tmp_path):
    _, out, _ = base_run
    code = main(["eval", "--target", str(models / "target"), "--baseline", str(out / "report.json"),
                 "--batch-sizes", "1", "--fidelity-contexts", "0", "--out", str(tmp_path / "keep"), "--no-progress"])
    report = json.loads((tmp_path / "keep" / "report.json").read_text())
    verdict = report["comparison"]["verdict"]
    assert code == 0 and verdict["decision"] == "keep" and verdict["reason"].startswith("keep:")
    assert all(row["al"]["change"] == 0 for row in report["comparison"]["rows"])
    assert compare_reports(report, out)["verdict"]["decision"] == "keep"
    assert report["settings"]["max_new_tokens"] == 12  # read from the baseline


def test_changed_target_calls_for_retune(base_run, models, tmp_path):
    _, out, _ = base_run
    code = main(["eval", "--target", str(models / "changed"), "--baseline", str(out), "--batch-sizes", "1",
                 "--fidelity-contexts", "0", "--out", str(tmp_path / "retune"), "--no-progress"])
    report = json.loads((tmp_path / "retune" / "report.json").read_text())
    comparison = report["comparison"]
    assert code == 3 and report["exit_code"] == 3
    assert comparison["verdict"]["decision"] == "retune" and comparison["verdict"]["reason"].startswith("retune:")
    for row in comparison["rows"]:
        assert row["al"]["relative"] < -0.05 and row["al"]["relative_ci"][1] < 0
        assert set(row["by_category"]) == {"chat", "code"}
        assert len(row["positions"]) == row["draft_len"]
    assert "Change against the baseline" in (tmp_path / "retune" / "report.md").read_text()
    # The API on two finished reports reaches the same verdict as the run did.
    assert compare_reports(report, out / "report.json")["verdict"] == comparison["verdict"]
