"""`draftsmith serve`: a real server on 127.0.0.1 (a tiny target, an early-exit drafter) answers the
official `openai` client exactly as offline `generate` decodes, streaming or not, and refuses bad
requests with OpenAI-style 4xx bodies; disconnects free rows; a failed step fails only its requests;
SIGTERM drains and exits 0."""

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
pytest.importorskip("sse_starlette")

from draftsmith.speculative.drafters import load_drafter  # noqa: E402
from draftsmith.speculative.generate import SpeculativeDecoder  # noqa: E402
from draftsmith.speculative.loading import load_model  # noqa: E402
from draftsmith.speculative.options import DecodeOptions  # noqa: E402
from draftsmith.speculative.prompts import encode_prompt, stop_token_ids  # noqa: E402
from draftsmith.speculative.sampling import SamplingParams  # noqa: E402
from draftsmith.speculative.server import create_app, serving_for  # noqa: E402

TARGET, DRAFTER, D, MODEL = "tiny:0:3", "early-exit:1", 3, "tiny"
KV_BUDGET = 600  # a few requests' worth: the concurrent test queues


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"no server at {url}")


@pytest.fixture(scope="module")
def server():
    """The server in this process (uvicorn in a thread, the engine in its own): real sockets, and the
    test can reach its engine."""
    target = load_model(TARGET)
    proposer, _ = load_drafter(DRAFTER, target)
    serving = serving_for(target, proposer, DecodeOptions(draft_len=D), max_batch=8, kv_budget=KV_BUDGET,
                          model_name=MODEL)
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(create_app(serving), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)
    yield SimpleNamespace(url=url, serving=serving,
                          client=openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120))
    uv.should_exit = True
    thread.join(30)


@pytest.fixture(scope="module")
def offline():
    """Offline `generate` on a second copy of the target (the server's is busy in its own thread)."""
    target = load_model(TARGET)
    proposer, _ = load_drafter(DRAFTER, target)
    decoder = SpeculativeDecoder(target.model, proposer, stop_token_ids=stop_token_ids(target.model, target.tokenizer))

    def run(prompt: list[int], sampling: SamplingParams, max_tokens: int) -> list[int]:
        return decoder.generate([prompt], sampling, DecodeOptions(max_new_tokens=max_tokens, draft_len=D)).tokens[0]

    def text(ids: list[int]) -> str:
        return target.tokenizer.decode(ids, skip_special_tokens=True)

    return SimpleNamespace(run=run, text=text, tokenizer=target.tokenizer)


def metric(url: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(f"{url}/metrics").text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.9, 7)])
def test_completions_equal_offline_generate(server, offline, temperature, seed):
    prompt, max_tokens = "The quick brown fox", 12
    expected = offline.run(encode_prompt(offline.tokenizer, prompt, chat=False), SamplingParams(temperature, seed=seed or 0),
                           max_tokens)
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=temperature, seed=seed)
    whole = server.client.completions.create(**kwargs)
    assert whole.choices[0].text == offline.text(expected)
    assert whole.usage.completion_tokens == len(expected)
    assert whole.choices[0].finish_reason == ("stop" if len(expected) < max_tokens else "length")
    chunks = list(server.client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == offline.text(expected)
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    ids = server.client.completions.create(**{**kwargs, "prompt": [1, 84, 104, 101]})
    assert ids.choices[0].text == offline.text(offline.run([1, 84, 104, 101], SamplingParams(temperature, seed=seed or 0),
                                                           max_tokens))


def test_chat_renders_the_template_and_streams_the_same_text(server, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    expected = offline.run(encode_prompt(offline.tokenizer, messages, chat=True), SamplingParams(0.7, seed=3), 10)
    kwargs = dict(model=MODEL, messages=messages, max_tokens=10, temperature=0.7, seed=3)
    whole = server.client.chat.completions.create(**kwargs)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == offline.text(expected)
    chunks = list(server.client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == offline.text(expected)
    assert chunks[-1].usage.completion_tokens == len(expected)


def test_a_stop_string_cuts_the_text_and_frees_the_row(server, offline):
    expected = offline.text(offline.run(encode_prompt(offline.tokenizer, "hello", chat=False), SamplingParams(), 30))
    stop = expected[5:7]
    assert stop and stop in expected
    out = server.client.completions.create(model=MODEL, prompt="hello", max_tokens=30, temperature=0, stop=[stop])
    assert out.choices[0].text == expected[: expected.index(stop)] and out.choices[0].finish_reason == "stop"
    streamed = server.client.completions.create(model=MODEL, prompt="hello", max_tokens=30, temperature=0, stop=stop,
                                                stream=True)
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text


def test_models_health_and_metrics(server):
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("draftsmith_requests_total", "draftsmith_queued_requests", "draftsmith_running_requests",
                 "draftsmith_generation_tokens_total", "draftsmith_acceptance_length_bucket",
                 "draftsmith_time_to_first_token_seconds_bucket", "draftsmith_inter_token_latency_seconds_bucket",
                 "draftsmith_kv_reserved_tokens"):
        assert name in text, name


def test_a_request_drafting_its_own_way_still_decodes_exactly(server, offline):
    """How a request drafts (extra body fields) changes its speed, never its greedy text; the engine's
    tests check that each row drafts as its request asks."""
    prompt = [1, 84, 104, 101, 32, 113, 117, 105, 99, 107]
    expected = offline.text(offline.run(prompt, SamplingParams(0.0), 16))
    for extra in ({"draft_confidence": 0.5, "draft_len": 2}, {"draft_alternatives": 3, "leaf_min_prob": 0.1}):
        got = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, extra_body=extra)
        assert got.choices[0].text == expected, extra


BAD = [
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ({"model": MODEL, "prompt": [1] * 2040, "max_tokens": 16}, 400, "max_tokens"),  # past the 2048-token window
    ({"model": MODEL, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"model": MODEL, "prompt": "hi", "n": 2}, 400, "n"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 1000}, 400, "max_tokens"),  # over the KV budget
    ({"model": MODEL, "prompt": [1, 5000]}, 400, "prompt"),  # an id outside the vocabulary
    ({"model": MODEL}, 400, "prompt"),  # no prompt
    ({"model": MODEL, "prompt": "hi", "draft_confidence": 1.5}, 400, "draft_confidence"),
    ({"model": MODEL, "prompt": "hi", "draft_alternatives": -1}, 400, "draft_alternatives"),
    ({"model": MODEL, "prompt": "hi", "leaf_min_prob": 1.0}, 400, "leaf_min_prob"),
]


@pytest.mark.parametrize("body,status,param", BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
def test_bad_requests_get_openai_error_bodies(server, body, status, param):
    response = httpx.post(f"{server.url}/v1/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error" and error["param"] == param


def test_malformed_json_and_the_client_sees_4xx(server):
    response = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "malformed JSON" in response.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        server.client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model=MODEL, prompt="x", temperature=-1)


def test_a_client_that_disconnects_mid_stream_frees_its_row(server):
    cancelled = metric(server.url, 'draftsmith_requests_total{outcome="cancelled"}')
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert sum(1 for line, _ in zip(lines, range(6)) if line.startswith("data:")) >= 2
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if metric(server.url, 'draftsmith_requests_total{outcome="cancelled"}') > cancelled:
            break
        time.sleep(0.1)
    assert metric(server.url, 'draftsmith_requests_total{outcome="cancelled"}') == cancelled + 1
    assert server.serving.worker.engine.running == 0 and not server.serving.worker.engine.reserved


def test_a_failed_step_fails_its_requests_and_the_server_goes_on(server, offline):
    engine = server.serving.worker.engine

    def broken():
        raise RuntimeError("injected failure")
    engine.run.round = broken  # this batch only: the engine drops it and starts a fresh one
    with pytest.raises(openai.InternalServerError, match="injected failure"):
        server.client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=0)
    expected = offline.run(encode_prompt(offline.tokenizer, "hi", chat=False), SamplingParams(), 4)
    assert server.client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=0).choices[0].text \
        == offline.text(expected)
    assert httpx.get(f"{server.url}/health").status_code == 200


