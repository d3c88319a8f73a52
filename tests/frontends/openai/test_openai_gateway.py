"""Live tests of the OpenAI-compatible gateway with the official ``openai`` client.

The gateway runs as ``quanta serve --openai-port`` runs it (on a thread, the chat template and
tokenizer from the checkpoint) in front of the shared server's ``quanta-one-seq`` model, served
to clients as ``quanta``: one request at a time, so a second one deterministically waits, and a
small device pool (24 blocks of 16 tokens) so a long request visibly holds blocks. One test
runs ``quanta serve --openai-port`` itself and stops it with Ctrl-C.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import quanta
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from quanta import SamplingParams
from quanta.frontends.triton.launcher import free_port
from serving import start_serve, stop_serve, wait_for

openai = pytest.importorskip("openai")

MODEL = "quanta"


@dataclass(frozen=True)
class Live:
    """The endpoints the gateway tests talk to: a gateway and the Triton model behind it."""

    openai_url: str
    http_url: str
    grpc_url: str
    metrics_url: str
    model_dir: Path
    triton_model: str


@pytest.fixture(scope="module")
def live(triton):
    triton_model = "quanta-one-seq"
    return Live(
        triton.openai_url(triton_model, MODEL),
        triton.http_url,
        triton.grpc_url,
        triton.metrics_url,
        triton.model_dir,
        triton_model,
    )


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live.openai_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def llm(live):
    return quanta.LLM(str(live.model_dir))


def scrape(live) -> dict[str, float]:
    """The served model's ``quanta_*`` samples keyed by name{labels}."""
    from serving import scrape as scrape_metrics

    return scrape_metrics(live.metrics_url, live.triton_model)


@pytest.mark.live
def test_serve_with_the_gateway_stops_cleanly_on_ctrl_c(tmp_path, opt_tiny):
    """``quanta serve --openai-port`` answers through its gateway, then Ctrl-C stops both:
    exit status 0, and the gateway's port is closed."""
    serve = start_serve(tmp_path, model_dir=opt_tiny)
    try:
        with openai.OpenAI(base_url=serve.openai_url, api_key="-", max_retries=0) as c:
            assert c.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices
    finally:
        code, out = stop_serve(serve)
    assert code == 0, out
    assert "shutting down" in out
    port = int(serve.openai_url.rsplit(":", 1)[1].split("/")[0])
    with socket.socket() as s:  # the gateway is gone with it
        assert s.connect_ex(("127.0.0.1", port)) != 0


