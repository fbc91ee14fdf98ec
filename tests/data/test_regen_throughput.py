"""benchmarks/regen_throughput.py: schedules and dtypes side by side in one table; bad choices exit 2."""


def test_dtypes_side_by_side(tmp_path, capsys, load_benchmark):
    import json

    bench = load_benchmark("regen_throughput")
    out = tmp_path / "r.json"
    assert bench.main(["--target", "tiny:0", "--prompts", "builtin:quickstart", "--count", "3", "--max-new-tokens", "4",
                       "--batch-sizes", "2", "--dtypes", "float32,bfloat16", "--json", str(out)]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert table[0] == "| dtype | B | static tok/s | engine tok/s | engine / static | engine against float32 |"
    assert [row.split(" | ")[:2] for row in table[1:]] == [["| float32", "2"], ["| bfloat16", "2"]]
    assert table[1].endswith("| 1.00x |")
    runs = json.loads(out.read_text())["runs"]
    assert {(r["dtype"], r["schedule"]) for r in runs} == {(d, s) for d in ("float32", "bfloat16")
                                                          for s in ("static", "engine")}
    assert all(r["identical"] and r["tokens"] > 0 for r in runs)


def test_unknown_dtype_or_schedule_is_one_error_line(capsys, load_benchmark):
    bench = load_benchmark("regen_throughput")
    assert bench.main(["--target", "tiny:0", "--dtypes", "float8"]) == 2
    assert bench.main(["--target", "tiny:0", "--schedules", "fast"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)
