"""``/tokenize``, ``/detokenize``, ``/version`` and ``/ping`` in vLLM's shapes.

Most tests run the real gateway (every route and middleware) in front of a recording stand-in
for Triton, with the tiny checkpoint's tokenizer; the last ones ask the live gateway, where
what ``/tokenize`` counts must be what the engine counts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from gateway_fakes import MODEL, RecordingTriton, serve
from quanta.frontends.openai.auth import KeyPolicy
from quanta.frontends.openai.server import GatewayServer
from quanta.text.chat_template import ChatTemplate, Turn
from quanta.text.tokenizer import load_tokenizer

openai = pytest.importorskip("openai")

KEY = "sk-test-1234"
TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, opt_tiny: Path) -> Path:
    """The tiny checkpoint's tokenizer with a chat template of its own."""
    root = tmp_path_factory.mktemp("templated")
    for name in ("tokenizer.json", "config.json", "tokenizer_config.json"):
        if (opt_tiny / name).is_file():
            (root / name).write_bytes((opt_tiny / name).read_bytes())
    config_path = root / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    config_path.write_text(json.dumps(config | {"chat_template": TEMPLATE}))
    return root


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[GatewayServer]:
    server = serve(
        tmp_path_factory.mktemp("state"),
        RecordingTriton(),
        chat_template=ChatTemplate.from_model_dir(checkpoint),
    )
    try:
        yield server
    finally:
        server.stop()


def post(url: str, body: Any, key: str | None = None) -> tuple[int, Any]:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    response = requests.post(url, json=body, headers=headers, timeout=30)
    return response.status_code, response.json()


def test_tokenize_a_prompt(gateway, checkpoint):
    tokenizer = load_tokenizer(checkpoint)
    status, body = post(f"{gateway.url}/tokenize", {"model": MODEL, "prompt": "Hello there"})
    assert status == 200
    assert body == {
        "count": len(tokenizer.encode("Hello there")),
        "max_model_len": 512,
        "tokens": tokenizer.encode("Hello there"),
    }


