"""benchmarks/by_category.py: each category's speedup over plain with a CI from the paired (prompt, repetition)
decodes, and a category called slower only when its whole CI is below plain."""

import json


def test_a_category_is_slower_only_when_its_whole_ci_is_below_plain(load_benchmark):
    bench = load_benchmark("by_category")
    rows = [{"category": "math", "speedup_vs_plain": 1.2, "speedup_ci": [1.1, 1.3]},
            {"category": "translation", "speedup_vs_plain": 0.98, "speedup_ci": [0.95, 1.01]},
            {"category": "summarization", "speedup_vs_plain": 0.9, "speedup_ci": [0.85, 0.96]},
            {"category": "qa", "speedup_vs_plain": 1.01, "speedup_ci": [0.97, 1.05]}]
    assert bench.behind_plain(rows) == (["summarization"], ["translation"])


def test_every_row_has_its_paired_ci(tmp_path, capsys, load_benchmark):
    bench = load_benchmark("by_category")
    out = tmp_path / "c.json"
    assert bench.main(["--target", "tiny-lm:0:4", "--drafter", "ngram", "--prompts-file", "builtin:unlike_training",
                       "--per-category", "2", "--max-new-tokens", "6", "--reps", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["category"] for r in rows} == {"translation", "summarization", "long_context_qa"}
    for r in rows:
        low, high = r["speedup_ci"]
        assert low <= r["speedup_vs_plain"] <= high
        if r["system"] == "plain":
            assert low == high == r["speedup_vs_plain"] == 1.0  # plain against itself, pair by pair
    printed = capsys.readouterr().out
    assert "vs plain [95% CI]" in printed and printed.count("below plain within the CI:") == 2
