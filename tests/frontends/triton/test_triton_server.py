"""Live tests: a real tritonserver with the quanta backend on 127.0.0.1 and free ports.

The session's shared server (``conftest.triton``) serves the model ``quanta``. Its device pool
is small on purpose (24 blocks of 16 tokens), so concurrent traffic preempts and the outputs
still have to equal the offline API's.
"""

from __future__ import annotations

import csv
import json
import os
import queue
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import quanta
from quanta import SamplingParams
from quanta.frontends.triton.cli import DEMO_TOKENS
from quanta.frontends.triton.client import (
    GenerateError,
    grpc_events,
    grpc_inputs,
    http_events,
    output_ids,
    output_list,
    request_inputs,
)
from quanta.frontends.triton.launcher import ServerOptions, TritonServer, free_port
from quanta.frontends.triton.repository import write_model_repository
from serving import wait_for

pytestmark = pytest.mark.live

ROOT = Path(__file__).resolve().parents[3]
MODEL = "quanta"
MODES = ["http-stream", "http", "grpc-stream", "grpc"]


@pytest.fixture(scope="module")
def model_dir(opt_tiny):
    return opt_tiny


@pytest.fixture(scope="module")
def server(triton):
    return triton


@pytest.fixture(scope="module")
def llm(model_dir):
    return quanta.LLM(str(model_dir))


def run(server, mode, prompt, params, **metadata):
    """(token ids, final event) of one request through ``mode``."""
    stream = mode.endswith("stream")
    meta = quanta.RequestMetadata(**metadata) if metadata else None
    inputs = request_inputs(prompt, params, stream=stream, metadata=meta)
    if mode.startswith("grpc"):
        events = list(grpc_events(server.grpc_url, MODEL, inputs, timeout=60))
    else:
        events = list(http_events(server.http_url, MODEL, inputs, stream=stream, timeout=60))
    assert events, "no response"
    if not stream:
        assert len(events) == 1
    ids = [t for e in events for t in output_ids(e)]
    return ids, events


def scrape(server) -> dict[str, float]:
    """The model's ``quanta_*`` samples on /metrics, keyed by name{labels}."""
    return server.scrape(MODEL)


GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=40, seed=1234)


# -- outputs equal the offline API -----------------------------------------------------------
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_all_transports_match_offline_api(server, llm, params):
    prompt = "The quick brown fox"
    expected = llm.generate(prompt, params)[0]
    for mode in MODES:
        ids, events = run(server, mode, prompt, params)
        assert ids == expected.token_ids, mode
        text = "".join(e.get("text_output", "") for e in events)
        assert text == expected.text, mode
        final = events[-1]
        assert final["finish_reason"] == expected.finish_reason
        assert final["num_output_tokens"] == len(expected.token_ids)
        times = [final[f"{k}_time_ns"] for k in ("arrival", "first_token", "finish")]
        assert 0 < times[0] <= times[1] <= times[2]


FEATURES = SamplingParams(
    max_tokens=16,
    temperature=0.0,
    repetition_penalty=1.5,
    presence_penalty=0.5,
    frequency_penalty=0.3,
    min_tokens=6,
    logprobs=0,
)


def test_trtllm_sampling_inputs_and_log_probs_match_offline_api(server, llm):
    prompt = "The quick brown fox"
    expected = llm.generate(prompt, FEATURES)[0]
    want = [lp.logprob for lp in expected.logprobs]
    for mode in MODES:
        ids, events = run(server, mode, prompt, FEATURES)
        assert ids == expected.token_ids, mode
        logprobs = [x for e in events for x in output_list(e, "output_log_probs")]
        assert logprobs == pytest.approx(want, abs=1e-4), mode
        final = events[-1]
        assert final["cum_log_probs"] == pytest.approx(sum(want), abs=1e-3), mode
        assert final["sequence_length"] == len(output_ids(final)), mode


