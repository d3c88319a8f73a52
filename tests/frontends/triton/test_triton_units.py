"""Triton frontend pieces that need no server: parameters, tensors, responder, packaging."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from quanta.core.errors import (
    EngineStepError,
    InvalidRequestError,
    RequestAbortedError,
    ThrottledError,
)
from quanta.core.output import TokenLogprob
from quanta.core.stream import RequestOutput
from quanta.frontends.triton.inputs import is_reset_request, parse_request
from quanta.frontends.triton.repository import DEFAULT_PARAMETERS, render_config
from quanta.frontends.triton.responder import (
    InflightRequest,
    Reply,
    Responder,
    SequenceGroupSender,
)
from quanta.frontends.triton.settings import ConfigParameterError, parse_parameters
from quanta.frontends.triton.tensors import output_arrays
from serving import wait_for

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "scheduler_backend" / "python" / "quanta"


# -- packaging -------------------------------------------------------------------------------
def test_shipped_backend_model_is_the_canonical_one():
    canonical = ROOT / "scheduler_backend" / "python" / "model.py"
    shipped = PACKAGE / "frontends" / "triton" / "backend_model.py"
    assert shipped.read_text() == canonical.read_text()


def test_default_model_repository_matches_the_packaged_default():
    on_disk = (ROOT / "triton_models" / "quanta" / "config.pbtxt").read_text()
    assert on_disk == render_config(DEFAULT_PARAMETERS)


def test_cli_module_imports_neither_torch_nor_tritonclient():
    code = (
        "import sys, quanta.frontends.triton.cli\n"
        "bad = [m for m in ('torch', 'tritonclient', 'triton_python_backend_utils') "
        "if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- config.pbtxt parameters -----------------------------------------------------------------
def test_parameters_parse_into_engine_config(tmp_path):
    engine, settings = parse_parameters(
        {
            **DEFAULT_PARAMETERS,
            "dtype": "float32",
            "enable_chunked_prefill": "false",
            "policy_options": '{"allow_swap": false}',
            "metrics_interval_ms": "100",
        },
        cwd=tmp_path,
    )
    assert engine.model == str(tmp_path / "engines" / "opt-tiny")
    assert engine.cache.block_size == 16 and engine.cache.num_device_blocks == 256
    assert engine.scheduler.max_num_batched_tokens == 1024
    assert engine.scheduler.enable_chunked_prefill is False
    assert engine.policy_options == {"allow_swap": False}
    assert settings.preset == "opt-tiny" and settings.metrics_interval_ms == 100


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("block_size", "sixteen", "block_size"),
        ("block_size", "0", "block_size"),
        ("num_device_blocks", "-3", "num_device_blocks"),
        ("max_num_seqs", "0", "max_num_seqs"),
        ("policy_options", "{not json", "policy_options"),
        ("device_memory_fraction", "1.5", "device_memory_fraction"),
        ("blok_size", "16", "blok_size"),  # a typo is an error, not ignored
        ("policy", "nope", "policy"),
    ],
)
def test_bad_parameter_is_named(key, value, named):
    with pytest.raises(ConfigParameterError, match=f"parameter '{named}"):
        parse_parameters({**DEFAULT_PARAMETERS, key: value})


def test_prefix_caching_is_on_unless_a_parameter_or_the_serve_flag_says_off():
    from quanta.frontends.triton.model_entry import served_parameters

    assert parse_parameters(DEFAULT_PARAMETERS)[0].enable_prefix_caching is True
    off = served_parameters(enable_prefix_caching=False)  # --no-enable-prefix-caching
    assert off == {"enable_prefix_caching": "false"}
    assert parse_parameters({**DEFAULT_PARAMETERS, **off})[0].enable_prefix_caching is False
    assert served_parameters(enable_prefix_caching=None) == {}  # not given: the model's own
    with pytest.raises(ConfigParameterError, match="parameter 'enable_prefix_caching'"):
        parse_parameters({**DEFAULT_PARAMETERS, "enable_prefix_caching": "sometimes"})


def test_model_dir_is_required():
    with pytest.raises(ConfigParameterError, match="parameter 'model_dir'"):
        parse_parameters({"policy": "fcfs"})


# -- tensors ---------------------------------------------------------------------------------
def _getter(**arrays):
    return lambda name: arrays.get(name)


def test_parse_request_maps_trtllm_names():
    parsed = parse_request(
        _getter(
            text_input=np.array([b"hello"], dtype=np.object_),
            max_tokens=np.array([7], dtype=np.int32),
            temperature=np.array([0.5], dtype=np.float32),
            top_k=np.array([3], dtype=np.int32),
            seed=np.array([9], dtype=np.uint64),
            stop_words=np.array([b"a", b"bc"], dtype=np.object_),
            end_id=np.array([2], dtype=np.int32),
            stream=np.array([True]),
            tenant=np.array([b"acme"], dtype=np.object_),
            priority_class=np.array([b"offline"], dtype=np.object_),
            ttft_slo_ms=np.array([250.0], dtype=np.float32),
        )
    )
    assert parsed.prompt == "hello" and parsed.stream
    p = parsed.params
    assert (p.max_tokens, p.temperature, p.top_k, p.seed) == (7, 0.5, 3, 9)
    assert p.stop == ("a", "bc") and p.stop_token_ids == (2,)
    m = parsed.metadata
    assert (m.tenant, m.priority_class, m.ttft_slo_ms) == ("acme", "offline", 250.0)


def test_parse_request_takes_trtllm_sampling_inputs():
    text = np.array([b"hi"], dtype=np.object_)
    parsed = parse_request(
        _getter(
            text_input=text,
            max_tokens=np.array([9], dtype=np.int32),
            repetition_penalty=np.array([1.2], dtype=np.float32),
            presence_penalty=np.array([0.5], dtype=np.float32),
            frequency_penalty=np.array([-0.5], dtype=np.float32),
            min_p=np.array([0.1], dtype=np.float32),
            logit_bias=np.array([b'{"50256": -100, "3": 2.5}'], dtype=np.object_),
            min_length=np.array([3], dtype=np.int32),
            bad_words=np.array([b"foo", b"bar baz"], dtype=np.object_),
            return_log_probs=np.array([True]),
            exclude_input_in_output=np.array([False]),
            beam_width=np.array([1], dtype=np.int32),
            num_return_sequences=np.array([1], dtype=np.int32),
            pad_id=np.array([0], dtype=np.int32),
            return_context_logits=np.array([False]),
        )
    )
    p = parsed.params
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == pytest.approx(
        (1.2, 0.5, -0.5)
    )
    assert p.min_p == pytest.approx(0.1) and p.logit_bias == {50256: -100.0, 3: 2.5}
    assert (p.min_tokens, p.logprobs) == (3, 0)
    assert parsed.bad_words == ("foo", "bar baz") and parsed.echo and parsed.return_log_probs
    plain = parse_request(_getter(text_input=text))
    assert not plain.echo and plain.params.logprobs is None  # absent: no echo (docs/triton-api.md)
    kept = parse_request(_getter(text_input=text, exclude_input_in_output=np.array([True])))
    assert not kept.echo


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({}, "text_input"),
        (
            {"text_input": np.array([b"x"], dtype=np.object_), "beam_width": np.array([2])},
            "'beam_width' must be 1: beam search is not supported",
        ),
        (
            {
                "text_input": np.array([b"x"], dtype=np.object_),
                "num_return_sequences": np.array([17]),
            },
            "'num_return_sequences' must be 1 to 16",
        ),
        (
            {
                "text_input": np.array([b"x"], dtype=np.object_),
                "return_generation_logits": np.array([True]),
            },
            "logits are not returned",
        ),
        (
            {
                "text_input": np.array([b"x"], dtype=np.object_),
                "min_tokens": np.array([2], dtype=np.int32),
                "min_length": np.array([3], dtype=np.int32),
            },
            "min_tokens and min_length",
        ),
        (
            {
                "text_input": np.array([b"x"], dtype=np.object_),
                "repetition_penalty": np.array([0.0], dtype=np.float32),
            },
            "repetition_penalty",
        ),
        ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, "exactly one value"),
        ({"text_input": np.array([1.5])}, "'text_input' must be STRING"),
        ({"text_input": np.array([b"\xff"], dtype=np.object_)}, "UTF-8"),
        ({"input_ids": np.array([1.0, 2.0])}, "'input_ids' must be INT32"),
        (
            {
                "text_input": np.array([b"x"], dtype=np.object_),
                "temperature": np.array([-1.0], dtype=np.float32),
            },
            "temperature",
        ),
        (
            {
                "text_input": np.array([b"x"], dtype=np.object_),
                "top_p": np.array([1.5], dtype=np.float32),
            },
            "top_p",
        ),
        (
            {
                "text_input": np.array([b"x"], dtype=np.object_),
                "priority_class": np.array([b"urgent"], dtype=np.object_),
            },
            "priority_class",
        ),
        (
            {
                "text_input": np.array([b"x"], dtype=np.object_),
                "stop_words": np.array([b""], dtype=np.object_),
            },
            "stop_words",
        ),
        (
            {
                "text_input": np.array([b"x"], dtype=np.object_),
                "min_p": np.array([1.5], dtype=np.float32),
            },
            "min_p: Input should be less than or equal to 1",
        ),
        (
            {
                "text_input": np.array([b"x"], dtype=np.object_),
                "logit_bias": np.array([b"{5: 1}"], dtype=np.object_),
            },
            "input 'logit_bias' is not JSON",
        ),
        (
            {
                "text_input": np.array([b"x"], dtype=np.object_),
                "logit_bias": np.array([b"[5, 1]"], dtype=np.object_),
            },
            "input 'logit_bias' must be a JSON object",
        ),
        (
            {
                "text_input": np.array([b"x"], dtype=np.object_),
                "logit_bias": np.array([b'{"5": 250}'], dtype=np.object_),
            },
            r"logit_bias: Value error, bias 250.0 of token 5 must lie in \[-100, 100\]",
        ),
        (
            {
                "text_input": np.array([b"x"], dtype=np.object_),
                "logit_bias": np.array([b'{"five": 1}'], dtype=np.object_),
            },
            "logit_bias.five",
        ),
    ],
)
def test_parse_request_rejects_bad_input(arrays, message):
    with pytest.raises(InvalidRequestError, match=message):
        parse_request(_getter(**arrays))


def test_output_arrays_final_carries_accounting():
    from quanta.core.stream import RequestMetrics

    arrays = output_arrays("hi", [1, 2], finish_reason="length")
    assert arrays["text_output"].tolist() == [b"hi"]
    assert arrays["output_ids"].dtype == np.int32
    assert arrays["finish_reason"].tolist() == [b"length"]
    assert "arrival_time_ns" not in arrays
    metrics = RequestMetrics(1.0, 1.1, 1.2, 1.5, (1.2, 1.5), 40, 2, 0, 0, 0, num_cached_tokens=32)
    final = output_arrays("hi", [1, 2], finish_reason="length", metrics=metrics)
    assert final["num_prompt_tokens"].tolist() == [40]
    assert final["num_cached_tokens"].tolist() == [32]


_RESET = np.array([True])


def test_a_reset_is_a_request_of_its_own():
    assert is_reset_request(_getter(reset_prefix_cache=_RESET))
    assert is_reset_request(_getter(reset_prefix_cache=np.array([[True]])))  # tensorrt_llm
    text = np.array([b"hi"], dtype=np.object_)
    assert not is_reset_request(_getter(text_input=text))
    off = _getter(text_input=text, reset_prefix_cache=np.array([False]))
    assert not is_reset_request(off) and parse_request(off).prompt == "hi"


@pytest.mark.parametrize(
    ("arrays", "parameters", "message"),
    [
        (
            {"reset_prefix_cache": _RESET, "text_input": np.array([b"hi"], dtype=np.object_)},
            None,
            r"'reset_prefix_cache' makes a request of its own .*got text_input",
        ),
        (
            {"reset_prefix_cache": _RESET, "stream": np.array([True])},
            None,
            "takes no other input; got stream",
        ),
        ({"reset_prefix_cache": np.array([1], dtype=np.int32)}, None, "must be BOOL, got int32"),
        ({"reset_prefix_cache": np.array([True, True])}, None, "exactly one value"),
        ({"reset_prefix_cache": _RESET}, '{"reset": true}', "unknown input 'reset'"),
    ],
    ids=["with-a-prompt", "with-stream", "not-bool", "two-values", "unknown-field"],
)
def test_a_malformed_reset_gets_a_typed_error(arrays, parameters, message):
    with pytest.raises(InvalidRequestError, match=message):
        is_reset_request(_getter(**arrays), parameters)


# -- responder -------------------------------------------------------------------------------
class FakeSender:
    def __init__(self, cancelled: bool = False) -> None:
        self.sent: list[tuple[object, int]] = []
        self.cancelled = cancelled

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))

    def is_cancelled(self):
        return self.cancelled


class FakeFactory:
    final_flag = 1

    def response(self, arrays):
        return {k: v.tolist() for k, v in arrays.items()}

    def error(self, code, message):
        return ("error", code, message)


def test_responder_streams_deltas_and_ends_with_final_flag():
    cancels: list[str] = []
    responder = Responder(FakeFactory(), cancels.append)
    responder.start()
    stream_sender, whole_sender = FakeSender(), FakeSender()
    sink_a = responder.track(InflightRequest("a", stream_sender, stream=True))
    sink_b = responder.track(InflightRequest("b", whole_sender, stream=False))
    for sink, rid in ((sink_a, "a"), (sink_b, "b")):
        sink(RequestOutput(rid, (5,), "x"))
    wait_for(lambda: len(stream_sender.sent) == 1)  # sent before the next delta exists
    for sink, rid in ((sink_a, "a"), (sink_b, "b")):
        sink(RequestOutput(rid, (6,), "y", finished=True, finish_reason="length"))
    wait_for(lambda: len(stream_sender.sent) == 2 and len(whole_sender.sent) == 1)
    responder.stop()
    first = {"text_output": [b"x"], "output_ids": [5], "sequence_length": [1]}
    assert stream_sender.sent[0] == (first, 0)
    final, flags = stream_sender.sent[1]
    assert flags == 1 and final["text_output"] == [b"y"] and final["finish_reason"] == [b"length"]
    whole, flags = whole_sender.sent[0]
    assert flags == 1 and whole["text_output"] == [b"xy"] and whole["output_ids"] == [5, 6]
    assert responder.num_live() == 0 and cancels == []


def test_responder_echoes_the_prompt_and_returns_log_probs_when_asked():
    responder = Responder(FakeFactory(), lambda rid: None)
    responder.start()
    whole, streamed = FakeSender(), FakeSender()
    echo = InflightRequest("e", whole, stream=False, echo_text="Hi", echo_ids=(1, 2))
    echo.return_log_probs = True
    sinks = [(responder.track(echo), "e")]
    stream = InflightRequest("s", streamed, stream=True, return_log_probs=True)
    sinks.append((responder.track(stream), "s"))
    for sink, rid in sinks:
        sink(RequestOutput(rid, (5,), "x", logprobs=(TokenLogprob(-0.5),)))
    wait_for(lambda: len(streamed.sent) == 1)
    for sink, rid in sinks:
        sink(RequestOutput(rid, (6,), "y", True, "length", logprobs=(TokenLogprob(-1.25),)))
    wait_for(lambda: len(whole.sent) == 1 and len(streamed.sent) == 2)
    responder.stop()
    final, _ = whole.sent[0]
    assert final["text_output"] == [b"Hixy"] and final["output_ids"] == [1, 2, 5, 6]
    assert final["sequence_length"] == [4]
    assert final["output_log_probs"] == [-0.5, -1.25] and final["cum_log_probs"] == [-1.75]
    first, last = streamed.sent[0][0], streamed.sent[1][0]
    assert first["output_log_probs"] == [-0.5] and "cum_log_probs" not in first
    assert last["output_log_probs"] == [-1.25] and last["cum_log_probs"] == [-1.75]


def test_responder_merges_what_queued_up_into_one_response_per_request():
    """A responder behind the engine sends each request's backlog at once, not one IPC per
    token, so streams catch up and a disconnect is seen within a step or two."""
    gate = threading.Event()

    class SlowSender(FakeSender):
        def send(self, response=None, flags=0):
            gate.wait(5)  # the first send blocks while the engine makes more deltas
            super().send(response, flags)

    responder = Responder(FakeFactory(), lambda rid: None)
    responder.start()
    sender = SlowSender()
    sink = responder.track(InflightRequest("m", sender, stream=True))
    sink(RequestOutput("m", (1,), "a"))
    time.sleep(0.05)  # the responder is now blocked sending "a"
    for i, text in enumerate("bcd", start=2):
        sink(RequestOutput("m", (i,), text, logprobs=(TokenLogprob(-float(i)),)))
    sink(RequestOutput("m", (5,), "e", True, "length"))
    gate.set()
    wait_for(lambda: len(sender.sent) == 2)
    responder.stop()
    (first, _), (rest, flags) = sender.sent
    assert first["text_output"] == [b"a"]
    assert rest["text_output"] == [b"bcde"] and rest["output_ids"] == [2, 3, 4, 5]
    assert flags == 1 and rest["finish_reason"] == [b"length"]


def test_a_sequence_group_sends_the_final_flag_once_after_its_last_sequence():
    sender = FakeSender()
    group = SequenceGroupSender(sender, 3, final_flag=1)
    group.send("a0")
    group.send("a-end", flags=1)
    group.send("b-end", flags=1)
    assert [f for _, f in sender.sent] == [0, 0, 0]
    group.send("c-end", flags=1)
    assert sender.sent[-1] == ("c-end", 1)


def test_responder_cancels_and_still_sends_the_final_flag():
    cancels: list[str] = []
    responder = Responder(FakeFactory(), cancels.append, cancel_check_interval=0.001)
    responder.start()
    sender = FakeSender(cancelled=True)
    sink = responder.track(InflightRequest("c", sender, stream=True))
    wait_for(lambda: cancels == ["c"])  # the periodic sweep finds it without any output
    sink(RequestOutput("c", (), "", finished=True, error=RequestAbortedError("request cancelled")))
    wait_for(lambda: len(sender.sent) == 1)
    responder.stop()
    assert sender.sent == [(("error", "cancelled", "request cancelled"), 1)]


def test_responder_rejects_with_typed_error():
    responder = Responder(FakeFactory(), lambda rid: None)
    responder.start()
    sender = FakeSender()
    responder.reject(InflightRequest("d", sender, stream=False), InvalidRequestError("bad"))
    wait_for(lambda: len(sender.sent) == 1)
    responder.stop()
    assert sender.sent == [(("error", "invalid_argument", "bad"), 1)]


def test_responder_answers_a_control_request_with_one_final_response():
    responder = Responder(FakeFactory(), lambda rid: None)
    responder.start()
    sender = FakeSender()
    responder.reply(InflightRequest("r", sender, stream=False), Reply())
    wait_for(lambda: len(sender.sent) == 1)
    responder.stop()
    assert sender.sent == [({}, 1)] and responder.num_live() == 0


def test_prefix_cache_metrics_follow_the_loop_stats():
    from quanta.core.loop import LoopStats
    from quanta.frontends.triton.metrics import MetricsReporter

    class Series(list):
        def increment(self, value):
            self.append(value)

        set = observe = increment

    class Family:
        HISTOGRAM = COUNTER = GAUGE = "kind"

        def __init__(self, name, description, kind):
            self.series = {}

        def Metric(self, labels, buckets=None):
            return self.series.setdefault(labels.get("tier", ""), Series())

    class Pb:
        MetricFamily = Family

    def stats(queries, hits, device, host):
        return LoopStats(0, 0, 0, 0, 24, 0, 64, 1, 0, 0, 0, prefix_cache_queries=queries,
                         prefix_cache_hits=hits, device_cached_blocks=device,
                         host_cached_blocks=host)  # fmt: skip

    snapshots = iter([stats(40, 0, 2, 0), stats(80, 32, 3, 1)])
    reporter = MetricsReporter(Pb, {"model": "m"}, stats=lambda: next(snapshots))
    reporter.flush()
    reporter.flush()
    families = reporter._families
    assert families["quanta_prefix_cache_queries_total"].series[""] == [40, 40]
    assert families["quanta_prefix_cache_hits_total"].series[""] == [32]  # counted from 0
    blocks = families["quanta_prefix_cache_blocks"].series
    assert blocks["device"] == [2, 3] and blocks["host"] == [0, 1]


class _FakePbUtils:
    """The two ``triton_python_backend_utils`` names ``TritonResponses.error`` uses."""

    class TritonError:
        INVALID_ARG, UNAVAILABLE, CANCELLED, INTERNAL = range(4)

        def __init__(self, message, code):
            self.message, self.code = message, code

    class InferenceResponse:
        def __init__(self, error):
            self.error = error

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


@pytest.mark.parametrize(
    ("error", "triton_code", "http"),
    [
        (InvalidRequestError("prompt is empty"), "INVALID_ARG", 400),
        (ThrottledError("tenant t is over its share"), "UNAVAILABLE", 429),
        (RequestAbortedError("request cancelled"), "CANCELLED", 503),
        (EngineStepError("internal error: boom"), "INTERNAL", 500),
    ],
)
def test_error_code_survives_a_grpc_stream_as_a_message_tag(error, triton_code, http):
    """gRPC stream errors carry text only: the ``[code]`` tag is what the gateway reads."""
    from quanta.frontends.openai.errors import classify
    from quanta.frontends.triton.backend import TritonResponses

    response = TritonResponses(_FakePbUtils).error(error.code, str(error))
    assert response.error.code == getattr(_FakePbUtils.TritonError, triton_code)
    assert response.error.message == f"[{error.code}] {error}"
    mapped = classify(response.error.message)
    assert (mapped.status, mapped.message) == (http, str(error))


def test_failed_engine_step_reaches_its_client_as_internal_and_the_loop_goes_on(make_loop):
    from quanta.core.request import Request, SamplingParams

    loop = make_loop(fail_on={"bad"})
    responder = Responder(FakeFactory(), loop.cancel)
    responder.start()
    loop.start()

    def submit(rid: str) -> FakeSender:
        sender = FakeSender()
        sink = responder.track(InflightRequest(rid, sender, stream=False))
        params = SamplingParams(max_tokens=4, temperature=0.0)
        loop.submit(Request(rid, [1, 2, 3], params, arrival_time=0.0, seed=0), sink)
        return sender

    bad = submit("bad")
    wait_for(lambda: len(bad.sent) == 1)
    good = submit("good")
    wait_for(lambda: len(good.sent) == 1)
    responder.stop()
    assert bad.sent == [(("error", "internal", "engine step failed: injected failure"), 1)]
    response, flags = good.sent[0]
    assert flags == 1 and len(response["output_ids"]) == 4


_PARAM = re.compile(
    r'^(#\s*)?parameters: \{ key: "(\w+)", value: \{ string_value: "((?:[^"\\]|\\.)*)" \} \}'
)


def test_template_documents_every_parameter_and_parses(tmp_path):
    from quanta.config.pbtxt import parameters

    lines = (ROOT / "triton_models" / "config.pbtxt.template").read_text().splitlines()
    found = [m.groups() for line in lines if (m := _PARAM.match(line))]
    assert {key for _, key, _ in found} == set(parameters())
    active = {key: value for commented, key, value in found if not commented}
    engine, _ = parse_parameters({**active, "model_dir": "engines/x"}, cwd=tmp_path)
    assert engine.cache.num_device_blocks == 1024


def test_unknown_request_parameters_are_refused_with_a_hint():
    """Triton's HTTP generate passes fields that name no input as request parameters."""
    get = _getter(text_input=np.array([b"hi"], dtype=np.object_))
    with pytest.raises(InvalidRequestError, match=r"'max_token' \(did you mean 'max_tokens'\?\)"):
        parse_request(get, '{"max_token": 5}')
    with pytest.raises(InvalidRequestError, match="unknown input 'zzz'; this model's inputs"):
        parse_request(get, '{"zzz": 1}')
    assert parse_request(get, "{}").prompt == "hi"  # no parameters, or Triton's own
    assert parse_request(get, '{"triton_enable_empty_final_response": true}').prompt == "hi"