# -- the happy paths -------------------------------------------------------------------------
def test_models_lists_the_model(client):
    assert [m.id for m in client.models.list()] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL
    # vLLM's additions: `vllm bench serve` without --model sends `root` to /tokenize
    assert card.model_extra["root"] == MODEL
    assert card.model_extra["max_model_len"] > 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_equals_offline_api(client, llm, stream):
    prompt = "The quick brown fox"
    expected = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0.0))[0]
    kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": 20, "temperature": 0}
    if stream:
        chunks = list(
            client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        assert len([c for c in chunks if c.choices]) > 1, "not streamed"
        assert not chunks[-1].choices  # the usage chunk comes last
        use = chunks[-1].usage
    else:
        reply = client.completions.create(**kwargs)
        text, finish, use = reply.choices[0].text, reply.choices[0].finish_reason, reply.usage
    assert text == expected.text
    assert finish == expected.finish_reason == "length"
    assert use.completion_tokens == len(expected.token_ids)
    assert use.prompt_tokens == len(llm.tokenizer.encode(prompt))
    assert use.total_tokens == use.prompt_tokens + use.completion_tokens


def test_completion_takes_token_ids_and_seeded_sampling(client, llm):
    ids = llm.tokenizer.encode("hello there")
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=20, seed=7)
    expected = llm.generate([ids], params)[0]
    reply = client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=12,
        temperature=0.8,
        top_p=0.9,
        seed=7,
        extra_body={"top_k": 20},
    )
    assert reply.choices[0].text == expected.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_uses_the_default_template(client, llm, stream):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
    ]
    prompt = "system: Be brief.\nuser: Hi!\nassistant:"  # the documented default template
    expected = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0))[0]
    kwargs = {"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0}
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"
    else:
        reply = client.chat.completions.create(**kwargs)
        assert reply.choices[0].message.role == "assistant"
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == 10
        text = reply.choices[0].message.content
    assert text == expected.text


def test_user_and_metadata_reach_the_scheduler(client, live):
    client.completions.create(model=MODEL, prompt="a", max_tokens=3, user="u-openai")
    client.completions.create(
        model=MODEL,
        prompt="b",
        max_tokens=4,
        extra_body={"tenant": "t-openai", "priority_class": "offline", "ttft_slo_ms": 500},
    )
    online = 'quanta_generation_tokens_total{priority_class="online",tenant="u-openai"}'
    offline = 'quanta_generation_tokens_total{priority_class="offline",tenant="t-openai"}'
    wait_for(
        lambda: (s := scrape(live)).get(online, 0) >= 1 and s.get(offline, 0) >= 1,
        what="per-tenant token counters",
    )


# -- errors ----------------------------------------------------------------------------------
BAD = {
    "temperature < 0": ({"temperature": -1}, "temperature", "greater than or equal to 0"),
    "empty prompt": ({"prompt": ""}, "prompt", "prompt is empty"),
    "n=0": ({"n": 0}, "n", "greater than or equal to 1"),
    "n=17": ({"n": 17}, "n", "less than or equal to 16"),
    "logprobs 21": ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
    "repetition penalty 0": (
        {"extra_body": {"repetition_penalty": 0}},
        "repetition_penalty",
        "greater than 0",
    ),
    "presence penalty 3": ({"presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
    "min_tokens over max_tokens": (
        {"max_tokens": 4, "extra_body": {"min_tokens": 8}},
        None,
        "min_tokens (8) must not exceed max_tokens (4)",
    ),
    "unknown field": ({"extra_body": {"tenantt": "x"}}, "tenantt", "Extra inputs"),
    "bad priority class": ({"extra_body": {"priority_class": "vip"}}, "priority_class", "online"),
    "too long for the model": ({"max_tokens": 600}, None, "exceeds the model's maximum length"),
    "too big for the KV pool": ({"max_tokens": 400}, None, "KV blocks"),
    # Integers are range-checked before Triton's INT32/UINT64 tensors could wrap them.
    "max_tokens past 32 bits": ({"max_tokens": 2**32 + 5}, "max_tokens", "2147483647"),
    "max_tokens 2^70": ({"max_tokens": 2**70}, "max_tokens", "2147483647"),
    "top_k past 32 bits": ({"extra_body": {"top_k": 2**32}}, "top_k", "2147483647"),
    "negative seed": ({"seed": -1}, "seed", "greater than or equal to 0"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_invalid_request_is_400_in_openai_format(client, case):
    changes, param, message = BAD[case]
    kwargs = {"model": MODEL, "prompt": "hi", "max_tokens": 4, **changes}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**kwargs)
    assert info.value.status_code == 400
    error = info.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert message in error["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("completions", '{"model": "quanta", "prompt": "hi \\ud800", "max_tokens": 2}', "prompt"),
        (
            "completions",
            '{"model": "quanta", "prompt": "hi", "stop": ["\\udc00"], "max_tokens": 2}',
            "stop",
        ),
        (
            "chat/completions",
            '{"model": "quanta", "messages": [{"role": "user", "content": "\\ud800x"}]}',
            "messages",
        ),
    ],
)
def test_a_lone_surrogate_is_400_naming_the_field(live, path, body, param):
    """JSON may escape half of a UTF-16 pair; that text cannot be encoded for the model."""
    req = urllib.request.Request(
        f"{live.openai_url}/{path}",
        data=body.encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=60)
    assert info.value.code == 400
    error = json.loads(info.value.read())["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert "lone surrogate" in error["message"]


def test_neutral_penalties_are_accepted(client, llm):
    """vLLM's benchmark client sends ``repetition_penalty: 1.0`` and ``logprobs: null``."""
    expected = llm.generate(["hi"], SamplingParams(max_tokens=4, temperature=0.0))[0].text
    extra = {"repetition_penalty": 1.0, "logprobs": None, "ignore_eos": True}
    out = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=4, temperature=0, frequency_penalty=0,
        extra_body=extra,
    )  # fmt: skip
    assert out.choices[0].text == expected


def test_penalties_and_min_tokens_reach_the_sampler(client, llm):
    params = SamplingParams(
        max_tokens=12,
        temperature=0.0,
        presence_penalty=0.6,
        frequency_penalty=0.9,
        repetition_penalty=1.3,
        min_tokens=5,
    )
    expected = llm.generate(["Hello there"], params)[0].text
    out = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=12, temperature=0, presence_penalty=0.6,
        frequency_penalty=0.9, extra_body={"repetition_penalty": 1.3, "min_tokens": 5},
    )  # fmt: skip
    assert out.choices[0].text == expected
    plain = llm.generate(["Hello there"], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert expected != plain.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_logprobs_are_the_engines(client, llm, stream):
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
    expected = llm.generate(["Hello there"], params)[0]
    out = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=8, temperature=0, logprobs=2, stream=stream
    )
    choices = [c for chunk in out for c in chunk.choices] if stream else out.choices
    tokens = [t for c in choices if c.logprobs for t in c.logprobs.tokens]
    values = [v for c in choices if c.logprobs for v in c.logprobs.token_logprobs]
    tops = [d for c in choices if c.logprobs for d in c.logprobs.top_logprobs]
    offsets = [o for c in choices if c.logprobs for o in c.logprobs.text_offset]
    assert values == pytest.approx([lp.logprob for lp in expected.logprobs], abs=1e-4)
    text = llm.tokenizer.decode
    assert tokens == [text([t]) for t in expected.token_ids]
    # NOTE: the legacy format keys alternatives by text: two ids with one text merge
    assert len(tops) == len(tokens) and all(1 <= len(d) <= 2 for d in tops)
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_repeats_the_prompt_before_the_completion(client, llm, stream):
    expected = llm.generate(["Hello there"], SamplingParams(max_tokens=6, temperature=0.0))[0]
    out = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=6, temperature=0, echo=True, stream=stream
    )
    text = "".join(c.text for chunk in (out if stream else [out]) for c in chunk.choices)
    assert text == "Hello there" + expected.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_with_logprobs_reports_the_prompts_tokens_first(client, llm, stream):
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=1, prompt_logprobs=1)
    expected = llm.generate(["Hello there"], params)[0]
    out = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=5, temperature=0, logprobs=1, echo=True,
        stream=stream,
    )  # fmt: skip
    choices = [c for chunk in out for c in chunk.choices] if stream else out.choices
    tokens = [t for c in choices if c.logprobs for t in c.logprobs.tokens]
    values = [v for c in choices if c.logprobs for v in c.logprobs.token_logprobs]
    tops = [d for c in choices if c.logprobs for d in c.logprobs.top_logprobs]
    offsets = [o for c in choices if c.logprobs for o in c.logprobs.text_offset]
    prompt_ids = llm.tokenizer.encode("Hello there")
    text = llm.tokenizer.decode
    assert tokens == [text([t]) for t in [*prompt_ids, *expected.token_ids]]
    assert values[0] is None and tops[0] is None  # nothing predicts the first token
    engine = [lp.logprob for lp in (*expected.prompt_logprobs, *expected.logprobs)]
    assert values[1:] == pytest.approx(engine, abs=1e-4)
    assert all(len(d) == 1 for d in tops[1:])
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert "".join(c.text for c in choices).startswith("Hello there")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_of_token_ids_scores_the_prompt_as_its_text_does(client, llm, stream):
    """What lm-evaluation-harness's ``local-completions`` sends to score a continuation: the
    prompt as token ids (in a batch of one), ``echo``, ``logprobs=1``, ``max_tokens=1``."""
    prompt_ids = llm.tokenizer.encode("Hello there")

    def scored(prompt: object) -> tuple[str, list[str], list[float | None]]:
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True,
            seed=1234, stream=stream,
        )  # fmt: skip
        choices = [c for chunk in out for c in chunk.choices] if stream else out.choices
        tokens = [t for c in choices if c.logprobs for t in c.logprobs.tokens]
        values = [v for c in choices if c.logprobs for v in c.logprobs.token_logprobs]
        return "".join(c.text for c in choices), tokens, values

    text, tokens, values = scored("Hello there")
    ids_text, ids_tokens, ids_values = scored([prompt_ids])
    assert ids_text == text and text.startswith(llm.tokenizer.decode(prompt_ids))
    assert ids_tokens == tokens and len(tokens) == len(prompt_ids) + 1
    assert ids_values[0] is None and ids_values[1:] == pytest.approx(values[1:], abs=1e-5)


