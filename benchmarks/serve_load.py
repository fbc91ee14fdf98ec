"""Latency under load: `draftsmith serve` with plain decoding and with drafters, open-loop, in one run.

    python benchmarks/serve_load.py [--target T] [--drafters none,early-exit:10,ngram] [--rates 0.1,0.2,0.4,0.8]
                                    [--requests 16] [--duration 120] [--max-tokens 64] [--draft-len 4]
                                    [--max-batch 8] [--slo-ttft 2] [--slo-tpot 0.25] [--out serve-load/]

For each configuration (a drafter, or `none` for plain decoding) the script starts a server on
127.0.0.1 (a free port, loopback only), warms it up, then for each request rate sends requests with
Poisson arrivals (exponential gaps, seeded: every configuration sees the same arrival times and
prompts), open loop: a request is sent at its time whether or not earlier ones have finished. A rate
sends at most --requests requests and stops sending after --duration seconds; every request streams
(chat completions, greedy, so each configuration must emit the same text: checked).

Per request: TTFT (send to first token), TPOT (time per output token after the first: (e2e - TTFT) /
(tokens - 1)), e2e latency. Per rate: their p50/p95/p99, the mean AL (tokens a row emitted per round,
from the server's /metrics before and after the rate), throughput (output tokens / s from the first
send to the last token), goodput (requests / s meeting both SLOs, TTFT <= --slo-ttft and TPOT <=
--slo-tpot), the achieved request rate. Per configuration: the server's peak RSS (VmHWM).

Out: results.json, and latency.png: p50 (solid) and p99 (dashed) TPOT against throughput per
configuration, and p50 TPOT against the offered rate with the crossover marked: the rate at which a
drafter's p50 TPOT stops beating plain decoding's, or (a drafter whose drafts do not pay alone, in a
batch that prices them at its size) starts to (linear interpolation between the two rates that bracket
the sign change; none within the rates tried: "ahead at every rate" or "never ahead").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from draftsmith.data.prompts import load_conversations

MODEL = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, drafter: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "draftsmith", "serve", "--port", str(port), "--host", "127.0.0.1",
               "--served-model-name", MODEL, "--max-batch", str(args.max_batch), "--draft-len", str(args.draft_len),
               "--device", args.device, "--dtype", args.dtype, "--log-level", "warning", "--shutdown-timeout", "5"]
    command += ["--target", args.target] if args.target else []
    command += ["--drafter", drafter] if drafter != "none" else []
    command += ["--kv-budget", str(args.kv_budget)] if args.kv_budget else []
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server for {drafter} exited: {process.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.5)
    process.kill()
    raise TimeoutError(f"the server for {drafter} did not come up")


def stop_server(process: subprocess.Popen) -> int | None:
    """Its peak RSS in bytes (Linux), then SIGTERM."""
    peak = None
    status = Path(f"/proc/{process.pid}/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
    return peak


async def one_request(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, text, tokens = None, [], 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                piece = choice["delta"].get("content")
                if piece and first is None:
                    first = time.perf_counter()
                text.append(piece or "")
    end = time.perf_counter()
    first = first or end
    return {"start": start, "ttft": first - start, "e2e": end - start, "tokens": tokens, "text": "".join(text),
            "tpot": (end - first) / (tokens - 1) if tokens > 1 else None}


async def run_rate(url: str, prompts: list[list[dict]], rate: float, args) -> list[dict]:
    """Open loop: request i is sent at its Poisson arrival time, whatever is still running."""
    rng = random.Random(args.seed)
    times, t = [], 0.0
    for _ in range(args.requests):
        t += rng.expovariate(rate)
        if t > args.duration:
            break
        times.append(t)
    limits = httpx.Limits(max_connections=len(times) + 1, max_keepalive_connections=len(times) + 1)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        t0 = time.perf_counter()

        async def at(i: int, when: float) -> dict:
            await asyncio.sleep(max(0.0, t0 + when - time.perf_counter()))
            try:
                result = await one_request(client, url, prompts[i % len(prompts)], args.max_tokens)
            except (RuntimeError, httpx.HTTPError) as e:  # counted, not fatal: the run's other requests stand
                result = {"error": str(e) or type(e).__name__}
            return result | {"prompt": i % len(prompts), "offset": when}

        return list(await asyncio.gather(*(at(i, w) for i, w in enumerate(times))))


def emitted_per_round(url: str) -> tuple[float, float]:
    """The server's running totals of tokens rows emitted and row-rounds (its AL histogram's sum and
    count, from /metrics): the difference over a rate is that rate's mean AL."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name in ("draftsmith_acceptance_length_sum", "draftsmith_acceptance_length_count"):
                totals[sample.name.rsplit("_", 1)[1]] = sample.value
    return totals.get("sum", 0.0), totals.get("count", 0.0)


