"""The OpenAI-compatible server on 127.0.0.1, called with the official `openai` client and raw HTTP."""
import asyncio
import json
import re
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from engine.llm import LLM
from engine.serve import Server, build_app
from engine.serving import AsyncEngine

from conftest import CHAT_PROMPTS

MODEL = "smollm2-135m"


class LiveServer:
    """engine.serve's app on an ephemeral loopback port, in this process (the test reads the engine)."""

    def __init__(self, llm: LLM, method: str, max_waiting: int = 1024):
        self.engine = AsyncEngine(llm, method, max_waiting)
        self.engine.start()
        config = uvicorn.Config(build_app(Server(self.engine, MODEL)), host="127.0.0.1", port=0,
                                log_level="warning")
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.uvicorn.started:
            assert time.time() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)
        port = self.uvicorn.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def close(self):
        self.uvicorn.should_exit = True
        self.thread.join(timeout=30)
        self.engine.shutdown()

    def idle(self, timeout: float = 30) -> bool:
        """Wait until no request is active and every KV block is back in the pool."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            used, _ = self.engine.kv_blocks()
            sched = self.engine.llm.scheduler
            if not self.engine.active and used == 0 and not sched.running and not sched.waiting:
                return True
            time.sleep(0.05)
        return False

    def metric(self, line_prefix: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_prefix))


@pytest.fixture(scope="module")
def server():
    llm = LLM(MODEL, None, kv_cache_gb=0.25, max_batch=64, method="auto")
    live = LiveServer(llm, "auto")
    yield live
    live.close()


def chat(server, prompt, **kw):
    kw = {"max_tokens": 16, "temperature": 0, **kw}
    return server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], **kw)


def test_chat_completions_streamed_and_not(server):
    r = chat(server, "Write a haiku about the sea.", max_tokens=24)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(chat(server, "Write a haiku about the sea.", max_tokens=24, stream=True,
                       stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content                       # greedy: the same text either way
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_completions_and_models_and_health(server):
    r = server.client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text and r.usage.completion_tokens <= 8
    streamed = "".join(c.choices[0].text for c in server.client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True))
    assert streamed == r.choices[0].text
    by_ids = server.client.completions.create(model=MODEL, prompt=server.engine.llm.tokenizer.encode(
        "The capital of France is"), max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    raw = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3,
                                                           "stream": True}).text
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_stop_strings_end_the_output_and_never_leak(server):
    full = chat(server, "Count from 1 to 20, one number per line.", max_tokens=48).choices[0].message.content
    assert "7" in full, full
    stop = full[full.index("7"):full.index("7") + 2]
    r = chat(server, "Count from 1 to 20, one number per line.", max_tokens=48, stop=[stop, "never appears"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[:full.index(stop)]
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(
        server, "Count from 1 to 20, one number per line.", max_tokens=48, stop=stop, stream=True))
    assert streamed == r.choices[0].message.content
    assert server.idle()


def test_logprobs_chat_and_completions(server):
    """Greedy: each token's logprob is its alternatives' first; streamed logprobs equal the whole answer's;
    the completions lists line up with the tokens. (Equality with vanilla under every method:
    tests/test_logprobs.py.)"""
    r = chat(server, "Name three colors.", max_tokens=12, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == e.logprob <= 0 and e.bytes == list(e.token.encode())
    chunks = list(chat(server, "Name three colors.", max_tokens=12, logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert chat(server, "Name three colors.", max_tokens=4).choices[0].logprobs is None
    c = server.client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                         temperature=0, logprobs=3)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == \
        c.usage.completion_tokens
    assert all(len(top) <= 3 and max(top.values()) == v for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    assert server.idle()


def test_echo_with_prompt_logprobs(server):
    """lm-evaluation-harness's request: echo + logprobs gives the prompt's tokens (the first without a
    logprob) before the completion's, streamed or not."""
    prompt = "The capital of France is"
    n_prompt = len(server.engine.llm.tokenizer.encode(prompt))
    r = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                         logprobs=1)
    text, lp = r.choices[0].text, r.choices[0].logprobs
    assert text.startswith(prompt) and len(lp.tokens) == n_prompt + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert "".join(lp.tokens[:n_prompt]) == prompt
    chunks = list(server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                                   echo=True, logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    plain = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text == text and plain.choices[0].logprobs is None
    assert server.idle()


def test_n_choices(server):
    """n choices, each its own engine request (choice i seeded with seed + i): indexed, the prompt counted once
    in usage, streamed as chunks tagged by index; greedy choices equal the request alone (the server runs
    `auto`, whose sampled draws follow the batch's draft depth: README)."""
    r = chat(server, "Name a color.", n=3, max_tokens=10, temperature=0.9, seed=5, logprobs=True)
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.message.content for c in r.choices)
    one = chat(server, "Name a color.", max_tokens=10)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    chunks = list(chat(server, "Name a color.", n=3, max_tokens=10, temperature=0.9, seed=5, stream=True))
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == [0, 1, 2]
    assert all("".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
               for i in range(3))
    greedy = chat(server, "Name a color.", n=2, max_tokens=10)
    assert [c.message.content for c in greedy.choices] == [one.choices[0].message.content] * 2
    c = server.client.completions.create(model=MODEL, prompt="Once upon a time", n=2, max_tokens=6, temperature=0)
    assert len(c.choices) == 2 and c.choices[0].text == c.choices[1].text
    assert server.idle()


