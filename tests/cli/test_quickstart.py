"""`draftsmith quickstart --tiny`: the whole flow on the tiny target with a reduced budget."""

import json

import pytest
import torch

from draftsmith.cli import main


@pytest.mark.slow
def test_quickstart_tiny_end_to_end_and_second_run_reuses(tmp_path, capsys):
    out = tmp_path / "qs"
    assert main(["quickstart", "--tiny", "--out", str(out), "--no-progress", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "on cpu" in err
    for n in range(1, 6):
        assert f"[{n}/5]" in err
    assert "speedup" in err and "identical to plain greedy" in err
    summary = (out / "quickstart.md").read_text()
    assert "eagle (trained)" in summary and "early-exit:1" in summary and "ngram" in summary
    reports = {p.parent.name: json.loads(p.read_text()) for p in (out / "eval").glob("*/report.json")}
    assert set(reports) == {"eagle", "early-exit-1", "ngram"}
    # the trained drafter is also decoded as generate and serve decode by default; the baselines are not
    assert [v["decoder"] for v in reports["eagle"]["speed"]] == ["plain", "speculative", "adaptive"]
    assert all(v["decoder"] != "adaptive" for name in ("early-exit-1", "ngram") for v in reports[name]["speed"])
    adaptive = next(v for v in reports["eagle"]["speed"] if v["decoder"] == "adaptive")
    row = next(line for line in summary.splitlines() if line.startswith("| eagle (trained)"))
    assert f"| {adaptive['tokens_per_s']:.1f} | **{adaptive['speedup']:.2f}x** |" in row
    assert "| - | - |" in next(line for line in summary.splitlines() if line.startswith("| ngram"))
    assert all(r["exactness"]["passed"] for r in reports.values())
    assert list((out / "eval" / "eagle").glob("*.png"))
    trained = max(a["al"] for a in reports["eagle"]["acceptance"])
    assert trained > 1.2  # the trained drafter is accepted, not just exact

    stamp = (out / "train" / "drafter" / "config.json").stat().st_mtime_ns
    assert main(["quickstart", "--tiny", "--out", str(out), "--no-progress"]) == 0
    assert "reusing" in capsys.readouterr().err
    assert (out / "train" / "drafter" / "config.json").stat().st_mtime_ns == stamp
    # the same table again, from the reports the first run wrote
    assert (out / "quickstart.md").read_text().split("Total time")[0] == summary.split("Total time")[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_quickstart_refuses_a_device_this_machine_lacks(tmp_path, capsys):
    assert main(["quickstart", "--tiny", "--out", str(tmp_path / "qs"), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error:") and "CUDA is not available" in err
    assert not (tmp_path / "qs").exists()


@pytest.mark.slow
def test_quickstart_trains_another_kind_beside_the_default_on_the_same_data(tmp_path, capsys):
    out = tmp_path / "qs"
    assert main(["quickstart", "--tiny", "--kind", "eagle3", "--out", str(out), "--no-progress", "--device", "cpu"]) == 0
    assert "eagle3, 1 layer" in capsys.readouterr().err
    config = json.loads((out / "train-eagle3" / "drafter" / "config.json").read_text())
    assert "eagle3" in json.dumps(config) and not (out / "train").exists()
    summary = (out / "quickstart.md").read_text()
    assert "eagle3 (trained)" in summary
    report = json.loads((out / "eval" / "eagle3" / "report.json").read_text())
    assert report["exactness"]["passed"]
