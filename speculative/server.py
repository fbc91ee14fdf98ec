"""The HTTP side of `draftsmith serve`: an OpenAI-compatible API over the engine thread (worker.py).

    POST /v1/completions        prompt (text or token ids) -> text; "stream": true sends server-sent events
    POST /v1/chat/completions   messages, rendered with the target's chat template
    GET  /v1/models             the one model served
    GET  /health                200 while the engine thread runs
    GET  /metrics               Prometheus text (serve_metrics.py)

A request is validated where it enters (body types by pydantic, ranges and limits in
openai_schema.py and here: known model, prompt within the context window, the KV budget), refused
with an OpenAI-style error body (4xx), and only then handed to the engine thread. Its text is cut at
the first stop string (the row then leaves the batch); a client that disconnects cancels its row.
Errors inside one request are that request's: a handler's exception is a 500 for it alone, and a
failed decoding step fails the requests of its batch and nothing else (worker.py).

Only this module, openai_schema.py and serve_metrics.py import FastAPI, sse-starlette and
prometheus_client (the `serve` extra); the runtime never does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.openai_schema import ApiError, ChatBody, CompletionBody, SamplingBody
from draftsmith.speculative.options import Request
from draftsmith.speculative.prompts import encode_prompt
from draftsmith.speculative.sampling import SamplingParams
from draftsmith.speculative.serve_metrics import ServeMetrics
from draftsmith.speculative.worker import EngineWorker, Handle

log = logging.getLogger("draftsmith.serve")
DISCONNECT_POLL_S = 0.25  # how often a waiting non-streaming request checks that its client is still there


class ClientGone(Exception):
    """The client of a non-streaming request disconnected."""


@dataclass
class Serving:
    """What the endpoints need: the engine thread, the tokenizer and the limits requests are held to."""

    worker: EngineWorker
    tokenizer: object
    model_name: str
    context_window: int | None  # the target's max_position_embeddings
    metrics: ServeMetrics
    default_max_tokens: int = 256  # chat requests without max_tokens: this, within the context window
    drain_s: float = 30.0  # how long a stream may go on after SIGTERM

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`",
                           "model", "model_not_found")

    def request_for(self, body: SamplingBody, prompt: list[int], default_max: int | None) -> Request:
        """The engine's request for a checked body and its prompt ids (400 when it cannot run here)."""
        vocab = self.worker.engine.decoder.vocab_size
        if not prompt:
            raise ApiError(400, "the prompt is empty", "prompt")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ApiError(400, f"the prompt has token ids outside 0..{vocab - 1}", "prompt")
        room = None if self.context_window is None else self.context_window - len(prompt)
        max_tokens = body.max_tokens or default_max or min(self.default_max_tokens,
                                                           self.default_max_tokens if room is None else max(room, 1))
        if room is not None and max_tokens > room:
            raise ApiError(400, f"This model's maximum context length is {self.context_window} tokens; the request "
                                f"asks for {len(prompt) + max_tokens} ({len(prompt)} in the prompt, {max_tokens} "
                                "for the completion)", "max_tokens", "context_length_exceeded")
        temperature = 1.0 if body.temperature is None else body.temperature
        seed = secrets.randbits(63) if body.seed is None else body.seed
        sampling = SamplingParams(temperature, max(body.top_k or 0, 0), 1.0 if body.top_p is None else body.top_p, seed)
        stops = set(body.stop_token_ids or [])
        request = Request(prompt, sampling, max_tokens, draft_len=body.draft_len, draft_confidence=body.draft_confidence,
                          draft_alternatives=body.draft_alternatives, leaf_min_prob=body.leaf_min_prob,
                          stop_token_ids=frozenset(stops), ignore_eos=body.ignore_eos)
        engine = self.worker.engine
        if engine.kv_budget is not None and engine.need(request) > engine.kv_budget:
            raise ApiError(400, f"the request needs {engine.need(request)} KV tokens; the server's budget is "
                                f"{engine.kv_budget}", "max_tokens")
        return request

    async def results(self, handle: Handle, out: "TextOut",
                      http: HttpRequest | None = None) -> AsyncIterator[tuple[str, str | None, int]]:
        """(new text, finish reason or None, tokens so far) as the request's tokens arrive. A stop string
        ends it (its row is cancelled); with `http`, a client that went away raises ClientGone."""
        generated = 0
        while True:
            try:
                event = await asyncio.wait_for(handle.events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if http is not None and await http.is_disconnected():
                    raise ClientGone() from None
                continue
            if event.error is not None:
                raise event.error
            generated += len(event.tokens)
            text = out.push(event.tokens, final=event.finish_reason is not None)
            if out.stopped:
                if event.finish_reason is None:
                    self.worker.cancel(handle, outcome="stop")
                yield text, "stop", generated
                return
            if event.finish_reason is not None:
                yield text, event.finish_reason, generated
                return
            if text:
                yield text, None, generated


class TextOut:
    """A request's text as its tokens arrive: held back at an unfinished character and at what may be
    the start of a stop string, cut before the first stop string (which is not returned, as OpenAI)."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = 0  # characters returned so far
        self.stopped = False

    def push(self, ids: list[int], final: bool = False) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s, self.sent) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, end = True, min(hits)
        elif final:
            end = len(text)
        else:
            end = min(len(text.rstrip("\ufffd")), len(text) - self._partial_stop(text))
        new = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return new

    def _partial_stop(self, text: str) -> int:
        """The length of the longest end of `text` that begins some stop string."""
        return max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def create_app(serving: Serving) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not serving.worker.alive:
            serving.worker.start()
        yield
        serving.worker.stop(timeout=serving.drain_s)

    app = FastAPI(title="draftsmith", lifespan=lifespan)
    app.state.serving = serving
    _add_error_handlers(app, serving)

    @app.get("/health")
    async def health():
        if not serving.worker.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(serving.metrics.render(), media_type=serving.metrics.content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": serving.model_name, "object": "model", "created": 0,
                                            "owned_by": "draftsmith", "max_model_len": serving.context_window}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HttpRequest):
        body.check()
        serving.check_model(body.model)
        text = body.prompt_text()
        prompt = encode_prompt(serving.tokenizer, text, chat=False) if text is not None else list(body.prompt)
        return await _respond(serving, body, prompt, http, chat=False, default_max=16)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, http: HttpRequest):
        body.check()
        serving.check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = encode_prompt(serving.tokenizer, messages, chat=True)
        except InvalidInputError:
            raise
        except Exception as error:  # noqa: BLE001 - a template that refuses these messages (jinja raises)
            raise ApiError(400, f"the chat template cannot render these messages: {error}", "messages") from None
        return await _respond(serving, body, prompt, http, chat=True, default_max=None)

    return app


async def _respond(serving: Serving, body: SamplingBody, prompt: list[int], http: HttpRequest, *, chat: bool,
                   default_max: int | None):
    request = serving.request_for(body, prompt, default_max)
    handle = Handle(request, asyncio.get_running_loop())
    serving.worker.submit(handle)
    reply = Reply(serving.model_name, chat, len(prompt))
    out = TextOut(serving.tokenizer, body.stops())
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return EventSourceResponse(_stream(serving, handle, out, reply, usage), ping=15,
                                   shutdown_grace_period=serving.drain_s)
    pieces, reason, generated = [], None, 0
    try:
        async for text, reason, generated in serving.results(handle, out, http):
            pieces.append(text)
    except ClientGone:
        serving.worker.cancel(handle)
        return Response(status_code=499)
    except BaseException:
        serving.worker.cancel(handle)
        raise
    return reply.whole("".join(pieces), reason, generated)


async def _stream(serving: Serving, handle: Handle, out: TextOut, reply: "Reply", usage: bool):
    """The SSE events of a streamed request; a client that disconnects cancels the task, and its row."""
    try:
        if reply.chat:
            yield json.dumps(reply.chunk({"role": "assistant", "content": ""}, None))
        generated = 0
        async for text, reason, generated in serving.results(handle, out):
            if text or reason is not None:
                yield json.dumps(reply.chunk(text, None))
            if reason is not None:
                yield json.dumps(reply.chunk("" if not reply.chat else {}, reason))
        if usage:
            yield json.dumps(reply.usage_chunk(generated))
        yield "[DONE]"
    except Exception as error:  # noqa: BLE001 - the headers are sent: the error goes in the stream
        log.exception("a streamed request failed")
        yield json.dumps(_error_body(error))
    finally:
        if not handle.done:
            serving.worker.cancel(handle)


class Reply:
    """OpenAI response bodies for one request."""

    def __init__(self, model: str, chat: bool, prompt_tokens: int):
        self.model, self.chat, self.prompt_tokens = model, chat, prompt_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def usage(self, generated: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": generated,
                "total_tokens": self.prompt_tokens + generated}

    def whole(self, text: str, reason: str | None, generated: int) -> dict:
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                   "logprobs": None} if self.chat else
                  {"index": 0, "text": text, "finish_reason": reason, "logprobs": None})
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage(generated)}

    def chunk(self, delta: str | dict, reason: str | None) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": delta if isinstance(delta, dict) else {"content": delta},
                      "finish_reason": reason, "logprobs": None}
            kind = "chat.completion.chunk"
        else:
            choice, kind = {"index": 0, "text": delta, "finish_reason": reason, "logprobs": None}, self.object
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [choice]}

    def usage_chunk(self, generated: int) -> dict:
        kind = "chat.completion.chunk" if self.chat else self.object
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [],
                "usage": self.usage(generated)}


def _error_body(error: BaseException) -> dict:
    if isinstance(error, ApiError):
        return error.body()
    if isinstance(error, InvalidInputError):
        return ApiError(400, str(error)).body()
    return ApiError(500, f"internal error: {type(error).__name__}: {error}", kind="server_error").body()


def _add_error_handlers(app: FastAPI, serving: Serving) -> None:
    def reply(error: ApiError) -> JSONResponse:
        serving.metrics.requests.labels(outcome="rejected" if error.status < 500 else "error").inc()
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(ApiError)
    async def api_error(_, error: ApiError):
        return reply(error)

    @app.exception_handler(InvalidInputError)
    async def invalid_input(_, error: InvalidInputError):
        return reply(ApiError(400, str(error)))

    @app.exception_handler(RequestValidationError)
    async def malformed(_, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        if first.get("type") == "json_invalid":
            return reply(ApiError(400, f"malformed JSON body: {first.get('msg', '')}"))
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return reply(ApiError(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", where or None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, error: StarletteHTTPException):
        return reply(ApiError(error.status_code, str(error.detail), code=None))

    @app.exception_handler(Exception)
    async def internal(_, error: Exception):
        log.exception("a request failed")
        return reply(ApiError(500, f"internal error: {type(error).__name__}: {error}", kind="server_error"))


def serving_for(target, proposer, options, *, max_batch: int | None = None, kv_budget: int | None = None,
                model_name: str | None = None, default_max_tokens: int = 256, drain_s: float = 30.0,
                verifier=None) -> Serving:
    """A `Serving` over a loaded target (loading.LoadedModel) and proposer (or None): the decoder, its
    engine (`options`: D and how to draft), the engine thread (not started: the app's lifespan starts it)."""
    from draftsmith.speculative.engine import Engine
    from draftsmith.speculative.generate import SpeculativeDecoder
    from draftsmith.speculative.prompts import stop_token_ids

    decoder = SpeculativeDecoder(target.model, proposer, stop_token_ids=stop_token_ids(target.model, target.tokenizer),
                                 verifier=verifier)
    engine = Engine(decoder, options, max_batch=max_batch, kv_budget=kv_budget)
    metrics = ServeMetrics(engine.draft_len)
    return Serving(EngineWorker(engine, metrics), target.tokenizer, model_name or target.name,
                   getattr(target.model.config, "max_position_embeddings", None), metrics,
                   default_max_tokens=default_max_tokens, drain_s=drain_s)
