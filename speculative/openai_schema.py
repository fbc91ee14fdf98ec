"""The request bodies of the OpenAI-compatible endpoints (server.py), and what draftsmith refuses.

Fields are OpenAI's; draftsmith adds `top_k`, `draft_len` (this request's most draft tokens per round,
within the server's D), `draft_confidence`, `draft_alternatives` (within the server's A) and
`leaf_min_prob` (how this request drafts; see `DecodeOptions`), `stop_token_ids` and `ignore_eos`. Unknown fields are ignored, as OpenAI's own
clients send fields a server may not know. Features draftsmith does not have (n > 1, logprobs, echo,
penalties, logit bias) are refused with a 400 rather than silently ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

MAX_STOP_STRINGS = 4  # OpenAI's limit


class ApiError(Exception):
    """An error the client hears as an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingBody(BaseModel):
    """What both endpoints share: the model, sampling, limits and streaming."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = None
    temperature: float | None = None  # None = 1.0, as OpenAI
    top_p: float | None = None
    top_k: int | None = None  # extension: 0 or -1 = off
    seed: int | None = None  # None = a fresh random seed
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: bool | int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    user: str | None = None
    draft_len: int | None = None  # extension
    draft_confidence: float | None = None  # extension: stop a draft after a token the drafter gives less
    draft_alternatives: int | None = None  # extension: sibling leaves per draft position (within the server's)
    leaf_min_prob: float | None = None  # extension
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False  # extension: generate to max_tokens (benchmarks)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def check(self) -> None:
        """Ranges and unsupported features, as 400s that name the field."""
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.temperature is not None and not 0.0 <= self.temperature <= 2.0:
            raise ApiError(400, f"temperature must lie in [0, 2], got {self.temperature}", "temperature")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ApiError(400, f"top_p must lie in (0, 1], got {self.top_p}", "top_p")
        if self.top_k is not None and self.top_k < -1:
            raise ApiError(400, f"top_k must be -1, 0 (off) or positive, got {self.top_k}", "top_k")
        if self.draft_len is not None and self.draft_len < 0:
            raise ApiError(400, f"draft_len must be >= 0, got {self.draft_len}", "draft_len")
        if self.draft_confidence is not None and not 0.0 <= self.draft_confidence < 1.0:
            raise ApiError(400, f"draft_confidence must lie in [0, 1), got {self.draft_confidence}", "draft_confidence")
        if self.draft_alternatives is not None and self.draft_alternatives < 0:
            raise ApiError(400, f"draft_alternatives must be >= 0, got {self.draft_alternatives}", "draft_alternatives")
        if self.leaf_min_prob is not None and not 0.0 <= self.leaf_min_prob < 1.0:
            raise ApiError(400, f"leaf_min_prob must lie in [0, 1), got {self.leaf_min_prob}", "leaf_min_prob")
        stops = self.stops()
        if len(stops) > MAX_STOP_STRINGS:
            raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop sequences, got {len(stops)}", "stop")
        if any(not s for s in stops):
            raise ApiError(400, "stop sequences must not be empty", "stop")
        unsupported = {"n": self.n != 1, "logprobs": bool(self.logprobs), "presence_penalty": self.presence_penalty != 0,
                       "frequency_penalty": self.frequency_penalty != 0, "logit_bias": bool(self.logit_bias)}
        for name, asked in unsupported.items():
            if asked:
                raise ApiError(400, f"{name} is not supported by draftsmith serve", name)


class CompletionBody(SamplingBody):
    prompt: str | list[int] | list[str]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise ApiError(400, "one prompt per request (got a list of several)", "prompt")
        for name, asked in {"echo": self.echo, "best_of": (self.best_of or 1) != 1, "suffix": bool(self.suffix)}.items():
            if asked:
                raise ApiError(400, f"{name} is not supported by draftsmith serve", name)

    def prompt_text(self) -> str | None:
        """The prompt as text, or None when it is given as token ids."""
        if isinstance(self.prompt, str):
            return self.prompt
        return self.prompt[0] if self.prompt and isinstance(self.prompt[0], str) else None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(p.type != "text" for p in self.content):
            raise ApiError(400, "only text content parts are supported", "messages")
        return "".join(p.text or "" for p in self.content)


class ChatBody(SamplingBody):
    messages: list[Message]
    max_completion_tokens: int | None = None

    def check(self) -> None:
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        super().check()
        if not self.messages:
            raise ApiError(400, "messages must not be empty", "messages")
