"""Serving: the engine in a background thread; requests join and leave the running batch between rounds.

The HTTP layer (serve.py) lives on an asyncio loop; the engine thread runs rounds (`LLM.step`). They meet
at three points: `submit` (a checked request enters the inbox), `abort` (its client went away) and each
request's asyncio queue, which the engine thread fills with `Delta`s via `loop.call_soon_threadsafe`.
Between rounds the thread admits the inbox and drops cancelled requests, so a vanished client's KV
blocks are back in the pool before the next round. Text is produced here, in the engine thread, because
a stop string must end its sequence before the next round runs.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

from .llm import LLM, RunStats
from .metrics import Metrics
from .scheduler import SamplingParams, Sequence

log = logging.getLogger("engine.serving")


class QueueFull(Exception):
    """The waiting queue is at its limit (the server answers 503)."""


@dataclass
class Delta:
    """What a request gained in one round: text (stop strings and unfinished characters held back)."""
    text: str
    finish_reason: str | None = None   # "stop", "length", or "error" (then `text` is the message)
    logprobs: list = field(default_factory=list)  # (token, TokenLogprob) of the tokens not sent before


class Detokenizer:
    """Incremental text of a growing token list: each call decodes a short window (the tokens since the
    last emitted text plus those before it that shape it), not the whole output."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prefix = self.read = 0   # window start; end of the tokens already turned into text

    def __call__(self, ids: list[int]) -> str:
        decode = lambda a, b: self.tokenizer.decode(ids[a:b], skip_special_tokens=True)
        before = decode(self.prefix, self.read)
        text = decode(self.prefix, len(ids))
        if text.endswith("\ufffd"):     # a multi-byte character split across tokens: wait for the rest
            return ""
        self.prefix, self.read = self.read, len(ids)
        return text[len(before):]


@dataclass(eq=False)
class Request:
    seq: Sequence
    stop: tuple[str, ...]
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    detok: Detokenizer
    arrived: float = field(default_factory=time.perf_counter)
    last_emit: float | None = None     # when tokens were last emitted (None: none yet)
    text: str = ""                     # the output text so far (a matched stop string cut off)
    sent: int = 0                      # characters of `text` already emitted
    counted: int = 0                   # output tokens already seen by the metrics
    logprobs_sent: int = 0             # output tokens whose logprobs were emitted
    done: bool = False

    @property
    def prompt_tokens(self) -> int:
        return len(self.seq.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.seq.output_ids)

    def put(self, delta: Delta):
        self.loop.call_soon_threadsafe(self.queue.put_nowait, delta)


