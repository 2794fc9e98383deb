"""OpenAI-compatible HTTP server: `python -m engine.serve` (FastAPI on uvicorn).

    POST /v1/chat/completions, /v1/completions   (streamed as server-sent events with "stream": true)
    GET  /v1/models, /health, /metrics           (Prometheus text format; engine/metrics.py)

Requests are checked before they reach the engine: anything malformed gets a 4xx with an OpenAI-style
{"error": {...}} body; a full waiting queue answers 503. A client that disconnects has its request
cancelled and its KV blocks returned (engine/serving.py).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import signal
import sys
import threading
import time
import uuid
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .loader import ModelNotFoundError
from .run import add_engine_args, build_llm, default_method
from .scheduler import MAX_LOGPROBS, SamplingParams

MAX_CHOICES = 16  # `n` of one request
from .serving import AsyncEngine, QueueFull, Request as EngineRequest


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.kind, self.param, self.code)


def error_response(status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


# --- request bodies (unknown fields are ignored, as OpenAI's own server does for most) -----------------

class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Body):
    include_usage: bool = False


class JSONSchema(_Body):
    name: str
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")   # None: any JSON object
    strict: bool | None = None   # the schema is always enforced


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchema | None = None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` object: one constraint."""
    json_: dict | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class Sampling(_Body):
    """The fields both endpoints share. Extensions beyond OpenAI's (as vLLM's): top_k, ignore_eos,
    repetition_penalty, min_tokens, and structured output's guided_json / guided_regex / guided_choice /
    guided_grammar / structured_outputs beside OpenAI's response_format."""
    model: str
    max_tokens: int | None = Field(None, gt=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)
    response_format: ResponseFormat | None = None
    guided_json: dict | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    def structured(self) -> tuple[str | None, tuple[str, str] | None]:
        """The one output constraint asked for, as SamplingParams.structured, and the field that asked."""
        schema = lambda v: v if isinstance(v, str) else json.dumps(v)
        asked = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked.append(("response_format", ("json", "")))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise APIError(400, "response_format.json_schema: required when type is json_schema",
                               param="response_format.json_schema")
            given = fmt.json_schema.schema_
            asked.append(("response_format", ("json", "" if given is None else schema(given))))
        so = self.structured_outputs or StructuredOutputs()
        for param, value, kind, spec in (
                ("guided_json", self.guided_json, "json", schema),
                ("guided_regex", self.guided_regex, "regex", str),
                ("guided_choice", self.guided_choice, "choice", json.dumps),
                ("guided_grammar", self.guided_grammar, "grammar", str),
                ("structured_outputs.json", so.json_, "json", schema),
                ("structured_outputs.regex", so.regex, "regex", str),
                ("structured_outputs.choice", so.choice, "choice", json.dumps),
                ("structured_outputs.grammar", so.grammar, "grammar", str),
                ("structured_outputs.json_object", so.json_object or None, "json", lambda _: "")):
            if value is not None:
                asked.append((param, (kind, spec(value))))
        if len(asked) > 1:
            raise APIError(400, f"{', '.join(p for p, _ in asked)}: give at most one output constraint",
                           param=asked[1][0])
        return asked[0] if asked else (None, None)

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatBody(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def alternatives(self) -> int | None:
        """SamplingParams.logprobs: None (off) or the alternatives per token."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs set to true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionBody(Sampling):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


def parse(body: bytes, model: type[BaseModel]):
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(x) for x in err["loc"]) or None
        raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param) from None


# --- the app --------------------------------------------------------------------------------------------

class Server:
    """Turns checked requests into engine requests and engine deltas into OpenAI responses."""

    def __init__(self, engine: AsyncEngine, model_name: str, default_max_tokens: int = 512):
        self.engine, self.model_name, self.default_max_tokens = engine, model_name, default_max_tokens
        self.created = int(time.time())
        self.context = engine.llm.cfg.max_position

    def check_model(self, body: Sampling):
        if body.model != self.model_name:
            raise APIError(404, f"model {body.model!r} does not exist (this server serves {self.model_name!r})",
                           param="model", code="model_not_found")

    def params(self, body: Sampling, prompt_len: int, max_tokens: int | None) -> SamplingParams:
        unsupported = {"best_of": getattr(body, "best_of", None) not in (None, 1),
                       "suffix": bool(getattr(body, "suffix", None))}
        for name, bad in unsupported.items():
            if bad:
                raise APIError(400, f"{name}: not supported by this server (only its default)", param=name)
        if any(not s for s in body.stops()):
            raise APIError(400, "stop: stop strings must be non-empty", param="stop")
        if max_tokens is None:
            max_tokens = max(1, min(self.default_max_tokens, self.context - prompt_len))
        chat = isinstance(body, ChatBody)
        logprobs = body.alternatives() if chat else body.logprobs
        prompt_logprobs = logprobs if not chat and body.echo else None
        try:
            bias = {int(t): v for t, v in (body.logit_bias or {}).items()}
        except ValueError:
            raise APIError(400, "logit_bias: keys must be token ids", param="logit_bias") from None
        if any(not -100 <= v <= 100 for v in bias.values()):
            raise APIError(400, "logit_bias: values must be in [-100, 100]", param="logit_bias")
        if body.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens: {body.min_tokens} exceeds max_tokens ({max_tokens})", param="min_tokens")
        param, structured = body.structured()
        if structured is not None:
            if body.min_tokens:
                raise APIError(400, f"min_tokens: cannot be combined with {param}", param="min_tokens")
            grammars = self.engine.llm.grammars
            try:
                if grammars is None:
                    raise ValueError("structured output needs the model's tokenizer")
                grammars.check(structured)   # compiled once: admission's compile is a cache hit
            except ValueError as e:
                raise APIError(400, f"{param}: {e}", param=param) from None
        return SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
                              max_new_tokens=max_tokens, ignore_eos=body.ignore_eos, seed=body.seed,
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs, presence_penalty=body.presence_penalty,
                              frequency_penalty=body.frequency_penalty,
                              repetition_penalty=body.repetition_penalty, logit_bias=bias or None,
                              min_tokens=body.min_tokens, structured=structured)

    def chat_ids(self, body: ChatBody) -> list[int]:
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
        try:
            return self.engine.llm.chat_ids(messages)
        except Exception as e:   # the model's template rejects the conversation
            raise APIError(400, f"messages: the chat template rejected them ({e})", param="messages") from None

    def completion_ids(self, body: CompletionBody) -> list[int]:
        if isinstance(body.prompt, str):
            return self.engine.llm.tokenizer.encode(body.prompt)
        vocab = self.engine.llm.cfg.vocab_size
        if any(not 0 <= t < vocab for t in body.prompt):
            raise APIError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
        return list(body.prompt)

    def submit(self, ids: list[int], params: SamplingParams, stop: tuple[str, ...]) -> EngineRequest:
        try:
            return self.engine.submit(ids, params, stop)
        except QueueFull as e:
            raise APIError(503, str(e), kind="server_overloaded", code="queue_full") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except RuntimeError as e:
            raise APIError(503, str(e), kind="server_error") from None

    def submit_all(self, ids: list[int], params: SamplingParams, body: Sampling) -> list[EngineRequest]:
        """The request's n choices as engine requests (choice i seeded with seed + i when a seed is given);
        if one cannot be queued, those already queued are cancelled."""
        reqs = []
        try:
            for i in range(body.n):
                seed = None if params.seed is None else params.seed + i
                reqs.append(self.submit(ids, dataclasses.replace(params, seed=seed), body.stops()))
        except APIError:
            for req in reqs:
                self.engine.abort(req)
            raise
        return reqs

    async def respond(self, http: Request, reqs: list[EngineRequest], body: Sampling, chat: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(self._stream(reqs, body, rid, chat, usage), media_type="text/event-stream")
        choices = []
        for i, (req, (text, finish, logprobs)) in enumerate(zip(reqs, await self._collect(http, reqs))):
            if not chat and body.echo:  # the prompt before the completion, its tokens' logprobs before theirs
                text, logprobs = self.echo(req, body) + text, self.prompt_entries(req) + logprobs
            choice = {"index": i, "finish_reason": finish, "logprobs": self.logprobs(req, logprobs, chat)}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            choices.append(choice)
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": self.model_name, "choices": choices,
                             "usage": usage_of(reqs)})

    async def _collect(self, http: Request, reqs: list[EngineRequest]) -> list[tuple[str, str, list]]:
        """Each choice's whole output (text, finish reason, logprobs), or cancellation of all when the client
        disconnects first."""
        async def collect(req):
            parts, logprobs = [], []
            while True:
                delta = await req.queue.get()
                if delta.finish_reason == "error":
                    raise APIError(500, delta.text, kind="server_error")
                parts.append(delta.text)
                logprobs += delta.logprobs
                if delta.finish_reason:
                    return "".join(parts), delta.finish_reason, logprobs

        async def disconnected():
            while (await http.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.ensure_future(asyncio.gather(*(collect(r) for r in reqs)))
        gone = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                for req in reqs:
                    self.engine.abort(req)
        if work.cancelled():
            raise asyncio.CancelledError
        return work.result()

    async def _stream(self, reqs: list[EngineRequest], body: Sampling, rid: str, chat: bool, include_usage: bool):
        """Server-sent events of all choices, each chunk one choice's delta (its `index`), as they arrive."""
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(i: int, text: str | None, finish: str | None, first: bool = False, logprobs=()) -> str:
            lp = self.logprobs(reqs[i], logprobs, chat) if logprobs else None
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                choice = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": lp}
            else:
                choice = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": lp}
            out = {"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": [choice]}
            if include_usage:
                out["usage"] = None
            return f"data: {json.dumps(out)}\n\n"

        merged: asyncio.Queue = asyncio.Queue()

        async def forward(i, req):
            while True:
                delta = await req.queue.get()
                await merged.put((i, delta))
                if delta.finish_reason:
                    return

        tasks = [asyncio.ensure_future(forward(i, r)) for i, r in enumerate(reqs)]
        try:
            if chat:
                for i in range(len(reqs)):
                    yield chunk(i, None, None, first=True)
            echo = set(range(len(reqs))) if not chat and body.echo else set()
            left = len(reqs)
            while left:
                i, delta = await merged.get()
                if i in echo and delta.finish_reason != "error":  # the prefill is done: the prompt goes first
                    yield chunk(i, self.echo(reqs[i], body), None, logprobs=self.prompt_entries(reqs[i]))
                    echo.discard(i)
                if delta.finish_reason == "error":
                    err = {"error": {"message": delta.text, "type": "server_error", "param": None, "code": None}}
                    yield f"data: {json.dumps(err)}\n\n"
                    break
                yield chunk(i, delta.text, delta.finish_reason, logprobs=delta.logprobs)
                left -= bool(delta.finish_reason)
            if include_usage:
                yield f"data: {json.dumps({'id': rid, 'object': kind, 'created': created, 'model': self.model_name, 'choices': [], 'usage': usage_of(reqs)})}\n\n"
            yield "data: [DONE]\n\n"
        finally:   # the client went away mid-stream (or we are done: then abort is a no-op)
            for task in tasks:
                task.cancel()
            for req in reqs:
                if not req.done:
                    self.engine.abort(req)

    def echo(self, req: EngineRequest, body: "CompletionBody") -> str:
        """The prompt as the client sent it (text), or its tokens' text."""
        return body.prompt if isinstance(body.prompt, str) else self.engine.llm.tokenizer.decode(body.prompt)

    def prompt_entries(self, req: EngineRequest) -> list:
        """(token, TokenLogprob or None) of the prompt, for echo: empty unless logprobs were asked."""
        return list(zip(req.seq.prompt_ids, req.seq.prompt_logprobs))

    def logprobs(self, req: EngineRequest, tokens: list, chat: bool) -> dict | None:
        """OpenAI's logprobs object for (token, TokenLogprob) pairs: chat's `content` list, or the legacy
        completions lists (text offsets relative to this part's first token). -inf (a token the request's
        top-k / top-p excludes) is reported as -9999.0, as vLLM does."""
        if req.seq.params.logprobs is None:
            return None
        if not chat:
            return self.completion_logprobs(tokens)
        text = self.token_text
        entry = lambda t, v: {"token": text(t), "logprob": finite(v), "bytes": list(text(t).encode())}
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in top]}
                            for t, (lp, top) in tokens]}

    def completion_logprobs(self, tokens: list) -> dict:
        """The legacy completions lists; an entry without logprobs (a prompt's first token) is null."""
        text = self.token_text
        offsets, at = [], 0
        for t, _ in tokens:
            offsets.append(at)
            at += len(text(t))
        return {"tokens": [text(t) for t, _ in tokens],
                "token_logprobs": [None if e is None else finite(e[0]) for _, e in tokens],
                "top_logprobs": [None if e is None else {text(a): finite(v) for a, v in e[1]} for _, e in tokens],
                "text_offset": offsets}

    def token_text(self, token: int) -> str:
        return self.engine.llm.tokenizer.decode([token])


