"""The official `openai` SDK through faden to a real vLLM, on every path (conftest.PATHS: the
server's gateway to a direct, a worker and a tunnel worker, and a standalone gateway to each):
answers equal vLLM's own to the same request (greedy decoding), streams byte for byte as vLLM
frames them, usage with `prompt_tokens_details.cached_tokens` passed through, clients that leave
free the engine, and vLLM's errors passed through unchanged.

Only the response id and its `created` second differ between two answers of vLLM to the same
request; `normalised()` blanks them before comparing bytes.
"""

import json
import re
import socket
import uuid

import httpx
import openai
import pytest

import engine
import faden_harness

# Greedy decoding and a fixed length: vLLM gives the same tokens to the same request.
GREEDY = {"temperature": 0, "max_tokens": 16}
IGNORE_EOS = {"ignore_eos": True}
# Long enough to be still running when the client leaves (~3 ms a token here), short of the
# model's 4096-token window.
LONG = 3000


def normalised(raw: bytes) -> bytes:
    raw = re.sub(rb'"id":"[^"]*"', b'"id":"ID"', raw)
    return re.sub(rb'"created":\d+', b'"created":0', raw)


def post_raw(url: str, body: dict, key: str = "unused") -> httpx.Response:
    """A whole answer of `url`/v1/chat/completions (or completions, by body), read to the end."""
    route = "chat/completions" if "messages" in body else "completions"
    return httpx.post(f"{url}/v1/{route}", json=body, timeout=60, headers={"Authorization": f"Bearer {key}"})


def chat_body(model: str, content: str = "hello there", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], **GREEDY, **IGNORE_EOS, **extra}


def own(vllm) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{vllm.url}/v1", api_key="unused", max_retries=0, timeout=60)


def long_prompt(words: int = 60) -> str:
    """A prompt of several 128-token blocks that no other test sends (a fresh nonce first)."""
    return f"{uuid.uuid4().hex} " + "hello world " * words


def test_chat_not_streamed(path, vllm):
    messages = [{"role": "user", "content": "hello there"}]
    answer = path.client.chat.completions.create(model=path.model, messages=messages, **GREEDY, extra_body=IGNORE_EOS)
    direct = own(vllm).chat.completions.create(model=path.model, messages=messages, **GREEDY, extra_body=IGNORE_EOS)
    assert answer.model == "tiny"
    assert answer.choices[0].finish_reason == "length"
    assert answer.choices[0].message.content == direct.choices[0].message.content
    assert answer.usage.completion_tokens == 16
    assert answer.usage.prompt_tokens == direct.usage.prompt_tokens
    # And the bytes: faden passes the answer on as vLLM wrote it.
    body = chat_body(path.model)
    through, straight = post_raw(path.url, body, path.client.api_key), post_raw(vllm.url, body)
    assert (through.status_code, through.headers["content-type"]) == (200, straight.headers["content-type"])
    assert normalised(through.content) == normalised(straight.content)


def test_chat_streamed(path, vllm):
    def pieces(client):
        stream = client.chat.completions.create(
            model=path.model, messages=[{"role": "user", "content": "stream please"}], stream=True,
            stream_options={"include_usage": True}, **GREEDY, extra_body=IGNORE_EOS)
        text, finish, usage = [], None, None
        for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        return text, finish, usage

    text, finish, usage = pieces(path.client)
    direct_text, direct_finish, direct_usage = pieces(own(vllm))
    # The same tokens; how many a chunk carries depends on timing (stream_shape()).
    assert ("".join(text), finish, usage) == ("".join(direct_text), direct_finish, direct_usage)
    assert finish == "length" and usage.completion_tokens == 16
    assert len(text) > 2  # streamed in pieces


def test_completions(path, vllm):
    args = dict(model=path.model, prompt="once upon a time", **GREEDY, extra_body=IGNORE_EOS)
    answer = path.client.completions.create(**args)
    assert answer.choices[0].text == own(vllm).completions.create(**args).choices[0].text
    assert answer.usage.completion_tokens == 16
    streamed = "".join(c.choices[0].text for c in path.client.completions.create(**args, stream=True) if c.choices)
    assert streamed == answer.choices[0].text


def stream_shape(raw: bytes) -> tuple[list[bytes], str]:
    """A stream's events with the text of each token chunk blanked, runs of equal events
    collapsed into one, and the text they carried. vLLM puts one token in a chunk, or several
    when its output lags the engine (timing, so two answers to one request may cut the text
    differently); everything else of each event is compared byte for byte."""
    text, events = [], []
    for event in normalised(raw).split(b"\n\n"):
        pieces = re.findall(rb'"(?:content|text)":"((?:[^"\\]|\\.)*)"', event)
        text += [json.loads(b'"' + p + b'"') for p in pieces]
        shape = re.sub(rb'"(content|text)":"(?:[^"\\]|\\.)*"', rb'"\1":"-"', event)
        if not events or events[-1] != shape:
            events.append(shape)
    return events, "".join(text)


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_stream_bytes_are_vllms_own(path, vllm, kind):
    """The stream as vLLM framed it: `data: {...}\\n\\n` events of the same bytes in the same
    order (the role chunk, token chunks, the finish chunk, the usage chunk, `data: [DONE]`), and
    the same text."""
    opts = {"stream": True, "stream_options": {"include_usage": True}, "max_tokens": 32}
    body = chat_body(path.model, **opts) if kind == "chat" else {
        "model": path.model, "prompt": "once upon a time", **GREEDY, **IGNORE_EOS, **opts}
    through, straight = post_raw(path.url, body, path.client.api_key), post_raw(vllm.url, body)
    assert through.status_code == straight.status_code == 200
    assert through.headers["content-type"] == straight.headers["content-type"]
    assert stream_shape(through.content) == stream_shape(straight.content)
    events = through.content.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    assert b'"usage":{"prompt_tokens"' in events[-3]