def test_chat_logprobs_with_top_logprobs(client, llm):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy took the best
        assert entry.bytes == list(entry.token.encode())
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs: true"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], top_logprobs=2
        )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_response_format_json_schema_and_guided_choice(client, stream):
    schema = {
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no"]},
            "score": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["answer", "score"],
        "additionalProperties": False,
    }
    asks = [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "v", "schema": schema},
            }
        },
        {"extra_body": {"guided_choice": ["left", "right"]}},
    ]
    texts = []
    for ask in asks:
        out = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Answer in JSON."}],
            max_tokens=24,
            temperature=0,
            stream=stream,
            **ask,
        )
        chunks = list(out) if stream else [out]
        if stream:
            texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
            assert chunks[-1].choices[0].finish_reason == "stop"
        else:
            texts.append(out.choices[0].message.content)
            assert out.choices[0].finish_reason == "stop"
    value = json.loads(texts[0])
    assert set(value) == {"answer", "score"} and value["answer"] in ("yes", "no")
    assert texts[1] in ("left", "right")


def test_a_guide_that_cannot_compile_is_400_naming_it(client):
    with pytest.raises(openai.BadRequestError, match="the regex cannot be compiled") as info:
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=4, extra_body={"guided_regex": "(ab"}
        )
    assert info.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="response_format type must be"):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "yaml"},  # type: ignore[arg-type, typeddict-item]
        )