def test_tokenize_without_special_tokens_and_with_token_strings(gateway, checkpoint):
    tokenizer = load_tokenizer(checkpoint)
    request = {"prompt": "Hello there", "add_special_tokens": False, "return_token_strs": True}
    status, body = post(f"{gateway.url}/tokenize", request)
    assert status == 200
    assert body["tokens"] == tokenizer.encode("Hello there", add_special_tokens=False)
    assert body["token_strs"] == [tokenizer.backend.id_to_token(t) for t in body["tokens"]]
    assert body["count"] == len(body["tokens"]) < len(tokenizer.encode("Hello there"))


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_tokenize_chat_messages_in_the_template(gateway, checkpoint, generation_prompt):
    """Chat's default leaves special tokens to the template, as vLLM's does."""
    template = ChatTemplate.from_model_dir(checkpoint)
    tokenizer = load_tokenizer(checkpoint)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    request = {"messages": messages, "add_generation_prompt": generation_prompt}
    status, body = post(f"{gateway.url}/tokenize", request)
    assert status == 200
    turns = [Turn(m["role"], m["content"]) for m in messages]
    text = template.render(turns, add_generation_prompt=generation_prompt)
    assert text.endswith("<|assistant|>") == generation_prompt
    assert body["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    status, special = post(f"{gateway.url}/tokenize", request | {"add_special_tokens": True})
    assert special["tokens"] == tokenizer.encode(text)


def test_tokenize_a_prefilled_reply_ends_inside_it(gateway, checkpoint):
    template = ChatTemplate.from_model_dir(checkpoint)
    tokenizer = load_tokenizer(checkpoint)
    messages = [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "The capital is"},
    ]
    request = {"messages": messages, "add_generation_prompt": False}
    status, body = post(f"{gateway.url}/tokenize", request | {"continue_final_message": True})
    assert status == 200
    turns = [Turn(m["role"], m["content"]) for m in messages]
    text = template.render(turns, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("The capital is")
    assert body["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    status, body = post(
        f"{gateway.url}/tokenize", {"messages": messages, "continue_final_message": True}
    )
    assert status == 400 and "cannot both be true" in body["error"]["message"]


def test_detokenize_round_trips(gateway):
    _, tokens = post(f"{gateway.url}/tokenize", {"prompt": "The tide came in."})
    status, body = post(f"{gateway.url}/detokenize", {"model": MODEL, "tokens": tokens["tokens"]})
    assert status == 200
    assert body == {"prompt": "The tide came in."}


@pytest.mark.parametrize(
    ("route", "request_body", "status", "param", "message"),
    [
        ("tokenize", {"model": "other", "prompt": "x"}, 404, "model", "does not exist"),
        ("detokenize", {"model": "other", "tokens": [1]}, 404, "model", "does not exist"),
        ("tokenize", {}, 400, "prompt", "Field required"),
        ("tokenize", {"prompt": "x", "typo": 1}, 400, "typo", "Extra inputs"),
        ("tokenize", {"messages": []}, 400, "messages", "at least 1"),
        ("tokenize", {"prompt": 5}, 400, "prompt", "string"),
        ("detokenize", {"tokens": [-1]}, 400, "tokens", "greater than or equal to 0"),
        ("detokenize", {"tokens": [10**6]}, 400, "tokens", "the tokenizer has 512 ids"),
        ("detokenize", {"tokens": "1 2"}, 400, "tokens", "list"),
    ],
)
def test_bad_requests_name_the_field(gateway, route, request_body, status, param, message):
    code, body = post(f"{gateway.url}/{route}", request_body)
    assert code == status
    assert body["error"]["param"] == param
    assert message in body["error"]["message"]


def test_version_and_ping(gateway):
    import quanta

    version = requests.get(f"{gateway.url}/version", timeout=10)
    assert version.status_code == 200 and version.json() == {"version": quanta.__version__}
    for method in ("GET", "POST"):
        ping = requests.request(method, f"{gateway.url}/ping", timeout=10)
        assert ping.status_code == 200 and ping.json() == {"status": "ok"}


def test_without_a_tokenizer_the_routes_say_what_is_missing(tmp_path):
    server = serve(tmp_path / "state", RecordingTriton())
    try:
        for route, body in (("tokenize", {"prompt": "x"}), ("detokenize", {"tokens": [1]})):
            code, answer = post(f"{server.url}/{route}", body)
            assert code == 400 and "--model-dir" in answer["error"]["message"]
    finally:
        server.stop()


def test_with_keys_tokenize_needs_one_and_ping_does_not(tmp_path, checkpoint):
    server = serve(
        tmp_path / "state",
        RecordingTriton(),
        chat_template=ChatTemplate.from_model_dir(checkpoint),
        api_keys={KEY: KeyPolicy(tenant="alice")},
    )
    try:
        for route, body in (("tokenize", {"prompt": "x"}), ("detokenize", {"tokens": [5]})):
            assert post(f"{server.url}/{route}", body)[0] == 401
            assert post(f"{server.url}/{route}", body, key=KEY)[0] == 200
        assert requests.get(f"{server.url}/ping", timeout=10).status_code == 200
        assert requests.get(f"{server.url}/version", timeout=10).status_code == 200
    finally:
        server.stop()


# -- against the live gateway ------------------------------------------------------------------
def test_tokenize_counts_what_the_engine_counts(triton):
    """``vllm bench serve``'s alignment: the server's token count of a prompt is the one
    ``usage`` reports for it."""
    url = triton.openai_url("quanta-one-seq", MODEL)
    base = url.removesuffix("/v1")
    with openai.OpenAI(base_url=url, api_key="-", max_retries=0, timeout=60) as client:
        for prompt in ("Hello", "A longer prompt, with punctuation; and more words."):
            _, tokens = post(f"{base}/tokenize", {"model": MODEL, "prompt": prompt})
            reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
            assert reply.usage.prompt_tokens == tokens["count"]
            _, text = post(f"{base}/detokenize", {"model": MODEL, "tokens": tokens["tokens"]})
            assert text["prompt"] == prompt
    for method in ("GET", "POST"):
        assert requests.request(method, f"{base}/ping", timeout=30).status_code == 200
