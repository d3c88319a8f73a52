"""Size limits and strict types on the OpenAI gateway.

The gateway runs as in production in front of ``RecordingTriton`` (no model needed). The body
limit is checked with raw sockets, which can promise a body they never send: an answer that
arrives while the body is still missing shows the gateway did not wait to read it.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gateway_fakes import MODEL, RecordingTriton, serve
from quanta.frontends.openai.limits import PromptLimit, longest_token_bytes, prompt_limit
from quanta.text.chat_template import ChatTemplate

openai = pytest.importorskip("openai")

LIMIT = 64 * 1024


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[Any, RecordingTriton, str]]:
    upstream = RecordingTriton()
    server = serve(
        tmp_path / "state",
        upstream,
        max_request_bytes=LIMIT,
        max_file_bytes=4 * LIMIT,
        max_prompt_bytes=1000,
        max_model_len=50,
    )
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0, timeout=30)
    try:
        yield c, upstream, server.url
    finally:
        c.close()
        server.stop()


def raw_exchange(url: str, head: bytes, chunks: list[bytes]) -> tuple[int, dict[str, Any]]:
    """Send ``head`` and ``chunks`` on one connection, stop sending, and read the answer;
    a server that waited for more of the body would time the read out."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head)
        for chunk in chunks:
            sock.sendall(chunk)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    status = int(answer.split(b" ", 2)[1])
    return status, json.loads(answer.split(b"\r\n\r\n", 1)[1])


def test_a_promised_body_past_the_limit_is_a_413_before_it_is_read(gateway):
    _, upstream, url = gateway
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000000\r\n\r\n"
    )
    status, body = raw_exchange(url, head, [b'{"model": "quanta", '])  # 20 of 10^8 bytes
    assert status == 413, body
    assert body["error"]["code"] == "request_too_large"
    assert str(LIMIT) in body["error"]["message"]
    assert upstream.inputs() == []


def test_a_chunked_body_is_refused_once_it_passes_the_limit(gateway):
    _, upstream, url = gateway
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    piece = b"x" * 16384
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    status, body = raw_exchange(url, head, [chunk] * 5)  # 80 KiB, never the last chunk
    assert status == 413, body
    assert upstream.inputs() == []


def test_a_file_upload_has_its_own_limit(gateway):
    client, _, _ = gateway

    def lines(count: int) -> bytes:
        body = {"model": MODEL, "prompt": "p" * 900, "max_tokens": 1}
        return "\n".join(
            json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions"})[:-1]
            + f', "body": {json.dumps(body)}}}'
            for i in range(count)
        ).encode()

    small = lines(100)  # ~100 KiB: over the request limit, not the file's
    assert len(small) > LIMIT
    assert client.files.create(file=("in.jsonl", small), purpose="batch").bytes == len(small)
    with pytest.raises(openai.APIStatusError) as info:
        client.files.create(file=("in.jsonl", lines(300)), purpose="batch")
    assert info.value.status_code == 413


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stream", "yes"),
        ("stream", 1),
        ("echo", "true"),
        ("max_tokens", "16"),
        ("max_tokens", 16.0),
        ("n", True),
        ("seed", "7"),
        ("temperature", "0.5"),
        ("temperature", True),
        ("top_p", "1"),
    ],
)
def test_types_are_strict_and_a_wrong_one_names_its_field(gateway, field, value):
    client, upstream, _ = gateway
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", extra_body={field: value})
    assert info.value.body["param"] == field, info.value.body
    assert upstream.inputs() == []


def test_stream_options_without_a_stream_are_refused_naming_the_field(gateway):
    client, upstream, _ = gateway
    options = {"include_usage": True}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", stream_options=options)
    assert info.value.body["param"] == "stream_options", info.value.body
    assert upstream.inputs() == []
    stream = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=1, stream=True, stream_options=options
    )
    assert list(stream)
    assert len(upstream.inputs()) == 1


def test_a_json_integer_is_still_a_number_where_a_float_is_expected(gateway):
    client, upstream, _ = gateway
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, temperature=1, top_p=1)
    (inputs,) = upstream.inputs()
    assert inputs["temperature"] == 1.0