def test_invalid_chat_request_is_400(client):
    with pytest.raises(openai.BadRequestError, match="tool_choice names 'g'"):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_choices_are_seeded_samples_each_equal_to_the_offline_api(client, llm, stream):
    n, seed = 3, 11
    expected = [
        llm.generate(
            ["Hello there"],
            SamplingParams(max_tokens=8, temperature=1.0, seed=seed + i, ignore_eos=True),
        )[0].text
        for i in range(n)
    ]
    out = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=8, temperature=1.0, seed=seed, n=n,
        stream=stream, extra_body={"ignore_eos": True},
        **({"stream_options": {"include_usage": True}} if stream else {}),
    )  # fmt: skip
    texts = [""] * n
    if stream:
        chunks = list(out)
        for chunk in chunks:
            for c in chunk.choices:
                texts[c.index] += c.text
        usage_ = chunks[-1].usage
    else:
        assert [c.index for c in out.choices] == list(range(n))
        texts = [c.text for c in out.choices]
        usage_ = out.usage
    assert texts == expected
    assert len(set(texts)) > 1  # the seeds differ
    assert usage_.completion_tokens == 8 * n


def test_n_chat_choices(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2, seed=5
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.message.role == "assistant" for c in out.choices)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    error = info.value.response.json()["error"]
    assert error["code"] == "model_not_found" and "no-such-model" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )


# -- prefix caching --------------------------------------------------------------------------
def _reset(live) -> dict:
    status, body = _post_raw(f"{live.openai_url.removesuffix('/v1')}/reset_prefix_cache", {})
    assert status == 200, body
    return json.loads(body)


def test_usage_reports_cached_prompt_tokens_until_a_reset(client, live):
    """A repeated prompt of 40 token ids finds its first 32 (two blocks) cached, and each kind
    of usage object says so as OpenAI's does (``prompt_tokens_details.cached_tokens``); after
    ``POST /reset_prefix_cache`` the next request computes the whole prompt again."""
    assert _reset(live) == {"status": "ok", "model": MODEL}
    kwargs = {"model": MODEL, "prompt": list(range(300, 340)), "max_tokens": 2, "temperature": 0}
    include = {"stream": True, "stream_options": {"include_usage": True}}

    def cached(**more) -> int:
        reply = client.completions.create(**kwargs, **more)
        use = list(reply)[-1].usage if more else reply.usage
        assert use.prompt_tokens == 40
        return use.prompt_tokens_details.cached_tokens

    assert [cached(), cached(), cached(**include)] == [0, 32, 32]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a story " * 4}]}
    client.chat.completions.create(**chat, max_tokens=2)
    whole = client.chat.completions.create(**chat, max_tokens=2).usage
    streamed = list(client.chat.completions.create(**chat, max_tokens=2, **include))[-1].usage
    for use in (whole, streamed):
        assert 0 < use.prompt_tokens_details.cached_tokens < use.prompt_tokens
        assert use.prompt_tokens_details.cached_tokens % 16 == 0
    _reset(live)
    assert cached() == 0