class AsyncEngine:
    """Owns an `LLM` and the thread that runs it. `submit` and `abort` are called from the asyncio loop."""

    def __init__(self, llm: LLM, method: str, max_waiting: int = 1024, metrics: Metrics | None = None):
        self.llm, self.method, self.max_waiting = llm, method, max_waiting
        self.metrics = metrics or Metrics()
        self.stats = RunStats()
        self.active: dict[int, Request] = {}   # seq_id -> request, owned by the engine thread
        self._inbox: list[Request] = []
        self._cancel: list[Request] = []
        self._cv = threading.Condition()
        self._stopping = self._ended = False
        self._thread: threading.Thread | None = None
        self.error: Exception | None = None   # the last round failure, if any

    def run(self):
        """The engine loop, in this thread, until shutdown(). engine.serve runs it in the main thread: OpenMP
        keeps a thread pool per thread that starts parallel work, and with a second pool (the one the model
        was loaded with) more threads than cores exist, so libgomp's workers stop spin-waiting between the
        ~150 parallel kernels of a step (measured: decode 4.5x slower from a second thread on 2 cores)."""
        try:
            self._loop()
        finally:
            self._ended = True

    def start(self):
        """The engine loop in a background thread (tests; single-threaded torch)."""
        self._thread = threading.Thread(target=self.run, name="engine", daemon=True)
        self._thread.start()

    # --- the asyncio side ----------------------------------------------------------------------------

    def shutdown(self):
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return not self._ended

    def submit(self, prompt_ids: list[int], params: SamplingParams, stop: tuple[str, ...] = ()) -> Request:
        """Queue a request. ValueError: it can never run here (bad parameters, too long); QueueFull."""
        seq = Sequence(list(prompt_ids), params)
        self.llm.scheduler.check(seq)
        req = Request(seq, tuple(s for s in stop if s), asyncio.get_running_loop(), asyncio.Queue(),
                      Detokenizer(self.llm.tokenizer))
        with self._cv:
            if not self.alive:
                raise RuntimeError("the engine has stopped")
            if len(self._inbox) + len(self.llm.scheduler.waiting) >= self.max_waiting:
                raise QueueFull(f"{self.max_waiting} requests are already waiting; retry later")
            self._inbox.append(req)
            self._cv.notify()
        return req

    def abort(self, req: Request):
        """Cancel a request (its client disconnected); a no-op once it has finished."""
        with self._cv:
            self._cancel.append(req)
            self._cv.notify()

    def kv_blocks(self) -> tuple[int, int]:
        """(in use, total) KV blocks."""
        blocks = self.llm.scheduler.blocks
        return blocks.num_blocks - blocks.num_free, blocks.num_blocks

    # --- the engine thread ---------------------------------------------------------------------------

    def _loop(self):
        while True:
            with self._cv:
                while not (self._inbox or self._cancel or self.llm.has_work or self._stopping):
                    self._cv.wait()
                if self._stopping:
                    break
                inbox, self._inbox = self._inbox, []
                cancel, self._cancel = self._cancel, []
            for req in inbox:
                self.llm.scheduler.add(req.seq)
                self.active[req.seq.seq_id] = req
            for req in cancel:
                if not req.done:
                    self.llm.abort(req.seq)
                    self._finish(req, "abort")
            if self.llm.has_work:
                try:
                    self._round()
                except Exception as e:   # fail this batch's requests; the engine serves the next ones
                    log.exception("a round failed")
                    self.error = e
                    self.llm.abort_all()
                    for req in list(self.active.values()):
                        req.put(Delta(f"engine error: {type(e).__name__}: {e}", "error"))
                        self._finish(req, "error")
            self.metrics.set_load(len(self.llm.scheduler.waiting) + len(self._inbox),
                                  len(self.llm.scheduler.running), *self.kv_blocks())

    def _round(self):
        done = self.llm.step(self.stats, lambda seq, kept: self._on_tokens(seq))
        if done.lengths:
            self.metrics.round(self.method, done.depth, done.lengths, done.decode_s, done.from_context)
        for seq in done.finished:
            req = self.active.get(seq.seq_id)
            if req is not None:
                self._finish(req, seq.finish_reason)

    def _on_tokens(self, seq: Sequence):
        """New tokens of `seq`: extend its text, cut at a stop string (finishing it), emit what is safe."""
        req = self.active.get(seq.seq_id)
        if req is None:
            return
        now = time.perf_counter()
        self.metrics.tokens(req.arrived if req.last_emit is None else None,
                            req.last_emit, now, len(seq.output_ids) - req.counted)
        req.counted = len(seq.output_ids)
        req.text += req.detok(seq.output_ids)
        hold = 0
        if req.stop:
            cut = min((i for i in (req.text.find(s, max(0, req.sent - len(s) + 1)) for s in req.stop) if i >= 0),
                      default=-1)
            if cut >= 0:
                req.text = req.text[:cut]
                seq.finish_reason = "stop"
            elif not seq.finished:   # hold back a tail that may be the start of a stop string
                hold = max((k for s in req.stop for k in range(1, len(s)) if req.text.endswith(s[:k])), default=0)
        end = len(req.text) - hold
        if seq.finished or end > req.sent:
            n = len(seq.logprobs)
            logprobs = list(zip(seq.output_ids[req.logprobs_sent:n], seq.logprobs[req.logprobs_sent:n]))
            req.put(Delta(req.text[req.sent:end], seq.finish_reason, logprobs))
            req.sent, req.logprobs_sent = end, n
        req.last_emit = now

    def _finish(self, req: Request, reason: str | None):
        if req.done:
            return
        req.done = True
        self.active.pop(req.seq.seq_id, None)
        self.metrics.finished(self.method, req, reason or "stop")