def test_cached_tokens_pass_through(path):
    """The same long prompt twice: the second answer's `usage.prompt_tokens_details.cached_tokens`
    is vLLM's count of prompt tokens it took from its prefix cache: whole 128-token blocks, short
    of the last prompt token (which is always computed)."""
    messages = [{"role": "user", "content": long_prompt()}]
    first = path.client.chat.completions.create(model=path.model, messages=messages, max_tokens=1)
    second = path.client.chat.completions.create(model=path.model, messages=messages, max_tokens=1)
    n = first.usage.prompt_tokens
    assert n > 2 * engine.BLOCK_SIZE
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // engine.BLOCK_SIZE * engine.BLOCK_SIZE


def _generated(vllm) -> float:
    # A request an earlier test left running would count here: wait until vLLM runs nothing.
    faden_harness.wait_for(lambda: vllm.metric("vllm:num_requests_running") == 0, 60,
                           "vLLM idle before the test", 0.1)
    return vllm.metric("vllm:generation_tokens_total")


def _wait_aborted(vllm, generated_before: float) -> None:
    """Until vLLM runs nothing, then checks that it stopped the request short of its LONG
    tokens. (vLLM counts no finished reason for an aborted request: `request_success_total`
    stays as it was.)"""
    faden_harness.wait_for(lambda: vllm.metric("vllm:num_requests_running") == 0, 30,
                           "vLLM to stop the request", 0.1)
    assert _generated(vllm) - generated_before < LONG


def _faden_gauges(path) -> dict[str, float]:
    text = path.metrics()
    return {g: engine.metric(text, g) for g in ("faden_gateway_active_requests", "faden_gateway_active_streams")}


def _wait_faden_back_to(path, before: dict[str, float]) -> None:
    """Until faden's in-flight gauges are back where they were before the request (other tests
    share the gateway: a leak elsewhere is not this test's)."""

    def back():
        now = _faden_gauges(path)
        assert now == before, f"in flight now {now}, before {before}"  # wait_for reports it
        return True

    faden_harness.wait_for(back, 10, "faden's in-flight gauges back", 0.1)


# Open: a client that leaves through faden often leaves vLLM generating the whole LONG answer
# (about two runs in three per test here, on every path; straight at vLLM it is stopped within
# 20 ms). One cause seen: a long stream's first chunks sometimes arrive together about 5 s late
# through faden (direct and worker paths), by which time vLLM is nearly done; once the client
# leaves, vLLM stops within about 15 ms. The gauges' part of these tests is covered by
# gateway/tests/accounting.rs. Not strict: a run where vLLM is stopped in time shows XPASS.
CLIENT_LEAVING_REACHES_VLLM_LATE = pytest.mark.xfail(
    strict=False, reason="vLLM is often not stopped in time when a client leaves through faden")


@CLIENT_LEAVING_REACHES_VLLM_LATE
def test_client_leaving_mid_stream_frees_vllm(path, vllm):
    """A client that closes its stream after the first tokens: vLLM aborts the request (it would
    have run for seconds more), and faden's in-flight gauges return to where they were."""
    generated, gauges = _generated(vllm), _faden_gauges(path)
    stream = path.client.chat.completions.create(
        model=path.model, messages=[{"role": "user", "content": "a long story"}], stream=True,
        max_tokens=LONG, extra_body=IGNORE_EOS)
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    assert vllm.metric("vllm:num_requests_running") == 1
    stream.close()
    _wait_aborted(vllm, generated)
    _wait_faden_back_to(path, gauges)


@CLIENT_LEAVING_REACHES_VLLM_LATE
def test_client_leaving_before_the_answer_head_frees_vllm(path, vllm):
    """A client that gives up on a non-streamed answer while vLLM generates it (no byte of the
    answer sent yet): vLLM aborts the request, faden counts the disconnect and its in-flight
    gauges return to where they were."""
    generated, gauges = _generated(vllm), _faden_gauges(path)
    disconnects = engine.metric(path.metrics(), "faden_gateway_client_disconnects_total")
    body = httpx.Request("POST", f"{path.url}/v1/chat/completions", json=chat_body(path.model, max_tokens=LONG))
    host, port = path.url.removeprefix("http://").rsplit(":", 1)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Authorization: Bearer {path.client.api_key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body.content)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head + body.content)
        faden_harness.wait_for(lambda: vllm.metric("vllm:num_requests_running") == 1, 10,
                               "vLLM running the request", 0.05)
    _wait_aborted(vllm, generated)
    _wait_faden_back_to(path, gauges)
    assert engine.metric(path.metrics(), "faden_gateway_client_disconnects_total") == disconnects + 1


@pytest.mark.parametrize("error", ["prompt_too_long", "bad_temperature"])
def test_vllm_errors_pass_through_unchanged(path, vllm, error):
    body = {
        "prompt_too_long": chat_body(path.model, content="hello world " * 700),
        "bad_temperature": chat_body(path.model, temperature=-1),
    }[error]
    through, straight = post_raw(path.url, body, path.client.api_key), post_raw(vllm.url, body)
    assert straight.status_code == 400, straight.text
    assert (through.status_code, through.headers["content-type"]) == (400, straight.headers["content-type"])
    assert through.content == straight.content
    with pytest.raises(openai.BadRequestError) as raised:
        path.client.chat.completions.create(model=path.model, messages=body["messages"],
                                            max_tokens=16, temperature=body["temperature"])
    assert raised.value.body == straight.json()["error"]