# -- cancellation ----------------------------------------------------------------------------
def _post(live, body):
    """Send a completion request on a raw connection (so the test can hang up) and return it."""
    host, port = live.openai_url.split("://", 1)[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(
        "POST",
        "/v1/completions",
        body=json.dumps({"model": MODEL, "ignore_eos": True, **body}),
        headers={"Content-Type": "application/json"},
    )
    return conn


def _stream_a_while(live):
    """A streamed request of 360 tokens (seconds on CPU, 23 of the 24 device blocks)."""
    conn = _post(live, {"prompt": "cancel me", "max_tokens": 360, "stream": True})
    resp = conn.getresponse()
    assert resp.status == 200
    events = 0
    while events < 3:
        events += resp.readline().startswith(b"data:")
    return conn


USED = 'quanta_kv_blocks_used{tier="device"}'
ABORTED = 'quanta_request_finished_total{reason="abort"}'


def test_disconnect_mid_stream_frees_the_blocks(live):
    before = scrape(live).get(ABORTED, 0.0)
    conn = _stream_a_while(live)
    try:
        wait_for(lambda: scrape(live)[USED] > 0, what="the request to hold blocks")
    finally:
        conn.close()  # the client goes away mid-stream
    samples = wait_for(
        lambda: (s := scrape(live))[USED] == 0 and s.get(ABORTED, 0.0) == before + 1 and s,
        what="the request to be aborted and its blocks freed",
    )
    assert samples["quanta_num_requests_running"] == 0


def test_disconnect_while_waiting_cancels(live):
    holder = _stream_a_while(live)
    try:
        before = scrape(live).get(ABORTED, 0.0)
        # A non-streamed request waits behind it (max_num_seqs=1); its client gives up.
        waiting = _post(live, {"prompt": "me too", "max_tokens": 300})
        wait_for(lambda: scrape(live)["quanta_num_requests_waiting"] == 1, what="it to wait")
        waiting.close()
        # It leaves the queue while the stream holds the only seat, as an abort. The counter
        # moves at the metrics' next flush, which on a loaded machine also records every
        # finished request's token gaps (so more than the default wait) and may count an
        # earlier test's abort in the same flush (so at least one more, not exactly one).
        seen: dict[str, float] = {}

        def aborted() -> bool:
            s = scrape(live)
            seen.update(waiting=s["quanta_num_requests_waiting"],
                        running=s["quanta_num_requests_running"],
                        aborted=s.get(ABORTED, 0.0) - before)  # fmt: skip
            return seen["waiting"] == 0 and seen["aborted"] >= 1

        try:
            wait_for(aborted, timeout=30.0, what="the waiting request to be aborted")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last seen {seen}") from None
    finally:
        holder.close()
    wait_for(
        lambda: (s := scrape(live))[USED] == 0 and s["quanta_num_requests_running"] == 0,
        what="all blocks to be freed",
    )


# -- pieces that need no server --------------------------------------------------------------
def test_jinja_chat_template_from_tokenizer_config(tmp_path):
    from quanta.frontends.openai.protocol import ChatMessage
    from quanta.text.chat_template import ChatTemplate

    template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    config = {"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [ChatMessage(role="user", content="hi")]
    assert ChatTemplate.from_model_dir(tmp_path).render(messages) == "<s><|user|>hi<|assistant|>"
    assert ChatTemplate.from_model_dir(tmp_path / "nothing").render(messages) == (
        "user: hi\nassistant:"
    )


def test_triton_error_messages_map_to_http_codes():
    from quanta.frontends.openai.errors import classify

    assert classify("Request for unknown model: 'x' is not found").status == 404
    assert classify("[invalid_argument] prompt is empty").status == 400
    assert classify("[unavailable] tenant t is over its share").status == 429
    assert classify("[resource_exhausted] tenant t is over its share").status == 429
    assert classify("[cancelled] the model is being unloaded").status == 503
    assert classify("[internal] engine step failed").status == 500
    assert classify("[invalid_argument] bad").message == "bad"
    assert classify("unexpected shape for input 'max_tokens'").status == 400
    # Untagged messages come from Triton itself; only its known phrases are classified.
    assert classify("request throttled: tenant over its share").status == 500
    assert classify("something broke").status == 500


def test_echo_of_token_ids_without_a_tokenizer_is_400():
    """A gateway that does not know the tokenizer cannot write the prompt's text back."""
    from quanta.frontends.openai.server import start_gateway

    gateway = start_gateway(
        f"127.0.0.1:{free_port()}", host="127.0.0.1", port=free_port(), model_name=MODEL
    )
    try:
        c = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="-", max_retries=0)
        with c, pytest.raises(openai.BadRequestError) as info:
            c.completions.create(model=MODEL, prompt=[1, 2], max_tokens=1, echo=True)
        assert info.value.response.json()["error"]["param"] == "echo"
        assert "needs the model's tokenizer" in info.value.response.json()["error"]["message"]
    finally:
        gateway.stop()


def test_unreachable_triton_is_503():
    from quanta.frontends.openai.server import start_gateway

    gateway = start_gateway(
        f"127.0.0.1:{free_port()}", host="127.0.0.1", port=free_port(), model_name=MODEL
    )
    try:
        c = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="-", max_retries=0)
        with c, pytest.raises(openai.InternalServerError) as info:
            c.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert info.value.status_code == 503
        assert info.value.response.json()["error"]["code"] == "backend_unavailable"
        status, body = _post_raw(f"{gateway.url}/reset_prefix_cache", {})
        assert status == 503 and json.loads(body)["error"]["code"] == "backend_unavailable"
    finally:
        gateway.stop()