def test_prefix_cache_in_usage_and_metrics(server):
    """A repeated conversation's prompt comes from the prefix cache: usage says how much, and so does the
    Prometheus counter beside the prompt tokens'."""
    before = server.metric("eagle_prompt_tokens_cached_total")
    messages = [{"role": "user", "content": "Tell me about the moons of Jupiter, one line each, please."}]
    first = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    again = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached == (again.usage.prompt_tokens - 1) // 16 * 16
    assert again.choices[0].message.content == first.choices[0].message.content
    assert server.idle() and server.metric("eagle_prompt_tokens_cached_total") - before >= cached


def test_penalties_bias_and_min_tokens(server):
    """The logit transforms reach the engine: a +100 bias makes a token the whole answer; min_tokens keeps EOS
    away; penalties are accepted (their arithmetic and losslessness: tests/test_logprobs.py)."""
    tok = server.engine.llm.tokenizer
    word = tok.encode(" blue")[-1]
    r = chat(server, "Say hi.", max_tokens=5, logit_bias={str(word): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == tok.decode([word] * 5)
    eos = tok.eos_token_id
    r = chat(server, "Say hi.", max_tokens=6, logit_bias={str(eos): 100}, extra_body={"min_tokens": 3})
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "stop"
    r = chat(server, "List some fruit.", max_tokens=16, presence_penalty=1.5, frequency_penalty=0.5,
             extra_body={"repetition_penalty": 1.2})
    assert r.choices[0].message.content and server.idle()


def test_structured_output(server):
    """OpenAI's response_format (json_object, json_schema) and vLLM's guided_* / structured_outputs fields on both
    endpoints: the answers satisfy their grammar and end with "stop", streamed or not; bad ones are 400s that
    name the field (more shapes in BAD)."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}}
    r = chat(server, "Where is the Eiffel Tower? Answer in JSON.", max_tokens=48, response_format=fmt)
    text = r.choices[0].message.content
    assert set(json.loads(text)) == {"city", "country"} and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(
        server, "Where is the Eiffel Tower? Answer in JSON.", max_tokens=48, response_format=fmt, stream=True))
    assert streamed == text
    r = chat(server, "Reply with a JSON object giving the city and country of Paris.", max_tokens=48,
             response_format={"type": "json_object"}, n=2, temperature=0.7, seed=3)
    # Sampled under `auto`, whose depths follow the machine's timings, an answer may ramble past the cap: then
    # it must be a prefix of a JSON object (the grammar takes it), else a whole one.
    for c in r.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
        else:
            assert c.finish_reason == "length"
            assert server.engine.llm.grammars.state(("json", "")).matcher.accept_string(c.message.content)
    r = chat(server, "Make up a US phone number.", max_tokens=16, extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", r.choices[0].message.content)
    r = chat(server, "Is the sky blue?", max_tokens=8, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = chat(server, "What is 6 times 7?", max_tokens=16,
             extra_body={"structured_outputs": {"grammar": 'root ::= "It is " [0-9]+ "."'}})
    assert re.fullmatch("It is [0-9]+\\.", r.choices[0].message.content)
    r = server.client.completions.create(model=MODEL, prompt="Paris is in France. As JSON:", max_tokens=48,
                                         temperature=0, extra_body={"response_format": fmt})
    assert set(json.loads(r.choices[0].text)) == {"city", "country"}
    for extra, match in (({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
                          "response_format: invalid json: Unsupported type"),
                         ({"guided_regex": "(ab"}, "guided_regex: invalid regex"),
                         ({"guided_json": schema, "guided_regex": "a"}, "guided_json, guided_regex: give at most one"),
                         ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens: cannot be combined with guided_regex")):
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi"})):
            r = httpx.post(server.url + path, json={"model": MODEL, "max_tokens": 8, **body, **extra})
            assert r.status_code == 400 and r.json()["error"]["message"].startswith(match), r.text
    assert server.idle()


BAD = [
    (b"{not json", 400), (b"[1, 2]", 400),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400),                        # no model
    ({"model": MODEL}, 400),                                                         # no messages
    ({"model": MODEL, "messages": []}, 400),
    ({"model": MODEL, "messages": "hi"}, 400),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -0.5}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 1.01}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": [""]}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 0}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 17}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": "2"}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": "yes"}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": -1}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400),  # no logprobs
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 2.5}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "frequency_penalty": -3}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 0}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"abc": 1}}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 101}}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999999": 1}}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "min_tokens": 5}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "response_format": "json"}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}}, 400),   # no name
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": 5}}}}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "guided_json": "{not json"}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "guided_regex": "[a-"}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "guided_regex": 5}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "guided_choice": []}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "guided_choice": "yes"}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "guided_grammar": "root ::= "}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"regex": 5}}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"},
      "structured_outputs": {"choice": ["a"]}}, 400),
    ({"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]}, 404),
]


@pytest.mark.parametrize("body,status", BAD)
def test_bad_requests_get_openai_style_4xx(server, body, status):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + "/v1/chat/completions", content=content,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and set(err) == {"message", "type", "param", "code"}


def test_prompts_past_the_context_and_bad_token_ids_are_rejected(server):
    ctx = server.engine.llm.cfg.max_position
    for prompt, match in (([1] * ctx, "context"), ([10**9], "token ids"), ([], "prompt")):
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
        assert r.status_code == 400 and match in r.json()["error"]["message"], r.text
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model=MODEL, prompt="x " * (ctx + 10), max_tokens=4)
    assert httpx.get(server.url + "/health").status_code == 200 and server.idle()


def test_disconnects_cancel_requests_and_return_their_blocks(server):
    aborted = server.metric('eagle_requests_total{finish_reason="abort"')
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a very long story."}],
            "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client:
        streams = [client.stream("POST", server.url + "/v1/chat/completions", json=body) for _ in range(6)]
        for s in streams:
            response = s.__enter__()
            lines = response.iter_lines()
            assert next(l for l in lines if l.startswith("data: "))   # the stream is running
        assert server.engine.kv_blocks()[0] > 0
        for s in streams:
            s.__exit__(None, None, None)                                # hang up mid-stream
    # A non-streamed request whose client hangs up before the answer.
    payload = json.dumps({**body, "stream": False}).encode()
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        time.sleep(1.0)
    assert server.idle(), "blocks of cancelled requests were not returned"
    assert server.metric('eagle_requests_total{finish_reason="abort"') - aborted == 7


def test_greedy_output_is_the_same_alone_and_among_63_others(server):
    prompts = [f"{p} ({i})" for i, p in enumerate(CHAT_PROMPTS * 4)][:64]

    async def run_all():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        rs = await asyncio.gather(*(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=20, temperature=0) for p in prompts))
        await client.close()
        return [r.choices[0].message.content for r in rs]

    together = asyncio.run(run_all())
    for i in (0, 21, 42, 63):
        assert chat(server, prompts[i], max_tokens=20).choices[0].message.content == together[i], i
    assert server.idle()


def test_metrics_report_load_latency_and_speculation(server):
    chat(server, "Why is the sky blue?", max_tokens=32)
    text = httpx.get(server.url + "/metrics").text
    for name in ("eagle_requests_total", "eagle_prompt_tokens_total", "eagle_generation_tokens_total",
                 "eagle_time_to_first_token_seconds_bucket", "eagle_inter_token_latency_seconds_bucket",
                 "eagle_requests_waiting", "eagle_requests_running", "eagle_kv_blocks_used", "eagle_kv_blocks_total",
                 "eagle_spec_draft_depth_bucket", "eagle_round_seconds_bucket"):
        assert name in text, name
    assert server.metric("eagle_generation_tokens_total") >= 32
    assert server.metric("eagle_kv_blocks_used") == 0
    spec = server.metric('eagle_spec_rounds_total{method="auto"}')
    if spec:   # the adaptive policy speculated: acceptance metrics must be consistent
        assert 1 <= server.metric('eagle_spec_mean_acceptance_length{method="auto"}')
        assert 'eagle_spec_acceptance_rate{method="auto",position="1"}' in text
    # a reply that repeats a list: its rounds verify what followed the list's earlier occurrence (lookup: on by
    # default on a CPU, off on a GPU)
    chat(server, "Repeat this list exactly three times: red apple, green pear, yellow banana, blue plum.", max_tokens=48)
    lookups = server.metric('eagle_spec_lookup_rounds_total{method="auto"}')
    assert (lookups > 0) == bool(getattr(server.engine.llm.decoder, "lookup", 0)), lookups


def test_a_full_queue_answers_503_and_loses_nothing():
    """A pool that holds two requests and a queue of two: a burst of 10 gets 503s for the overflow, and
    every admitted request completes with its solo output."""
    llm = LLM(MODEL, None, kv_cache_gb=0.004, max_batch=64, method="vanilla")
    live = LiveServer(llm, "vanilla", max_waiting=2)
    try:
        prompts = [f"{p}" for p in CHAT_PROMPTS[:10]]

        async def burst():
            client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=300)
            rs = await asyncio.gather(*(client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=24, temperature=0)
                for p in prompts), return_exceptions=True)
            await client.close()
            return rs

        results = asyncio.run(burst())
        busy = [r for r in results if isinstance(r, openai.APIStatusError)]
        done = [(p, r) for p, r in zip(prompts, results) if not isinstance(r, Exception)]
        assert busy and all(r.status_code == 503 for r in busy)
        assert len(done) + len(busy) == len(prompts) and len(done) >= 2
        assert live.idle()
        for p, r in done:
            assert chat(live, p, max_tokens=24).choices[0].message.content == r.choices[0].message.content
        r = httpx.post(live.url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 4000,
                       "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "KV blocks" in r.json()["error"]["message"]
    finally:
        live.close()


def test_a_failing_round_fails_its_requests_and_the_server_goes_on(server, monkeypatch):
    decoder = server.engine.llm.decoder
    real = decoder.step
    calls = {"n": 0}

    def broken(seqs, depth=0, chunk=None):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return real(seqs, depth, chunk)

    monkeypatch.setattr(decoder, "step", broken)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0})
    assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
    assert server.idle()
    assert httpx.get(server.url + "/health").status_code == 200
    assert chat(server, "hi", max_tokens=8).choices[0].message.content


def test_the_command_serves_from_the_main_thread_and_stops_on_sigterm():
    """`python -m engine.serve` as a user runs it: the engine loop in the main thread (uvicorn in another), a
    streamed answer, SIGTERM -> exit 0; a port already taken -> a one-line error, exit 1."""
    import signal
    import subprocess
    import tempfile
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = subprocess.run([sys.executable, "-m", "engine.serve", "--port", str(port), "--threads", "1"], cwd=root,
                              capture_output=True, text=True, timeout=300)
    assert busy.returncode == 1 and busy.stderr.strip().splitlines()[-1].startswith("error: could not serve")
    log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe nobody reads: the server never blocks writing
    proc = subprocess.Popen([sys.executable, "-m", "engine.serve", "--port", str(port), "--threads", "1",
                             "--method", "vanilla"], cwd=root, stderr=log, text=True)
    try:
        deadline = time.time() + 300
        while True:
            assert proc.poll() is None and time.time() < deadline, "server did not start"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                           timeout=120) as client:  # closed before SIGTERM: no keep-alive for shutdown to wait on
            stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}],
                                                    max_tokens=8, temperature=0, stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            code = None
        log.seek(0)
        assert code == 0, f"exit {code} after SIGTERM; the server's stderr:\n{log.read()[-3000:]}"
    finally:
        proc.kill()
        log.close()
