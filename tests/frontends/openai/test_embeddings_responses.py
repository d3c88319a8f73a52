"""Live tests of ``/v1/embeddings`` and ``/v1/responses`` with the official ``openai`` client,
on the shared server's tiny random-weight model behind a gateway."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import quanta
import torch
from quanta import PoolingParams

openai = pytest.importorskip("openai")

MODEL = "quanta"
pytestmark = pytest.mark.live


@pytest.fixture(scope="module")
def client(triton):
    url = triton.openai_url("quanta", MODEL)
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def llm(triton):
    return quanta.LLM(str(triton.model_dir))


def _close(got: list[float] | str, expected: list[float]) -> None:
    """``got`` as floats, or as base64 of little-endian float32 (``encoding_format``)."""
    if isinstance(got, str):
        got = np.frombuffer(base64.b64decode(got), dtype="<f4").tolist()
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("encoding_format", ["float", "base64", None])
def test_embeddings_equal_the_offline_api(client, llm, encoding_format):
    """Texts and token ids, as floats or base64 (None: the SDK asks for base64 and decodes
    it itself)."""
    prompts = ["Hello, my name is", "a", "Once upon a time, in a land far away"]
    extra = {} if encoding_format is None else {"encoding_format": encoding_format}
    answer = client.embeddings.create(model=MODEL, input=prompts, **extra)
    expected = llm.embed(prompts)
    assert [d.index for d in answer.data] == [0, 1, 2]
    for d, e in zip(answer.data, expected, strict=True):
        _close(d.embedding, e.embedding)
    assert answer.usage.prompt_tokens == sum(e.num_prompt_tokens for e in expected)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens
    ids = llm.tokenizer.encode(prompts[0])
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    _close(by_ids.data[0].embedding, expected[0].embedding)
    unnormalized = client.embeddings.create(
        model=MODEL, input="a", encoding_format="float", extra_body={"normalize": False}
    )
    _close(
        unnormalized.data[0].embedding,
        llm.embed("a", PoolingParams(normalize=False))[0].embedding,
    )
    renamed = client.embeddings.create(  # vLLM 0.32's name for normalize
        model=MODEL, input="a", encoding_format="float", extra_body={"use_activation": False}
    )
    assert renamed.data[0].embedding == unnormalized.data[0].embedding


def test_embeddings_refuse_what_they_cannot_do(client):
    with pytest.raises(openai.BadRequestError, match="dimensions") as info:
        client.embeddings.create(model=MODEL, input="a", dimensions=8)
    assert info.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError, match="input is empty"):
        client.embeddings.create(model=MODEL, input=[])
    with pytest.raises(openai.BadRequestError, match="input 1 is empty"):
        client.embeddings.create(model=MODEL, input=["a", ""])
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="a")
    with pytest.raises(openai.BadRequestError, match="never cut") as info:
        client.embeddings.create(model=MODEL, input="a", extra_body={"truncate_prompt_tokens": 4})
    assert info.value.body["param"] == "truncate_prompt_tokens"
    with pytest.raises(openai.BadRequestError, match="disagree"):
        client.embeddings.create(
            model=MODEL, input="a", extra_body={"normalize": True, "use_activation": False}
        )


def test_embeddings_take_vllms_truncation_to_the_context(client):
    """``vllm bench serve --backend openai-embeddings`` sends ``truncate_prompt_tokens: -1``."""
    plain = client.embeddings.create(model=MODEL, input="The tide", encoding_format="float")
    bounded = client.embeddings.create(
        model=MODEL, input="The tide", encoding_format="float",
        extra_body={"truncate_prompt_tokens": -1},
    )  # fmt: skip
    assert bounded.data[0].embedding == plain.data[0].embedding


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def test_responses_equal_chat(client):
    """The same greedy answer as the chat route gives the same conversation."""
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=0.0
    )
    answer = client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input=[{"role": "user", "content": "Hi there"}],
        max_output_tokens=12,
        temperature=0.0,
    )
    assert answer.object == "response"
    assert answer.output_text == chat.choices[0].message.content
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.usage.output_tokens == chat.usage.completion_tokens
    expected_status = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert answer.status == expected_status


def test_responses_stream_as_the_sdk_reads_them(client):
    kwargs = {"model": MODEL, "input": "Hi there", "max_output_tokens": 10, "temperature": 0.0}
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas == done.text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    # the SDK's helper, which parses each event into its typed object as it accumulates
    with client.responses.stream(**kwargs) as stream:
        helped = [e for e in stream if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in helped) == whole.output_text


def test_responses_take_vllms_sampling_fields_as_chat_does(client):
    """What ``vllm bench serve --backend openai-responses`` sends (``ignore_eos``), and vLLM's
    other sampling fields, mean on /v1/responses what they mean on chat."""
    extra = {"ignore_eos": True, "seed": 7, "top_k": 3, "min_p": 0.05, "repetition_penalty": 1.1}
    sampling = {"temperature": 0.8, "extra_body": extra}
    chat = client.chat.completions.create(model=MODEL, messages=CHAT[1:], max_tokens=12, **sampling)
    answer = client.responses.create(
        model=MODEL, input="Hi there", max_output_tokens=12, **sampling
    )
    assert answer.output_text == chat.choices[0].message.content
    assert answer.usage.output_tokens == chat.usage.completion_tokens == 12  # ignore_eos


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"extra_body": {"top_k": -1}}, "top_k"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"temperature": -1.0}, "temperature"),
    ],
)
def test_responses_refuse_unsupported_fields_by_name(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="Hi", **extra)
    assert info.value.body["param"] == param
    assert param in info.value.body["message"]


def test_embedding_requests_run_beside_generation(client, llm):
    """An embedding is the same while completions share the engine's steps."""
    import concurrent.futures

    expected = llm.embed("The capital of France")[0].embedding
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        busy = [
            pool.submit(client.completions.create, model=MODEL, prompt="x y z", max_tokens=24)
            for _ in range(3)
        ]
        got = client.embeddings.create(
            model=MODEL, input="The capital of France", encoding_format="float"
        )
        for b in busy:
            b.result()
    _close(got.data[0].embedding, expected)