def test_top_log_probs_come_as_n_ids_and_values_per_token(server, llm):
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)
    expected = llm.generate("Hello", params)[0]
    want_ids = [t for lp in expected.logprobs for t, _ in lp.top]
    want_values = [v for lp in expected.logprobs for _, v in lp.top]
    for mode in MODES:
        _, events = run(server, mode, "Hello", params)
        ids = [t for e in events for t in output_list(e, "top_log_prob_ids")]
        values = [v for e in events for v in output_list(e, "top_log_probs")]
        assert ids == want_ids, mode
        assert values == pytest.approx(want_values, abs=1e-4), mode


def test_prompt_log_probs_come_once_with_the_prompts_ids(server, llm):
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, prompt_logprobs=2)
    expected = llm.generate("Hello there", params)[0]
    want = [lp.logprob for lp in expected.prompt_logprobs]
    want_top = [t for lp in expected.prompt_logprobs for t, _ in lp.top]
    for mode in MODES:
        _, events = run(server, mode, "Hello there", params)
        carrying = [e for e in events if "prompt_ids" in e]
        assert len(carrying) == 1, mode
        assert output_list(carrying[0], "prompt_ids") == llm.tokenizer.encode("Hello there")
        got = output_list(carrying[0], "prompt_log_probs")
        assert got == pytest.approx(want, abs=1e-4), mode
        assert output_list(carrying[0], "prompt_top_log_prob_ids") == want_top, mode


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_num_return_sequences_are_seeded_sequences_in_one_request(server, llm, stream):
    n, seed = 3, 21
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=seed, ignore_eos=True)
    want = [
        llm.generate("Hello", params.model_copy(update={"seed": seed + i}))[0].token_ids
        for i in range(n)
    ]
    inputs = request_inputs("Hello", params, stream=stream) | {"num_return_sequences": n}
    events = list(grpc_events(server.grpc_url, MODEL, inputs))
    got: dict[int, list[int]] = {i: [] for i in range(n)}
    for event in events:
        got[event["sequence_index"]] += output_ids(event)
    assert [got[i] for i in range(n)] == want
    assert len({tuple(w) for w in want}) > 1
    assert sum("finish_reason" in e for e in events) == n  # each sequence ends once


def test_exclude_input_in_output_false_echoes_the_prompt(server, llm):
    prompt = "Hello there"
    expected = llm.generate(prompt, GREEDY)[0]
    inputs = request_inputs(prompt, GREEDY, stream=False) | {"exclude_input_in_output": False}
    assert request_inputs(prompt, GREEDY, stream=False)["exclude_input_in_output"]
    for events in (
        list(http_events(server.http_url, MODEL, inputs, stream=False)),
        list(grpc_events(server.grpc_url, MODEL, inputs)),
    ):
        final = events[-1]
        assert final["text_output"] == prompt + expected.text
        assert output_ids(final) == llm.tokenizer.encode(prompt) + expected.token_ids


def test_bad_words_are_banned_and_beam_search_is_refused(server, llm):
    prompt = "The quick brown fox"
    plain = llm.generate(prompt, GREEDY)[0]
    word = llm.tokenizer.decode(plain.token_ids[:1])
    banned = tuple(llm.tokenizer.encode(word, add_special_tokens=False))
    expected = llm.generate(prompt, GREEDY.model_copy(update={"bad_words_ids": (banned,)}))[0]
    inputs = request_inputs(prompt, GREEDY, stream=False) | {"bad_words": [word]}
    events = list(http_events(server.http_url, MODEL, inputs, stream=False))
    assert output_ids(events[-1]) == expected.token_ids != plain.token_ids
    for extra, message in (
        ({"beam_width": 2}, "beam search is not supported"),
        ({"num_return_sequences": 17}, "'num_return_sequences' must be 1 to 16"),
    ):
        with pytest.raises(GenerateError, match=message):
            list(http_events(server.http_url, MODEL, inputs | extra, stream=False))


def test_input_ids_instead_of_text(server, llm):
    prompt_ids = llm.tokenizer.encode("hello there")
    expected = llm.generate([prompt_ids], GREEDY)[0]
    for mode in ("http", "grpc-stream"):
        assert run(server, mode, prompt_ids, GREEDY)[0] == expected.token_ids