# -- random JSON at both HTTP endpoints ------------------------------------------------------
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=8,
)
_FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "stream",
    "logprobs",
    "text_input",
    "input_ids",
    "tenant",
    "priority_class",
    "presence_penalty",
    "min_tokens",
    "bad_words",
    "beam_width",
]
_BODIES = st.one_of(
    _JSON,
    st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=6),
    st.fixed_dictionaries(
        {"model": st.just(MODEL), "prompt": st.text(max_size=8)},
        optional={name: _JSON for name in _FIELDS[3:]},
    ),
)


def _post_raw(url: str, body: object) -> tuple[int, bytes]:
    try:
        data = json.dumps(body).encode()
    except ValueError:  # e.g. a lone surrogate json cannot encode: send it as text
        data = repr(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=_BODIES)
def test_random_json_never_breaks_either_endpoint(live, body):
    """The gateway answers 2xx or 4xx, always in OpenAI's error shape; Triton's generate
    endpoint answers (its own parser's 400/500 included) and keeps serving."""
    status, raw = _post_raw(f"{live.openai_url}/completions", body)
    assert status < 500 or status == 503, raw  # 503: a valid request the pool cannot hold
    if status >= 400:
        error = json.loads(raw)["error"]
        assert error["type"] and error["message"], raw
    if isinstance(body, dict) and isinstance(body.get("stream"), bool):
        body = {**body, "stream": False}  # keep the SSE endpoint out: one answer per call
    status, raw = _post_raw(f"{live.http_url}/v2/models/{live.triton_model}/generate", body)
    assert status in (200, 400, 404, 500), raw
    assert json.loads(raw), raw  # an answer, whatever it is


@pytest.mark.slow
def test_serve_replicas_behind_one_gateway(tmp_path, opt_tiny):
    """``quanta serve --replicas 2 --openai-port``: two tritonservers, the gateway routing to
    both (round-robin, so the split does not depend on timing), and Ctrl-C stops all of
    them."""
    from concurrent.futures import ThreadPoolExecutor

    args = ("--replicas", "2", "--router", "round-robin")
    serve = start_serve(tmp_path, model_dir=opt_tiny, args=args)
    try:
        with openai.OpenAI(base_url=serve.openai_url, api_key="-", max_retries=0) as c:

            def ask(i: int) -> str:
                # ignore_eos: a sampled end-of-text from the random weights would end a
                # request early, and the test is about routing, not about where it stops
                choice = c.completions.create(
                    model=MODEL, prompt=f"Hi {i}", max_tokens=8, extra_body={"ignore_eos": True}
                )
                return choice.choices[0].finish_reason

            with ThreadPoolExecutor(4) as pool:
                assert list(pool.map(ask, range(8))) == ["length"] * 8
        base = serve.openai_url.removesuffix("/v1")
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as answer:
            metrics = answer.read().decode()
    finally:
        code, out = stop_serve(serve)
    assert code == 0, out
    assert out.count("(replica 1)") == 3 and "ready; Ctrl-C stops the servers" in out
    sent = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("quanta_gateway_upstream_requests_total{")
    ]
    assert sent == [4.0, 4.0], metrics
