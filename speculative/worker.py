"""The engine thread of a server: one thread owns the engine (engine.py) and steps its batch; requests
reach it, and leave it, through a thread-safe inbox.

    worker = EngineWorker(engine, metrics)
    worker.start()
    handle = Handle(request, asyncio.get_running_loop())
    worker.submit(handle)                 # from the server's event loop
    event = await handle.events.get()     # Event(tokens, finish_reason, error), in order
    worker.cancel(handle)                 # a client that went away: its row leaves the batch

The thread takes every message waiting in the inbox between two steps (adds and cancels, in arrival
order), then runs one step. When nothing runs it blocks on the inbox. An exception inside a step
cannot be pinned on one row, so the batch is dropped (`Engine.abort`), its requests get the error,
and the thread goes on with the queue: the server never goes down with a request.

Measured here, where the tokens appear: time to first token (from the handle's arrival), the time
between a request's successive emissions (inter-token latency; a round's tokens arrive together), the
tokens each row emitted per round (its acceptance length, cut at a stop or the budget) and the
batch's size; `metrics` is any object with ServeMetrics' methods (serve_metrics.py), or None.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from draftsmith.speculative.engine import Engine
from draftsmith.speculative.options import Request

log = logging.getLogger("draftsmith.serve")
IDLE_POLL_S = 0.5  # how often an idle engine thread looks at its stop flag


@dataclass
class Event:
    """What a request hears from the engine thread: new tokens, then a finish reason or an error."""

    tokens: list[int]
    finish_reason: str | None = None  # "stop" or "length" on the last event
    error: BaseException | None = None  # the request failed (the engine refused it, or its batch broke)


class Handle:
    """One request in flight between an event loop and the engine thread."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.loop = loop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.arrival = time.perf_counter()
        self.request_id: int | None = None  # the engine's id, set in the engine thread
        self.first_token_at: float | None = None
        self.last_emission_at: float | None = None
        self.generated = 0
        self.done = False  # the last event was sent (set in the engine thread)

    def push(self, event: Event) -> None:
        """Hand an event to the request's event loop (from the engine thread)."""
        self.done = self.done or event.finish_reason is not None or event.error is not None
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass


class EngineWorker:
    """Owns an `Engine` in a thread of its own (see the module docstring)."""

    def __init__(self, engine: Engine, metrics=None):
        self.engine = engine
        self.metrics = metrics
        self.inbox: queue.SimpleQueue[tuple[str, Handle | None]] = queue.SimpleQueue()
        self.handles: dict[int, Handle] = {}  # engine request id -> handle, waiting or running
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="draftsmith-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, handle: Handle) -> None:
        self.inbox.put(("add", handle))

    def cancel(self, handle: Handle, outcome: str = "cancelled") -> None:
        """Take the request out (a client that disconnected, a stop string reached: `outcome` for the
        metrics); harmless after it finished."""
        self.inbox.put((outcome, handle))

    def stop(self, timeout: float | None = None) -> None:
        """Stop stepping and fail what is left (the server drains its requests before calling this)."""
        self._stop.set()
        self.inbox.put(("wake", None))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # --- the engine thread --------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._take_inbox(block=not self.engine.busy)
            if self.engine.busy and not self._stop.is_set():
                self._step()
        for handle in self.handles.values():
            handle.push(Event([], error=RuntimeError("the server is shutting down")))
        self.handles.clear()

    def _take_inbox(self, block: bool) -> None:
        try:
            message = self.inbox.get(timeout=IDLE_POLL_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, handle = message
            if kind == "add":
                self._add(handle)
            elif kind != "wake":
                self._cancel(handle, kind)
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, handle: Handle) -> None:
        try:
            handle.request_id = self.engine.add(handle.request)
        except Exception as error:  # noqa: BLE001 - a refused request fails alone
            self._count("error")
            handle.push(Event([], error=error))
            return
        self.handles[handle.request_id] = handle
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(handle.request.prompt))
        self._state()

    def _cancel(self, handle: Handle, outcome: str) -> None:
        if handle.request_id is None or self.handles.pop(handle.request_id, None) is None:
            return
        self.engine.cancel(handle.request_id)
        self._count(outcome, handle if outcome == "stop" else None, time.perf_counter())
        self._state()

    def _step(self) -> None:
        try:
            emissions = self.engine.step()
        except Exception as error:  # noqa: BLE001 - the batch breaks, the server goes on
            log.exception("a decoding step failed; its batch is dropped and its requests get the error")
            for request_id in self.engine.abort():
                handle = self.handles.pop(request_id, None)
                if handle is not None:
                    self._count("error")
                    handle.push(Event([], error=error))
            self._state()
            return
        now = time.perf_counter()
        for e in emissions:
            handle = self.handles.get(e.request_id)
            if handle is None:
                continue
            self._measure(handle, e.tokens, now)
            if e.finish_reason is not None:
                del self.handles[e.request_id]
                self._count(e.finish_reason, handle, now)
            handle.push(Event(e.tokens, e.finish_reason))
        self._state()

    # --- measurements -------------------------------------------------------------------------------

    def _measure(self, handle: Handle, tokens: list[int], now: float) -> None:
        m = self.metrics
        if m is not None:
            m.round_tokens.observe(len(tokens))
            m.generation_tokens.inc(len(tokens))
            if tokens and handle.first_token_at is None:
                m.time_to_first_token.observe(now - handle.arrival)
            elif tokens:
                m.inter_token_latency.observe(now - handle.last_emission_at)
        if tokens:
            handle.first_token_at = handle.first_token_at or now
            handle.last_emission_at = now
            handle.generated += len(tokens)

    def _count(self, outcome: str, handle: Handle | None = None, now: float | None = None) -> None:
        m = self.metrics
        if m is None:
            return
        m.requests.labels(outcome=outcome).inc()
        if handle is not None and now is not None:
            m.e2e_latency.observe(now - handle.arrival)
            if handle.generated > 1:
                m.time_per_output_token.observe((now - handle.first_token_at) / (handle.generated - 1))

    def _state(self) -> None:
        m = self.metrics
        if m is not None:
            m.running.set(self.engine.running)
            m.queued.set(self.engine.queued)
            ledger = self.engine.ledger()
            m.kv_reserved.set(ledger["reserved_tokens"])
            m.kv_bytes.labels(cache="target").set(ledger["target_kv_bytes"])
            m.kv_bytes.labels(cache="drafter").set(ledger["drafter_kv_bytes"])