def finite(logprob: float) -> float:
    """JSON has no -inf (a token the request's top-k / top-p excludes): -9999.0 instead, as vLLM."""
    return max(logprob, -9999.0)


def usage_of(reqs: list[EngineRequest]) -> dict:
    """A request's choices share its prompt: counted once."""
    prompt, completion = reqs[0].prompt_tokens, sum(r.completion_tokens for r in reqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": reqs[0].seq.cached_tokens}}


def build_app(server: Server) -> FastAPI:
    app = FastAPI(title="eagle-engine", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, e: RequestValidationError):
        return error_response(400, str(e.errors()[0].get("msg", e)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else
                              "invalid_request_error")

    @app.get("/health")
    async def health():
        if not server.engine.alive:
            return error_response(503, f"engine stopped: {server.engine.error}", "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "eagle-engine"}]}

    @app.get("/metrics")
    async def metrics():
        server.engine.metrics.set_load(len(server.engine.llm.scheduler.waiting), len(server.engine.llm.scheduler.running),
                                       *server.engine.kv_blocks())
        return Response(server.engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions")
    async def chat(http: Request):
        body = parse(await http.body(), ChatBody)
        server.check_model(body)
        ids = server.chat_ids(body)
        params = server.params(body, len(ids), body.max_completion_tokens or body.max_tokens)
        return await server.respond(http, server.submit_all(ids, params, body), body, chat=True)

    @app.post("/v1/completions")
    async def completions(http: Request):
        body = parse(await http.body(), CompletionBody)
        server.check_model(body)
        ids = server.completion_ids(body)
        params = server.params(body, len(ids), body.max_tokens)
        return await server.respond(http, server.submit_all(ids, params, body), body, chat=False)

    return app


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m engine.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    p.add_argument("--max-waiting", type=int, default=1024, help="queued requests before new ones get 503")
    p.add_argument("--default-max-tokens", type=int, default=512,
                   help="max_tokens of a request that sets none (capped by the context)")
    p.add_argument("--log-level", default="warning")
    add_engine_args(p, max_batch=64)
    return p.parse_args(argv)


def main(argv=None) -> int:
    import uvicorn
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    try:
        if not 0 <= args.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {args.port}")
        if args.max_waiting < 1 or args.default_max_tokens < 1:
            raise ValueError("--max-waiting and --default-max-tokens must be >= 1")
        llm = build_llm(args)
    except (ModelNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine = AsyncEngine(llm, args.method or default_method(), args.max_waiting)
    server = Server(engine, args.served_model_name or args.model, args.default_max_tokens)
    http = uvicorn.Server(uvicorn.Config(build_app(server), host=args.host, port=args.port, log_level=args.log_level))

    def serve_http():  # uvicorn in a thread, the engine in the main one (AsyncEngine.run says why)
        try:
            http.run()
        finally:
            engine.shutdown()

    thread = threading.Thread(target=serve_http, name="http", daemon=True)
    thread.start()
    signal.signal(signal.SIGTERM, signal.default_int_handler)   # stop as on Ctrl-C
    print(f"serving {server.model_name} ({engine.method}) on http://{args.host}:{args.port}", file=sys.stderr,
          flush=True)
    try:
        engine.run()
    except KeyboardInterrupt:
        pass
    finally:
        http.should_exit = True
        thread.join(timeout=30)
    if not http.started:
        print(f"error: could not serve on {args.host}:{args.port} (see the message above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