def test_concurrent_requests_complete_and_match(server, llm):
    prompts = [f"request number {i} says" + " hello" * (i % 5) for i in range(12)]
    params = [
        SamplingParams(max_tokens=40 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(12)
    ]
    # A long request holds up to 20 of the 24 device blocks while the others arrive, so they
    # overlap it however slowly their clients connect: the policy has to preempt.
    holder_params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    expected = llm.generate([*prompts, "a long story"], [*params, holder_params])
    before = scrape(server)
    holder = grpc_events(
        server.grpc_url, MODEL, request_inputs("a long story", holder_params, stream=True)
    )
    holder_events = [next(holder)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [
            pool.submit(run, server, MODES[i % 4], p, sp, tenant=f"t{i % 3}")
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        results = [f.result(timeout=120) for f in futures]
    holder_events += list(holder)
    results.append(([t for e in holder_events for t in output_ids(e)], holder_events))
    for (ids, events), exp, sp in zip(results, expected, [*params, holder_params], strict=True):
        assert ids == exp.token_ids and len(ids) == sp.max_tokens
        assert events[-1]["finish_reason"] == "length"
    after = wait_for(
        lambda: (s := scrape(server))['quanta_kv_blocks_used{tier="device"}'] == 0 and s,
        what="blocks to be freed",
    )
    preemptions = sum(v for k, v in after.items() if k.startswith("quanta_num_preemptions"))
    assert preemptions > sum(v for k, v in before.items() if k.startswith("quanta_num_preemptions"))


# -- structured output --------------------------------------------------------------------------
def test_guided_decoding_inputs_match_the_offline_api(server, llm):
    schema = {
        "type": "object",
        "properties": {
            "pick": {"enum": ["a", "b"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["pick", "n"],
    }
    params = SamplingParams(
        max_tokens=32,
        temperature=0.0,
        structured_output=quanta.StructuredOutput(json_schema=schema),
    )
    expected = llm.generate("Pick one:", params)[0]
    assert json.loads(expected.text)["pick"] in ("a", "b")
    for mode in MODES:
        ids, events = run(server, mode, "Pick one:", params)
        assert ids == expected.token_ids, mode
        assert events[-1]["finish_reason"] == "stop", mode
    inputs = request_inputs("Pick one:", GREEDY, stream=False) | {
        "guided_decoding_guide_type": "regex",
        "guided_decoding_guide": "(ab",
    }
    with pytest.raises(GenerateError, match="the regex cannot be compiled"):
        list(grpc_events(server.grpc_url, MODEL, inputs))
    with pytest.raises(GenerateError, match="the regex cannot be compiled"):
        list(http_events(server.http_url, MODEL, inputs, stream=False))


# -- cancellation ------------------------------------------------------------------------------
def _grpc_stream_then_cancel(server, inputs, holding):
    import tritonclient.grpc as grpcclient

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(MODEL, grpc_inputs(inputs), request_id="cancel-grpc")
        for _ in range(3):
            _, error = responses.get(timeout=30)
            assert error is None
        holding()
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def _http_stream_then_disconnect(server, inputs, holding):
    import http.client

    conn = http.client.HTTPConnection(server.options.host, server.options.http_port, timeout=30)
    try:
        conn.request("POST", f"/v2/models/{MODEL}/generate_stream", body=json.dumps(inputs))
        resp = conn.getresponse()
        assert resp.status == 200
        events = 0
        while events < 3:
            events += resp.readline().startswith(b"data:")
        holding()
    finally:
        conn.close()  # the client goes away mid-stream


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_cancelled_stream_frees_its_blocks(server, transport):
    aborted = 'quanta_request_finished_total{reason="abort"}'
    used = 'quanta_kv_blocks_used{tier="device"}'
    before = scrape(server).get(aborted, 0.0)
    # 360 tokens take seconds on CPU; the pool (24 x 16 tokens) just holds them.
    params = SamplingParams(max_tokens=360, temperature=0.0, ignore_eos=True)
    inputs = request_inputs("cancel me", params, stream=True)

    def holding():
        wait_for(lambda: scrape(server)[used] > 0, what="the request to hold blocks")

    cancel = _grpc_stream_then_cancel if transport == "grpc" else _http_stream_then_disconnect
    cancel(server, inputs, holding)
    samples = wait_for(
        lambda: (s := scrape(server))[used] == 0 and s.get(aborted, 0.0) > before and s,
        timeout=10,
        what="the cancelled request to be aborted and its blocks freed",
    )
    assert samples["quanta_num_requests_running"] == 0


# -- bad inputs get their error while good requests go on ------------------------------------
def _http_raw(server, model, body):
    req = urllib.request.Request(
        f"{server.http_url}/v2/models/{model}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


BAD_HTTP = {
    "empty prompt": (MODEL, {"text_input": ""}, 400, "prompt is empty"),
    "too long": (MODEL, {"text_input": "hi", "max_tokens": 600}, 400, "exceeds the model"),
    "too big for the KV pool": (MODEL, {"text_input": "hi", "max_tokens": 400}, 400, "KV blocks"),
    "temperature < 0": (MODEL, {"text_input": "hi", "temperature": -1}, 400, "temperature"),
    "top_p > 1": (MODEL, {"text_input": "hi", "top_p": 1.5}, 400, "top_p"),
    "no prompt": (MODEL, {"max_tokens": 4}, 400, "text_input"),
    "bad priority class": (
        MODEL,
        {"text_input": "hi", "priority_class": "vip"},
        400,
        "priority_class",
    ),
    # Triton itself rejects a JSON value of the wrong type before the backend sees it, and its
    # generate endpoint answers that with 500, whatever the backend would say.
    "malformed dtype": (MODEL, {"text_input": "hi", "max_tokens": "many"}, 500, "Unable to parse"),
    "token id out of range": (MODEL, {"input_ids": [1, 99999]}, 400, "input_ids"),
    # Triton turns a field that names no input into a request parameter: refused, not dropped.
    "unknown field": (
        MODEL,
        {"text_input": "hi", "max_token": 5},
        400,
        "unknown input 'max_token' (did you mean 'max_tokens'?)",
    ),
    "unknown model": ("no-such-model", {"text_input": "hi"}, 404, "no-such-model"),
    "reset with a prompt": (
        MODEL,
        {"reset_prefix_cache": True, "text_input": "hi"},
        400,
        "'reset_prefix_cache' makes a request of its own",
    ),
}


class GoodRequest:
    """A streaming request running in the background while a bad one is sent."""

    def __init__(self, server, max_tokens=48):
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.result: list[int] | Exception | None = None
        self.thread = threading.Thread(target=self._run, args=(server,))
        self.thread.start()

    def _run(self, server):
        try:
            self.result = run(server, "grpc-stream", "a good request", self.params)[0]
        except Exception as exc:
            self.result = exc

    def check(self):
        self.thread.join(60)
        assert isinstance(self.result, list), self.result
        assert len(self.result) == self.params.max_tokens


@pytest.mark.parametrize("case", list(BAD_HTTP))
def test_bad_http_input_gets_its_error(server, case):
    model, body, status, message = BAD_HTTP[case]
    good = GoodRequest(server)
    code, reply = _http_raw(server, model, body)
    assert code == status, reply
    assert message in reply["error"]
    good.check()


def _grpc_error(server, inputs):
    import tritonclient.grpc as grpcclient

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(MODEL, inputs)
        _, error = responses.get(timeout=30)
    finally:
        client.stop_stream()
        client.close()
    assert error is not None, "expected an error response"
    return error


def test_bad_grpc_inputs_get_invalid_argument(server):
    import tritonclient.grpc as grpcclient

    good = GoodRequest(server)
    # NOTE: a gRPC stream response carries only an error message (ModelStreamInferResponse has
    # no status field), so the INVALID_ARG code is checked over HTTP (400) above.
    err = _grpc_error(server, grpc_inputs({"text_input": "hi", "temperature": -0.5}))
    assert "temperature" in err.message() and "greater than or equal to 0" in err.message()
    # A wrong shape: two prompts where the model takes one.
    two = grpcclient.InferInput("text_input", [2], "BYTES")
    two.set_data_from_numpy(np.array([b"a", b"b"], dtype=np.object_))
    err = _grpc_error(server, [two])
    assert "text_input" in err.message()
    # A wrong dtype: temperature as INT32 where the model declares FP32.
    wrong = grpcclient.InferInput("temperature", [1], "INT32")
    wrong.set_data_from_numpy(np.array([1], dtype=np.int32))
    text = grpc_inputs({"text_input": "hi"})
    err = _grpc_error(server, [*text, wrong])
    assert "temperature" in err.message()
    good.check()


def test_client_raises_server_errors(server):
    with pytest.raises(GenerateError, match="top_p"):
        list(http_events(server.http_url, MODEL, {"text_input": "x", "top_p": 2.0}, stream=True))
    with pytest.raises(GenerateError, match="prompt is empty"):
        list(grpc_events(server.grpc_url, MODEL, {"text_input": ""}))


# -- metrics -----------------------------------------------------------------------------------
def test_metrics_appear_and_move(server):
    names = [
        "quanta_time_to_first_token_seconds_count",
        "quanta_e2e_request_latency_seconds_count",
        "quanta_time_per_output_token_seconds_count",
        "quanta_engine_steps_total",
        'quanta_kv_blocks_total{tier="device"}',
        "quanta_num_requests_waiting",
    ]
    before = scrape(server)
    for name in names:
        assert name in before, name
    assert before['quanta_kv_blocks_total{tier="device"}'] == 24
    tokens = 'quanta_generation_tokens_total{priority_class="offline",tenant="metrics-test"}'
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    run(server, "http-stream", "count me", params, tenant="metrics-test", priority_class="offline")
    after = wait_for(
        lambda: (s := scrape(server)).get(tokens) == 10 and s, what="per-tenant token counter"
    )
    for name in names[:4]:
        assert after[name] > before.get(name, 0), name
    assert 'quanta_time_to_first_token_seconds_bucket{le="+Inf"}' in after
    assert (
        "nv_inference_request_success"
        in urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    )  # Triton's own metrics are there too


# -- prefix caching --------------------------------------------------------------------------
def test_a_shared_prefix_is_served_from_the_cache_until_a_reset(server, llm):
    """Two prompts of 40 token ids sharing their first 32 (two blocks): the second finds them
    cached, says so in its final response and on /metrics, and answers as the offline API
    does. A reset sent while another request runs empties the cache and loses nothing."""
    from quanta.cli import app
    from quanta.frontends.triton.client import reset_prefix_cache
    from typer.testing import CliRunner

    shared = list(range(400, 432))
    first, second = shared + list(range(440, 448)), shared + list(range(460, 468))
    params = SamplingParams(max_tokens=4, temperature=0.0)
    hits, device = "quanta_prefix_cache_hits_total", 'quanta_prefix_cache_blocks{tier="device"}'
    before = scrape(server)
    ids, events = run(server, "grpc", first, params)
    assert events[-1]["num_cached_tokens"] == 0
    ids_2, events = run(server, "http", second, params)
    assert events[-1]["num_cached_tokens"] == 32 and events[-1]["num_prompt_tokens"] == 40
    assert [ids, ids_2] == [r.token_ids for r in llm.generate([first, second], params)]
    after = wait_for(
        lambda: (s := scrape(server)).get(hits, 0) >= before.get(hits, 0) + 32 and s,
        what="the hit counter",
    )
    assert (
        after["quanta_prefix_cache_queries_total"]
        >= before["quanta_prefix_cache_queries_total"] + 80
    )
    assert after[device] >= 2

    good = GoodRequest(server)  # names the blocks it fills after the reset: reset again
    reset_prefix_cache(server.grpc_url, MODEL, use_grpc=True)
    good.check()
    reset_prefix_cache(server.http_url, MODEL)
    cli = CliRunner().invoke(app, ["reset-prefix-cache", "--url", server.http_url])
    assert cli.exit_code == 0 and "prefix cache reset" in cli.output, cli.output
    wait_for(lambda: scrape(server)[device] == 0, what="the cache to empty")
    assert run(server, "grpc", first, params)[1][-1]["num_cached_tokens"] == 0


# -- speculative decoding ----------------------------------------------------------------------
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_speculative_decoding_answers_as_plain_decoding(server, llm, params):
    """The ``quanta-spec`` variant verifies prompt-lookup drafts (``--speculative-config``):
    streamed over gRPC and HTTP, its tokens are the offline API's plain decoding, and
    /metrics counts drafts and acceptances."""
    prompts = ["one two three one two three one two", "Hello, Quanta", "a b a b a b a"]
    names = [
        "quanta_spec_decode_num_drafts_total",
        "quanta_spec_decode_num_draft_tokens_total",
        "quanta_spec_decode_num_accepted_tokens_total",
    ]
    before = server.scrape("quanta-spec")
    expected = [r.token_ids for r in llm.generate(prompts, params)]
    for prompt, want in zip(prompts, expected, strict=True):
        inputs = request_inputs(prompt, params, stream=True)
        grpc = list(grpc_events(server.grpc_url, "quanta-spec", inputs, timeout=60))
        http = list(http_events(server.http_url, "quanta-spec", inputs, stream=True, timeout=60))
        for events in (grpc, http):
            assert [t for e in events for t in output_ids(e)] == want, prompt
    # Drafts are proposed from the prompt's repeats whatever the sampling; whether a sampled
    # token takes a draft depends on the random draws, so acceptance is required of greedy only.
    grew = names[2] if params.temperature == 0 else names[0]
    after = wait_for(
        lambda: (s := server.scrape("quanta-spec")).get(grew, 0) > before.get(grew, 0) and s,
        what=f"{grew} to grow on /metrics",
    )
    assert after[names[1]] >= after[names[2]] and after[names[0]] > before.get(names[0], 0)


# -- Locust ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_headless_locust_run_has_no_failures(server, tmp_path):
    prefix = tmp_path / "locust"
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(ROOT / "loadtests" / "locustfile.py"),
        "--headless",
        "-u",
        "4",
        "-r",
        "4",
        "--run-time",
        "4s",
        "--stop-timeout",
        "10",
        "-H",
        server.http_url,
        "--csv",
        str(prefix),
        "--only-summary",
        "--tenant-mix",
        "gold:1,bronze:2",
        "--output-tokens",
        "4,24",
        "--prompt-words",
        "2,12",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(f"{prefix}_stats.csv", newline="") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    assert int(rows[("", "Aggregated")]["Failure Count"]) == 0
    assert int(rows[("POST", "generate_stream")]["Request Count"]) > 0
    assert int(rows[("METRIC", "time_to_first_token")]["Request Count"]) > 0
    assert int(rows[("METRIC", "time_per_output_token")]["Request Count"]) > 0


@pytest.mark.slow
def test_locust_replays_a_workload_file_and_stops_when_done(server, tmp_path):
    from quanta.workloads import WorkloadRequest, save_workload

    rows = [
        WorkloadRequest(0.0, 6, 4, "a", tenant="locust-gold", app="chat", interaction_id="i0"),
        WorkloadRequest(0.2, 5, 3, "b", tenant="locust-gold", app="chat", interaction_id="i0"),
        WorkloadRequest(0.3, 4, 6, "c", tenant="locust-batch", priority_class="offline"),
        WorkloadRequest(
            0.3, 7, 2, "d", tenant="locust-free", prompt="hello there", ttft_slo_ms=9e4
        ),
        WorkloadRequest(0.5, 3, 5, "e", tenant="locust-free"),
    ]
    workload = save_workload(tmp_path / "w.jsonl", rows)
    before = scrape(server)
    prefix = tmp_path / "locust"
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtests" / "locustfile.py")]
    cmd += ["--headless", "-u", "3", "-r", "3", "--run-time", "60s", "--stop-timeout", "10"]
    cmd += ["-H", server.http_url, "--csv", str(prefix), "--only-summary"]
    cmd += ["--workload", str(workload)]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert time.monotonic() - started < 45, "the run should end when the file is used up"
    with open(f"{prefix}_stats.csv", newline="") as f:
        stats = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    assert int(stats[("", "Aggregated")]["Failure Count"]) == 0
    assert int(stats[("POST", "generate_stream")]["Request Count"]) == len(rows), proc.stderr

    def tokens(tenant, cls="online"):
        key = f'quanta_generation_tokens_total{{priority_class="{cls}",tenant="{tenant}"}}'
        return scrape(server).get(key, 0.0) - before.get(key, 0.0)

    wait_for(lambda: tokens("locust-free") == 7, what="metrics of the last request")
    assert tokens("locust-gold") == 7  # ignore_eos: exactly the file's output lengths
    assert tokens("locust-batch", "offline") == 6


@pytest.mark.slow
def test_locust_waits_for_the_previous_call_and_abandons_after_a_failure(server, tmp_path):
    from quanta.workloads import WorkloadRequest, save_workload

    def call(rid, stage, out=3, **kw):
        kw.setdefault("interaction_id", "i-ok")
        return WorkloadRequest(
            0.0, 5, out, rid, tenant="locust-agent", interaction_stage=stage, **kw
        )

    rows = [
        call("ok0", 0),
        call("ok1", 1, think_time_s=0.3, interaction_last=True),
        call("bad0", 0, out=600, interaction_id="i-bad"),  # too long: the server refuses it
        call("bad1", 1, interaction_id="i-bad", interaction_last=True),
    ]
    workload = save_workload(tmp_path / "w.jsonl", rows)
    prefix = tmp_path / "locust"
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtests" / "locustfile.py")]
    cmd += ["--headless", "-u", "4", "-r", "4", "--run-time", "60s", "--stop-timeout", "10"]
    cmd += ["-H", server.http_url, "--csv", str(prefix), "--only-summary"]
    cmd += ["--workload", str(workload)]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert time.monotonic() - started < 45, "the run should end when the file is used up"
    with open(f"{prefix}_stats.csv", newline="") as f:
        stats = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    sent = stats[("POST", "generate_stream")]
    assert int(sent["Request Count"]) == 3, proc.stderr[-3000:]  # bad1 was never sent
    assert int(sent["Failure Count"]) == 1
    assert int(stats[("ABANDONED", "interaction_call")]["Request Count"]) == 1
    assert proc.returncode != 0  # Locust's exit code for a run with a failure


# -- the CLI demo --------------------------------------------------------------------------------
def test_serve_demo_streams_one_request(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "quanta.cli",
        "serve",
        "--http-port",
        str(free_port()),
        "--grpc-port",
        str(free_port()),
        "--metrics-port",
        str(free_port()),
        "--log-file",
        str(tmp_path / "triton.log"),
        "--demo",
        "Hello",
    ]
    proc = subprocess.run(cmd, capture_output=True, timeout=300, cwd=tmp_path, env=env)
    out = proc.stdout.decode()  # NOTE: no newline translation: the text may hold a "\r"
    assert proc.returncode == 0, out + proc.stderr.decode()
    assert "HTTP    http://127.0.0.1:" in out and "> Hello\n" in out
    assert (tmp_path / "engines" / "opt-tiny" / "config.json").is_file()  # built on demand
    llm = quanta.LLM(str(tmp_path / "engines" / "opt-tiny"))
    params = SamplingParams(max_tokens=DEMO_TOKENS, temperature=0.0)
    expected = llm.generate("Hello", params)[0].text  # the tiny model has no chat template
    assert out.split("> Hello\n", 1)[1] == "triton: " + expected + "\n"


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_cli_generate_against_the_server(server, llm, transport):
    url = server.http_url if transport == "http" else server.grpc_url
    cmd = [sys.executable, "-m", "quanta.cli", "generate", "--url", url, "--max-tokens", "12"]
    cmd += ["--grpc"] if transport == "grpc" else []
    proc = subprocess.run([*cmd, "Hello there"], capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()
    expected = llm.generate("Hello there", SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert proc.stdout.decode() == expected.text + "\n"
    assert "the prompt goes as raw text" in proc.stderr.decode()  # no --model-dir: said so


def test_cli_generate_url_takes_the_template_from_model_dir(server, llm, model_dir, tmp_path):
    """Triton serves text, not the checkpoint's template: ``--model-dir`` supplies it."""
    from quanta.text.chat_template import ChatTemplate, Turn

    for name in ("tokenizer.json", "config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    rendered = ChatTemplate.from_model_dir(tmp_path).render([Turn("user", "Hello there")])
    cmd = [sys.executable, "-m", "quanta.cli", "generate", "--url", server.http_url]
    cmd += ["--max-tokens", "12", "--model-dir", str(tmp_path), "Hello there"]
    proc = subprocess.run(cmd, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()
    expected = llm.generate(rendered, SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert proc.stdout.decode() == expected.text + "\n"
    assert "raw text" not in proc.stderr.decode()


def test_bad_parameter_stops_model_load_with_its_name(tmp_path, model_dir):
    from quanta.frontends.triton.launcher import LaunchError

    # NOTE: model_dir exists (a session checkpoint): only the parameter is wrong.
    repo = write_model_repository(
        tmp_path / "models", overrides={"model_dir": str(model_dir), "block_size": "big"}
    )
    options = ServerOptions(repo, http_port=0, grpc_port=0, metrics_port=0, exit_timeout_s=2)
    bad = TritonServer(options, log_file=tmp_path / "triton.log")
    try:
        with pytest.raises(LaunchError, match=r"config\.pbtxt parameter 'block_size'"):
            bad.start().wait_ready(timeout=120)
    finally:
        bad.stop()


@pytest.mark.parametrize("inherited", ["default", "sigint-ignored"])
def test_serve_stops_cleanly_on_ctrl_c(tmp_path, model_dir, inherited):
    """Also when started with SIGINT ignored, as a background job of a script is."""
    import signal
    import socket

    # NOTE: model_dir exists (a session checkpoint), so no preset build is timed here.
    repo = write_model_repository(tmp_path / "models", overrides={"model_dir": str(model_dir)})
    http_port = free_port()
    cmd = [sys.executable, "-m", "quanta.cli", "serve", "--model-repository", str(repo)]
    cmd += ["--http-port", str(http_port), "--grpc-port", str(free_port())]
    cmd += ["--metrics-port", str(free_port()), "--log-file", str(tmp_path / "triton.log")]
    ignore = inherited == "sigint-ignored"
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore else None,
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("ready"):
                break
        assert any(line.startswith("metrics http://127.0.0.1:") for line in lines), lines
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert "shutting down" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    with socket.socket() as s:  # tritonserver is gone with it
        assert s.connect_ex(("127.0.0.1", http_port)) != 0


def test_ports_picked_for_one_server_are_distinct(tmp_path):
    """Asked one at a time the kernel may hand out one port twice (it did: HTTP and gRPC on
    one port, which Triton refuses); the ports of one server are picked together."""
    from quanta.frontends.triton.launcher import free_ports

    for _ in range(50):
        ports = free_ports(3)
        assert len(set(ports)) == 3 and all(p > 0 for p in ports)
    options = ServerOptions(
        tmp_path, http_port=0, grpc_port=0, metrics_port=0, backend_dir=tmp_path / "backend"
    )
    picked = TritonServer(options).options  # NOTE: never started
    assert len({picked.http_port, picked.grpc_port, picked.metrics_port}) == 3
