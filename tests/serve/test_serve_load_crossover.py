"""benchmarks/serve_load.py's analysis: where a drafter's p50 time per output token meets plain's, and the
AL per rate."""


def rows(rates, tpots):
    return [{"rate": r, "tpot": {"p50": t}} for r, t in zip(rates, tpots)]


def test_crossover_is_interpolated_and_a_drafter_slower_from_the_start_never_crosses(load_benchmark):
    crossover = load_benchmark("serve_load").crossover
    plain = rows([0.1, 0.3, 0.9], [60.0, 90.0, 130.0])
    rate, how = crossover(plain, rows([0.1, 0.3, 0.9], [40.0, 80.0, 150.0]))
    assert how == "crosses" and abs(rate - (0.3 + 0.6 * 10 / 30)) < 1e-9
    assert crossover(plain, rows([0.1, 0.3, 0.9], [70.0, 140.0, 170.0])) == (None, "never ahead")
    assert crossover(plain, rows([0.1, 0.3, 0.9], [30.0, 60.0, 100.0])) == (None, "ahead at every rate")


def test_a_drafter_behind_at_low_load_and_ahead_under_load_overtakes(load_benchmark):
    crossover = load_benchmark("serve_load").crossover
    plain = rows([0.1, 0.3, 0.9], [105.0, 182.0, 253.0])
    rate, how = crossover(plain, rows([0.1, 0.3, 0.9], [115.0, 154.0, 226.0]))
    assert how == "overtakes" and abs(rate - (0.1 + 0.2 * 10 / 38)) < 1e-9


def test_the_mean_al_per_rate_comes_from_the_servers_metrics(monkeypatch, load_benchmark):
    from draftsmith.speculative.serve_metrics import ServeMetrics

    module = load_benchmark("serve_load")
    metrics = ServeMetrics(draft_len=4)

    class Reply:
        @property
        def text(self):
            return metrics.render().decode()

    monkeypatch.setattr(module.httpx, "get", lambda url, timeout: Reply())
    before = module.emitted_per_round("http://server")
    for tokens in (1, 3, 5, 3):  # four row-rounds
        metrics.round_tokens.observe(tokens)
    after = module.emitted_per_round("http://server")
    assert before == (0.0, 0.0) and (after[0] - before[0]) / (after[1] - before[1]) == 3.0


def test_a_failed_request_is_counted_and_the_rest_summarised(load_benchmark):
    import argparse

    import pytest

    module = load_benchmark("serve_load")
    ok = {"start": 0.0, "ttft": 0.3, "e2e": 2.0, "tokens": 20, "tpot": 0.09, "offset": 1.0}
    results = [ok, {"error": "internal error", "offset": 2.0}, ok | {"start": 1.0, "offset": 3.0}]
    summary = module.summarise(results, 0.3, argparse.Namespace(slo_ttft=2.0, slo_tpot=0.25))
    assert summary["errors"] == 1 and summary["requests"] == 2 and summary["tpot"]["p50"] == 0.09
    assert summary["slo_met"] == 2 / 3  # a failed request misses the SLO
    with pytest.raises(RuntimeError, match="every request"):
        module.summarise([{"error": "x", "offset": 1.0}], 0.3, argparse.Namespace(slo_ttft=2.0, slo_tpot=0.25))