def test_content_null_is_refused_for_a_user_message_and_taken_for_an_assistant(gateway):
    client, upstream, _ = gateway
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": None}], max_tokens=1
        )
    assert info.value.body["param"] == "messages"
    assert "content" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "system"}], max_tokens=1)
    client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": None},
            {"role": "user", "content": "b"},
        ],
        max_tokens=1,
    )
    assert len(upstream.inputs()) == 1


def test_a_prompt_that_cannot_fit_is_refused_before_anything_tokenizes_it(gateway):
    client, upstream, _ = gateway
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="é" * 501, max_tokens=1)  # 1002 bytes
    assert info.value.body["param"] == "prompt"
    assert "1002 bytes" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x" * 1001}], max_tokens=1
        )
    assert info.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=list(range(51)), max_tokens=1)
    assert info.value.body["param"] == "prompt"
    assert upstream.inputs() == []
    client.completions.create(model=MODEL, prompt="é" * 500, max_tokens=1)  # 1000 bytes
    client.completions.create(model=MODEL, prompt=list(range(50)), max_tokens=1)
    assert len(upstream.inputs()) == 2


class FakeVocab:
    """A tokenizer's backend that lists a vocabulary (``longest_token_bytes``)."""

    def __init__(self, tokens: list[str]) -> None:
        self.backend = self
        self._tokens = tokens

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        return {t: i for i, t in enumerate(self._tokens)}


def test_the_prompt_limit_is_the_context_times_the_longest_token(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 128}))
    vocab = FakeVocab(["a", "Ġthe", "<|endoftext|>", "▁é"])  # "▁é": 5 UTF-8 bytes
    assert longest_token_bytes(vocab) == len("<|endoftext|>")  # type: ignore[arg-type]
    limit = prompt_limit(tmp_path, vocab)  # type: ignore[arg-type]
    assert limit == PromptLimit(max_bytes=128 * 13, max_ids=128)
    assert prompt_limit(tmp_path, vocab, max_model_len=10).max_bytes == 130  # type: ignore[arg-type]
    assert prompt_limit(tmp_path, None) == PromptLimit(None, 128)  # no tokenizer: no text bound
    assert prompt_limit(None, None, max_prompt_bytes=7) == PromptLimit(7, None)


class ThreadRecordingTemplate(ChatTemplate):
    """The default template, noting which thread rendered each conversation."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[threading.Thread] = []

    def render(self, messages: Any, *args: Any, **kwargs: Any) -> str:
        self.threads.append(threading.current_thread())
        return super().render(messages, *args, **kwargs)


def test_chat_templates_render_off_the_event_loop(tmp_path):
    template = ThreadRecordingTemplate()
    upstream = RecordingTriton()
    server = serve(tmp_path / "state", upstream, chat_template=template)
    try:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as c:
            c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1
            )
    finally:
        server.stop()
    assert template.threads
    assert all(t.name != "quanta-openai" for t in template.threads)  # not the loop's thread


def test_a_text_prompt_longer_than_the_context_is_counted_and_refused_at_the_gateway(tmp_path):
    """Past the bytes that surely fit, the gateway counts tokens itself (off its loop) and
    refuses an over-long prompt, so the engine's server never tokenizes it."""
    counted: list[str] = []

    def count(text: str) -> int:  # one token per word
        counted.append(text)
        return len(text.split())

    limit = PromptLimit(max_bytes=None, max_ids=20)
    limit.check_tokens("a b c", count, "prompt")  # 5 bytes: fits without counting
    assert counted == []
    limit.check_tokens("word " * 21, count, "prompt")  # 21 words: within one of the context
    with pytest.raises(Exception) as info:
        limit.check_tokens("word " * 30, count, "prompt")
    assert "30 tokens" in str(info.value) and len(counted) == 2
    template = ChatTemplate(count_tokens=count)
    upstream = RecordingTriton()
    server = serve(tmp_path / "state", upstream, chat_template=template, max_model_len=20)
    try:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as c:
            c.completions.create(model=MODEL, prompt="word " * 10, max_tokens=1)
    finally:
        server.stop()
    assert len(upstream.inputs()) == 1  # no tokenizer known to the gateway: nothing counted