def summarise(results: list[dict], rate: float, args) -> dict:
    """Latency percentiles, throughput and goodput over the requests that completed; `errors` counts the
    others (a failed request is reported, and the run goes on)."""
    offered, results = results, [r for r in results if "error" not in r]
    if not results:
        raise RuntimeError(f"every request at {rate} req/s failed, the first with: {offered[0]['error']}")

    def pct(key: str) -> dict:
        values = [r[key] for r in results if r[key] is not None]
        return {f"p{q}": float(np.percentile(values, q)) if values else None for q in (50, 95, 99)}
    begin = min(r["start"] for r in results)
    span = max(r["start"] + r["e2e"] for r in results) - begin
    good = [r for r in results if r["ttft"] <= args.slo_ttft and (r["tpot"] is None or r["tpot"] <= args.slo_tpot)]
    return {"rate": rate, "requests": len(results), "achieved_rate": len(results) / max(results[-1]["offset"], 1e-9),
            "ttft": pct("ttft"), "tpot": pct("tpot"), "e2e": pct("e2e"),
            "throughput_tok_s": sum(r["tokens"] for r in results) / span, "goodput_req_s": len(good) / span,
            "slo_met": len(good) / len(offered), "errors": len(offered) - len(results)}


def crossover(plain: list[dict], spec: list[dict]) -> tuple[float | None, str]:
    """(a rate where spec's p50 TPOT meets plain's, interpolated; how the curves relate): "crosses" (ahead
    at low load, behind from that rate), "overtakes" (behind at low load, ahead from that rate: at low
    load its drafts do not pay, under load a batch that drafts little does), "ahead at every rate" or
    "never ahead" (behind at every rate tried); for the last two the rate is None."""
    gaps = [(p["rate"], s["tpot"]["p50"] - p["tpot"]["p50"]) for p, s in zip(plain, spec)]
    ahead = gaps[0][1] < 0
    for (r0, g0), (r1, g1) in zip(gaps, gaps[1:]):
        if (g1 < 0) != ahead:
            return r0 + (r1 - r0) * (-g0) / (g1 - g0), "crosses" if ahead else "overtakes"
    return None, "ahead at every rate" if ahead else "never ahead"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (name, config) in enumerate(report["configs"].items()):
        rows, color = config["rates"], f"C{i}"
        x = [r["throughput_tok_s"] for r in rows]
        left.plot(x, [1000 * r["tpot"]["p50"] for r in rows], "o-", color=color, label=f"{name} p50")
        left.plot(x, [1000 * r["tpot"]["p99"] for r in rows], "s--", color=color, label=f"{name} p99")
        right.plot([r["rate"] for r in rows], [1000 * r["tpot"]["p50"] for r in rows], "o-", color=color, label=name)
        cross = config.get("crossover_rate")
        if cross is not None:
            right.axvline(cross, color=color, linestyle=":", label=f"{name} crosses plain at {cross:.2f} req/s")
    left.set(xlabel="throughput (output tokens/s)", ylabel="time per output token (ms)",
             title="TPOT p50 / p99 against throughput")
    right.set(xlabel="offered load (requests/s)", ylabel="p50 time per output token (ms)", xscale="log",
              title="p50 TPOT against load")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="as for draftsmith serve (default: the embedded SmolLM2)")
    parser.add_argument("--drafters", default="none,early-exit:10", help="comma list; none = plain decoding")
    parser.add_argument("--rates", default="0.1,0.2,0.4,0.8", help="requests per second, comma list")
    parser.add_argument("--requests", type=int, default=16, help="most requests per rate")
    parser.add_argument("--duration", type=float, default=120.0, help="most seconds of arrivals per rate")
    parser.add_argument("--timeout", type=float, default=600.0, help="most seconds one request may take")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--draft-len", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--kv-budget", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="as for draftsmith serve (auto: float32 on CPU)")
    parser.add_argument("--prompts-file", default="builtin:vicuna_bench")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.25, help="seconds per output token")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("serve-load"))
    args = parser.parse_args(argv)

    rows = load_conversations(args.prompts_file)
    step = max(len(rows) // args.prompts, 1)
    prompts = [rows[i]["messages"] for i in range(0, len(rows), step)][: args.prompts]
    rates = [float(r) for r in args.rates.split(",")]
    report = {"settings": {k: str(v) for k, v in vars(args).items()}, "configs": {}}
    texts: dict[int, str] = {}
    mismatches = 0
    for drafter in args.drafters.split(","):
        process, url = start_server(args, drafter)
        try:
            asyncio.run(run_rate(url, prompts[:1], 1.0, argparse.Namespace(**{**vars(args), "requests": 1})))  # warm-up
            summaries = []
            for rate in rates:
                before = emitted_per_round(url)
                results = asyncio.run(run_rate(url, prompts, rate, args))
                after = emitted_per_round(url)
                for r in results:  # greedy: every configuration emits the same text for a prompt
                    if "error" not in r:
                        mismatches += texts.setdefault(r["prompt"], r["text"]) != r["text"]
                summaries.append(summarise(results, rate, args))
                s = summaries[-1]
                rounds = after[1] - before[1]
                s["acceptance_length"] = (after[0] - before[0]) / rounds if rounds else None
                print(f"{drafter:16s} rate {rate:6.3f}/s: TPOT p50 {1000 * s['tpot']['p50']:7.1f} ms "
                      f"p99 {1000 * s['tpot']['p99']:7.1f} ms | TTFT p50 {s['ttft']['p50']:6.2f} s | "
                      f"{s['throughput_tok_s']:6.1f} tok/s | goodput {s['goodput_req_s']:.3f} req/s | "
                      f"AL {s['acceptance_length'] or 0:.2f}" + (f" | {s['errors']} FAILED" if s["errors"] else ""),
                      file=sys.stderr, flush=True)
        finally:
            peak = stop_server(process)
        report["configs"][drafter] = {"rates": summaries, "peak_rss_bytes": peak}
    plain = report["configs"].get("none")
    for name, config in report["configs"].items():
        if plain is not None and name != "none":
            config["crossover_rate"], config["crossover"] = crossover(plain["rates"], config["rates"])
            low = plain["rates"][0]["tpot"]["p50"] / config["rates"][0]["tpot"]["p50"]
            config["low_load_tpot_p50_speedup"] = low
            where = config["crossover_rate"]
            relation = {"crosses": f"falls behind plain from {where or 0:.3f} req/s",
                        "overtakes": f"behind plain at low load, ahead from {where or 0:.3f} req/s",
                        "never ahead": "slower than plain at every rate tried",
                        "ahead at every rate": "ahead of plain at every rate tried"}[config["crossover"]]
            print(f"{name}: p50 TPOT speedup over plain {low:.2f}x at {rates[0]} req/s; {relation}; peak RSS "
                  f"{(config['peak_rss_bytes'] or 0) / 2**20:.0f} MiB (plain {(plain['peak_rss_bytes'] or 0) / 2**20:.0f})")
    report["text_mismatches"] = mismatches
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / "latency.png")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'latency.png'}; greedy text mismatches across "
          f"configurations: {mismatches}", file=sys.stderr)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
