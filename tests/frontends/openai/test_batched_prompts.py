"""A list of prompts in one ``/v1/completions`` request, as batch scripts and
lm-evaluation-harness's ``local-completions`` with ``batch_size > 1`` send it.

Each prompt is its own request to the scheduler; the answer holds every prompt's ``n`` choices
in order (choice ``i * n + j`` is prompt i's choice j, as OpenAI and vLLM index them), and
``usage`` sums the prompts. The live tests check each choice against the same prompt sent
alone; the fast ones check what reaches the scheduler, on a recording stand-in for Triton.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import requests
from gateway_fakes import MODEL, RecordingTriton, serve

openai = pytest.importorskip("openai")

TEXTS = ["Hello there", "The quick brown fox jumps", "A"]


@pytest.fixture(scope="module")
def client(triton):
    url = triton.openai_url("quanta-one-seq", MODEL)
    with openai.OpenAI(base_url=url, api_key="-", max_retries=0, timeout=120) as c:
        yield c


def by_choice(reply: Any, stream: bool) -> dict[int, dict[str, Any]]:
    """Each choice's text, tokens and token logprobs, whole or gathered from its chunks."""
    choices: dict[int, dict[str, Any]] = defaultdict(
        lambda: {"text": "", "tokens": [], "values": [], "finish": None}
    )
    for chunk in reply if stream else [reply]:
        for c in chunk.choices:
            choice = choices[c.index]
            choice["text"] += c.text
            if c.logprobs is not None:
                choice["tokens"] += c.logprobs.tokens
                choice["values"] += c.logprobs.token_logprobs
            choice["finish"] = c.finish_reason or choice["finish"]
    return dict(choices)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("as_ids", [True, False], ids=["token-ids", "texts"])
def test_lm_eval_batch_scores_each_prompt_as_alone(client, triton, stream, as_ids):
    """What ``local-completions`` sends to score a batch: the prompts (as token ids),
    ``echo``, ``logprobs=1``, ``max_tokens=1``, ``temperature=0`` and a seed."""
    from quanta.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(triton.model_dir)
    prompts = [tokenizer.encode(t) for t in TEXTS] if as_ids else TEXTS
    scoring = {"max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True, "seed": 1234}
    batch = by_choice(
        client.completions.create(model=MODEL, prompt=prompts, stream=stream, **scoring), stream
    )
    assert sorted(batch) == list(range(len(TEXTS)))
    for i, prompt in enumerate(prompts):
        alone = by_choice(
            client.completions.create(model=MODEL, prompt=[prompt], stream=stream, **scoring),
            stream,
        )[0]
        assert batch[i]["text"] == alone["text"]
        assert batch[i]["text"].startswith(TEXTS[i])
        assert batch[i]["tokens"] == alone["tokens"]
        assert len(batch[i]["tokens"]) == len(tokenizer.encode(TEXTS[i])) + 1
        assert batch[i]["values"][0] is None and alone["values"][0] is None
        assert batch[i]["values"][1:] == pytest.approx(alone["values"][1:], abs=1e-5)
        assert batch[i]["finish"] == alone["finish"] == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_choices_per_prompt_are_prompt_major_and_usage_sums(client, stream):
    sampling = {"max_tokens": 6, "temperature": 0.9, "seed": 7, "n": 2}
    prompts = TEXTS[:2]
    kwargs: dict[str, Any] = {"stream_options": {"include_usage": True}} if stream else {}
    reply = client.completions.create(
        model=MODEL, prompt=prompts, stream=stream, **sampling, **kwargs
    )
    chunks = list(reply) if stream else [reply]
    batch = by_choice(chunks if stream else reply, stream)
    use = chunks[-1].usage
    assert sorted(batch) == [0, 1, 2, 3]
    prompt_tokens = completion_tokens = 0
    for i, prompt in enumerate(prompts):
        alone = client.completions.create(model=MODEL, prompt=prompt, **sampling)
        for choice in alone.choices:
            assert batch[i * 2 + choice.index]["text"] == choice.text
        prompt_tokens += alone.usage.prompt_tokens
        completion_tokens += alone.usage.completion_tokens
    assert use.prompt_tokens == prompt_tokens
    assert use.completion_tokens == completion_tokens
    assert use.total_tokens == prompt_tokens + completion_tokens


def test_one_bad_prompt_refuses_the_batch(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=["fine", ""], max_tokens=2)
    error = info.value.response.json()["error"]
    assert error["param"] == "prompt" and "prompt 1 is empty" in error["message"]


# -- what reaches the scheduler (no server) ---------------------------------------------------
def test_each_prompt_is_its_own_request_with_the_same_tenant_and_class(tmp_path):
    upstream = RecordingTriton()
    server = serve(tmp_path / "state", upstream)
    try:
        body = {
            "model": MODEL,
            "prompt": [[5, 6, 7], [8, 9]],
            "max_tokens": 2,
            "n": 2,
            "tenant": "alice",
            "priority_class": "offline",
        }
        response = requests.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        answer = response.json()
    finally:
        server.stop()
    sent = upstream.inputs()
    assert [s["input_ids"] for s in sent] == [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]]
    assert {s["tenant"] for s in sent} == {"alice"}
    assert {s["priority_class"] for s in sent} == {"offline"}
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in answer["choices"]] == ["5 ", "5 ", "8 ", "8 "]
    assert answer["usage"]["prompt_tokens"] == len("5 6 7") + len("8 9")
    assert answer["usage"]["completion_tokens"] == 4 * 2


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "prompt is empty"),
        (["a", ""], "prompt 1 is empty"),
        ([[1, 2], []], "prompt 1 is empty"),
        (["a", [1, 2]], "give a text, a list of token ids"),
        ([2**40], "give a text, a list of token ids"),
    ],
)
def test_malformed_batches_are_400_naming_prompt(tmp_path, prompt, message):
    server = serve(tmp_path / "state", RecordingTriton())
    try:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        response = requests.post(f"{server.url}/v1/completions", json=body, timeout=30)
    finally:
        server.stop()
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt" and message in error["message"]
