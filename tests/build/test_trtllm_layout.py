"""The ``tensorrt_llm`` layout, served as ``ensemble``: requests shaped and typed as NVIDIA's
TensorRT-LLM clients send them (every tensor ``[1, ...]``, ``beam_width``, ``pad_id``,
``bad_words``, ``return_log_probs``, the outputs they ask for), answered as TensorRT-LLM
answers (prompt echo unless ``exclude_input_in_output``), and equal to the offline API."""

from __future__ import annotations

import json
import queue
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import quanta
from quanta import SamplingParams
from serving import TRTLLM_MODEL

pytestmark = pytest.mark.live

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def model_dir(opt_tiny) -> Path:
    return opt_tiny


@pytest.fixture(scope="module")
def server(triton) -> dict[str, int]:
    """The ports of the shared server, whose ``ensemble`` model is what ``quanta serve
    CHECKPOINT --served-model-name ensemble --io-layout tensorrt_llm --kv-cache-memory 8MiB``
    serves, and of a gateway in front of it."""
    openai_url = triton.openai_url(TRTLLM_MODEL)
    return {
        "http": triton.options.http_port,
        "grpc": triton.options.grpc_port,
        "metrics": triton.options.metrics_port,
        "openai": int(openai_url.rsplit(":", 1)[1].split("/")[0]),
    }


@pytest.fixture(scope="module")
def llm(model_dir):
    return quanta.LLM(str(model_dir), cache={"num_device_blocks": 64})


def trtllm_inputs(stream: bool, **extra: np.ndarray) -> dict[str, np.ndarray]:
    """What TensorRT-LLM's end_to_end_grpc_client sends for one prompt."""
    return {
        "text_input": np.array([[PROMPT]], dtype=object),
        "max_tokens": np.array([[12]], dtype=np.int32),
        "stream": np.array([[stream]], dtype=bool),
        "beam_width": np.array([[1]], dtype=np.int32),
        "temperature": np.array([[0.0]], dtype=np.float32),
        "num_return_sequences": np.array([[1]], dtype=np.int32),
        "repetition_penalty": np.array([[1.2]], dtype=np.float32),
        "presence_penalty": np.array([[0.0]], dtype=np.float32),
        "frequency_penalty": np.array([[0.0]], dtype=np.float32),
        "return_log_probs": np.array([[True]], dtype=bool),
        "end_id": np.array([[2]], dtype=np.int32),
        "pad_id": np.array([[1]], dtype=np.int32),
        **extra,
    }


def infer(port: int, inputs: dict[str, np.ndarray]) -> list:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    tensors = []
    for name, value in inputs.items():
        tensor = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    wanted = ["text_output", "cum_log_probs", "output_log_probs", "batch_index"]
    outputs = [grpcclient.InferRequestedOutput(name) for name in wanted]
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    client.start_stream(callback=lambda result, error: results.put(error or result))
    client.async_stream_infer("ensemble", tensors, outputs=outputs, request_id="1")
    client.stop_stream()  # waits for the final response, as the TensorRT-LLM client does
    out = []
    while not results.empty():
        out.append(results.get())
    client.close()
    return out


def expected(llm, **kw) -> quanta.GenerationResult:
    params = SamplingParams(
        max_tokens=12, temperature=0.0, repetition_penalty=1.2, stop_token_ids=(2,), logprobs=0
    )
    return llm.generate(PROMPT, params.model_copy(update=kw))[0]


def test_non_streamed_answer_echoes_the_prompt_by_default(server, llm):
    want = expected(llm)
    (result,) = infer(server["grpc"], trtllm_inputs(stream=False))
    assert result.as_numpy("text_output").shape == (1,)  # as TensorRT-LLM's models answer
    assert result.as_numpy("text_output")[0].decode() == PROMPT + want.text
    assert result.as_numpy("batch_index").tolist() == [[0]]
    log_probs = result.as_numpy("output_log_probs")[0].tolist()
    assert log_probs == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
    assert result.as_numpy("cum_log_probs")[0][0] == pytest.approx(sum(log_probs), abs=1e-3)
    excluded = trtllm_inputs(stream=False, exclude_input_in_output=np.array([[True]], dtype=bool))
    (result,) = infer(server["grpc"], excluded)
    assert result.as_numpy("text_output")[0].decode() == want.text


def test_streamed_answer_has_no_echo_and_bad_words_apply(server, llm):
    plain = expected(llm)
    word = llm.tokenizer.decode(plain.token_ids[:1])
    banned = tuple(llm.tokenizer.encode(word, add_special_tokens=False))
    want = expected(llm, bad_words_ids=(banned,))
    inputs = trtllm_inputs(stream=True, bad_words=np.array([[word]], dtype=object))
    results = infer(server["grpc"], inputs)
    assert all(not isinstance(r, Exception) for r in results), results
    text = "".join(r.as_numpy("text_output")[0].decode() for r in results)
    assert text == want.text and want.text != plain.text


def test_beam_search_is_refused_naming_the_input(server):
    (error,) = infer(
        server["grpc"], trtllm_inputs(stream=False, beam_width=np.array([[4]], dtype=np.int32))
    )
    assert "'beam_width' must be 1: beam search is not supported" in str(error)


def test_http_generate_our_clients_and_the_gateway_work_with_it(server, llm, model_dir):
    want = expected(llm, repetition_penalty=1.0, logprobs=None, stop_token_ids=())
    body = {"text_input": PROMPT, "max_tokens": 12, "temperature": 0.0, "stream": False}
    request = urllib.request.Request(
        f"http://127.0.0.1:{server['http']}/v2/models/ensemble/generate",
        data=json.dumps(body).encode(),
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        assert json.loads(r.read())["text_output"] == PROMPT + want.text
    from quanta.frontends.triton.client import generate

    pieces = generate(
        f"127.0.0.1:{server['grpc']}",
        PROMPT,
        SamplingParams(max_tokens=12, temperature=0.0),
        model="ensemble",
        use_grpc=True,
        stream=True,
    )
    assert "".join(pieces) == want.text
    completion = {"model": "ensemble", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    request = urllib.request.Request(
        f"http://127.0.0.1:{server['openai']}/v1/completions",
        data=json.dumps(completion).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        assert json.loads(r.read())["choices"][0]["text"] == want.text