PROMPTS = ["Once upon a time", "def add(a, b):", "1, 2, 3, 4,", "The capital of France", "hello hello hello",
           "Roses are red", "SELECT * FROM", "abcabcabc"]


@pytest.mark.slow
def test_32_concurrent_mixed_requests_equal_offline_generate(server, offline):
    """Greedy and seeded sampled, streamed and whole, ragged lengths, more than the batch and the KV budget hold."""
    cases = [dict(prompt=PROMPTS[i % len(PROMPTS)], temperature=0.0 if i % 3 == 0 else 0.6 + 0.1 * (i % 5),
                  seed=100 + i, max_tokens=8 + (i * 7) % 25, stream=i % 2 == 1) for i in range(32)]
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)
    peak_queue = []

    async def one(case):
        if case["stream"]:
            stream = await client.completions.create(model=MODEL, **case)
            return "".join([c.choices[0].text async for c in stream if c.choices])
        return (await client.completions.create(model=MODEL, **case)).choices[0].text

    async def watch(done):
        while not done.is_set():
            peak_queue.append(server.serving.worker.engine.queued)
            await asyncio.sleep(0.05)

    async def run_all():
        done = asyncio.Event()
        watcher = asyncio.create_task(watch(done))
        texts = await asyncio.gather(*(one(c) for c in cases))
        done.set()
        await watcher
        return texts

    texts = asyncio.run(run_all())
    for case, text in zip(cases, texts):
        ids = encode_prompt(offline.tokenizer, case["prompt"], chat=False)
        assert text == offline.text(offline.run(ids, SamplingParams(case["temperature"], seed=case["seed"]),
                                                case["max_tokens"])), case
    assert max(peak_queue) > 0  # the KV budget and max_batch made requests wait


@pytest.mark.slow
def test_sigterm_lets_running_requests_finish_and_exits_zero(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([sys.executable, "-m", "draftsmith", "serve", "--target", TARGET, "--drafter", "ngram",
                                "--port", str(port), "--log-level", "warning", "--shutdown-timeout", "60",
                                "--served-model-name", MODEL], stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_healthy(url)
        events = []

        def stream():
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 60, "temperature": 0, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
                events.extend(line[5:].strip() for line in response.iter_lines() if line.startswith("data:"))
        client = threading.Thread(target=stream)
        client.start()
        deadline = time.monotonic() + 60
        while not metric(url, "draftsmith_generation_tokens_total") and time.monotonic() < deadline:
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        client.join(120)
        assert process.wait(120) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert events[-1] == "[DONE]"
    finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finish[-1] in ("length", "stop") and sum(
        len(json.loads(e)["choices"][0]["text"]) for e in events[:-1]) > 0


def test_the_runtime_imports_no_server_library_and_the_command_is_registered():
    code = ("import sys; import draftsmith.speculative.engine, draftsmith.speculative.worker, draftsmith.cli; "
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'sse_starlette', 'prometheus_client', 'starlette') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    from draftsmith.cli import build_parser

    args = build_parser().parse_args(["serve", "--target", TARGET, "--kv-budget", "4096", "--max-batch", "4"])
    assert args.command == "serve" and args.kv_budget == 4096 and args.max_batch == 4
