"""The official `openai` Python client against a real `faden up` (gateway + embedded worker +
mock engine): streaming and non-streaming chat, completions, embeddings, model listing, and the
OpenAI-shaped errors the client turns into exceptions."""

import openai
import pytest


@pytest.fixture(scope="module")
def client(faden):
    return openai.OpenAI(base_url=faden["base_url"], api_key=faden["key"], max_retries=0, timeout=20)


def test_models_lists_demo(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["demo"]


def test_chat_non_streaming(client):
    answer = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    assert answer.choices[0].message.content == "tok0 tok1 tok2 tok3 "
    assert answer.choices[0].finish_reason in ("length", "stop")


def test_chat_streaming_arrives_in_chunks(client):
    stream = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert pieces == [f"tok{i} " for i in range(8)]
    assert usage is not None and usage.completion_tokens == 8


def test_completions(client):
    answer = client.completions.create(model="demo", prompt="hi", max_tokens=3)
    assert answer.choices[0].text == "tok0 tok1 tok2 "


def test_embeddings(client):
    answer = client.embeddings.create(model="demo", input=["a", "b"])
    assert len(answer.data) == 2
    assert all(len(d.embedding) > 0 for d in answer.data)


def test_errors_are_openai_shaped(client, faden):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert err.value.body["code"] == "model_not_found" or "model" in str(err.value)
    bad = openai.OpenAI(base_url=faden["base_url"], api_key="fdn_0000000000000000_00000000000000000000000000000000", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
